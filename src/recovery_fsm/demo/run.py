"""One seeded chaos run on a local Ray cluster: a trainer, rollout groups, and a killer.

The trainer makes real optimizer steps on a tiny causal LM (a synthetic next-token task),
pushes every version to the groups through the object store and exports it through the
trainer hooks. One thread per group keeps generating with whatever weights its routed
process holds and checks each answer against the version it was admitted with. A chaos
thread kills groups through Ray at seeded moments: idle, during an export, while a restart
loads, two at once, and one group again and again. Everything the report says is read off
the journal (``Ledger``) or counted at the real actors and files.
"""

from __future__ import annotations

import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import ray
import torch

from .. import GroupState, GroupView, RecoveryConfig, StandbyState
from .. import effects as fx
from ..errors import RecoveryError
from ..journal.ledger import Ledger
from ..ray import Policy, RecoveryRuntime, ReferenceEngine, RolloutFailed, Sampling, Statistics
from ..trainer import RecoveryHooks

MODELS: dict[str, dict[str, Any]] = {
    # Llama configs; parameter counts are roughly 0.2M, 3M and 25M.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=512),
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, vocab_size=2048),
    "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, vocab_size=4096),
}
KINDS = ("idle", "export", "loading", "double", "repeat")
# The runs a demo can make, each in its own directory under --out: immediate recovery with
# warm standbys, without them, the cold path, and the same scenario without failures (the
# goodput's yardstick).
RUNS = ("standby", "immediate", "cold", "free")
LABELS = {
    "standby": "immediate + standbys",
    "immediate": "immediate recovery",
    "cold": "cold path",
    "free": "no failures",
}
WRITTEN = frozenset({"journal.jsonl", "journal.jsonl.owner", "checkpoints", "timeline.png"})
_CHECKPOINT = re.compile(r"step-\d+|\.tmp-step-\d+-[0-9a-f]+")


class OutputInUse(RecoveryError):
    """``--out`` holds something a demo run did not write, so it is not replaced."""


def replace_previous_run(out: Path) -> list[Path]:
    """Delete the previous run's directories under ``out`` (every run's, so a run left by
    an earlier invocation with other ``--runs`` is not read beside this one) and return them.

    A second run appending to the first's journal made it unreplayable, and the first's
    checkpoints blocked the second's. Everything is checked before anything is deleted:
    a directory holding anything the demo does not write raises ``OutputInUse``."""
    found = [out / name for name in RUNS if (out / name).exists() or (out / name).is_symlink()]
    for d in found:
        if d.is_symlink() or not d.is_dir():
            raise OutputInUse(f"{d} is not a directory a demo run wrote; choose another --out")
        alien = [p.name for p in d.iterdir() if p.name not in WRITTEN]
        ckpts = d / "checkpoints"
        if ckpts.is_symlink() or (ckpts.exists() and not ckpts.is_dir()):
            alien.append(ckpts.name)
        elif ckpts.is_dir():
            alien += [f"checkpoints/{p.name}" for p in ckpts.iterdir()
                      if not _CHECKPOINT.fullmatch(p.name)]  # fmt: skip
        if alien:
            raise OutputInUse(
                f"{d} holds files a demo run does not write ({', '.join(sorted(alien)[:3])}); "
                "move them or choose another --out"
            )
    for d in found:
        shutil.rmtree(d)
    return found


@attrs.frozen
class DemoOptions:
    steps: int = 10
    groups: int = 3
    model: str = "small"
    step_s: float = 4.0
    chaos_rate: float = 0.7  # chance of an incident in a step (the 2nd to the 3rd-last)
    seed: int = 0
    out: Path = Path("demo-out")  # each run replaces the previous run's files here
    hf_interval: int = 4  # every so many versions the export is also the HF save (pinned)
    settle_s: float = 30.0  # after the last step, how long to wait for outages to end
    request_interval_s: float = 0.2  # the pause between two rollout calls
    engine: str = "reference"  # or "vllm"
    standby: int = 1  # warm standbys in the "standby" run
    # The restart budget (6) counts the failures of this many seconds (None: the whole run).
    restart_window_s: float | None = None


