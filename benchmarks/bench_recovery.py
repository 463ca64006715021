"""Recovery latency by path (a warm standby, immediate, cold) at three step lengths, next to
its limit.

    .venv/bin/python benchmarks/bench_recovery.py [--steps-s 4 16 64] [--trials 3]
        [--engine reference vllm]

A local Ray cluster; two groups of one engine each (the reference engine, or vLLM serving
the demo's "small" Llama, ~3M parameters, in float32), one engine after the other in the
same run. The trainer syncs a new version every step (one optimizer step, a push through
the object store, an export). In each trial one group is killed at a point of a step spread
evenly over the trials (1/6, 1/2, 5/6 of the step for three), after that step's export
committed; latency runs from the kill to the moment the group is routed again holding the
fleet's current version. The standby path hands the group a warm
standby engine that took the step's push (``standby=1``; the pool boots a replacement at
once, on the same two cores); the immediate path boots from the committed checkpoint; the
cold path (``immediate_recovery=False``, what frameworks do today) boots empty and serves
after the next sync. Idle group-seconds per failure come from the journal (``Ledger``).
"detected" is the kill to the controller's decision (its new incarnation): what a standby's
recovery cannot go below, with the admission check (the canary, measured with the limit).

The limit, measured in the same minutes as each row (one boot right before each trial's
kill): a fresh engine actor started and loading the committed checkpoint from the page cache
(actor creation to load returned, split into the process coming up and the verified load).
The same boots give where a boot's time goes (process up; for vLLM the byte check, vLLM's
import, its init with the load, the first forward pass), the canary asked of it, and a load
in place of the same checkpoint into the running engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers.utils import logging as hf_logging

from recovery_fsm import RecoveryConfig, Rules
from recovery_fsm import effects as fx
from recovery_fsm.demo.run import DemoOptions, SyntheticTrainer, engine_class, model_config
from recovery_fsm.export import CheckpointStore
from recovery_fsm.export.canary import Canary, check
from recovery_fsm.ray import RecoveryRuntime


class Clock:
    """Router: when each group was last routed, and to which version."""

    def __init__(self) -> None:
        self.routed: dict[str, tuple[float, int, int]] = {}
        self.cv = threading.Condition()

    def __call__(self, effect: fx.RouteTraffic | fx.WithdrawTraffic) -> None:
        if isinstance(effect, fx.RouteTraffic):
            with self.cv:
                self.routed[effect.group] = (time.monotonic(), effect.incarnation, effect.version)
                self.cv.notify_all()

    def routed_after(self, group: str, inc: int, timeout: float) -> tuple[float, int] | None:
        """(when, version) once a process of ``group`` newer than ``inc`` is routed."""
        with self.cv:
            ok = self.cv.wait_for(
                lambda: group in self.routed and self.routed[group][1] > inc, timeout
            )
            return (self.routed[group][0], self.routed[group][2]) if ok else None


PATHS = ("standby", "immediate", "cold")


def run_path(work: Path, config: dict[str, Any], engine: str, path: str, step_s: float,
             trials: int, seed: int, rules: type[Rules] = Rules) -> dict[str, Any]:  # fmt: skip
    clock = Clock()
    trainer = SyntheticTrainer(config, seed)
    tag = f"{engine}-{path}-{step_s:g}"
    (work / tag).mkdir(parents=True)
    rt = RecoveryRuntime(
        work / tag / "ckpt", groups=["g0", "g1"], model_config=config,
        config=RecoveryConfig(immediate_recovery=path != "cold", restart_budget=trials + 2),
        journal=work / tag / "journal.jsonl", router=clock, tick_s=0.5,
        probe_interval_s=1.0, probe_timeout_s=2.0, grace_s=10.0, engine=engine_class(engine),
        call_timeout_s=300.0, standby=1 if path == "standby" else 0, rules=rules,
    )  # fmt: skip
    latencies: list[float] = []
    detected: list[float] = []
    limits: list[dict[str, float]] = []
    with rt:
        rt.start(trainer.model)
        if path == "standby":  # booted, so that the first sync's push reaches it
            wait_ready(rt, booted=True)
        version = 1
        trainer.step()
        rt.sync(trainer.model, version)
        for trial in range(trials):
            while rt.controller.checkpoint_state(version) != "ready":
                time.sleep(0.01)
            # The limit, between steps (the trainer waits for it): C(version) is committed.
            limits.append(boot_once(engine, config, str(rt.store.path_for(version)), trial))
            version += 1
            trainer.step()
            rt.sync(trainer.model, version)  # the trial's step starts
            step_start = time.monotonic()
            while rt.controller.checkpoint_state(version) != "ready":
                time.sleep(0.01)
            if path == "standby":
                wait_ready(rt)  # the refill of the previous trial holds this version
            offset = (trial + 0.5) / trials * step_s
            time.sleep(max(0.0, offset - (time.monotonic() - step_start)))
            inc = rt.kill("g0")
            killed = time.monotonic()
            while rt.controller.incarnation("g0") == inc:
                time.sleep(0.001)
            detected.append(time.monotonic() - killed)
            # The trainer keeps stepping on schedule until g0 serves again.
            next_sync = step_start + step_s
            while (got := clock.routed_after("g0", inc, next_sync - time.monotonic())) is None:
                version += 1
                trainer.step()
                rt.sync(trainer.model, version)
                next_sync += step_s
            at, _ = got
            latencies.append(at - killed)
            time.sleep(max(0.0, next_sync - time.monotonic()))  # finish the step
        idle = rt.ledger.idle_group_seconds()
        failures = len(rt.ledger.crashes)
    return {"latency": latencies, "idle_per_failure": idle / max(1, failures),
            "limit": limits, "detected": detected}  # fmt: skip


def wait_ready(rt: RecoveryRuntime, timeout: float = 300.0, booted: bool = False) -> None:
    """Until the pool's standby holds the fleet's version (pushed or loaded), or only has
    booted (``booted``)."""
    deadline = time.monotonic() + timeout
    views = rt.controller.standbys
    while not any(v.ready or (booted and v.state != "booting") for v in views().values()):
        if time.monotonic() > deadline:
            raise RuntimeError("no standby became current")
        time.sleep(0.01)


def boot_once(engine: str, config: dict[str, Any], path: str, n: int) -> dict[str, float]:
    """A fresh engine booting a committed checkpoint that is in the page cache; seconds of
    each phase: ``up`` (actor created to first answer), ``boot`` (the boot call), the
    engine's own split of it if it keeps one, ``canary`` and ``in_place`` (a load of the same
    checkpoint into the running engine)."""
    cls = engine_class(engine)
    remote = ray.remote(concurrency_groups={"health": 1, "watch": 1})(cls)  # type: ignore[call-overload]
    t0 = time.monotonic()
    actor = remote.options(num_cpus=0.1, **getattr(cls, "ACTOR_OPTIONS", {})).remote(
        config, "limit", n + 1
    )
    ray.get(actor.ping.remote())
    t1 = time.monotonic()
    ray.get(actor.boot_from_checkpoint.remote(path))
    t2 = time.monotonic()
    expected = Canary.from_json(CheckpointStore(Path(path).parent).read_manifest(path)["canary"])
    answer = ray.get(actor.canary.remote(list(expected.prompt), len(expected.answer.tokens)))
    t3 = time.monotonic()
    assert check(expected, answer) is None, check(expected, answer)
    ray.get(actor.load_checkpoint.remote(path, n + 2))
    t4 = time.monotonic()
    phases = ray.get(actor.__ray_call__.remote(lambda self: dict(getattr(self, "timings", {}))))
    ray.kill(actor)
    return {"up": t1 - t0, "boot": t2 - t1, "canary": t3 - t2, "in_place": t4 - t3,
            **{k: v for k, v in phases.items() if k != "load_s"}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps-s", type=float, nargs="+", default=[4.0, 16.0, 64.0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", nargs="+", choices=["reference", "vllm"],
                        default=["reference"])  # fmt: skip
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-recovery-"))
    config = model_config(DemoOptions(model=a.model))
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.2f} at start; model {a.model}")
    print("limit: a fresh engine + the verified load of the committed checkpoint from the page "
          "cache, measured in each row's minutes")  # fmt: skip
    print()
    print("| engine | step length | path | kill to serving p50 | max | detected p50 | limit "
          "(process up + load) | p50 / limit | idle s per failure |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rows: dict[tuple[str, float, str], dict[str, Any]] = {}
    for engine in a.engine:
        for step_s in a.steps_s:
            for path in a.paths:
                r = run_path(work, config, engine, path, step_s, a.trials, a.seed)
                rows[(engine, step_s, path)] = r
                p50 = statistics.median(r["latency"])
                up = statistics.median(b["up"] for b in r["limit"])
                lim = statistics.median(b["up"] + b["boot"] for b in r["limit"])
                print(f"| {engine} | {step_s:g} s | {path} | {p50:.2f} s | "
                      f"{max(r['latency']):.2f} s | {statistics.median(r['detected']):.3f} s | "
                      f"{lim:.2f} s ({up:.2f} + {lim - up:.2f}) | {p50 / lim:.2f}x | "
                      f"{r['idle_per_failure']:.2f} |", flush=True)  # fmt: skip
    print()
    for engine in a.engine:
        for step_s in a.steps_s:
            got = {p: rows[(engine, step_s, p)] for p in a.paths}
            if "immediate" in got and "cold" in got:
                saved = 1 - got["immediate"]["idle_per_failure"] / got["cold"]["idle_per_failure"]
                print(f"{engine}, step {step_s:g} s: immediate idles {saved:.0%} less per "
                      "failure than cold")  # fmt: skip
            if "standby" in got and "immediate" in got:
                s, i = got["standby"], got["immediate"]
                saved = 1 - s["idle_per_failure"] / i["idle_per_failure"]
                s50 = statistics.median(s["latency"])
                floor = statistics.median(s["detected"]) + statistics.median(
                    b["canary"] for b in s["limit"]
                )
                print(f"{engine}, step {step_s:g} s: a standby serves in {s50:.2f} s, "
                      f"{s50 / floor:.2f}x detection + admission ({floor:.2f} s), "
                      f"{s50 / statistics.median(i['latency']):.3f}x the immediate path; it "
                      f"idles {saved:.0%} less per failure than immediate")  # fmt: skip
    print()
    print("where a boot from the checkpoint goes (median of every limit boot, seconds):")
    names = ["up", "verify_s", "import_s", "init_s", "warmup_s", "boot", "canary", "in_place"]
    print("| engine | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for engine in a.engine:
        boots = [b for (e, _, _), r in rows.items() if e == engine for b in r["limit"]]
        cells = [f"{statistics.median(b[n] for b in boots):.3f}" if n in boots[0] else "-"
                 for n in names]  # fmt: skip
        print(f"| {engine} | " + " | ".join(cells) + " |")
    print(
        "(up: actor created to first answer; boot: the whole boot call, which holds verify, "
        "import, init and warm-up where the engine splits it; in_place: a load of the same "
        "checkpoint into the running engine)"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
