"""Warm standbys through the controller: the pool fills, standbys stay current (push or load in
place), a failed group claims one in the order the rules give, leases, deadlines, the boot
budget, shutdown, and refusals that change nothing."""

from __future__ import annotations

import itertools

import pytest
from conftest import Driver

from recovery_fsm import (
    ClaimStandby,
    EventNotAllowed,
    LoadCheckpoint,
    LoadStandby,
    RecoveryConfig,
    RestartCold,
    RestartFromCheckpoint,
    RouteTraffic,
    StartStandby,
    StopStandby,
    UnknownGroup,
    WrongIncarnation,
)
from recovery_fsm import events as ev
from recovery_fsm.effects import Effect
from recovery_fsm.journal.ledger import Ledger


def kinds(effects: tuple[Effect, ...], cls: type[Effect]) -> list[Effect]:
    return [f for f in effects if isinstance(f, cls)]


def pool(size: int = 1, **changes: object) -> Driver:
    """Groups g0, g1 registered on version 0, a pool of ``size`` standbys booted (empty)."""
    d = Driver(RecoveryConfig(standby=size, **changes))  # type: ignore[arg-type]
    first = d.send(ev.GroupRegistered, "g0", 0)
    assert [f.standby for f in kinds(first, StartStandby)] == [  # type: ignore[attr-defined]
        f"standby-{n}" for n in range(1, size + 1)
    ]
    d.send(ev.GroupRegistered, "g1", 0)
    for n in range(1, size + 1):
        d.send(ev.StandbyBooted, f"standby-{n}")
    return d


def push(d: Driver, version: int, standbys: bool = True) -> tuple[Effect, ...]:
    """A sync to every up group and (``standbys``) every up standby."""
    names = dict(d.c.up_groups())
    if standbys:
        names.update(dict.fromkeys(d.c.up_standbys(), 1))
    return d.send(ev.WeightsSynced, version, names)


def test_a_pushed_standby_is_claimed_as_it_is_and_the_pool_refills() -> None:
    d = pool()
    assert d.c.standbys()["standby-1"].state == "stale"  # booted, no weights, no checkpoint
    push(d, 1)
    assert d.c.standbys()["standby-1"].ready
    effects = d.about(ev.GroupFailed, "g0")
    [claim] = kinds(effects, ClaimStandby)
    assert claim == ClaimStandby("g0", 2, "standby-1", 1, None)
    assert not kinds(effects, RestartCold) and not kinds(effects, RestartFromCheckpoint)
    assert d.c.group("g0").state == "claiming" and d.c.group("g0").lease is None
    # The refill waits for the claim's outcome: its boot would slow the claim's check.
    assert not kinds(effects, StartStandby)
    assert not kinds(d.send(ev.ProbeOk, "g1", 1), StartStandby)
    routed = d.about(ev.RestartLoaded, "g0")
    assert RouteTraffic("g0", 2, 1) in routed
    assert [f.standby for f in kinds(routed, StartStandby)] == ["standby-2"]  # type: ignore[attr-defined]
    assert d.c.group("g0").restarts == 1  # a claim spends the restart budget like a restart


def test_the_ledger_names_the_standby_path() -> None:
    d = pool()
    ledger = Ledger()
    d.c = type(d.c)(d.c.config, journal=ledger)
    for name in ("g0", "g1"):
        d.send(ev.GroupRegistered, name, 0)
    d.send(ev.StandbyBooted, "standby-1")
    push(d, 1)
    d.about(ev.GroupFailed, "g0")
    d.about(ev.RestartLoaded, "g0")
    assert ledger.recovered["standby"] == 1
    assert [r.path for r in ledger.recoveries] == ["standby"]
    assert ledger.standbys_started == 2


def test_a_stale_standby_is_not_admitted_without_a_checkpoint() -> None:
    d = pool()
    push(d, 1, standbys=False)  # load mode: the push skips standbys; C(1) not written yet
    assert d.c.standbys()["standby-1"].state == "stale"
    effects = d.about(ev.GroupFailed, "g0")
    assert not kinds(effects, ClaimStandby)
    assert d.c.group("g0").state == "awaiting_checkpoint"  # C(1)'s export follows the sync