@attrs.frozen
class Incident:
    step: int  # the version whose step it happens in
    kind: str  # one of KINDS
    offset: float  # fraction of the step at which it starts (for "idle", "loading", "double")
    target: int  # which group (an index; the next serving one if that is down)


def plan(options: DemoOptions) -> list[Incident]:
    """The seeded incidents: every kind appears before any repeats, at most one a step."""
    rng = random.Random(options.seed)
    steps = [s for s in range(2, options.steps - 1) if rng.random() < options.chaos_rate]
    kinds: list[str] = []
    while len(kinds) < len(steps):
        batch = list(KINDS)
        rng.shuffle(batch)
        kinds += batch
    return [
        Incident(s, k, rng.uniform(0.1, 0.6), rng.randrange(options.groups))
        for s, k in zip(steps, kinds, strict=False)
    ]


@attrs.define
class Counters:
    """What the rollouts and the router saw at the real actors."""

    tokens: int = 0  # in accepted samples
    requests: int = 0  # rollout calls answered
    samples: int = 0  # samples accepted (each certified)
    reissued: int = 0  # prompts issued again after a death, a hang or a sync's abort
    lost: int = 0  # prompts a rollout failed by policy (no group served within its deadline)
    # Answers from weights older than the controller says that process holds when asked.
    stale_serves: int = 0
    stale_admissions: int = 0  # routed while the process held older weights than routed
    killed: list[tuple[float, str, str]] = attrs.Factory(list)  # (monotonic, group, kind)
    skipped: list[tuple[int, str]] = attrs.Factory(list)  # (step, kind): no group served


@attrs.frozen
class RunResult:
    mode: str  # one of RUNS
    options: DemoOptions
    journal: Path
    root: Path
    ledger: Ledger
    counters: Counters
    statistics: Statistics
    drained: bool
    outstanding: list[str]
    link_errors: int
    leaked: list[str]  # checkpoint directories left that nobody keeps
    kept: list[str]  # HF saves, kept on purpose
    wall_s: float
    losses: list[float]
    rollout_s: float  # how long the rollout threads ran: tokens per second divide by it

    @property
    def immediate(self) -> bool:
        return self.mode != "cold"

    @property
    def label(self) -> str:
        return LABELS[self.mode]


