"""The trainer's crash and resume through the controller: what the old runtime had in flight
ends, the future's checkpoints go, C(v) is the source again, and no process serves before it
answers (``Resumed``, ``GroupVerified``, ``StandbyVerified``)."""

from __future__ import annotations

import pytest
from conftest import Driver

from recovery_fsm import (
    ClaimStandby,
    DeleteCheckpoint,
    EventNotAllowed,
    LoadCheckpoint,
    LoadStandby,
    MalformedEvent,
    RecoveryConfig,
    RestartFromCheckpoint,
    RouteTraffic,
    StartStandby,
    StopFound,
    StopGroup,
    StopStandby,
    UnknownVersion,
    VerifyGroup,
    VerifyStandby,
    WithdrawTraffic,
    WrongIncarnation,
)
from recovery_fsm import events as ev
from recovery_fsm.effects import Effect


def of(effects: tuple[Effect, ...], cls: type[Effect]) -> list[Effect]:
    return [f for f in effects if isinstance(f, cls)]


def ran_to(version: int, **config: object) -> Driver:
    """g0, g1 serving ``version``, every step exported and its predecessor deleted; C(1)
    pinned (the trainer's own checkpoint at 1)."""
    d = Driver(RecoveryConfig(**config), groups=["g0", "g1"])  # type: ignore[arg-type]
    for v in range(1, version + 1):
        d.step(v)
        if v == 1:
            d.send(ev.CheckpointPinned, 1)
    return d


def test_resume_withdraws_everyone_and_asks_each_process_what_it_holds() -> None:
    d = ran_to(3)
    effects = d.resume(1)
    assert d.c.version == 1
    assert {f.group for f in of(effects, WithdrawTraffic)} == {"g0", "g1"}  # type: ignore[attr-defined]
    assert of(effects, VerifyGroup) == [VerifyGroup("g0", 1), VerifyGroup("g1", 1)]
    assert {g.state for g in d.c.groups().values()} == {"resuming"}
    assert not d.c.up_groups()  # no push reaches an unverified process
    # The future (C(3)) is deleted; the pinned C(1) is the recovery source again.
    assert of(effects, DeleteCheckpoint) == [DeleteCheckpoint(3, "/ckpt/step-3")]
    assert d.c.checkpoint_state(1) == "ready"


def test_a_survivor_holding_v_serves_without_a_reboot_and_one_ahead_loads_c_v() -> None:
    d = ran_to(3)
    d.resume(1)
    assert of(d.send(ev.GroupVerified, "g0", 1, 1), RouteTraffic) == [RouteTraffic("g0", 1, 1)]
    effects = d.send(ev.GroupVerified, "g1", 1, 3)  # it holds the abandoned future's weights
    assert of(effects, LoadCheckpoint) == [LoadCheckpoint("g1", 2, 1, "/ckpt/step-1", 1)]
    assert d.c.groups()["g0"].restarts == d.c.groups()["g1"].restarts == 0


def test_a_load_in_flight_keeps_its_lease_until_the_process_answers() -> None:
    d = ran_to(3)
    d.about(ev.GroupFailed, "g1")  # restarts from C(3)
    assert d.c.lease_of("g1") is not None
    effects = d.resume(2)
    assert of(effects, DeleteCheckpoint) == []  # C(3) is leased by g1's load
    assert d.c.checkpoint_state(3) == "superseded"
    effects = d.send(ev.GroupVerified, "g1", 2, 3)
    assert of(effects, DeleteCheckpoint) == [DeleteCheckpoint(3, "/ckpt/step-3")]


def test_a_process_that_does_not_answer_has_failed_and_recovers_from_c_v() -> None:
    d = ran_to(2)
    d.resume(1)
    effects = d.send(ev.GroupFailed, "g0", 1, reason="no actor under its name")
    assert of(effects, RestartFromCheckpoint) == [RestartFromCheckpoint("g0", 2, 1, "/ckpt/step-1")]
    assert d.c.recovery_state("g0") == "enabled"  # a resume's failure does not cool


