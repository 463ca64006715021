"""Checkpoint lifecycle through the controller, including the seed review's race."""

from __future__ import annotations

import pytest
from conftest import Driver
from statemachine.exceptions import TransitionNotAllowed

from recovery_fsm import events as ev
from recovery_fsm.effects import CancelExport, DeleteCheckpoint, RestartFromCheckpoint
from recovery_fsm.machines import CheckpointMachine, CheckpointRecord


def test_export_commit_supersede_delete(driver: Driver) -> None:
    c = driver.c
    assert c.checkpoint_state(1) == "ready"
    effects = driver.sync(2)
    assert effects == (DeleteCheckpoint(1, "/ckpt/step-1"),)
    assert c.checkpoint_state(1) == "deletable"
    assert driver.send(ev.CheckpointDeleted, 1) == ()
    assert c.checkpoint_state(1) == "deleted"


def test_seed_race_delete_only_after_lease_released(driver: Driver) -> None:
    c = driver.c
    (restart,) = driver.send(ev.GroupFailed, "g1")
    assert isinstance(restart, RestartFromCheckpoint)
    assert (restart.version, restart.path) == (1, "/ckpt/step-1")

    # The trainer moves on while g1 still reads C(1): superseded, but no delete.
    effects = driver.sync(2, ["g2"])
    assert c.checkpoint_state(1) == "superseded"
    assert not any(isinstance(e, DeleteCheckpoint) for e in effects)
    driver.export(2)
    assert c.checkpoint_state(1) == "superseded"

    effects = driver.send(ev.RestartLoaded, "g1", restart.lease)
    assert DeleteCheckpoint(1, "/ckpt/step-1") in effects
    assert c.checkpoint_state(1) == "deletable"
    assert c.group_state("g1") == "pending_weights"  # loaded v1, fleet is at v2


def test_two_leases_both_must_be_released(driver: Driver) -> None:
    (r1,) = driver.send(ev.GroupFailed, "g1")
    (r2,) = driver.send(ev.GroupFailed, "g2")
    assert isinstance(r1, RestartFromCheckpoint) and isinstance(r2, RestartFromCheckpoint)
    assert r1.lease != r2.lease
    driver.sync(2, [])
    assert driver.send(ev.RestartLoaded, "g1", r1.lease) == ()
    assert driver.c.checkpoint_state(1) == "superseded"
    assert DeleteCheckpoint(1, "/ckpt/step-1") in driver.send(
        ev.RestartLoadFailed, "g2", r2.lease, error="boom"
    )


def test_export_still_running_at_next_sync_is_abandoned_and_cancelled(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    effects = driver.sync(3)
    assert CancelExport(2) in effects
    assert driver.c.checkpoint_state(2) == "abandoned"
    # It never becomes a recovery source, even if the write lands late.
    assert driver.send(ev.ExportCommitted, 2, "/ckpt/step-2") == (
        DeleteCheckpoint(2, "/ckpt/step-2"),
    )
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
    assert driver.send(ev.ExportCommitted, 2, "/ckpt/step-2") == ()
    assert driver.c.checkpoint_state(2) == "superseded"


def test_machine_guard_refuses_to_reap_leased_or_pinned() -> None:
    for record in (CheckpointRecord(1, leases=1), CheckpointRecord(1, pinned=True)):
        m = CheckpointMachine(model=record, start_value="superseded")
        with pytest.raises(TransitionNotAllowed):
            m.send("reap")
        assert record.state == "superseded"
    free = CheckpointRecord(1)
    CheckpointMachine(model=free, start_value="superseded").send("reap")
    assert free.state == "deletable"
