"""What the journal's owner fence costs per record: a controller journaling ticks and syncs
to a plain ``JsonlJournal`` and to one that checks ``<journal>.owner`` under ``flock`` before
every record, side by side in one run (interleaved, so the machine's state hits both).
Prints records per second for each and their ratio; with ``--fsync`` each record is also
synced to disk (what a journal on a node that may lose power pays anyway).

    .venv/bin/python benchmarks/bench_journal.py [--records 20000] [--rounds 5] [--fsync]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.journal import JournalOwner, JsonlJournal


def one_run(directory: Path, records: int, fenced: bool, fsync: bool) -> float:
    """Records per second through a controller (a tick or a sync per record)."""
    path = directory / f"journal-{time.monotonic_ns()}.jsonl"
    owner = None
    if fenced:
        owner = JournalOwner(path)
        owner.claim(1, fresh=True)
    journal = JsonlJournal(path, fsync=fsync, owner=owner, epoch=1 if fenced else None)
    c = RecoveryController(RecoveryConfig(), journal=journal)
    c.handle(ev.GroupRegistered("g0", 0, at=0.0))
    began = time.perf_counter()
    version = 0
    for i in range(1, records):
        if i % 100 == 0:
            version += 1
            c.handle(ev.WeightsSynced(version, {"g0": 1}, at=float(i)))
        else:
            c.handle(ev.Tick(at=float(i)))
    took = time.perf_counter() - began
    journal.close()
    return records / took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fsync", action="store_true")
    args = p.parse_args()
    plain: list[float] = []
    fenced: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-journal-") as tmp:
        for _ in range(args.rounds):
            plain.append(one_run(Path(tmp), args.records, False, args.fsync))
            fenced.append(one_run(Path(tmp), args.records, True, args.fsync))
    p50, f50 = statistics.median(plain), statistics.median(fenced)
    print(f"records per round: {args.records}, rounds: {args.rounds}, fsync: {args.fsync}")
    print(f"{'journal':<8} {'median rec/s':>13} {'min':>10} {'max':>10}")
    print(f"{'plain':<8} {p50:>13.0f} {min(plain):>10.0f} {max(plain):>10.0f}")
    print(f"{'fenced':<8} {f50:>13.0f} {min(fenced):>10.0f} {max(fenced):>10.0f}")
    print(f"fenced / plain: {f50 / p50:.2f}x; per record the fence adds "
          f"{(1 / f50 - 1 / p50) * 1e6:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