def test_a_verification_past_the_load_deadline_is_killed() -> None:
    d = ran_to(1, load_timeout_s=5.0)
    d.resume(1)
    d.c.handle(ev.Tick(at=1000.0))
    assert d.c.group_state("g0") == "loading"  # killed, restarted from C(1)


def standby_holding(version: int) -> Driver:
    """``ran_to(version)`` with a pool of one whose standby booted and loaded C(version)."""
    d = ran_to(version, standby=1)
    d.send(ev.StandbyBooted, "standby-1")
    d.send(ev.StandbyLoaded, "standby-1", version)
    assert d.c.standbys()["standby-1"].ready
    return d


def test_a_standby_that_survived_is_asked_and_never_claimed_before_it_answers() -> None:
    d = standby_holding(1)
    effects = d.resume(1)
    assert of(effects, VerifyStandby) == [VerifyStandby("standby-1")]
    assert of(effects, StopStandby) == of(effects, StartStandby) == []  # no boot
    assert d.c.standbys()["standby-1"].state == "resuming"
    assert d.c.up_standbys() == []  # no push reaches it either
    d.send(ev.GroupVerified, "g0", 1, 1)
    effects = d.about(ev.GroupFailed, "g0")
    assert of(effects, ClaimStandby) == []
    assert of(effects, RestartFromCheckpoint) == [RestartFromCheckpoint("g0", 2, 1, "/ckpt/step-1")]
    assert of(d.send(ev.StandbyVerified, "standby-1", 1), LoadStandby) == []  # current
    d.send(ev.GroupVerified, "g1", 1, 1)
    effects = d.about(ev.GroupFailed, "g1")
    assert of(effects, ClaimStandby) == [ClaimStandby("g1", 2, "standby-1", 1, None)]


def test_a_group_waiting_for_an_export_claims_the_standby_once_it_answers_current() -> None:
    d = Driver(RecoveryConfig(standby=1), groups=["g0", "g1"])
    d.send(ev.StandbyBooted, "standby-1")
    d.send(ev.WeightsSynced, 1, {"g0": 1, "g1": 1, "standby-1": 1})  # not exported
    d.resume(1)
    d.send(ev.GroupVerified, "g0", 1, 1)
    d.send(ev.ExportStarted, 1)  # the restarted trainer exports its v
    d.about(ev.GroupFailed, "g0")
    assert d.c.group_state("g0") == "awaiting_checkpoint"
    effects = d.send(ev.StandbyVerified, "standby-1", 1)
    assert of(effects, ClaimStandby) == [ClaimStandby("g0", 2, "standby-1", 1, None)]


def test_a_standby_loading_the_future_keeps_its_lease_then_loads_c_v() -> None:
    d = ran_to(3, standby=1)
    assert of(d.send(ev.StandbyBooted, "standby-1"), LoadStandby)  # loads C(3)
    effects = d.resume(1)
    assert of(effects, DeleteCheckpoint) == []  # C(3) is still read by the standby
    effects = d.send(ev.StandbyVerified, "standby-1", 3)  # the abandoned future's weights
    assert of(effects, DeleteCheckpoint) == [DeleteCheckpoint(3, "/ckpt/step-3")]
    assert of(effects, LoadStandby) == [LoadStandby("standby-1", 1, "/ckpt/step-1")]


def test_the_abandoned_future_is_none_even_once_the_fleet_reaches_its_number() -> None:
    """The new run syncs 2 and 3 before the standby (behind its load of the old C(3)) and g1
    answer: what they hold is the dead run's 3, never what the new run calls 3."""
    d = ran_to(3, standby=1)
    d.send(ev.StandbyBooted, "standby-1")  # loads C(3)
    d.resume(1)
    d.send(ev.GroupVerified, "g0", 1, 1)
    d.sync(2)
    d.sync(3)
    d.send(ev.StandbyVerified, "standby-1", 3)
    d.send(ev.GroupVerified, "g1", 1, 3)
    assert d.c.standbys()["standby-1"].state == "stale"
    assert d.c.group_state("g1") == "pending_weights"


