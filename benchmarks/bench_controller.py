"""Controller cost per event and per 1,000-group weight sync, beside raw python-statemachine
dispatch measured in the same run (ratios, since the machine is shared and noisy).

    .venv/bin/python benchmarks/bench_controller.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.machines import Fleet, GroupRecord, WorkerGroupMachine


def raw_dispatch_us(n: int, repeat: int) -> float:
    """One python-statemachine event, the same machine and transitions as the controller's."""
    m = WorkerGroupMachine(model=GroupRecord("g", Fleet(0), 0), start_value="active")
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n // 2):
            m.send("probe_failed")
            m.send("probe_ok")
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / n * 1e6


def controller_event_us(n: int, repeat: int, journal: bool, fleet: int = 1) -> float:
    """The same two transitions driven through ``RecoveryController.handle``, on one group
    of a fleet of ``fleet`` groups (what an event costs must not grow with the fleet)."""
    records: list[dict[str, Any]] = []
    c = RecoveryController(
        RecoveryConfig(suspect_threshold=10**9), journal=records.append if journal else None
    )
    c.handle(ev.GroupRegistered("g", 0, at=0.0))
    for i in range(1, fleet):
        c.handle(ev.GroupRegistered(f"g{i}", 0, at=0.0))
    samples = []
    for r in range(repeat):
        # Events are built outside the timed loop: the trainer builds them, not the controller.
        kinds = (ev.ProbeFailed, ev.ProbeOk)
        batch = [kinds[i % 2]("g", 1, at=float(r * n + i + 1)) for i in range(n)]
        t0 = time.perf_counter()
        for e in batch:
            c.handle(e)
        samples.append(time.perf_counter() - t0)
        records.clear()
    return statistics.median(samples) / n * 1e6


def sync_fanout_ms(groups: int, case: str, repeat: int) -> tuple[float, int]:
    """Median time of one WeightsSynced across ``groups`` groups; and transitions it fired."""
    samples = []
    fired = 0
    names = {f"g{i}": 1 for i in range(groups)}
    for _ in range(repeat):
        c = RecoveryController(RecoveryConfig(clean_syncs_to_reenable=1))
        t = 0.0
        for name in sorted(names):
            t += 1
            c.handle(ev.GroupRegistered(name, 0, at=t))
        version = 0
        if case in {"missed", "reenable"}:
            c.handle(ev.WeightsSynced(1, names, at=t + 1))
            c.handle(ev.ExportStarted(1, at=t + 2))
            version = 1
            if case == "reenable":
                c.handle(ev.WeightsSynced(2, names, at=t + 3))  # miss: every group cools down
                c.handle(ev.ExportStarted(2, at=t + 4))
                c.handle(ev.ExportCommitted(2, "/ckpt/step-2", at=t + 5))
                version = 2
        elif case == "clean":
            c.handle(ev.ExportStarted(0, at=t + 1))
            c.handle(ev.ExportCommitted(0, "/ckpt/step-0", at=t + 2))
        elif case == "readmit":
            c.handle(ev.WeightsSynced(1, {}, at=t + 1))  # everyone left out: pending
            version = 1
        sync = ev.WeightsSynced(version + 1, names, at=t + 10)
        t0 = time.perf_counter()
        c.handle(sync)
        samples.append(time.perf_counter() - t0)
        fired = len(c.last_transitions)
        assert c.check_invariants() == []
    return statistics.median(samples) * 1e3, fired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=7)
    a = parser.parse_args()

    # One run of each candidate per round, rounds interleaved: the machine's speed drifts
    # over minutes, and measured one after the other the candidates took different drifts.
    runs: dict[str, list[float]] = {k: [] for k in ("raw", "ctl", "ctl_j", "big", "big_j")}
    for _ in range(a.repeat):
        runs["raw"].append(raw_dispatch_us(a.events, 1))
        runs["ctl"].append(controller_event_us(a.events, 1, journal=False))
        runs["ctl_j"].append(controller_event_us(a.events, 1, journal=True))
        runs["big"].append(controller_event_us(a.events, 1, journal=False, fleet=a.groups))
        runs["big_j"].append(controller_event_us(a.events, 1, journal=True, fleet=a.groups))
    raw, ctl, ctl_j, big, big_j = (statistics.median(runs[k]) for k in runs)
    print(f"per event ({a.events} events, median of {a.repeat} interleaved rounds; aim: 1.5x "
          "raw at most)")  # fmt: skip
    print(f"  raw python-statemachine dispatch   {raw:8.1f} us   1.00x")
    print(f"  controller.handle                  {ctl:8.1f} us   {ctl / raw:.2f}x raw")
    print(f"  controller.handle + journal        {ctl_j:8.1f} us   {ctl_j / raw:.2f}x raw")
    print(f"  the same, {a.groups} groups registered {big:6.1f} us   {big / raw:.2f}x raw")
    print(f"  + journal, {a.groups} groups          {big_j:6.1f} us   {big_j / raw:.2f}x raw")
    print()
    print(f"one WeightsSynced fanned out to {a.groups} groups (median of {a.repeat})")
    cases = {
        "clean": "clean sync, every group active and enabled",
        "readmit": "every group pending_weights, readmitted",
        "missed": "export missed, every group cools down",
        "reenable": "clean sync ends every cooldown",
    }
    for case, label in cases.items():
        ms, fired = sync_fanout_ms(a.groups, case, a.repeat)
        floor = fired * raw / 1e3
        print(
            f"  {label:<44} {ms:7.2f} ms  {fired:5d} transitions"
            f"  (raw dispatch alone: {floor:6.2f} ms, {ms / floor:.2f}x)"
        )


if __name__ == "__main__":
    main()
