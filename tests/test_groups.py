"""Worker-group and immediate-recovery machines through the controller: failures, restarts,
process identity (incarnations), routing effects, deadlines and the clean-sync streak."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from conftest import Driver

from recovery_fsm import GroupView, Lease, RecoveryConfig, UnknownGroup, WrongIncarnation
from recovery_fsm import events as ev
from recovery_fsm.effects import (
    CancelExport,
    DeleteCheckpoint,
    Effect,
    LoadCheckpoint,
    RestartCold,
    RestartFromCheckpoint,
    RetireGroup,
    RouteTraffic,
    StopGroup,
    WithdrawTraffic,
)
from recovery_fsm.machines import Fleet, GroupRecord, WorkerGroupMachine

C1 = "/ckpt/step-1"
SERVING = frozenset({"active", "suspect"})


def serving(d: Driver) -> set[tuple[str, int]]:
    """The processes the controller says may serve, read from its queries."""
    return {(name, v.incarnation) for name, v in d.c.groups().items() if v.state in SERVING}


def without_clock(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A snapshot minus the last event's time: a Tick that decides nothing still moves it."""
    return {k: v for k, v in snapshot.items() if k != "now"}


class Timed(Driver):
    """A Driver whose clock can jump, so a deadline can be hit to the second."""

    def __init__(self, config: RecoveryConfig, groups: Iterable[str] = ()) -> None:
        self.t = 0.0
        super().__init__(config, groups)

    def now(self) -> float:
        self.t += 1.0
        return self.t

    def tick(self, at: float) -> tuple[Effect, ...]:
        self.t = at
        effects = self.c.handle(ev.Tick(at=at))
        assert self.c.check_invariants() == []
        return effects


# -- probes, failures, restarts (the behaviour kept from before the redesign) -----------------


def test_probe_failures_suspect_then_fail_at_threshold(driver: Driver) -> None:
    c = driver.c
    assert driver.about(ev.ProbeFailed, "g1") == ()
    assert c.group_state("g1") == "suspect"
    assert driver.about(ev.ProbeOk, "g1") == ()
    assert c.group_state("g1") == "active"
    driver.about(ev.ProbeFailed, "g1")
    driver.about(ev.ProbeFailed, "g1")
    effects = driver.about(ev.ProbeFailed, "g1")  # threshold 3: it may still run, so stop it
    assert effects == (
        WithdrawTraffic("g1", 1),
        StopGroup("g1", 1, "failed probes"),
        RestartFromCheckpoint("g1", 2, 1, C1),
    )
    assert c.group_state("g1") == "loading"
    assert c.incarnation("g1") == 2


def test_probe_ok_resets_the_count(driver: Driver) -> None:
    driver.about(ev.ProbeFailed, "g1")
    driver.about(ev.ProbeFailed, "g1")
    driver.about(ev.ProbeOk, "g1")
    driver.about(ev.ProbeFailed, "g1")
    driver.about(ev.ProbeFailed, "g1")
    assert driver.c.group_state("g1") == "suspect"


def test_probe_count_restarts_when_a_demoted_suspect_is_readmitted(driver: Driver) -> None:
    """Every way into ``active`` starts with no failed probe counted; a suspect group that
    misses a sync and is re-admitted must not fail on its next single failed probe."""
    driver.about(ev.ProbeFailed, "g1")
    driver.about(ev.ProbeFailed, "g1")  # suspect, 2 of 3
    driver.sync(2, ["g2"])  # demoted
    assert RouteTraffic("g1", 1, 3) in driver.sync(3)  # re-admitted
    assert driver.c.group_state("g1") == "active"
    assert driver.c.snapshot()["groups"]["g1"]["probe_failures"] == 0
    assert driver.about(ev.ProbeFailed, "g1") == ()
    assert driver.c.group_state("g1") == "suspect"


def test_immediate_restart_readmits_on_current_version(driver: Driver) -> None:
    restart = driver.about(ev.GroupFailed, "g1")
    assert restart == (WithdrawTraffic("g1", 1), RestartFromCheckpoint("g1", 2, 1, C1))
    assert driver.send(ev.RestartLoaded, "g1", 2) == (RouteTraffic("g1", 2, 1),)
    assert driver.c.group_state("g1") == "active"
    assert driver.c.leases == {}