def test_in_load_mode_the_standby_loads_each_commit_in_place_under_a_lease() -> None:
    d = pool()
    push(d, 1, standbys=False)
    d.send(ev.ExportStarted, 1)
    effects = d.send(ev.ExportCommitted, 1, "/ckpt/step-1")
    assert kinds(effects, LoadStandby) == [LoadStandby("standby-1", 1, "/ckpt/step-1")]
    assert d.c.checkpoints()[1].leases == 1
    d.send(ev.StandbyLoaded, "standby-1", 1)
    assert d.c.standbys()["standby-1"].ready and d.c.checkpoints()[1].leases == 0


def test_a_group_failing_while_the_standby_loads_claims_it_with_its_own_lease() -> None:
    d = pool()
    push(d, 1, standbys=False)
    d.send(ev.ExportStarted, 1)
    d.send(ev.ExportCommitted, 1, "/ckpt/step-1")  # standby-1 loads C(1)
    effects = d.about(ev.GroupFailed, "g0")
    assert kinds(effects, ClaimStandby) == [ClaimStandby("g0", 2, "standby-1", 1, "/ckpt/step-1")]
    assert d.c.checkpoints()[1].leases == 2  # the standby's own load still runs
    # A sync supersedes C(1); neither load's checkpoint may be deleted under it.
    push(d, 2)
    assert d.c.checkpoint_state(1) == "superseded"
    d.send(ev.StandbyLoaded, "standby-1", 1)  # the orphaned load ends: one lease left
    assert d.c.checkpoints()[1].leases == 1
    done = d.about(ev.RestartLoaded, "g0")
    assert d.c.checkpoint_state(1) == "deletable"
    assert any(getattr(f, "version", None) == 1 for f in done)
    assert d.c.group("g0").state == "pending_weights"  # it loaded 1; the fleet is at 2


def test_a_current_standby_comes_before_a_ready_checkpoint() -> None:
    d = pool()
    push(d, 1)
    d.export(1)
    effects = d.about(ev.GroupFailed, "g0")
    assert kinds(effects, ClaimStandby) == [ClaimStandby("g0", 2, "standby-1", 1, None)]
    # The second failure finds only the refill, still booting: it restarts from C(1).
    effects = d.about(ev.GroupFailed, "g1")
    assert kinds(effects, RestartFromCheckpoint) and not kinds(effects, ClaimStandby)


def test_a_claim_that_fails_admission_does_not_cool_a_load_that_fails_does() -> None:
    d = pool()
    push(d, 1)
    d.about(ev.GroupFailed, "g0")
    d.about(ev.RestartLoadFailed, "g0", error="canary refused")
    assert d.c.group("g0").recovery == "enabled"
    d2 = pool()
    push(d2, 1, standbys=False)
    d2.send(ev.ExportStarted, 1)
    d2.send(ev.ExportCommitted, 1, "/ckpt/step-1")
    d2.send(ev.StandbyLoaded, "standby-1", 1)
    push(d2, 2, standbys=False)  # standby stale, C(2) not written
    d2.send(ev.ExportStarted, 2)
    d2.send(ev.ExportCommitted, 2, "/ckpt/step-2")  # standby-1 loads C(2) in place
    d2.about(ev.GroupFailed, "g0")  # claims it with a load
    d2.about(ev.RestartLoadFailed, "g0", error="bad shard")
    assert d2.c.group("g0").recovery == "cooldown"


def test_a_group_waiting_for_a_checkpoint_takes_a_standby_that_becomes_current() -> None:
    d = pool()
    push(d, 1, standbys=False)
    d.send(ev.ExportStarted, 1)
    d.about(ev.GroupFailed, "g0")
    assert d.c.group("g0").state == "awaiting_checkpoint"
    d.send(ev.ExportCommitted, 1, "/ckpt/step-1")  # wakes g0 first: it claims standby-1
    assert d.c.group("g0").state == "claiming"
    assert "standby-1" not in d.c.standbys()


