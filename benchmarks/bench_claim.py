"""A standby's claim, kill to serving, beside its floor: the pool's refill booting once the
claim's check reported (the rule) against booting the moment the standby is claimed (the
rule before it), to see whether the refill's boot, on the same cores, slows the check.
Alternates the two, rounds x trials each, in one run.

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
from pathlib import Path

import ray
import torch
from bench_recovery import DemoOptions, model_config, run_path
from transformers.utils import logging as hf_logging

from recovery_fsm import Rules


class RefillAtOnce(Rules):
    """The rule before: a claim in flight does not hold the refill back."""

    def _claim_checked(self) -> bool:
        return False


ARMS = {"after the claim (the rule)": Rules, "at once (before)": RefillAtOnce}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-claim-"))
    config = model_config(DemoOptions(model="small"))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {a.engine}")
    got: dict[str, dict[str, list[float]]] = {}
    for rnd in range(a.rounds):
        for n, (arm, rules) in enumerate(ARMS.items()):
            r = run_path(work / f"{rnd}-{n}", config, a.engine, "standby", 4.0, a.trials, 0, rules)
            mine = got.setdefault(arm, {"latency": [], "floor": []})
            mine["latency"] += r["latency"]
            mine["floor"] += [d + b["canary"] for d, b in zip(r["detected"], r["limit"],
                                                                  strict=True)]  # fmt: skip
    print("| refill | claims | kill to serving p50 | max | floor p50 (detected + canary) | "
          "p50 / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for arm, r in got.items():
        p50, floor = statistics.median(r["latency"]), statistics.median(r["floor"])
        worst = max(r["latency"])
        print(f"| {arm} | {len(r['latency'])} | {p50 * 1000:.0f} ms | {worst * 1000:.0f} ms | "
              f"{floor * 1000:.0f} ms | {p50 / floor:.2f}x |")  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
