"""The chaos demo run long with short steps, its bookkeeping sampled as it goes: the driver's
resident memory, the controller's tables, the runtime's actor table, the ledger and the
journal's bytes per step. Bounded means flat once the run is warm, whatever the step count.

    .venv/bin/python benchmarks/soak.py [--steps 500] [--step-s 1] [--chaos-rate 0.1]
        [--every 50] [--run standby|immediate] [--window-s 60]

The restart budget refills (``restart_window_s``, default 60 s), so a long run's groups keep
recovering instead of retiring one by one. Not in it (issue 20, still open): a trainer
restart (``resume``) and a node loss (``tests/test_node_loss.py`` covers the latter alone).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers.utils import logging as hf_logging

from recovery_fsm.demo.run import DemoOptions, run
from recovery_fsm.search.replay import replay


def rss_mb() -> float:
    """The driver's resident memory now (not its peak)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Sampler:
    def __init__(self, every: int, journal: Path) -> None:
        self.every, self.journal = every, journal
        self.rows: list[list[Any]] = []
        self.last = 0
        self.last_bytes = 0
        self.states: dict[str, str] = {}

    def __call__(self, rt: Any, version: int, steps: int) -> None:
        if version == self.last or version % self.every:
            return
        snap = rt.controller.snapshot()
        size = self.journal.stat().st_size if self.journal.exists() else 0
        per_step = (size - self.last_bytes) / max(1, version - self.last)
        led = rt.ledger
        self.rows.append([
            version, f"{rss_mb():.0f}", len(snap["checkpoints"]), len(snap["finished"]),
            len(snap["starts"]), len(snap["standbys"]), len(led.crashes), len(led.recoveries),
            f"{size / 2**20:.2f}", f"{per_step:.0f}",
        ])  # fmt: skip
        self.last, self.last_bytes = version, size

    def status(self, rt: Any, version: int, steps: int) -> None:
        self.states = {g: v.state for g, v in rt.controller.groups().items()}
        self(rt, version, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--chaos-rate", type=float, default=0.1)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--run", choices=["standby", "immediate"], default="standby")
    parser.add_argument("--window-s", type=float, default=60.0)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="recovery-fsm-soak-")) / a.run
    options = DemoOptions(steps=a.steps, step_s=a.step_s, chaos_rate=a.chaos_rate, out=out,
                          hf_interval=0, restart_window_s=a.window_s)  # fmt: skip
    sampler = Sampler(a.every, out / "journal.jsonl")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {a.steps} "
          f"steps of {a.step_s:g} s, chaos rate {a.chaos_rate}, run {a.run}")  # fmt: skip
    start = time.monotonic()
    result = run(options, mode=a.run, out=out, on_status=sampler.status, note=lambda _m: None)
    print("| step | driver RSS MB | checkpoints | finished | starts | standbys | crashes "
          "(ledger) | recoveries (ledger) | journal MB | journal bytes/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in sampler.rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    safety = result.statistics.safety
    report = replay(result.journal)
    print(f"{time.monotonic() - start:.0f} s; failures {result.ledger.failures}; recoveries "
          f"{dict(result.statistics.recoveries)}; groups at the last step "
          f"{sampler.states}")  # fmt: skip
    print(f"safety: stale admissions {result.counters.stale_admissions}, stale answers "
          f"{result.counters.stale_serves}, loads from deleted paths {safety.loads_from_deleted},"
          f" leaked directories {len(result.leaked)}, lost reports {safety.lost_reports}; "
          f"journal replayed: {'clean' if report.ok else report.render()}; load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
