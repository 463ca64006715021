"""How fast the runtime notices a dead or hung engine, and how fast it serves again.

    .venv/bin/python benchmarks/bench_detection.py [--groups 3] [--trials 5]

A local Ray cluster, ``--groups`` groups of one tiny-Llama reference engine each. Death: an
engine is killed through Ray; detection is the time until the controller no longer counts
it as serving (the monitor's watch call failed), recovery the time until it is routed again
(immediate recovery from the committed checkpoint). Hang: an engine's probe stops answering
(one engine, then two at once); detection is the time until the controller declares it
failed, after ``suspect_threshold`` probes that each waited ``--probe-timeout``. A probe
round pings every group at once under one timeout, so two hangs cost what one does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from recovery_fsm import RecoveryConfig
from recovery_fsm.ray import RecoveryRuntime
from recovery_fsm.ray.chaos import hangable

CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


def wait(cond: Any, timeout: float = 120.0, c: Any = None) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the runtime did not get there in time: {c and c.groups()}")
        time.sleep(0.01)
    return time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--probe-interval", type=float, default=1.0)
    parser.add_argument("--probe-timeout", type=float, default=1.0)
    parser.add_argument("--threshold", type=int, default=3)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-detect-"))
    flags = work / "flags"
    os.makedirs(flags)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    groups = [f"g{i}" for i in range(a.groups)]
    # Every trial restarts a group: a budget that trials cannot exhaust.
    config = RecoveryConfig(suspect_threshold=a.threshold, restart_budget=10_000)
    death: list[float] = []
    recovery: list[float] = []
    hang: dict[int, list[float]] = {1: [], 2: []}
    with RecoveryRuntime(
        work / "ckpt", groups=groups, model_config=LlamaConfig(**CONFIG).to_dict(),
        config=config, engine=hangable(str(flags)), tick_s=0.1, probe_interval_s=a.probe_interval,
        probe_timeout_s=a.probe_timeout, grace_s=0.5,
    ) as rt:  # fmt: skip
        rt.start(model)
        rt.sync(model, 1)
        wait(lambda: rt.controller.checkpoint_state(1) == "ready")
        c = rt.controller
        for trial in range(a.trials):
            g = groups[trial % len(groups)]
            wait(lambda g=g: c.group_state(g) == "active")  # type: ignore[misc]
            time.sleep(1.0)  # past the grace period of its last start
            t0 = time.monotonic()
            rt.kill(g)
            death.append(wait(lambda g=g: c.group_state(g) != "active") - t0)  # type: ignore[misc]
            recovery.append(wait(lambda g=g: c.group_state(g) == "active") - t0)  # type: ignore[misc]
        for trial in range(a.trials):
            for n in (1, 2):
                hung = [groups[(trial + i) % len(groups)] for i in range(n)]
                for g in hung:
                    wait(lambda g=g: c.group_state(g) == "active")  # type: ignore[misc]
                time.sleep(a.probe_interval + 1.0)
                incs = {g: c.incarnation(g) for g in hung}
                t0 = time.monotonic()
                for g in hung:
                    Path(flags, g).touch()
                ends = [
                    wait(lambda g=g, inc=incs[g]: c.incarnation(g) > inc  # type: ignore[misc]
                         or c.group_state(g) not in ("active", "suspect"))
                    for g in hung
                ]  # fmt: skip
                for g in hung:
                    Path(flags, g).unlink()
                hang[n].extend(end - t0 for end in ends)
        stats = rt.statistics()
    ray.shutdown()

    def row(label: str, xs: list[float]) -> None:
        print(f"  {label:<52} p50 {statistics.median(xs):6.2f} s   max {max(xs):6.2f} s"
              f"   (n={len(xs)})")  # fmt: skip

    print(f"{a.groups} groups, {a.trials} trials, probes every {a.probe_interval} s with a "
          f"{a.probe_timeout} s timeout, failed after {a.threshold} missed; "
          f"{os.cpu_count()} cores")  # fmt: skip
    row("death: kill -> no longer serving", death)
    row("death: kill -> serving again (immediate recovery)", recovery)
    row("hang, one engine: probe stops -> failed", hang[1])
    row("hang, two engines at once: probe stops -> failed", hang[2])
    print(f"  runtime statistics: {stats.recoveries} recoveries, "
          f"{stats.refused_reports} refused reports")  # fmt: skip


if __name__ == "__main__":
    main()