def test_stale_load_waits_for_weights_then_next_sync_admits(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    assert driver.send(ev.RestartLoaded, "g1", 2) == (DeleteCheckpoint(1, C1),)
    assert driver.c.group_state("g1") == "pending_weights"
    assert RouteTraffic("g1", 2, 3) in driver.sync(3)
    assert driver.c.group_state("g1") == "active"


def test_pending_group_left_out_of_a_sync_stays_pending(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    driver.about(ev.RestartLoaded, "g1")
    effects = driver.sync(3, ["g2"])
    assert not any(isinstance(e, (RouteTraffic, WithdrawTraffic)) for e in effects)
    assert driver.c.group_state("g1") == "pending_weights"


def test_active_group_left_out_of_a_sync_is_demoted(driver: Driver) -> None:
    effects = driver.sync(2, ["g1"])
    assert effects == (DeleteCheckpoint(1, C1), WithdrawTraffic("g2", 1))
    assert driver.c.group_state("g2") == "pending_weights"


def test_failure_while_export_runs_waits_then_boots_on_commit(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    assert driver.about(ev.GroupFailed, "g1") == (WithdrawTraffic("g1", 1),)
    assert driver.c.group_state("g1") == "awaiting_checkpoint"
    effects = driver.send(ev.ExportCommitted, 2, "/ckpt/step-2")
    assert effects == (RestartFromCheckpoint("g1", 2, 2, "/ckpt/step-2"),)
    assert driver.c.group_state("g1") == "loading"


def test_failure_between_sync_and_export_start_waits(driver: Driver) -> None:
    driver.sync(2)
    driver.about(ev.GroupFailed, "g1")
    assert driver.c.group_state("g1") == "awaiting_checkpoint"
    driver.send(ev.ExportStarted, 2)
    (restart,) = driver.send(ev.ExportCommitted, 2, "/ckpt/step-2")
    assert restart == RestartFromCheckpoint("g1", 2, 2, "/ckpt/step-2")


def test_without_export_every_sync_a_failure_before_export_goes_cold() -> None:
    d = Driver(RecoveryConfig(export_every_sync=False), ["g1"])
    d.sync(1)
    assert d.about(ev.GroupFailed, "g1") == (WithdrawTraffic("g1", 1), RestartCold("g1", 2))


@pytest.mark.parametrize("ending", ["failed", "cancelled", "synced"])
def test_awaiting_group_goes_cold_when_the_export_will_not_come(
    driver: Driver, ending: str
) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.about(ev.GroupFailed, "g1")
    if ending == "failed":
        effects = driver.send(ev.ExportFailed, 2, "EIO")
    elif ending == "cancelled":
        effects = driver.send(ev.ExportCancelled, 2)
    else:
        effects = driver.sync(3, ["g2"])
    assert RestartCold("g1", 2) in effects
    assert driver.c.group_state("g1") == "relaunching"


def test_await_checkpoint_timeout_goes_cold_at_the_deadline() -> None:
    d = Timed(RecoveryConfig(await_checkpoint_timeout_s=10.0), ["g1"])
    d.sync(1)
    d.send(ev.ExportStarted, 1)
    t0 = d.now()
    d.c.handle(ev.GroupFailed("g1", 1, at=t0))
    assert d.tick(t0 + 9.0) == ()
    assert d.tick(t0 + 9.5) == ()
    assert d.c.group_state("g1") == "awaiting_checkpoint"
    assert d.tick(t0 + 10.0) == (RestartCold("g1", 2),)
    assert d.c.group_state("g1") == "relaunching"


def test_cold_path_relaunch_then_admitted_by_next_sync(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")
    effects = driver.send(ev.RestartLoadFailed, "g1", 2, error="corrupt")
    assert effects == (RestartCold("g1", 3),)
    assert driver.c.recovery_state("g1") == "cooldown"
    assert driver.send(ev.Relaunched, "g1", 3) == ()
    assert driver.c.group_state("g1") == "pending_weights"
    assert RouteTraffic("g1", 3, 2) in driver.sync(2)


def test_relaunch_failures_spend_the_budget_then_retire(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")  # restart 1 of 3
    driver.send(ev.RestartLoadFailed, "g1", 2)  # restart 2
    assert driver.send(ev.RelaunchFailed, "g1", 3) == (RestartCold("g1", 4),)  # restart 3
    assert driver.send(ev.RelaunchFailed, "g1", 4) == (RetireGroup("g1"),)
    assert driver.c.group_state("g1") == "retired"
    assert driver.c.group("g1").restarts == 3


def test_group_dying_while_loading_releases_its_lease(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")
    driver.sync(2, ["g2"])
    effects = driver.send(ev.GroupFailed, "g1", 2)
    assert DeleteCheckpoint(1, C1) in effects
    assert driver.c.leases == {}
    assert driver.c.group_state("g1") in {"awaiting_checkpoint", "relaunching"}


def test_missed_export_cools_every_group_down_until_n_clean_syncs(driver: Driver) -> None:
    c = driver.c
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.step(3)  # export of 2 missed
    assert {c.recovery_state("g1"), c.recovery_state("g2")} == {"cooldown"}
    # In cooldown a failed group takes the cold path even though C(3) is ready.
    assert driver.about(ev.GroupFailed, "g1") == (WithdrawTraffic("g1", 1), RestartCold("g1", 2))
    driver.step(4)  # clean 1 of 2
    assert c.recovery_state("g2") == "cooldown"
    driver.step(5)  # clean 2 of 2
    assert c.recovery_state("g2") == "enabled"
    assert isinstance(driver.about(ev.GroupFailed, "g2")[-1], RestartFromCheckpoint)


def test_miss_after_reenable_cools_again(driver: Driver) -> None:
    """With N=2 the second miss lands after the group was re-enabled (streak 0); the miss
    in the middle of a streak is test_clean_sync_streak_restarts_after_a_miss_in_cooldown."""
    c = driver.c
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.step(3)  # miss -> cooldown
    driver.step(4)  # clean 1
    driver.sync(5)  # clean 2 -> enabled
    assert c.recovery_state("g1") == "enabled"
    driver.send(ev.ExportStarted, 5)
    driver.step(6)  # miss again
    assert c.recovery_state("g1") == "cooldown"
    driver.step(7)  # clean 1
    assert c.recovery_state("g1") == "cooldown"
    driver.step(8)  # clean 2
    assert c.recovery_state("g1") == "enabled"


def test_a_sync_without_export_is_neither_clean_nor_missed(driver: Driver) -> None:
    driver.about(ev.GroupFailed, "g1")
    driver.send(ev.RestartLoadFailed, "g1", 2)
    assert driver.c.recovery_state("g1") == "cooldown"
    driver.send(ev.Relaunched, "g1", 3)
    driver.sync(2)
    driver.sync(3)  # no export of 2
    driver.sync(4)  # no export of 3
    assert driver.c.recovery_state("g1") == "cooldown"
    assert driver.c.recovery_state("g2") == "enabled"


def test_disabled_by_configuration_always_takes_the_cold_path() -> None:
    d = Driver(RecoveryConfig(immediate_recovery=False), ["g1"])
    d.step(1)
    assert d.c.recovery_state("g1") == "disabled"
    assert d.about(ev.GroupFailed, "g1") == (WithdrawTraffic("g1", 1), RestartCold("g1", 2))


def test_registering_with_stale_weights_loads_the_ready_checkpoint_in_place(
    driver: Driver,
) -> None:
    assert driver.send(ev.GroupRegistered, "g3", 0) == (LoadCheckpoint("g3", 2, 1, C1, 1),)
    assert driver.c.group_state("g3") == "loading"
    assert driver.send(ev.RestartLoaded, "g3", 2) == (RouteTraffic("g3", 2, 1),)
    assert driver.send(ev.GroupRegistered, "g4", 1) == (RouteTraffic("g4", 1, 1),)
    assert driver.c.group_state("g4") == "active"


def test_registering_with_stale_weights_waits_for_a_sync_without_a_ready_checkpoint(
    driver: Driver,
) -> None:
    driver.sync(2)  # C(2) is not written yet
    assert driver.send(ev.GroupRegistered, "g3", 1) == ()
    assert driver.c.group_state("g3") == "pending_weights"
    assert driver.sync(3, ["g1", "g2", "g3"])[-1] == RouteTraffic("g3", 1, 3)


def test_machine_guard_admits_only_a_group_holding_the_fleet_version() -> None:
    fleet = Fleet(2)
    record = GroupRecord("g", fleet, version=1)
    m = WorkerGroupMachine(model=record, start_value="pending_weights")
    m.send("sync")
    assert record.state == "pending_weights"  # stale: the graph keeps it waiting
    record.version = 2
    m.send("sync")
    assert record.state == "active"
    fleet.version = 3
    m.send("sync")
    assert record.state == "pending_weights"  # left out of the sync: demoted
    loading = GroupRecord("h", fleet, version=2, state="loading")
    WorkerGroupMachine(model=loading).send("loaded")
    assert loading.state == "pending_weights"  # loaded an older version than the fleet's


# -- rule: process identity ------------------------------------------------------------------


def _reboot_g1_at_v1(d: Driver) -> None:
    """The trainer pushes v2 to g1's incarnation 1, which dies before the sync is reported;
    incarnation 2 boots from C(1) and is admitted at v1."""
    d.about(ev.GroupFailed, "g1")
    assert d.send(ev.RestartLoaded, "g1", 2) == (RouteTraffic("g1", 2, 1),)
    assert (d.c.group("g1").state, d.c.group("g1").version) == ("active", 1)


def test_identity_sync_naming_a_dead_incarnation_demotes_its_successor(driver: Driver) -> None:
    _reboot_g1_at_v1(driver)
    effects = driver.send(ev.WeightsSynced, 2, {"g1": 1, "g2": 1})
    assert effects == (DeleteCheckpoint(1, C1), WithdrawTraffic("g1", 2))
    g1 = driver.c.group("g1")
    assert (g1.state, g1.incarnation, g1.version) == ("pending_weights", 2, 1)
    assert serving(driver) == {("g2", 1)}
    # The next sync that reaches incarnation 2 admits it.
    assert RouteTraffic("g1", 2, 3) in driver.sync(3)


def test_identity_sync_naming_the_current_incarnation_counts(driver: Driver) -> None:
    _reboot_g1_at_v1(driver)
    effects = driver.send(ev.WeightsSynced, 2, {"g1": 2, "g2": 1})
    assert effects == (DeleteCheckpoint(1, C1),)
    g1 = driver.c.group("g1")
    assert (g1.state, g1.incarnation, g1.version) == ("active", 2, 2)


def test_identity_sync_naming_a_dead_incarnation_does_not_admit_a_pending_one(
    driver: Driver,
) -> None:
    driver.about(ev.GroupFailed, "g1")
    driver.send(ev.RestartLoadFailed, "g1", 2)
    driver.send(ev.Relaunched, "g1", 3)
    effects = driver.send(ev.WeightsSynced, 2, {"g1": 2, "g2": 1})
    assert not any(isinstance(e, RouteTraffic) for e in effects)
    assert (driver.c.group_state("g1"), driver.c.group("g1").version) == ("pending_weights", None)
    assert driver.send(ev.WeightsSynced, 3, {"g1": 3, "g2": 1}) == (RouteTraffic("g1", 3, 3),)


def _history(d: Driver) -> None:
    """g1: incarnation 1 served, 2 failed its load, 3 is relaunching cold.
    g2: incarnation 1 served, 2 died while loading (a failed immediate restart: recovery
    cools), 3 is relaunching cold."""
    d.about(ev.GroupFailed, "g1")
    d.send(ev.RestartLoadFailed, "g1", 2)
    d.about(ev.GroupFailed, "g2")
    d.send(ev.GroupFailed, "g2", 2)
    assert (d.c.group_state("g1"), d.inc("g1")) == ("relaunching", 3)
    assert (d.c.group_state("g2"), d.inc("g2")) == ("relaunching", 3)
    assert d.c.recovery_state("g2") == "cooldown"


LATE_REPORTS = [
    (ev.Relaunched, "g1", 1),
    (ev.Relaunched, "g1", 2),
    (ev.RelaunchFailed, "g1", 2),
    (ev.RestartLoaded, "g1", 2),
    (ev.RestartLoadFailed, "g1", 2),
    (ev.GroupFailed, "g1", 1),
    (ev.GroupFailed, "g1", 2),
    (ev.RestartLoaded, "g2", 1),
    (ev.RestartLoaded, "g2", 2),
    (ev.RestartLoadFailed, "g2", 2),
    (ev.Relaunched, "g2", 2),
    (ev.RelaunchFailed, "g2", 1),
    (ev.GroupFailed, "g2", 2),
    (ev.ProbeFailed, "g2", 1),
    # never started
    (ev.Relaunched, "g1", 4),
    (ev.RestartLoaded, "g2", 4),
    (ev.GroupFailed, "g2", 9),
]


@pytest.mark.parametrize(("cls", "group", "incarnation"), LATE_REPORTS)
def test_identity_report_for_another_incarnation_is_refused_and_changes_nothing(
    driver: Driver, cls: type[ev.Event], group: str, incarnation: int
) -> None:
    _history(driver)
    before = driver.c.snapshot()
    with pytest.raises(WrongIncarnation):
        driver.send(cls, group, incarnation)
    assert driver.c.snapshot() == before
    # The current incarnations still report normally.
    assert driver.send(ev.Relaunched, "g1", 3) == ()
    assert driver.send(ev.Relaunched, "g2", 3) == ()
    assert driver.c.group_state("g2") == "pending_weights"


@pytest.mark.parametrize("listed", [{"g1": 2}, {"g1": 1, "g2": 2}, {"g2": 7}])
def test_identity_sync_naming_an_incarnation_never_started_is_refused(
    driver: Driver, listed: dict[str, int]
) -> None:
    before = driver.c.snapshot()
    with pytest.raises(WrongIncarnation):
        driver.send(ev.WeightsSynced, 2, listed)
    assert driver.c.snapshot() == before
    assert driver.c.version == 1


def test_identity_sync_naming_an_unknown_group_is_refused(driver: Driver) -> None:
    before = driver.c.snapshot()
    with pytest.raises(UnknownGroup):
        driver.send(ev.WeightsSynced, 2, {"g1": 1, "nope": 1})
    assert driver.c.snapshot() == before


# -- rule: routing is an effect --------------------------------------------------------------


def test_routing_suspect_stays_routed(driver: Driver) -> None:
    assert driver.about(ev.ProbeFailed, "g1") == ()
    assert driver.about(ev.ProbeFailed, "g1") == ()
    assert serving(driver) == {("g1", 1), ("g2", 1)}
    assert driver.about(ev.ProbeOk, "g1") == ()


def test_routing_demotion_of_a_suspect_group_withdraws_it(driver: Driver) -> None:
    driver.about(ev.ProbeFailed, "g1")
    effects = driver.sync(2, ["g2"])
    assert effects == (DeleteCheckpoint(1, C1), WithdrawTraffic("g1", 1))
    assert driver.c.group_state("g1") == "pending_weights"


def test_routing_shutdown_withdraws_every_serving_group(driver: Driver) -> None:
    driver.about(ev.ProbeFailed, "g2")
    driver.sync(2, ["g1", "g2"])
    driver.send(ev.GroupRegistered, "g3", 1)  # pending: up but not routed
    effects = driver.send(ev.Shutdown)
    assert effects == (
        WithdrawTraffic("g1", 1),
        StopGroup("g1", 1, "shutdown"),
        WithdrawTraffic("g2", 1),
        StopGroup("g2", 1, "shutdown"),
        StopGroup("g3", 1, "shutdown"),
    )


def test_routing_retiring_a_serving_group_withdraws_it_once() -> None:
    d = Driver(RecoveryConfig(restart_budget=1), ["g1"])
    d.step(1)
    d.about(ev.GroupFailed, "g1")
    d.about(ev.RestartLoaded, "g1")
    assert d.about(ev.GroupFailed, "g1") == (WithdrawTraffic("g1", 2), RetireGroup("g1"))


class Routed(Driver):
    """A Driver that keeps a router from the routing effects alone, and after every event
    checks it against what the controller says serves; it also records which group
    transitions crossed the serving boundary."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.router: set[tuple[str, int]] = set()
        self.crossings: set[tuple[str, str]] = set()
        super().__init__(config)

    def send(self, cls: type[ev.Event], *args: object, **kwargs: object) -> tuple[Effect, ...]:
        effects = super().send(cls, *args, **kwargs)
        moves = 0
        for e in effects:
            if isinstance(e, RouteTraffic):
                assert all(g != e.group for g, _ in self.router), f"{e} while still routed"
                assert e.version == self.c.version
                self.router.add((e.group, e.incarnation))
                moves += 1
            elif isinstance(e, WithdrawTraffic):
                assert (e.group, e.incarnation) in self.router, f"{e} while not routed"
                self.router.remove((e.group, e.incarnation))
                moves += 1
        assert self.router == serving(self), f"after {cls.__name__}: {effects}"
        crossed = [
            (event, source)
            for machine, event, source, target in self.c.last_transitions
            if machine.startswith("group:") and (source in SERVING) != (target in SERVING)
        ]
        assert moves == len(crossed), f"{cls.__name__}: {crossed} but {effects}"
        self.crossings.update(crossed)
        return effects

    def finish_deletes(self, effects: Iterable[Effect]) -> None:
        for e in effects:
            if isinstance(e, DeleteCheckpoint):
                self.send(ev.CheckpointDeleted, e.version)


def test_routing_router_driven_by_effects_alone_matches_the_serving_set() -> None:
    d = Routed(
        RecoveryConfig(
            suspect_threshold=2,
            restart_budget=2,
            clean_syncs_to_reenable=2,
            await_checkpoint_timeout_s=2.0,
        )
    )
    for name in ("g1", "g2", "g3"):
        d.send(ev.GroupRegistered, name, 0)  # routed at once
    d.step(1)
    d.send(ev.GroupRegistered, "g4", 0)  # stale: not routed; loads C(1) in place
    d.about(ev.RestartLoaded, "g4")  # admitted
    d.send(ev.GroupRegistered, "g5", 1)  # current: routed
    d.finish_deletes(d.sync(2, ["g1", "g2", "g4", "g5"]))  # g3 demoted
    d.about(ev.ProbeFailed, "g1")  # suspect: stays routed
    d.about(ev.ProbeOk, "g1")
    d.about(ev.ProbeFailed, "g2")
    d.about(ev.ProbeFailed, "g2")  # threshold: failed, awaits C(2)
    assert d.c.group_state("g2") == "awaiting_checkpoint"
    d.export(2)  # g2 boots from C(2); the demoted g3 loads it in place
    d.about(ev.RestartLoaded, "g2")  # admitted after its load
    d.about(ev.RestartLoaded, "g3")  # admitted again, same process
    d.about(ev.GroupFailed, "g1")  # loads C(2)
    d.finish_deletes(d.sync(3))  # g1 is loading, not listed
    d.finish_deletes(d.about(ev.RestartLoaded, "g1"))  # loaded v2 at v3: pending
    assert d.c.group_state("g1") == "pending_weights"
    d.about(ev.GroupFailed, "g4")  # awaits C(3), which never comes
    d.send(ev.Tick)
    d.send(ev.Tick)  # await timeout: cold start
    d.about(ev.Relaunched, "g4")
    d.about(ev.ProbeFailed, "g5")
    d.finish_deletes(d.sync(4, ["g1", "g2", "g4"]))  # g1, g4 admitted; g3, suspect g5 demoted
    d.export(4)  # g3 and g5 load C(4) in place
    assert {d.c.group_state(g) for g in ("g3", "g5")} == {"loading"}
    d.about(ev.RestartLoaded, "g3")  # admitted again, same process
    d.about(ev.RestartLoaded, "g5")
    d.about(ev.GroupFailed, "g2")  # second restart of g2: loads C(4)
    d.about(ev.RestartLoadFailed, "g2")  # its budget is spent: retired
    assert d.c.group_state("g2") == "retired"
    d.about(ev.GroupFailed, "g4")  # second restart of g4: loads C(4)
    d.about(ev.GroupFailed, "g4")  # dies while loading: retired
    d.about(ev.GroupFailed, "g1")  # second restart of g1: loads C(4)
    d.about(ev.RestartLoaded, "g1")  # admitted after its load
    d.about(ev.GroupFailed, "g1")  # a serving group with its budget spent: retired
    assert d.c.group_state("g1") == "retired"
    d.finish_deletes(d.sync(5, ["g3", "g5"]))
    d.about(ev.ProbeFailed, "g3")
    d.send(ev.GroupRegistered, "g6", 5)
    d.send(ev.ExportStarted, 5)
    d.about(ev.GroupFailed, "g6")  # awaits C(5)
    d.send(ev.ExportCommitted, 5, "/ckpt/step-5")
    d.finish_deletes(d.send(ev.Shutdown))  # g3 (suspect), g5 withdrawn; g6 is loading
    d.finish_deletes(d.send(ev.RestartLoaded, "g6", 2))  # after shutdown: never routed
    assert d.router == set()
    assert d.c.drained, d.c.outstanding()
    assert d.crossings == {
        ("create", ""),
        ("loaded", "loading"),
        ("sync", "pending_weights"),
        ("fail", "active"),
        ("fail", "suspect"),
        ("sync", "active"),
        ("sync", "suspect"),
        ("stop", "active"),
        ("stop", "suspect"),
    }


# -- rule: deadlines -------------------------------------------------------------------------

DEADLINES = RecoveryConfig(load_timeout_s=100.0, relaunch_timeout_s=50.0)


@pytest.mark.parametrize("report", [ev.RestartLoaded, ev.RestartLoadFailed, ev.GroupFailed])
def test_deadline_load_is_killed_cools_and_keeps_its_lease_until_reported(
    report: type[ev.Event],
) -> None:
    d = Timed(DEADLINES, ["g1", "g2"])
    d.step(1)
    t0 = d.now()
    assert d.c.handle(ev.GroupFailed("g1", 1, at=t0)) == (
        WithdrawTraffic("g1", 1),
        RestartFromCheckpoint("g1", 2, 1, C1),
    )
    before = without_clock(d.c.snapshot())
    assert d.tick(t0 + 99.0) == ()
    assert without_clock(d.c.snapshot()) == before

    assert d.tick(t0 + 100.0) == (StopGroup("g1", 2, "load deadline"), RestartCold("g1", 3))
    g1 = d.c.group("g1")
    assert (g1.state, g1.incarnation, g1.recovery, g1.restarts) == (
        "relaunching",
        3,
        "cooldown",
        2,
    )
    assert g1.lease is None  # incarnation 3 starts cold
    assert d.c.leases == {"g1#2": Lease("g1", 2, 1, 1)}
    assert "a load of C(1) of group 'g1' incarnation 2 has not reported" in d.c.outstanding()

    # The killed process may still be reading C(1): a newer sync must not delete it.
    effects = d.sync(2)
    assert not any(isinstance(e, DeleteCheckpoint) for e in effects)
    assert d.c.checkpoint_state(1) == "superseded"
    assert d.c.checkpoints()[1].leases == 1

    view = d.c.group("g1")
    assert d.send(report, "g1", 2) == (DeleteCheckpoint(1, C1),)
    assert d.c.group("g1") == view  # only the lease ended
    assert d.c.leases == {}
    assert d.c.checkpoint_state(1) == "deletable"
    with pytest.raises(WrongIncarnation):
        d.send(report, "g1", 2)
    assert d.send(ev.Relaunched, "g1", 3) == ()


def test_deadline_killed_load_reporting_before_any_sync_just_frees_its_lease() -> None:
    d = Timed(DEADLINES, ["g1"])
    d.step(1)
    t0 = d.now()
    d.c.handle(ev.GroupFailed("g1", 1, at=t0))
    d.tick(t0 + 150.0)
    assert d.send(ev.RestartLoaded, "g1", 2) == ()
    assert d.c.checkpoint_state(1) == "ready"
    assert d.c.checkpoints()[1].leases == 0
    assert d.c.group_state("g1") == "relaunching"


@pytest.mark.parametrize("report", [ev.Relaunched, ev.RelaunchFailed, ev.GroupFailed])
def test_deadline_relaunch_is_killed_without_cooling(report: type[ev.Event]) -> None:
    d = Timed(
        RecoveryConfig(load_timeout_s=100.0, relaunch_timeout_s=50.0, export_every_sync=False),
        ["g1", "g2"],
    )
    d.sync(1)
    t0 = d.now()
    assert d.c.handle(ev.GroupFailed("g1", 1, at=t0)) == (
        WithdrawTraffic("g1", 1),
        RestartCold("g1", 2),
    )
    d.export(1)
    before = without_clock(d.c.snapshot())
    assert d.tick(t0 + 49.0) == ()
    assert without_clock(d.c.snapshot()) == before

    effects = d.tick(t0 + 50.0)
    assert effects == (
        StopGroup("g1", 2, "relaunch deadline"),
        RestartFromCheckpoint("g1", 3, 1, C1),
    )
    g1 = d.c.group("g1")
    assert (g1.state, g1.incarnation, g1.recovery, g1.restarts) == ("loading", 3, "enabled", 2)
    assert "a cold start of group 'g1' incarnation 2 has not reported" in d.c.outstanding()

    view = d.c.group("g1")
    assert d.send(report, "g1", 2) == ()
    assert d.c.group("g1") == view
    assert not any("incarnation 2" in s for s in d.c.outstanding())
    with pytest.raises(WrongIncarnation):
        d.send(report, "g1", 2)
    assert d.send(ev.RestartLoaded, "g1", 3) == (RouteTraffic("g1", 3, 1),)


def test_deadline_new_start_gets_its_own_full_deadline() -> None:
    d = Timed(DEADLINES, ["g1"])
    d.step(1)
    t0 = d.now()
    d.c.handle(ev.GroupFailed("g1", 1, at=t0))
    d.tick(t0 + 100.0)  # load killed; incarnation 3 relaunches from t0 + 100
    assert d.tick(t0 + 149.0) == ()
    assert d.tick(t0 + 150.0) == (StopGroup("g1", 3, "relaunch deadline"), RestartCold("g1", 4))


# -- rule: the clean-sync streak --------------------------------------------------------------


def _streak(d: Driver, group: str) -> int:
    return int(d.c.snapshot()["groups"][group]["recovery"]["clean_streak"])


def test_clean_sync_streak_restarts_after_a_miss_in_cooldown() -> None:
    d = Driver(RecoveryConfig(clean_syncs_to_reenable=3), ["g1", "g2"])
    d.step(1)
    d.about(ev.GroupFailed, "g1")
    d.send(ev.RestartLoadFailed, "g1", 2)  # a failed immediate restart cools g1
    d.send(ev.Relaunched, "g1", 3)
    assert (d.c.recovery_state("g1"), _streak(d, "g1")) == ("cooldown", 0)

    d.step(2)  # leaves v1, C(1) committed: clean 1
    d.sync(3)  # leaves v2, C(2) committed: clean 2
    assert (d.c.recovery_state("g1"), _streak(d, "g1")) == ("cooldown", 2)

    d.send(ev.ExportStarted, 3)
    assert CancelExport(3) in d.sync(4)  # leaves v3 with its export unfinished: missed
    assert (d.c.recovery_state("g1"), _streak(d, "g1")) == ("cooldown", 0)
    assert d.c.recovery_state("g2") == "cooldown"

    d.export(4)
    d.step(5)  # clean 1
    d.step(6)  # clean 2
    assert d.c.recovery_state("g1") == "cooldown"
    assert d.c.recovery_state("g2") == "cooldown"
    d.sync(7)  # clean 3
    assert d.c.recovery_state("g1") == "enabled"
    assert d.c.recovery_state("g2") == "enabled"
    assert _streak(d, "g1") == 0


# -- rule: queries ---------------------------------------------------------------------------


def test_queries_group_view_follows_a_restart(driver: Driver) -> None:
    c = driver.c
    assert c.group("g1") == GroupView("g1", "active", 1, 1, "enabled", 0, None)
    driver.about(ev.GroupFailed, "g1")
    lease = Lease("g1", 2, 1, 1)
    assert c.group("g1") == GroupView("g1", "loading", 2, None, "enabled", 1, lease)
    assert c.lease_of("g1") == lease
    assert c.leases == {"g1#2": lease}
    assert lease.id == "g1#2"
    driver.send(ev.RestartLoaded, "g1", 2)
    assert c.group("g1") == GroupView("g1", "active", 2, 1, "enabled", 1, None)
    assert c.lease_of("g1") is None
    assert c.incarnation("g1") == 2
    assert list(c.groups()) == ["g1", "g2"]
    assert c.groups()["g2"] == GroupView("g2", "active", 1, 1, "enabled", 0, None)


def test_queries_unknown_group_is_refused(driver: Driver) -> None:
    for query in (driver.c.group, driver.c.lease_of, driver.c.incarnation):
        with pytest.raises(UnknownGroup):
            query("nope")


def test_queries_up_groups_lists_only_processes_that_can_take_weights() -> None:
    d = Driver(RecoveryConfig(restart_budget=1), ["a", "b", "c", "d", "e", "f", "g"])
    d.step(1)
    d.about(ev.ProbeFailed, "a")  # suspect
    d.about(ev.GroupFailed, "b")  # loading
    d.about(ev.GroupFailed, "c")
    d.about(ev.RestartLoadFailed, "c")  # retired
    d.about(ev.GroupFailed, "e")
    d.about(ev.RestartLoaded, "e")  # active again, incarnation 2
    d.sync(2, ["a", "d", "e"])  # f, g demoted
    d.send(ev.GroupRegistered, "p", 1)  # pending_weights (C(2) is not ready)
    d.send(ev.ExportStarted, 2)
    d.about(ev.GroupFailed, "g")  # awaiting_checkpoint
    states = {n: v.state for n, v in d.c.groups().items()}
    assert states == {
        "a": "suspect",
        "b": "loading",
        "c": "retired",
        "d": "active",
        "e": "active",
        "f": "pending_weights",
        "g": "awaiting_checkpoint",
        "p": "pending_weights",
    }
    assert d.c.up_groups() == {"a": 1, "d": 1, "e": 2, "f": 1, "p": 1}
    d.send(ev.Shutdown)
    assert d.c.up_groups() == {}