def test_a_standby_whose_boot_died_with_the_trainer_loads_c_v_once_it_answers() -> None:
    d = ran_to(1, standby=1)  # its boot is in flight
    assert of(d.resume(1), VerifyStandby) == [VerifyStandby("standby-1")]
    effects = d.send(ev.StandbyVerified, "standby-1", None)
    assert of(effects, LoadStandby) == [LoadStandby("standby-1", 1, "/ckpt/step-1")]


def test_a_silent_standby_is_killed_at_the_load_deadline_and_the_pool_refills() -> None:
    d = standby_holding(1)
    d.resume(1)
    effects = d.c.handle(ev.Tick(at=1000.0))
    assert of(effects, StopStandby) == [StopStandby("standby-1", "verify deadline")]
    assert of(effects, StartStandby) == [StartStandby("standby-2")]
    assert "standby-1" not in d.c.standbys()
    # The killed process's answer (or its death) only ends what it owed.
    assert of(d.c.handle(ev.StandbyFailed("standby-1", at=1001.0)), Effect) == []
    assert d.c.check_invariants() == []
    with pytest.raises(EventNotAllowed, match="handed over, lost or stopped"):
        d.c.handle(ev.StandbyVerified("standby-1", 1, at=1002.0))


def test_a_standby_that_did_not_survive_is_replaced() -> None:
    d = standby_holding(1)
    d.resume(1)
    effects = d.send(ev.StandbyFailed, "standby-1", reason="no actor under its name")
    assert of(effects, StartStandby) == [StartStandby("standby-2")]


def test_a_standby_lost_before_it_answers_is_no_failed_boot() -> None:
    """Its boot was the dead runtime's: with a boot budget of one, the pool still refills."""
    d = ran_to(1, standby=1, standby_boot_budget=1)  # its boot is in flight, never ready
    d.resume(1)
    effects = d.send(ev.StandbyFailed, "standby-1", reason="never booted")
    assert of(effects, StartStandby) == [StartStandby("standby-2")]
    assert d.c.pool_state == "filling"


def test_bad_standby_answers_are_refused_and_change_nothing() -> None:
    d = standby_holding(1)
    before = d.c.snapshot()
    with pytest.raises(EventNotAllowed, match="expects it in one of \\['resuming'\\]"):
        d.send(ev.StandbyVerified, "standby-1", 1)  # nobody resumed
    with pytest.raises(EventNotAllowed, match="unknown standby"):
        d.send(ev.StandbyVerified, "standby-7", 1)
    assert d.c.snapshot() == before
    d.resume(1)
    before = d.c.snapshot()
    with pytest.raises(EventNotAllowed, match="expects it in one of \\['booting'\\]"):
        d.send(ev.StandbyBooted, "standby-1")  # the dead runtime's boot never reports
    assert d.c.snapshot() == before


def test_versions_after_the_resume_are_exported_anew_once_the_old_files_are_gone() -> None:
    d = ran_to(3)
    d.resume(1)
    for g in ("g0", "g1"):
        d.send(ev.GroupVerified, g, 1, 1)
    d.step(2)  # C(2) was deleted before the resume: its version is free again
    d.sync(3)
    with pytest.raises(EventNotAllowed, match="still being deleted"):
        d.send(ev.ExportStarted, 3)  # the abandoned future's C(3) is not deleted yet
    d.send(ev.CheckpointDeleted, 3)
    d.export(3)
    assert d.c.checkpoint_state(3) == "ready"


def test_bad_resumes_are_refused_and_change_nothing() -> None:
    d = ran_to(2)
    before = d.c.snapshot()
    with pytest.raises(UnknownVersion, match="only reached 2"):
        d.resume(3)
    with pytest.raises(EventNotAllowed, match="nobody asked to verify"):
        d.send(ev.GroupVerified, "g0", 1, 2)
    with pytest.raises(WrongIncarnation):
        d.send(ev.GroupVerified, "g0", 5, 2)
    assert d.c.snapshot() == before
    d.send(ev.Shutdown)
    with pytest.raises(EventNotAllowed, match="after Shutdown"):
        d.resume(1)


