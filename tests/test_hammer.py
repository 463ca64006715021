"""Eight threads, 100,000 events, one controller: no deadlock, every event processed exactly
once (the journal holds one record per send, steps without gaps, as many per group as its
thread sent), the invariants hold after every event. In-process through ``ControllerLink``,
and through the controller's actor with ``RemoteLink`` (fewer events: each is a Ray call).
Without the link's and the controller's locks the first test fails (a thread crashes on a
dictionary changed under it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hammer import Hammer, in_process, journal_counts, through_actor


def _check(h: Hammer, journal: Path, seconds: float, stuck: list[str]) -> None:
    t = h.tally
    assert not stuck, f"threads still running: {stuck}"
    assert not t.errors, t.errors[:3]
    assert not t.violations, t.violations[:3]
    steps, about = journal_counts(journal)
    assert steps == list(range(1, len(steps) + 1))  # no gap, no repeat
    assert len(steps) == t.total
    assert about == t.sent  # exactly once, per sender
    print(f"{t.total} events in {seconds:.1f} s: {t.total / seconds:.0f} events/s, "
          f"{t.refused} refused")  # fmt: skip


def test_eight_threads_send_100000_events_through_the_link(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    h, seconds, stuck, link = in_process(100_000, journal)
    _check(h, journal, seconds, stuck)
    assert not link.errors


@pytest.mark.usefixtures("ray_cluster")
def test_eight_threads_send_events_through_the_controller_actor(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    name = f"recovery-controller-{os.getpid()}-hammer"
    h, seconds, stuck, link = through_actor(4_000, journal, name)
    _check(h, journal, seconds, stuck)
    assert not link.errors