def model_config(options: DemoOptions) -> dict[str, Any]:
    from transformers import LlamaConfig

    size = MODELS[options.model]
    heads = max(2, size["hidden_size"] // 64)
    return LlamaConfig(
        **size, num_attention_heads=heads, num_key_value_heads=heads,
        architectures=["LlamaForCausalLM"], max_position_embeddings=256,
    ).to_dict()  # fmt: skip


class SyntheticTrainer:
    """Real optimizer steps on a fixed synthetic corpus: each sequence counts up mod vocab."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(LlamaConfig(**config))  # type: ignore[no-untyped-call]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        vocab = config["vocab_size"]
        starts = torch.randint(0, vocab, (8, 1))
        self.batch = (starts + torch.arange(32)) % vocab
        self.losses: list[float] = []

    def step(self) -> None:
        self.model.train()
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        self.losses.append(float(loss.detach()))


class _Rollouts:
    """The trainer's rollouts, through the runtime's rollout path: groups of samples per
    prompt at temperature 1, in calls paced as a fleet's requests arrive. A fleet's capacity
    is its serving groups (each engine on hardware of its own); here three engines share
    two cores, so capacity is modelled by the load offered: one paced caller per serving
    group, each call spread by the runtime over every serving group. Each sample's
    certificate is checked against what the controller believed before the call, and each
    newly admitted process is asked once what it holds."""

    SAMPLING = Sampling(max_new_tokens=16, temperature=1.0, n=4)
    POLICY = Policy(version="current", siblings="group", deadline_s=30.0)

    def __init__(self, rt: RecoveryRuntime, counters: Counters, interval_s: float) -> None:
        self.rt = rt
        self.interval_s = interval_s
        self.counters = counters
        self.admitted: dict[str, tuple[int, int]] = {}  # group -> (incarnation, version)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(g,), name=f"rollouts-{g}", daemon=True)
            for g in rt.groups
        ]
        self._checked: set[tuple[str, int, int]] = set()

    def route(self, effect: fx.RouteTraffic | fx.WithdrawTraffic) -> None:
        """The router: runs on the link's thread, so it only records."""
        with self.lock:
            if isinstance(effect, fx.RouteTraffic):
                self.admitted[effect.group] = (effect.incarnation, effect.version)
            else:
                self.admitted.pop(effect.group, None)

    def _check_admissions(self) -> None:
        """What each newly admitted process holds, asked once."""
        with self.lock:
            admitted = {g: a for g, a in self.admitted.items() if (g, *a) not in self._checked}
            self._checked.update((g, *a) for g, a in admitted.items())
        for g, (inc, version) in admitted.items():
            actors = self.rt.actors(g, inc)
            if not actors:
                continue
            try:
                held = ray.get(actors[0].weights.remote(), timeout=30)
            except Exception:  # the process died under us: the monitor reports it
                continue
            if held.version is None or held.version < version:
                with self.lock:
                    self.counters.stale_admissions += 1

    def _loop(self, group: str) -> None:
        """Offers load while ``group`` serves."""
        prompts = [[1 + i, 2, 3, 4] for i in range(2)]
        while not self.stop.is_set():
            with self.lock:
                serving = group in self.admitted
            if not serving:
                self.stop.wait(0.05)
                continue
            self._check_admissions()
            # What the controller believes each process holds, read before the call: a
            # sample from older weights means a report (a push, a load) was wrong.
            views = self.rt.controller.groups()
            believed = {g: (v.incarnation, v.version) for g, v in views.items()}
            try:
                results = self.rt.rollout(prompts, self.SAMPLING, self.POLICY)
            except RolloutFailed as err:
                with self.lock:
                    self.counters.lost += len(err.prompts)
                self.stop.wait(0.05)
                continue
            with self.lock:
                self.counters.requests += 1
                for r in results:
                    self.counters.reissued += r.reissued
                    for sample in r.samples:
                        self.counters.samples += 1
                        self.counters.tokens += len(sample.tokens)
                        c = sample.certificate
                        inc, version = believed.get(c.group, (0, None))
                        if inc == c.incarnation and c.version < (version or 0):
                            self.counters.stale_serves += 1
            # Paced, as requests arrive in a real fleet: generation that saturates the CPU
            # would slow every restart (here the engines share two cores with everything).
            self.stop.wait(self.interval_s)


class _Chaos:
    """Carries out the planned incidents; the trainer tells it when a step starts."""

    def __init__(self, rt: RecoveryRuntime, counters: Counters, incidents: list[Incident],
                 note: Callable[[str], None]) -> None:  # fmt: skip
        self.rt = rt
        self.counters = counters
        self.by_step = {i.step: i for i in incidents}
        self.note = note
        self.threads: list[threading.Thread] = []
        self.closing = threading.Event()
        self.killed_incarnation: dict[str, int] = {}

    def step_started(self, version: int, step_s: float) -> None:
        incident = self.by_step.get(version)
        if incident is None or incident.kind == "export":
            return
        t = threading.Thread(target=self._run, args=(incident, step_s), daemon=True)
        self.threads.append(t)
        t.start()

    def synced(self, version: int) -> None:
        """Right after the sync to ``version``: its export is being written now."""
        incident = self.by_step.get(version)
        if incident is not None and incident.kind == "export":
            group = self._serving(incident.target)
            if group is None:  # every group is recovering: nothing to kill now
                self.counters.skipped.append((version, incident.kind))
                return
            self._kill(group, "export", "while its export is written")

    def join(self, timeout: float = 90) -> None:
        """Let the incidents under way finish, then refuse new ones."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.closing.set()

    def _run(self, incident: Incident, step_s: float) -> None:
        if self.closing.wait(incident.offset * step_s):
            return
        first = self._wait_serving(incident.target)
        kind = incident.kind
        if first is None:
            self.counters.skipped.append((incident.step, kind))
        elif kind == "idle":
            self._kill(first, kind, "while serving")
        elif kind == "double":
            second = self._serving(incident.target + 1, besides=first)
            self._kill(first, kind, "two at once")
            self._kill(second, kind, "two at once")
        elif kind == "loading":  # a restart dies while it loads
            restarting = self._kill(first, kind, "to restart it")
            if restarting and self._restarted(first, lambda g: g.starting):
                self._kill(first, kind, "while its restart loads")
        elif kind == "repeat":  # one group that keeps dying
            for n in range(3):
                if not self._kill(first, kind, f"{n + 1} of 3 in a row"):
                    return
                back = self._restarted(first, lambda g: g.starting or g.up)
                if not back or self.closing.wait(0.5):
                    return

    def _serving(self, index: int, besides: str | None = None) -> str | None:
        """The first serving group from ``index`` on (another than ``besides``)."""
        groups = self.rt.groups
        for k in range(len(groups)):
            g = groups[(index + k) % len(groups)]
            if g != besides and self.rt.controller.group(g).serving:
                return g
        return None

    def _wait_serving(self, index: int, timeout: float = 30) -> str | None:
        """A serving group to hurt; if all are recovering, wait for one (up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (group := self._serving(index)) is None and time.monotonic() < deadline:
            if self.closing.wait(0.05):
                return None
        return group

    def _restarted(
        self, group: str | None, where: Callable[[GroupView], bool], timeout: float = 30
    ) -> bool:
        """Wait until a newer process of ``group`` than the one just killed is ``where``."""
        if group is None:
            return False
        killed = self.killed_incarnation[group]
        deadline = time.monotonic() + timeout
        while not self.closing.is_set() and time.monotonic() < deadline:
            g = self.rt.controller.group(group)
            if g.incarnation > killed and where(g):
                return True
            time.sleep(0.02)
        return False

    def _kill(self, group: str | None, kind: str, detail: str) -> bool:
        if group is None or self.closing.is_set():
            return False
        self.killed_incarnation[group] = inc = self.rt.kill(group)
        self.counters.killed.append((time.monotonic(), group, kind))
        self.note(f"chaos: killed {group}#{inc} ({kind}: {detail})")
        return True


def run(
    options: DemoOptions,
    *,
    mode: str,
    out: Path,
    on_status: Callable[[RecoveryRuntime, int, int], None] | None = None,
    note: Callable[[str], None] = print,
    on_rolling: Callable[[], None] | None = None,
) -> RunResult:
    """One run of the seeded scenario in ``mode`` (one of ``RUNS``; Ray must be initialised);
    returns what it saw. ``on_rolling``: called once the rollouts start (a benchmark starts
    its own load there)."""
    if mode not in RUNS:
        raise ValueError(f"unknown demo run {mode!r}; known: {', '.join(RUNS)}")
    out = out.resolve()  # the store resolves its root: compare like with like below
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "journal.jsonl"
    root = out / "checkpoints"
    if journal.exists() or (root.exists() and any(root.iterdir())):
        # Appended to, the journal would not replay; old checkpoints would count as leaked.
        raise OutputInUse(f"{out} already holds a run; give each run its own directory")
    config = model_config(options)
    counters = Counters()
    trainer = SyntheticTrainer(config, options.seed)
    groups = [f"g{i}" for i in range(options.groups)]
    recovery = RecoveryConfig(
        immediate_recovery=mode != "cold",
        restart_budget=6,
        restart_window_s=options.restart_window_s,
    )
    rollouts: _Rollouts | None = None

    def router(effect: fx.RouteTraffic | fx.WithdrawTraffic) -> None:
        if rollouts is not None:
            rollouts.route(effect)

    started = time.monotonic()
    rt = RecoveryRuntime(
        root, groups=groups, model_config=config, config=recovery, journal=journal,
        router=router, engine=engine_class(options.engine), tick_s=0.5, probe_interval_s=1.0,
        probe_timeout_s=2.0, grace_s=10.0, standby=options.standby if mode == "standby" else 0,
    )  # fmt: skip
    rollouts = _Rollouts(rt, counters, options.request_interval_s)
    chaos = _Chaos(rt, counters, plan(options) if mode != "free" else [], note)

    def status(version: int) -> None:
        if on_status is not None:
            on_status(rt, version, options.steps)

    with RecoveryHooks(rt) as hooks:
        rt.start(trainer.model)
        if mode == "standby":  # the pool boots beside the groups before the first step
            _wait_standbys(rt, options.standby, note)
        rolling = time.monotonic()
        for t in rollouts.threads:
            t.start()
        if on_rolling is not None:
            on_rolling()
        version = 0
        settle_by = None
        # The planned steps, then quiet ones until every outage has ended (a cold restart
        # needs a sync to serve again) or settle_s has passed.
        while version < options.steps or not _settled(rt):
            if version >= options.steps:
                settle_by = settle_by or time.monotonic() + options.settle_s
                if time.monotonic() > settle_by:
                    break
            version += 1
            step_start = time.monotonic()
            chaos.step_started(version, options.step_s)
            while time.monotonic() - step_start < options.step_s:  # the groups generate
                status(version - 1)
                time.sleep(0.25)
            trainer.step()
            hooks.before_weight_sync(version)
            got = rt.push(trainer.model, version)
            hooks.after_weight_sync(
                version, trainer.model, got,
                hf_save=options.hf_interval > 0 and version % options.hf_interval == 0,
            )  # fmt: skip
            chaos.synced(version)
            status(version)
            if version == options.steps:
                chaos.join()
        rollouts.stop.set()
        rollout_s = time.monotonic() - rolling
        for t in rollouts.threads:
            t.join(timeout=60)
        closed = hooks.close()
    kept = sorted(str(Path(p).resolve()) for p in closed.hf_saves.values())
    leaked = sorted(
        str(p) for p in root.iterdir() if str(p.resolve()) not in kept
    ) if root.exists() else []  # fmt: skip
    ledger = rt.ledger
    return RunResult(
        mode, options, journal, root, ledger, counters, rt.statistics(), closed.drained,
        rt.controller.outstanding(), len(rt.errors), leaked, kept,
        time.monotonic() - started, trainer.losses, rollout_s,
    )  # fmt: skip


def _wait_standbys(rt: RecoveryRuntime, size: int, note: Callable[[str], None]) -> None:
    """Wait (up to a minute) until the pool's standbys have booted."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        views = rt.controller.standbys().values()
        if sum(1 for v in views if v.state != StandbyState.BOOTING) >= size:
            return
        time.sleep(0.1)
    note("standbys still booting after 60 s: the run starts without them")


def engine_class(name: str) -> type:
    """The engine a demo runs: the reference engine, or vLLM serving the trainer's float32
    (its "auto" would serve bfloat16)."""
    if name == "vllm":
        from ..ray.vllm_engine import VLLMEngine

        return VLLMEngine.with_options(dtype="float32")
    if name != "reference":
        raise ValueError(f"unknown engine {name!r}; known: reference, vllm")
    return ReferenceEngine


def _settled(rt: RecoveryRuntime) -> bool:
    """Every group serves the fleet's version or was retired."""
    version = rt.ledger.version
    return all(
        (g.serving and g.version == version) or g.state == GroupState.RETIRED
        for g in rt.controller.groups().values()
    )