# -- what the new runtime found, and the epoch that fences the run it replaces ------------------


def test_a_resume_raises_the_epoch_and_one_not_above_it_is_refused_and_changes_nothing() -> None:
    d = ran_to(2)
    assert d.c.epoch == 1
    d.resume(2)
    assert d.c.epoch == 2
    before = d.c.snapshot()
    for stale in (1, 2):  # the replaced run's own resume, or one racing this one
        with pytest.raises(EventNotAllowed, match=f"epoch {stale}, but the run is at epoch 2"):
            d.resume(2, epoch=stale)
    assert d.c.snapshot() == before
    d.resume(2, epoch=7)  # epochs only need to grow
    assert d.c.epoch == 7


def test_a_process_the_resume_did_not_find_has_failed_and_recovers_at_once() -> None:
    """Not asked what it holds (nobody would answer): it recovers from C(v) in the same
    event, and not as a failed load (nobody knows whether its load ran)."""
    d = ran_to(2)
    effects = d.resume(2, gone=["g0#1"])
    assert of(effects, VerifyGroup) == [VerifyGroup("g1", 1)]
    assert of(effects, RestartFromCheckpoint) == [RestartFromCheckpoint("g0", 2, 2, "/ckpt/step-2")]
    assert of(effects, StopGroup) == []  # nothing of it is left to stop
    assert d.c.recovery_state("g0") == "enabled"


def test_a_process_that_did_not_answer_the_resume_is_stopped_before_it_is_replaced() -> None:
    d = ran_to(2)
    effects = d.resume(2, silent=["g1#1"])
    stop = effects.index(StopGroup("g1", 1, "silent at the resume"))
    restart = effects.index(RestartFromCheckpoint("g1", 2, 2, "/ckpt/step-2"))
    assert stop < restart
    assert of(effects, VerifyGroup) == [VerifyGroup("g0", 1)]


def test_processes_found_that_are_nobodys_are_stopped_before_any_lease_they_held_ends() -> None:
    """g1's restart from C(3) was killed at its deadline by the old runtime (its start still
    awaits an outcome); the resume finds that process alive, and an unknown one. Both are
    stopped, in the event's first effects, before C(3), no longer leased, is deleted."""
    d = ran_to(3, load_timeout_s=0.5)
    d.about(ev.GroupFailed, "g1")  # restarts as g1#2 from C(3)
    d.send(ev.Tick)  # killed at its load deadline; #3 starts cold
    assert d.inc("g1") == 3 and "g1#2" in d.c.leases  # #2 still holds C(3)
    effects = d.resume(1, strays=["g1#2", "ghost#4"])
    stops = of(effects, StopFound)
    assert {(f.name, f.incarnation) for f in stops} == {("g1", 2), ("ghost", 4)}  # type: ignore[attr-defined]
    deletes = [i for i, f in enumerate(effects) if isinstance(f, DeleteCheckpoint)]
    assert all(effects.index(f) < min(deletes, default=len(effects)) for f in stops)


def test_a_standby_the_resume_did_not_find_is_lost_without_spending_the_boot_budget() -> None:
    d = ran_to(1, standby=1, standby_boot_budget=1)
    effects = d.resume(1, gone=["standby-1#1"])
    assert of(effects, VerifyStandby) == []
    assert "standby-1" not in d.c.standbys() or d.c.standbys()["standby-1"].state == "lost"
    assert d.c.pool_state == "filling"  # a budget of one is not spent: a new one boots
    assert of(effects, StartStandby) == [StartStandby("standby-2")]


def test_a_resume_listing_a_process_twice_or_badly_named_is_refused_and_changes_nothing() -> None:
    d = ran_to(1)
    before = d.c.snapshot()
    for found, silent in ((["g0#1", "g0#1"], []), (["g0"], []), (["g0#0"], []),
                          (["g0#1"], ["g0#1"]), ("g0#1", [])):  # fmt: skip
        with pytest.raises(MalformedEvent):
            d.c.handle(ev.Resumed(1, epoch=2, found=found, silent=silent, at=d.now()))
    assert d.c.snapshot() == before
