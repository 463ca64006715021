"""Reports the controller did not ask for are refused and change nothing (design rule 4).

A runtime reports the outcome of an effect the rules emitted. A report that answers nothing
(an answer to a verification nobody asked, a load outcome for a relaunch, a standby's load of
another version) must not end a start that is still running: that would free its lease and
let its checkpoint be deleted under the load."""

from __future__ import annotations

import pytest
from conftest import Driver

from recovery_fsm import RecoveryConfig
from recovery_fsm import events as ev
from recovery_fsm.effects import DeleteCheckpoint, RestartFromCheckpoint, VerifyGroup
from recovery_fsm.errors import EventNotAllowed, RecoveryError


def _loading_from_c1() -> Driver:
    """g0 restarts from C(1); a sync to 2 supersedes C(1), which its lease keeps."""
    d = Driver(RecoveryConfig(), ["g0", "g1"])
    d.step(1)
    effects = d.about(ev.GroupFailed, "g0", reason="boom")
    assert any(isinstance(f, RestartFromCheckpoint) for f in effects)
    d.sync(2, groups=["g1"])
    assert d.c.checkpoint_state(1) == "superseded"
    return d


def test_a_verification_answer_outside_a_resume_is_refused_and_the_load_keeps_its_lease() -> None:
    """The harm the issue found: the stray answer ended the running start, released its
    lease (C(1) deleted under the load), and the real outcome then stopped the controller."""
    d = _loading_from_c1()
    before = d.c.snapshot()
    with pytest.raises(EventNotAllowed, match="nobody asked to verify"):
        d.send(ev.GroupVerified, "g0", 2, 1)
    assert d.c.snapshot() == before
    assert d.c.checkpoint_state(1) == "superseded"  # still leased: not deletable
    # The real outcome still lands, and only then may C(1) go.
    effects = d.about(ev.RestartLoaded, "g0")
    assert DeleteCheckpoint(1, "/ckpt/step-1") in effects
    assert d.c.group("g0").state == "pending_weights"


def test_reports_of_another_kind_or_incarnation_are_refused_and_change_nothing() -> None:
    d = _loading_from_c1()
    before = d.c.snapshot()
    wrong = [
        ev.Relaunched("g0", 2, at=50.0),  # a cold start's outcome for a load
        ev.RelaunchFailed("g0", 2, error="x", at=50.0),
        ev.RestartLoaded("g0", 1, at=50.0),  # the incarnation that died
        ev.RestartLoaded("g1", 1, at=50.0),  # a process that loads nothing
        ev.GroupVerified("g1", 1, 2, at=50.0),
        ev.StandbyLoaded("standby-1", 2, at=50.0),  # no standby was ever made
    ]
    for e in wrong:
        with pytest.raises(RecoveryError):
            d.c.handle(e)
        assert d.c.snapshot() == before, e


def test_a_verification_killed_at_its_deadline_is_answered_once_and_only_ends_its_start() -> None:
    d = Driver(RecoveryConfig(load_timeout_s=5.0), ["g0"])
    d.step(1)
    effects = d.resume(1)
    assert VerifyGroup("g0", 1) in effects
    d.c.handle(ev.Tick(at=100.0))  # past the verify deadline: killed, restarted from C(1)
    assert d.inc("g0") == 2
    # The killed process's late answer ends its start and nothing else; a second is refused.
    assert d.c.handle(ev.GroupVerified("g0", 1, 1, at=101.0)) == ()
    before = d.c.snapshot()
    with pytest.raises(EventNotAllowed, match="nobody asked to verify"):
        d.c.handle(ev.GroupVerified("g0", 1, 1, at=102.0))
    assert d.c.snapshot() == before
