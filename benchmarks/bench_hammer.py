"""Eight threads hammering one controller (``tests/hammer.py``): events per second through
the in-process ``ControllerLink`` and through the controller's Ray actor (``RemoteLink``),
with the invariants checked after every event and the journal checked for exactly once.

    .venv/bin/python benchmarks/bench_hammer.py [--events 100000] [--actor-events 100000]

Each event through the actor is three Ray calls (the thread reads its group's state, sends,
checks the invariants), so the actor's figure is a round trip's, not the controller's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hammer import Hammer, in_process, journal_counts, through_actor  # the tests' module


def report(how: str, h: Hammer, journal: Path, seconds: float, stuck: list[str]) -> None:
    steps, about = journal_counts(journal)
    once = steps == list(range(1, len(steps) + 1)) and about == h.tally.sent
    t, stuck_names = h.tally, ", ".join(stuck) or "none"
    print(f"| {how} | {t.total} | {seconds:.1f} s | {t.total / seconds:.0f} | {t.refused} | "
          f"{len(t.violations)} | {'yes' if once else 'NO'} | {stuck_names} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--actor-events", type=int, default=100_000)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-hammer-"))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print("| link | events | time | events/s | refused | invariant violations | exactly once "
          "| threads stuck |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    h, seconds, stuck, _ = in_process(a.events, work / "link.jsonl")
    report("ControllerLink (in process)", h, work / "link.jsonl", seconds, stuck)
    if a.actor_events:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")  # fmt: skip
        name = f"bench-hammer-{os.getpid()}"
        h, seconds, stuck, _ = through_actor(a.actor_events, work / "actor.jsonl", name)
        report("RemoteLink (controller actor)", h, work / "actor.jsonl", seconds, stuck)
        ray.shutdown()
    print(f"{time.perf_counter() - start:.0f} s in all; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
