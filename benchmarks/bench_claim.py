"""A standby's claim, kill to serving, beside its floor, with the pool's refill booting at
once (as the runtime does) and held back 3 s (to see whether the refill's boot, on the same
cores, slows the claim's check). Alternates the two, rounds x trials each, in one run.

    .venv/bin/python benchmarks/bench_claim.py [--engine reference|vllm] [--rounds 2]
        [--trials 3]

The floor is the kill to the controller's decision ("detected") plus the canary asked of a
fresh engine (the admission check), both measured in the same trials (``bench_recovery``'s
standby path at 4 s steps).
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
from bench_recovery import DemoOptions, model_config, run_path
from transformers.utils import logging as hf_logging

from recovery_fsm import effects as fx
from recovery_fsm.ray import runner

_boot_standby = runner.EffectRunner._standby
HOLD = {"on": False}


def _held(self: Any, effect: Any) -> Any:
    if isinstance(effect, fx.StartStandby) and HOLD["on"]:
        time.sleep(3.0)  # the refill's boot starts after the claim has been checked
    return _boot_standby(self, effect)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    runner.EffectRunner._standby = _held  # type: ignore[method-assign]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-claim-"))
    config = model_config(DemoOptions(model="small"))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {a.engine}")
    got: dict[bool, dict[str, list[float]]] = {}
    for rnd in range(a.rounds):
        for hold in (False, True):
            HOLD["on"] = hold
            r = run_path(work / f"{rnd}-{hold}", config, a.engine, "standby", 4.0, a.trials, 0)
            mine = got.setdefault(hold, {"latency": [], "floor": []})
            mine["latency"] += r["latency"]
            mine["floor"] += [d + b["canary"] for d, b in zip(r["detected"], r["limit"],
                                                                  strict=True)]  # fmt: skip
    print("| refill | claims | kill to serving p50 | max | floor p50 (detected + canary) | "
          "p50 / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for hold, r in got.items():
        p50, floor = statistics.median(r["latency"]), statistics.median(r["floor"])
        print(f"| {'held 3 s' if hold else 'at once'} | {len(r['latency'])} | "
              f"{p50 * 1000:.0f} ms | {max(r['latency']) * 1000:.0f} ms | {floor * 1000:.0f} ms "
              f"| {p50 / floor:.2f}x |")  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
