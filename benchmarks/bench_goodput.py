"""Goodput under the demo's chaos against the bound its forced boots set, side by side in one
run, in accepted samples per second (4 samples per prompt at temperature 1):

- ``chaos``: the demo's seeded failures (immediate recovery, no standby);
- ``free``: the same scenario without failures (the yardstick);
- ``free + boots``: without failures, with as many reference-engine boots started beside
  it, at the same moments, as the chaos run's failures forced (restarts and refills, read
  from its journal): what the boots alone cost the rollouts on these cores.

``chaos / (free + boots)`` is what recovery loses beyond the CPU its boots take.

    .venv/bin/python benchmarks/bench_goodput.py [--rounds 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import logging
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

from recovery_fsm.demo.run import DemoOptions, model_config, run
from recovery_fsm.ray import ReferenceEngine

BOOTS = ("RestartFromCheckpoint", "RestartCold", "StartStandby")


def boot_offsets(journal: Path) -> list[float]:
    """When each boot the run forced was asked for, in seconds after the fleet registered."""
    records = [json.loads(x) for x in journal.read_text().splitlines()]
    events = [r for r in records if "event" in r]
    start = max(r["event"]["at"] for r in events if r["event"]["kind"] == "GroupRegistered")
    return [
        r["event"]["at"] - start
        for r in events
        for e in r.get("effects", ())
        if e["kind"] in BOOTS
    ]


def booter(config: dict[str, Any], offsets: list[float]) -> tuple[Any, list[threading.Thread]]:
    """A hook that starts one engine boot (a new Ray worker process that imports torch and
    builds the model) at each offset, then kills it."""
    threads: list[threading.Thread] = []
    engine = ray.remote(concurrency_groups={"health": 1, "watch": 1})(ReferenceEngine).options(
        num_cpus=0.1
    )

    def one(at: float, began: float) -> None:
        time.sleep(max(0.0, began + at - time.monotonic()))
        actor = engine.remote(config, "beside", 1)
        try:
            ray.get(actor.boot_empty.remote(), timeout=120)
        finally:
            ray.kill(actor)

    def start() -> None:
        began = time.monotonic()
        for at in offsets:
            t = threading.Thread(target=one, args=(at, began), daemon=True)
            t.start()
            threads.append(t)

    return start, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-goodput-"))
    options = DemoOptions(steps=a.steps, out=work)
    config = model_config(options)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"demo defaults, {a.steps} steps, {a.rounds} rounds")  # fmt: skip
    got: dict[str, list[float]] = {"chaos": [], "free": [], "free + boots": []}
    quiet = {"note": lambda _: None}
    for rnd in range(a.rounds):
        chaos = run(options, mode="immediate", out=work / f"{rnd}-chaos", **quiet)
        offsets = boot_offsets(chaos.journal)
        free = run(options, mode="free", out=work / f"{rnd}-free", **quiet)
        start, threads = booter(config, offsets)
        bound = run(options, mode="free", out=work / f"{rnd}-bound", on_rolling=start, **quiet)
        for t in threads:
            t.join(120)
        for name, r in (("chaos", chaos), ("free", free), ("free + boots", bound)):
            got[name].append(r.counters.samples / r.rollout_s)
        print(f"round {rnd}: {len(chaos.counters.killed)} failures, {len(offsets)} boots; "
              + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items())
              + " accepted samples/s")
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"medians: chaos {med['chaos']:.1f}, free {med['free']:.1f}, free + boots "
          f"{med['free + boots']:.1f} samples/s; goodput {med['chaos'] / med['free']:.0%} of "
          f"free, the boots' bound {med['free + boots'] / med['free']:.0%}, chaos / bound "
          f"{med['chaos'] / med['free + boots']:.0%}")
    ray.shutdown()


if __name__ == "__main__":
    main()