def test_a_standby_dead_or_killed_at_its_deadline_is_replaced() -> None:
    d = pool(load_timeout_s=5.0, relaunch_timeout_s=7.0)
    effects = d.send(ev.StandbyFailed, "standby-1", reason="actor died")
    assert kinds(effects, StartStandby) == [StartStandby("standby-2")]
    at = d.now() + 10
    effects = d.c.handle(ev.Tick(at=at))
    d._clock = itertools.count(int(at) + 1)
    assert kinds(effects, StopStandby) == [StopStandby("standby-2", "boot deadline")]
    assert kinds(effects, StartStandby) == [StartStandby("standby-3")]
    assert d.c.check_invariants() == []
    # The killed boot's late outcome is accepted and only ends that start.
    d.send(ev.StandbyFailed, "standby-2", reason="killed")
    assert "standby-2" not in d.c.standbys()
    with pytest.raises(EventNotAllowed, match="handed over, lost or stopped"):
        d.send(ev.StandbyBooted, "standby-2")


def test_a_pool_that_keeps_failing_to_boot_stops_and_says_so() -> None:
    d = pool(standby_boot_budget=2)
    d.send(ev.StandbyFailed, "standby-1", reason="OOM")
    effects = d.send(ev.StandbyFailed, "standby-2", reason="OOM")
    assert not kinds(effects, StartStandby)
    assert d.c.pool_state == "exhausted" and d.c.standbys() == {}
    assert not kinds(d.about(ev.GroupFailed, "g0"), ClaimStandby)


def test_a_standby_that_was_current_once_does_not_spend_the_boot_budget() -> None:
    d = pool(standby_boot_budget=1)
    push(d, 1)
    d.send(ev.StandbyFailed, "standby-1", reason="died idle")
    assert d.c.pool_state == "filling" and list(d.c.standbys()) == ["standby-2"]


def test_shutdown_stops_every_standby_and_drains_after_their_outcomes() -> None:
    d = pool(size=2)
    push(d, 1, standbys=False)
    d.send(ev.ExportStarted, 1)
    d.send(ev.ExportCommitted, 1, "/ckpt/step-1")  # both standbys load C(1)
    effects = d.send(ev.Shutdown)
    assert sorted(f.standby for f in kinds(effects, StopStandby)) == ["standby-1", "standby-2"]  # type: ignore[attr-defined]
    assert not kinds(effects, StartStandby)
    assert any("standby" in line for line in d.c.outstanding())
    d.send(ev.StandbyLoaded, "standby-1", 1)
    d.send(ev.StandbyFailed, "standby-2", reason="stopped")
    assert not any("standby" in line for line in d.c.outstanding())
    assert d.c.checkpoints()[1].leases == 0


def test_bad_standby_input_is_refused_and_changes_nothing() -> None:
    d = pool()
    before = d.c.snapshot()
    with pytest.raises(EventNotAllowed, match="unknown standby"):
        d.c.handle(ev.StandbyBooted("standby-9", at=d.now()))
    with pytest.raises(EventNotAllowed, match="expects it in one of"):
        d.c.handle(ev.StandbyLoaded("standby-1", 1, at=d.now()))  # no load runs
    with pytest.raises(WrongIncarnation, match="standby"):
        d.c.handle(ev.WeightsSynced(1, {"standby-1": 2}, at=d.now()))
    with pytest.raises(UnknownGroup):
        d.c.handle(ev.WeightsSynced(1, {"standby-7": 1}, at=d.now()))
    with pytest.raises(EventNotAllowed, match="standbys'"):
        d.c.handle(ev.GroupRegistered("standby-x", 0, at=d.now()))
    assert {k: v for k, v in d.c.snapshot().items() if k != "now"} == {
        k: v for k, v in before.items() if k != "now"
    }


def test_a_sync_listing_a_standby_claimed_meanwhile_is_accepted() -> None:
    d = pool()
    push(d, 1)
    listed = dict.fromkeys(d.c.up_standbys(), 1) | d.c.up_groups()
    d.about(ev.GroupFailed, "g0")  # claims standby-1 while the push to it runs
    listed.pop("g0")
    d.send(ev.WeightsSynced, 2, listed)
    assert d.c.version == 2


def test_no_standbys_means_no_standby_effects() -> None:
    d = Driver(RecoveryConfig(), ["g0"])
    effects = d.about(ev.GroupFailed, "g0")
    assert not kinds(effects, StartStandby) and not kinds(effects, ClaimStandby)
    assert not kinds(effects, LoadCheckpoint)


