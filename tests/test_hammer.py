"""Eight threads, 100,000 events, one controller: no deadlock, every event processed exactly
once (the journal holds one record per send, steps without gaps, as many per group as its
thread sent), the invariants hold after every event. In-process through ``ControllerLink``,
and through the controller's actor with ``RemoteLink`` (fewer events: each is a Ray call)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import ray
from hammer import Hammer, journal_counts

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm.host import ControllerLink
from recovery_fsm.journal import JsonlJournal

# A budget no hammered group spends, so every group keeps taking events to the end.
CONFIG = RecoveryConfig(restart_budget=10**9)


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
    with JsonlJournal(journal) as sink:
        controller = RecoveryController(CONFIG, journal=sink)
        h: Hammer
        link = ControllerLink(controller, execute=lambda e: h.execute(e))

        def query(name: str, *args: Any) -> Any:
            value = getattr(controller, name)
            return value(*args) if callable(value) else value

        h = Hammer(link.send, query, events=100_000)
        h.register()
        seconds, stuck = h.run(timeout_s=600)
        assert link.close(60)
    _check(h, journal, seconds, stuck)
    assert not link.errors


@pytest.mark.usefixtures("ray_cluster")
def test_eight_threads_send_events_through_the_controller_actor(tmp_path: Path) -> None:
    from recovery_fsm.ray import RecoveryControllerActor, RemoteLink

    journal = tmp_path / "journal.jsonl"
    name = f"recovery-controller-{os.getpid()}-hammer"
    actor = RecoveryControllerActor.launch(name, CONFIG, journal=str(journal))
    h: Hammer
    link = RemoteLink(actor, execute=lambda e: h.execute(e))
    try:

        def query(name: str, *args: Any) -> Any:
            return ray.get(actor.query.remote(name, *args), timeout=60)

        h = Hammer(link.send, query, events=4_000)
        h.register()
        seconds, stuck = h.run(timeout_s=600)
        assert link.close(60)
        ray.get(actor.close.remote(), timeout=60)
        _check(h, journal, seconds, stuck)
        assert not link.errors
    finally:
        ray.kill(actor)
