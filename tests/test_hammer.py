"""Eight threads, 30,000 events, one controller: no deadlock, every event processed exactly
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


def test_eight_threads_send_30000_events_through_the_link(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    h, seconds, stuck, link = in_process(30_000, journal)
    _check(h, journal, seconds, stuck)
    assert not link.errors


@pytest.mark.usefixtures("ray_cluster")
def test_eight_threads_send_events_through_the_controller_actor(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    name = f"recovery-controller-{os.getpid()}-hammer"
    h, seconds, stuck, link = through_actor(4_000, journal, name)
    _check(h, journal, seconds, stuck)
    assert not link.errors


@pytest.mark.usefixtures("ray_cluster")
def test_the_controller_actor_refuses_bad_input_typed_and_unchanged() -> None:
    """Arbitrary classes and fields through ``RemoteLink`` arrive as the typed refusal the
    actor raised (not a ``RayTaskError``), and the actor's controller is unchanged."""
    import ray
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from recovery_fsm import RecoveryError
    from recovery_fsm import events as ev
    from recovery_fsm.ray import RecoveryControllerActor, RemoteLink

    actor = RecoveryControllerActor.launch(f"recovery-controller-{os.getpid()}-fuzz")
    link = RemoteLink(actor, execute=lambda e: None)
    link.send(ev.GroupRegistered, group="g0", version=0)
    junk = st.one_of(st.none(), st.integers(-5, 5), st.floats(), st.text(max_size=4),
                     st.lists(st.integers(), max_size=2))  # fmt: skip

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        kind=st.sampled_from([*ev.EVENT_TYPES.values(), str]),
        fields=st.dictionaries(st.sampled_from(["group", "version", "incarnation", "path",
                                                "groups", "at"]), junk, max_size=3),
    )  # fmt: skip
    def send_junk(kind: type, fields: dict[str, object]) -> None:
        before = ray.get(actor.query.remote("snapshot"), timeout=60)
        try:
            link.send(kind, **fields)
        except RecoveryError:
            assert ray.get(actor.query.remote("snapshot"), timeout=60) == before
            return
        assert not ray.get(actor.query.remote("check_invariants"), timeout=60)

    try:
        send_junk()
    finally:
        link.close(30)
        ray.kill(actor)
