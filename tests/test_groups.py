"""Worker-group and immediate-recovery machines through the controller."""

from __future__ import annotations

import pytest
from conftest import Driver
from statemachine.exceptions import TransitionNotAllowed

from recovery_fsm import RecoveryConfig
from recovery_fsm import events as ev
from recovery_fsm.effects import (
    ReadmitGroup,
    RestartCold,
    RestartFromCheckpoint,
    RetireGroup,
)
from recovery_fsm.machines import Fleet, GroupRecord, WorkerGroupMachine


def test_probe_failures_suspect_then_fail_at_threshold(driver: Driver) -> None:
    c = driver.c
    assert driver.send(ev.ProbeFailed, "g1") == ()
    assert c.group_state("g1") == "suspect"
    driver.send(ev.ProbeOk, "g1")
    assert c.group_state("g1") == "active"
    driver.send(ev.ProbeFailed, "g1")
    driver.send(ev.ProbeFailed, "g1")
    (effect,) = driver.send(ev.ProbeFailed, "g1")  # threshold 3
    assert isinstance(effect, RestartFromCheckpoint)
    assert c.group_state("g1") == "loading"


def test_probe_ok_resets_the_count(driver: Driver) -> None:
    driver.send(ev.ProbeFailed, "g1")
    driver.send(ev.ProbeFailed, "g1")
    driver.send(ev.ProbeOk, "g1")
    driver.send(ev.ProbeFailed, "g1")
    driver.send(ev.ProbeFailed, "g1")
    assert driver.c.group_state("g1") == "suspect"


