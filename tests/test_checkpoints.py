"""Checkpoint lifecycle through the controller, including the seed review's race, and how a
shut-down controller drains."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import pytest
from conftest import Driver
from statemachine.exceptions import TransitionNotAllowed

from recovery_fsm import (
    CheckpointView,
    EventNotAllowed,
    Lease,
    RecoveryConfig,
    RecoveryController,
    UnknownVersion,
    WrongIncarnation,
)
from recovery_fsm import events as ev
from recovery_fsm.effects import (
    CancelExport,
    DeleteCheckpoint,
    Effect,
    LoadCheckpoint,
    RestartCold,
    RestartFromCheckpoint,
    RouteTraffic,
    StopGroup,
    WithdrawTraffic,
)
from recovery_fsm.machines import CheckpointMachine, CheckpointRecord

C1 = "/ckpt/step-1"
C2 = "/ckpt/step-2"


def test_export_commit_supersede_delete(driver: Driver) -> None:
    c = driver.c
    assert c.checkpoint_state(1) == "ready"
    effects = driver.sync(2)
    assert effects == (DeleteCheckpoint(1, C1),)
    assert c.checkpoint_state(1) == "deletable"
    assert driver.send(ev.CheckpointDeleted, 1) == ()
    assert c.checkpoint_state(1) == "deleted"


def test_seed_race_delete_only_after_lease_released(driver: Driver) -> None:
    c = driver.c
    effects = driver.about(ev.GroupFailed, "g1")
    assert effects == (WithdrawTraffic("g1", 1), RestartFromCheckpoint("g1", 2, 1, C1))
    assert c.lease_of("g1") == Lease("g1", 2, 1, 1)

    # The trainer moves on while g1 still reads C(1): superseded, but no delete.
    effects = driver.sync(2, ["g2"])
    assert c.checkpoint_state(1) == "superseded"
    assert not any(isinstance(e, DeleteCheckpoint) for e in effects)
    driver.export(2)
    assert c.checkpoint_state(1) == "superseded"

    # It loaded v1 but the fleet is at v2: C(1) goes, and g1 loads C(2) in place (the same
    # process, renumbered 3, leased), instead of idling until the next sync.
    effects = driver.send(ev.RestartLoaded, "g1", 2)
    assert effects == (DeleteCheckpoint(1, C1), LoadCheckpoint("g1", 3, 2, C2, 2))
    assert c.checkpoint_state(1) == "deletable"
    assert c.group_state("g1") == "loading" and c.lease_of("g1") == Lease("g1", 3, 2, 2)
    # The first load's outcome again (a retried report) is not this load's outcome.
    with pytest.raises(WrongIncarnation):
        driver.send(ev.RestartLoaded, "g1", 2)
    assert c.group_state("g1") == "loading"
    assert driver.send(ev.RestartLoaded, "g1", 3) == (RouteTraffic("g1", 3, 2),)
    assert c.lease_of("g1") is None and c.checkpoints()[2].leases == 0


def test_two_leases_both_must_be_released(driver: Driver) -> None:
    (_, r1) = driver.about(ev.GroupFailed, "g1")
    (_, r2) = driver.about(ev.GroupFailed, "g2")
    assert r1 == RestartFromCheckpoint("g1", 2, 1, C1)
    assert r2 == RestartFromCheckpoint("g2", 2, 1, C1)
    assert driver.c.leases == {"g1#2": Lease("g1", 2, 1, 1), "g2#2": Lease("g2", 2, 1, 1)}
    assert driver.c.checkpoints()[1].leases == 2
    driver.sync(2, [])
    assert driver.send(ev.RestartLoaded, "g1", 2) == ()
    assert driver.c.checkpoint_state(1) == "superseded"
    effects = driver.send(ev.RestartLoadFailed, "g2", 2, error="boom")
    assert effects == (DeleteCheckpoint(1, C1), RestartCold("g2", 3))


def test_export_still_running_at_next_sync_is_abandoned_and_cancelled(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    effects = driver.sync(3)
    assert CancelExport(2) in effects
    assert driver.c.checkpoint_state(2) == "abandoned"
    # It never becomes a recovery source, even if the write lands late.
    assert driver.send(ev.ExportCommitted, 2, C2) == (DeleteCheckpoint(2, C2),)
    assert driver.c.checkpoint_state(2) == "deletable"


@pytest.mark.parametrize(
    ("outcome", "final"), [(ev.ExportCancelled, "discarded"), (ev.ExportFailed, "discarded")]
)
def test_abandoned_export_ends_without_files(
    driver: Driver, outcome: type[ev.Event], final: str
) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.sync(3)
    args = (2, "disk full") if outcome is ev.ExportFailed else (2,)
    assert driver.send(outcome, *args) == ()
    assert driver.c.checkpoint_state(2) == final


def test_export_failure_and_cancel_of_current_version(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.send(ev.ExportFailed, 2, "ENOSPC")
    assert driver.c.checkpoint_state(2) == "failed"
    driver.sync(3)
    driver.send(ev.ExportStarted, 3)
    driver.send(ev.ExportCancelled, 3)
    assert driver.c.checkpoint_state(3) == "discarded"


def test_pinned_checkpoint_is_never_deleted(driver: Driver) -> None:
    driver.send(ev.CheckpointPinned, 1)
    assert driver.sync(2) == ()
    assert driver.c.checkpoint_state(1) == "superseded"
    driver.export(2)
    driver.sync(3)
    assert driver.c.checkpoint_state(1) == "superseded"
    assert driver.c.checkpoint_state(2) == "deletable"


def test_pinned_export_is_not_cancelled_and_kept_when_it_lands_late(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2, pinned=True)
    assert driver.sync(3) == ()
    assert driver.c.checkpoint_state(2) == "abandoned"
    assert driver.send(ev.ExportCommitted, 2, C2) == ()
    assert driver.c.checkpoint_state(2) == "superseded"


def test_an_unpinned_superseded_checkpoint_is_deleted_once_unleased(driver: Driver) -> None:
    driver.send(ev.CheckpointPinned, 1)
    driver.about(ev.GroupFailed, "g1")  # g1 restarts from C(1): a lease
    driver.sync(2, ["g2"])
    assert driver.send(ev.CheckpointUnpinned, 1) == ()  # leased: kept until the load ends
    assert driver.c.checkpoint_state(1) == "superseded"
    effects = driver.send(ev.RestartLoaded, "g1", 2)
    assert DeleteCheckpoint(1, C1) in effects
    assert driver.c.checkpoint_state(1) == "deletable"


def test_an_unpinned_ready_checkpoint_stays_the_recovery_source(driver: Driver) -> None:
    driver.send(ev.CheckpointPinned, 1)
    assert driver.send(ev.CheckpointUnpinned, 1) == ()
    assert driver.c.checkpoint_state(1) == "ready"
    assert DeleteCheckpoint(1, C1) in driver.sync(2)  # superseded as any other


def test_unpinning_a_stale_pinned_export_cancels_it(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2, pinned=True)
    assert driver.sync(3) == ()  # kept running: pinned
    assert driver.send(ev.CheckpointUnpinned, 2) == (CancelExport(2),)
    assert driver.send(ev.ExportCommitted, 2, C2) == (DeleteCheckpoint(2, C2),)


def test_unpin_of_a_checkpoint_not_pinned_is_refused(driver: Driver) -> None:
    before = driver.c.snapshot()
    with pytest.raises(EventNotAllowed, match="not pinned"):
        driver.send(ev.CheckpointUnpinned, 1)
    assert driver.c.snapshot() == before


def test_machine_guard_keeps_a_leased_or_pinned_checkpoint_on_reap() -> None:
    for record in (CheckpointRecord(1, leases=1), CheckpointRecord(1, pinned=True)):
        m = CheckpointMachine(model=record, start_value="superseded")
        m.send("reap")  # the graph's choice: it stays
        assert record.state == "superseded"
    ready = CheckpointRecord(1)
    CheckpointMachine(model=ready, start_value="ready").send("reap")
    assert ready.state == "ready"  # still the recovery source
    exporting = CheckpointMachine(model=CheckpointRecord(1), start_value="exporting")
    with pytest.raises(TransitionNotAllowed):
        exporting.send("reap")  # never offered while writing
    free = CheckpointRecord(1)
    CheckpointMachine(model=free, start_value="superseded").send("reap")
    assert free.state == "deletable"


# -- rule: queries ---------------------------------------------------------------------------


def test_queries_checkpoints_lists_those_not_yet_final(driver: Driver) -> None:
    c = driver.c
    assert c.checkpoints() == {1: CheckpointView(1, "ready", C1, False, 0)}
    driver.about(ev.GroupFailed, "g1")
    driver.send(ev.CheckpointPinned, 1)
    assert c.checkpoints() == {1: CheckpointView(1, "ready", C1, True, 1)}
    driver.sync(2, ["g2"])
    driver.send(ev.ExportStarted, 2)
    assert c.checkpoints() == {
        1: CheckpointView(1, "superseded", C1, True, 1),
        2: CheckpointView(2, "exporting", None, False, 0),
    }
    driver.sync(3, ["g2"])
    driver.send(ev.ExportCommitted, 2, C2)
    assert c.checkpoints()[2] == CheckpointView(2, "deletable", C2, False, 0)
    driver.send(ev.CheckpointDeleted, 2)
    driver.send(ev.RestartLoaded, "g1", 2)
    assert c.checkpoints() == {1: CheckpointView(1, "superseded", C1, True, 0)}
    assert c.checkpoint_state(2) == "deleted"
    with pytest.raises(UnknownVersion):
        c.checkpoint_state(7)


def test_queries_outstanding_names_each_thing_owed() -> None:
    d = Driver(RecoveryConfig(), ["g1", "g2", "g3"])
    d.step(1)
    assert d.c.outstanding() == ["no Shutdown yet"]
    d.about(ev.GroupFailed, "g1")  # loads C(1)
    d.about(ev.GroupFailed, "g2")
    d.about(ev.RestartLoadFailed, "g2")  # cold start, incarnation 3
    d.sync(2, ["g3"])
    d.send(ev.ExportStarted, 2)
    d.about(ev.GroupFailed, "g3")  # waits for C(2)
    assert d.c.outstanding() == [
        "no Shutdown yet",
        "a load of C(1) of group 'g1' incarnation 2 has not reported",
        "a cold start of group 'g2' incarnation 3 has not reported",
        "the export of version 2 is still running (exporting)",
        "group 'g3' is waiting for a checkpoint",
    ]
    d.send(ev.Shutdown)
    assert d.c.outstanding() == [
        "a load of C(1) of group 'g1' incarnation 2 has not reported",
        "a cold start of group 'g2' incarnation 3 has not reported",
        "the export of version 2 is still running (abandoned)",
    ]
    d.send(ev.ExportCancelled, 2)
    d.send(ev.Relaunched, "g2", 3)
    d.send(ev.GroupFailed, "g1", 2)
    assert d.c.outstanding() == ["the delete of checkpoint 1 has not been reported"]
    d.send(ev.CheckpointDeleted, 1)
    assert d.c.outstanding() == []


# -- rule: drained ---------------------------------------------------------------------------


def test_drained_not_before_shutdown_even_when_idle() -> None:
    d = Driver(RecoveryConfig(), ["g1"])
    assert not d.c.drained
    d.send(ev.Shutdown)
    assert d.c.drained


@pytest.mark.parametrize("pinned", [False, True])
def test_drained_not_while_an_abandoned_export_runs(pinned: bool) -> None:
    d = Driver(RecoveryConfig(), ["g1"])
    d.step(1)
    d.step(2)  # reports the delete of C(1)
    d.sync(3)
    d.send(ev.CheckpointDeleted, 2)
    d.send(ev.ExportStarted, 3, pinned=pinned)
    effects = d.send(ev.Shutdown)
    assert (CancelExport(3) in effects) is not pinned
    assert d.c.checkpoint_state(3) == "abandoned"
    assert d.c.outstanding() == ["the export of version 3 is still running (abandoned)"]
    assert not d.c.drained
    d.send(ev.ExportCancelled, 3)
    assert d.c.drained


def test_drained_not_while_a_delete_is_owed() -> None:
    d = Driver(RecoveryConfig(), ["g1"])
    d.step(1)
    d.sync(2)
    d.send(ev.CheckpointDeleted, 1)
    d.send(ev.ExportStarted, 2)
    d.send(ev.Shutdown)
    assert d.send(ev.ExportCommitted, 2, C2) == (DeleteCheckpoint(2, C2),)
    assert d.c.outstanding() == ["the delete of checkpoint 2 has not been reported"]
    assert not d.c.drained
    d.send(ev.CheckpointDeleted, 2)
    assert d.c.drained


def test_drained_shutdown_of_a_ready_checkpoint_owes_its_delete() -> None:
    d = Driver(RecoveryConfig(), ["g1"])
    d.step(1)
    assert d.send(ev.Shutdown) == (
        WithdrawTraffic("g1", 1),
        StopGroup("g1", 1, "shutdown"),
        DeleteCheckpoint(1, C1),
    )
    assert not d.c.drained
    d.send(ev.CheckpointDeleted, 1)
    assert d.c.drained


def test_drained_not_while_a_killed_load_has_not_reported() -> None:
    d = Driver(RecoveryConfig(load_timeout_s=3.0), ["g1"])
    d.step(1)
    d.about(ev.GroupFailed, "g1")  # incarnation 2 loads C(1)
    d.send(ev.Tick)
    d.send(ev.Tick)
    assert d.send(ev.Tick) == (StopGroup("g1", 2, "load deadline"), RestartCold("g1", 3))
    assert d.send(ev.Shutdown) == (StopGroup("g1", 3, "shutdown"),)
    assert not d.c.drained
    d.send(ev.Relaunched, "g1", 3)
    assert d.c.outstanding() == ["a load of C(1) of group 'g1' incarnation 2 has not reported"]
    assert not d.c.drained
    assert d.send(ev.GroupFailed, "g1", 2) == (DeleteCheckpoint(1, C1),)
    assert not d.c.drained
    d.send(ev.CheckpointDeleted, 1)
    assert d.c.drained


# -- rule: shutdown drains from any order of reports ------------------------------------------

Report = Callable[[float], ev.Event]
# Each outstanding item -> the reports that may end it, with the effects each must return.
Choices = dict[str, list[tuple[Report, tuple[Effect, ...]]]]

LOADER: dict[str, Report] = {
    "loaded": lambda at: ev.RestartLoaded("g1", 2, at=at),
    "load_failed": lambda at: ev.RestartLoadFailed("g1", 2, at=at),
    "died": lambda at: ev.GroupFailed("g1", 2, at=at),
}
RELAUNCHER: dict[str, Report] = {
    "relaunched": lambda at: ev.Relaunched("g2", 3, at=at),
    "relaunch_failed": lambda at: ev.RelaunchFailed("g2", 3, at=at),
    "died": lambda at: ev.GroupFailed("g2", 3, at=at),
}
EXPORT: dict[str, Report] = {
    "committed": lambda at: ev.ExportCommitted(2, C2, at=at),
    "cancelled": lambda at: ev.ExportCancelled(2, at=at),
    "failed": lambda at: ev.ExportFailed(2, at=at),
}
# How outstanding() names each item.
SENTENCES = {
    "load": "a load of C(1) of group 'g1' incarnation 2 has not reported",
    "relaunch": "a cold start of group 'g2' incarnation 3 has not reported",
    "export": "the export of version 2 is still running (abandoned)",
    "delete 1": "the delete of checkpoint 1 has not been reported",
    "delete 2": "the delete of checkpoint 2 has not been reported",
}


def _shut_down_with_two_starts_and_an_export() -> RecoveryController:
    """g1's incarnation 2 loads C(1), g2's incarnation 3 relaunches cold, the export of
    version 2 runs; then Shutdown."""
    d = Driver(RecoveryConfig(), ["g1", "g2"])
    d.step(1)
    d.about(ev.GroupFailed, "g1")
    d.about(ev.GroupFailed, "g2")
    d.send(ev.RestartLoadFailed, "g2", 2)
    d.sync(2)  # nobody is up; C(1) stays, leased by g1
    d.send(ev.ExportStarted, 2)
    assert d.send(ev.Shutdown) == (
        StopGroup("g1", 2, "shutdown"),
        StopGroup("g2", 3, "shutdown"),
        CancelExport(2),
    )
    return d.c


def _drain_every_order(
    c: RecoveryController, pending: frozenset[str], choices: Choices, at: float
) -> int:
    """Check this state, then try every next report on a fork; returns the orders
    completed. A delete the controller asks for becomes a new pending item."""
    assert sorted(c.outstanding()) == sorted(SENTENCES[item] for item in pending)
    assert c.drained is (not pending)
    if not pending:
        return 1
    done = 0
    for item in sorted(pending):
        for report, expected in choices[item]:
            twin = c.fork()
            effects = twin.handle(report(at))  # accepted: it does not raise
            assert effects == expected, f"{item}: {report(at)}"
            assert twin.check_invariants() == []
            owed = {f"delete {e.version}" for e in effects if isinstance(e, DeleteCheckpoint)}
            done += _drain_every_order(twin, (pending - {item}) | owed, choices, at + 1)
    return done


@pytest.mark.parametrize(
    ("load", "relaunch", "export"), list(itertools.product(LOADER, RELAUNCHER, EXPORT))
)
def test_shutdown_drains_from_any_order_of_reports(load: str, relaunch: str, export: str) -> None:
    c = _shut_down_with_two_starts_and_an_export()
    choices: Choices = {
        "load": [(LOADER[load], (DeleteCheckpoint(1, C1),))],
        "relaunch": [(RELAUNCHER[relaunch], ())],
        "export": [(EXPORT[export], (DeleteCheckpoint(2, C2),) if export == "committed" else ())],
        "delete 1": [(lambda at: ev.CheckpointDeleted(1, at=at), ())],
        "delete 2": [(lambda at: ev.CheckpointDeleted(2, at=at), ())],
    }
    orders = _drain_every_order(c, frozenset({"load", "relaunch", "export"}), choices, 1000.0)
    # Every order of the reports with each delete after its cause: 5!/(2*2) or 4!/2.
    assert orders == (30 if export == "committed" else 12)


def test_shutdown_drain_view_after_shutdown_is_unchanged_by_late_reports() -> None:
    """Late reports only end their starts: the stopped groups stay as they were, less the
    loader's lease."""
    c = _shut_down_with_two_starts_and_an_export()
    groups = c.groups()
    assert groups["g1"].lease is not None and c.lease_of("g1") == groups["g1"].lease
    c.handle(ev.RestartLoaded("g1", 2, at=1000.0))
    c.handle(ev.Relaunched("g2", 3, at=1001.0))
    assert c.groups() == {**groups, "g1": attrs.evolve(groups["g1"], lease=None)}
    assert {v.state for v in groups.values()} == {"stopped"}
    assert c.up_groups() == {}
    assert c.leases == {}
    assert attrs.asdict(c.checkpoints()[1])["state"] == "deletable"