def test_a_repeated_load_report_is_not_taken_for_the_next_load() -> None:
    d = pool()
    push(d, 1, standbys=False)
    d.export(1)  # standby-1 loads C(1)
    push(d, 2, standbys=False)
    d.send(ev.ExportStarted, 2)
    d.send(ev.ExportCommitted, 2, "/ckpt/step-2")
    d.send(ev.StandbyLoaded, "standby-1", 1)  # stale on arrival: it loads C(2) next
    assert d.c.standbys()["standby-1"].state == "loading"
    with pytest.raises(EventNotAllowed, match="load in flight is of version 2"):
        d.c.handle(ev.StandbyLoaded("standby-1", 1, at=d.now()))
    d.send(ev.StandbyLoaded, "standby-1", 2)
    assert d.c.standbys()["standby-1"].ready


# -- a standby the push in flight made newer than its claim asked ----------------------------


def _claimed_ahead(**changes: object) -> Driver:
    """standby-1 holds 1 and is claimed by g0 as it is; the push of 2, in flight, reached
    it before its check: the check finds 2 and reports it."""
    d = pool(**changes)
    push(d, 1)
    [claim] = kinds(d.about(ev.GroupFailed, "g0"), ClaimStandby)
    assert claim.version == 1  # type: ignore[attr-defined]
    effects = d.about(ev.RestartLoaded, "g0", version=2)
    assert not kinds(effects, RouteTraffic) and not kinds(effects, LoadCheckpoint)
    assert d.c.group("g0").state == "pending_weights" and d.c.group("g0").version == 2
    return d


def test_a_claim_that_finds_the_pushed_version_serves_when_that_sync_lands_unlisted() -> None:
    """Neither refused (a kill and a slow restart) nor served early: the sync of 2, whose
    push began before the claim and so lists the standby's old name, admits it."""
    d = _claimed_ahead()
    d.send(ev.ExportStarted, 1)
    assert not kinds(d.send(ev.ExportCommitted, 1, "/ckpt/step-1"), LoadCheckpoint)
    routed = d.send(ev.WeightsSynced, 2, {"g1": 1, "standby-1": 1})
    assert RouteTraffic("g0", 2, 2) in routed and d.c.group("g0").state == "active"


def test_a_claim_that_finds_the_version_whose_sync_landed_meanwhile_serves_at_once() -> None:
    """The push of 2 reached the standby, then its sync landed (not listing the claim) before
    the check reported: found holding the fleet's version, it serves, with no load."""
    d = pool()
    push(d, 1)
    d.about(ev.GroupFailed, "g0")
    d.send(ev.WeightsSynced, 2, {"g1": 1, "standby-1": 1})
    effects = d.about(ev.RestartLoaded, "g0", version=2)
    assert RouteTraffic("g0", 2, 2) in effects and not kinds(effects, LoadCheckpoint)
    assert d.c.group("g0").state == "active"


def test_a_claim_ahead_that_no_sync_reports_goes_back_to_the_checkpoint_at_the_deadline() -> None:
    d = _claimed_ahead(load_timeout_s=5.0)
    d.send(ev.ExportStarted, 1)
    d.send(ev.ExportCommitted, 1, "/ckpt/step-1")
    assert not kinds(d.c.handle(ev.Tick(at=d.now() + 1.0)), LoadCheckpoint)
    [load] = kinds(d.c.handle(ev.Tick(at=100.0)), LoadCheckpoint)  # nobody's weights: C(1)
    assert load.version == 1 and d.c.group("g0").version is None  # type: ignore[attr-defined]


def test_a_claim_found_at_another_version_is_refused_unless_a_push_could_bring_it() -> None:
    d = pool()
    push(d, 1)
    d.about(ev.GroupFailed, "g0")
    before = d.c.snapshot()
    for version in (1, 0):  # what it was claimed holding, or older: say it without a version
        words = "not above the 1 it was claimed holding"
        with pytest.raises(EventNotAllowed, match=words):
            d.about(ev.RestartLoaded, "g0", version=version)
    assert d.c.snapshot() == before
    d2 = Driver(RecoveryConfig(), ["g0"])
    d2.step(1)
    d2.about(ev.GroupFailed, "g0")  # a restart from C(1): it loads what it was given
    with pytest.raises(EventNotAllowed, match="only a standby claimed as it is"):
        d2.about(ev.RestartLoaded, "g0", version=2)