def test_immediate_restart_readmits_on_current_version(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    assert isinstance(restart, RestartFromCheckpoint)
    assert driver.send(ev.RestartLoaded, "g1", restart.lease) == (ReadmitGroup("g1", 1),)
    assert driver.c.group_state("g1") == "active"
    assert driver.c.leases == {}


def test_stale_load_waits_for_weights_then_next_sync_admits(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    driver.send(ev.RestartLoaded, "g1", restart.lease)  # type: ignore[attr-defined]
    assert driver.c.group_state("g1") == "pending_weights"
    assert ReadmitGroup("g1", 3) in driver.sync(3)
    assert driver.c.group_state("g1") == "active"


def test_pending_group_left_out_of_a_sync_stays_pending(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    driver.send(ev.RestartLoaded, "g1", restart.lease)  # type: ignore[attr-defined]
    assert not any(e.kind == "ReadmitGroup" for e in driver.sync(3, ["g2"]))
    assert driver.c.group_state("g1") == "pending_weights"


def test_active_group_left_out_of_a_sync_is_demoted(driver: Driver) -> None:
    driver.sync(2, ["g1"])
    assert driver.c.group_state("g2") == "pending_weights"


def test_failure_while_export_runs_waits_then_boots_on_commit(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    assert driver.send(ev.GroupFailed, "g1") == ()
    assert driver.c.group_state("g1") == "awaiting_checkpoint"
    (restart,) = driver.send(ev.ExportCommitted, 2, "/ckpt/step-2")
    assert restart == RestartFromCheckpoint("g1", 2, "/ckpt/step-2", restart.lease)  # type: ignore[attr-defined]
    assert driver.c.group_state("g1") == "loading"


def test_failure_between_sync_and_export_start_waits(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.GroupFailed, "g1")
    assert driver.c.group_state("g1") == "awaiting_checkpoint"
    driver.send(ev.ExportStarted, 2)
    (restart,) = driver.send(ev.ExportCommitted, 2, "/ckpt/step-2")
    assert isinstance(restart, RestartFromCheckpoint)


def test_without_export_every_sync_a_failure_before_export_goes_cold() -> None:
    d = Driver(RecoveryConfig(export_every_sync=False), ["g1"])
    d.sync(1)
    assert d.send(ev.GroupFailed, "g1") == (RestartCold("g1"),)


@pytest.mark.parametrize("ending", ["failed", "cancelled", "synced"])
def test_awaiting_group_goes_cold_when_the_export_will_not_come(
    driver: Driver, ending: str
) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.send(ev.GroupFailed, "g1")
    if ending == "failed":
        effects = driver.send(ev.ExportFailed, 2, "EIO")
    elif ending == "cancelled":
        effects = driver.send(ev.ExportCancelled, 2)
    else:
        effects = driver.sync(3, ["g2"])
    assert RestartCold("g1") in effects
    assert driver.c.group_state("g1") == "relaunching"


def test_awaiting_group_goes_cold_after_timeout() -> None:
    d = Driver(RecoveryConfig(await_checkpoint_timeout_s=10.0), ["g1"])
    d.sync(1)
    d.send(ev.ExportStarted, 1)
    t0 = d.now()
    d.c.handle(ev.GroupFailed("g1", t0))
    assert d.c.handle(ev.Tick(t0 + 9.5)) == ()
    assert d.c.group_state("g1") == "awaiting_checkpoint"
    assert d.c.handle(ev.Tick(t0 + 10.0)) == (RestartCold("g1"),)
    assert d.c.check_invariants() == []


def test_cold_path_relaunch_then_admitted_by_next_sync(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    effects = driver.send(ev.RestartLoadFailed, "g1", restart.lease, error="corrupt")  # type: ignore[attr-defined]
    assert effects == (RestartCold("g1"),)
    assert driver.c.recovery_state("g1") == "cooldown"
    driver.send(ev.Relaunched, "g1")
    assert driver.c.group_state("g1") == "pending_weights"
    assert ReadmitGroup("g1", 2) in driver.sync(2)


def test_relaunch_failures_spend_the_budget_then_retire(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")  # restart 1 of 3
    driver.send(ev.RestartLoadFailed, "g1", restart.lease)  # type: ignore[attr-defined]  # 2
    assert driver.send(ev.RelaunchFailed, "g1") == (RestartCold("g1"),)  # 3
    assert driver.send(ev.RelaunchFailed, "g1") == (RetireGroup("g1"),)
    assert driver.c.group_state("g1") == "retired"


def test_group_dying_while_loading_releases_its_lease(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    effects = driver.send(ev.GroupFailed, "g1")
    assert any(e.kind == "DeleteCheckpoint" for e in effects)
    assert driver.c.leases == {}
    assert driver.c.group_state("g1") in {"awaiting_checkpoint", "relaunching"}
    del restart


def test_missed_export_cools_every_group_down_until_n_clean_syncs(driver: Driver) -> None:
    c = driver.c
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.step(3)  # export of 2 missed
    assert {c.recovery_state("g1"), c.recovery_state("g2")} == {"cooldown"}
    # In cooldown a failed group takes the cold path even though C(3) is ready.
    assert driver.send(ev.GroupFailed, "g1") == (RestartCold("g1"),)
    driver.step(4)  # clean 1 of 2
    assert c.recovery_state("g2") == "cooldown"
    driver.step(5)  # clean 2 of 2
    assert c.recovery_state("g2") == "enabled"
    assert isinstance(driver.send(ev.GroupFailed, "g2")[0], RestartFromCheckpoint)


def test_miss_during_cooldown_resets_streak(driver: Driver) -> None:
    c = driver.c
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.step(3)  # miss -> cooldown
    driver.step(4)  # clean 1
    driver.sync(5)
    driver.send(ev.ExportStarted, 5)
    driver.step(6)  # miss again: streak back to 0
    driver.step(7)  # clean 1
    assert c.recovery_state("g1") == "cooldown"
    driver.step(8)  # clean 2
    assert c.recovery_state("g1") == "enabled"


def test_a_sync_without_export_is_neither_clean_nor_missed(driver: Driver) -> None:
    (restart,) = driver.send(ev.GroupFailed, "g1")
    driver.send(ev.RestartLoadFailed, "g1", restart.lease)  # type: ignore[attr-defined]
    assert driver.c.recovery_state("g1") == "cooldown"
    driver.send(ev.Relaunched, "g1")
    driver.sync(2)
    driver.sync(3)  # no export of 2
    driver.sync(4)  # no export of 3
    assert driver.c.recovery_state("g1") == "cooldown"
    assert driver.c.recovery_state("g2") == "enabled"


def test_disabled_by_configuration_always_takes_the_cold_path() -> None:
    d = Driver(RecoveryConfig(immediate_recovery=False), ["g1"])
    d.step(1)
    assert d.c.recovery_state("g1") == "disabled"
    assert d.send(ev.GroupFailed, "g1") == (RestartCold("g1"),)


def test_registering_with_stale_weights_starts_pending(driver: Driver) -> None:
    driver.send(ev.GroupRegistered, "g3", 0)
    assert driver.c.group_state("g3") == "pending_weights"
    driver.send(ev.GroupRegistered, "g4", 1)
    assert driver.c.group_state("g4") == "active"


def test_machine_guard_refuses_to_admit_a_stale_group() -> None:
    fleet = Fleet(2)
    record = GroupRecord("g", fleet, version=1)
    m = WorkerGroupMachine(model=record, start_value="pending_weights")
    with pytest.raises(TransitionNotAllowed):
        m.send("admit")
    record.version = 2
    m.send("admit")
    assert record.state == "active"
