"""The ledger reads recoveries, idle time and failures off real controller journals."""

from __future__ import annotations

from typing import Any

import pytest

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.journal.ledger import Ledger, percentile


def journal(config: RecoveryConfig | None = None) -> tuple[RecoveryController, list[Any]]:
    records: list[Any] = []
    c = RecoveryController(config or RecoveryConfig(), journal=records.append)
    for g in ("g1", "g2"):
        c.handle(ev.GroupRegistered(g, 0, at=0.0))
    return c, records


def test_a_restart_that_lands_after_a_sync_and_catches_up_in_place_is_immediate() -> None:
    c, records = journal()
    c.handle(ev.WeightsSynced(1, {"g1": 1, "g2": 1}, at=10.0))
    c.handle(ev.ExportStarted(1, at=10.0))
    c.handle(ev.ExportCommitted(1, "/c/1", at=11.0))
    c.handle(ev.GroupFailed("g1", 1, at=12.0))  # boots from C(1)
    c.handle(ev.WeightsSynced(2, {"g2": 1}, at=20.0))
    c.handle(ev.ExportStarted(2, at=20.0))
    c.handle(ev.ExportCommitted(2, "/c/2", at=21.0))
    c.handle(ev.RestartLoaded("g1", 2, at=22.0))  # loaded v1: loads C(2) in place, as #3
    assert c.group_state("g1") == "loading"
    c.handle(ev.RestartLoaded("g1", 3, at=23.0))
    ledger = Ledger(records)
    [r] = ledger.recoveries
    assert (r.group, r.path, r.latency_s) == ("g1", "immediate", 11.0)
    assert (r.incarnation, r.attempts) == (1, 1)  # a load in place is no second start
    assert ledger.idle_group_seconds(until=30.0) == pytest.approx(11.0)
    assert ledger.metrics(until=30.0)["recovery/immediate_latency_p50_s"] == 11.0


def test_a_cold_start_that_loads_the_next_checkpoint_in_place_waited() -> None:
    c, records = journal()
    c.handle(ev.GroupFailed("g1", 1, at=12.0))  # before any sync: no checkpoint, cold
    c.handle(ev.Relaunched("g1", 2, at=14.0))
    c.handle(ev.WeightsSynced(1, {"g2": 1}, at=20.0))
    c.handle(ev.ExportStarted(1, at=20.0))
    c.handle(ev.ExportCommitted(1, "/c/1", at=21.0))  # g1 loads C(1) in place, as #3
    assert c.group_state("g1") == "loading"
    c.handle(ev.RestartLoaded("g1", 3, at=22.0))
    [r] = Ledger(records).recoveries
    assert (r.path, r.latency_s) == ("waited", 10.0)


def test_a_cold_start_admitted_by_a_sync_is_cold_and_counts_its_cooldown() -> None:
    c, records = journal(RecoveryConfig(clean_syncs_to_reenable=1))
    c.handle(ev.WeightsSynced(1, {"g1": 1, "g2": 1}, at=10.0))
    c.handle(ev.ExportStarted(1, at=10.0))
    c.handle(ev.ExportCommitted(1, "/c/1", at=11.0))
    c.handle(ev.GroupFailed("g1", 1, at=12.0))
    c.handle(ev.RestartLoadFailed("g1", 2, at=13.0, error="corrupt"))  # cools, goes cold
    c.handle(ev.Relaunched("g1", 3, at=15.0))
    c.handle(ev.WeightsSynced(2, {"g1": 3, "g2": 1}, at=20.0))
    ledger = Ledger(records)
    [r] = ledger.recoveries
    assert (r.path, r.latency_s) == ("cold", 8.0)
    # The failure it answers (the first process's death), and the two starts it took.
    assert (r.incarnation, r.reason, r.attempts) == (1, "GroupFailed", 2)
    assert ledger.cooldowns == 1
    assert [(m.group, m.incarnation, m.detail) for m in ledger.crashes] == [
        ("g1", 1, "GroupFailed"), ("g1", 2, "corrupt")
    ]


def test_a_load_past_its_deadline_is_a_failure_named_by_its_stop() -> None:
    c, records = journal(RecoveryConfig(load_timeout_s=5.0))
    c.handle(ev.WeightsSynced(1, {"g1": 1, "g2": 1}, at=10.0))
    c.handle(ev.ExportStarted(1, at=10.0))
    c.handle(ev.ExportCommitted(1, "/c/1", at=11.0))
    c.handle(ev.GroupFailed("g1", 1, at=12.0, reason="oom"))
    c.handle(ev.Tick(at=17.0))
    crashes = Ledger(records).crashes
    assert [(m.incarnation, m.detail) for m in crashes] == [(1, "oom"), (2, "load deadline")]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_every_name_the_ledger_reads_is_one_the_machines_have() -> None:
    """The ledger reads transition labels and machine event and state names off the
    journal; each comes from the names classes, which must match the graphs exactly."""
    import ast
    import inspect

    from recovery_fsm.journal import ledger as ledger_module
    from recovery_fsm.machines import (
        MACHINES,
        CheckpointEvent,
        CheckpointState,
        GroupEvent,
        GroupState,
        SwitchEvent,
        SwitchState,
        names,
    )

    graphs = {
        GroupState: {s.id for s in MACHINES["worker_group"].states},
        GroupEvent: {e.id for e in MACHINES["worker_group"].events},
        SwitchState: {s.id for s in MACHINES["immediate_recovery"].states},
        SwitchEvent: {e.id for e in MACHINES["immediate_recovery"].events},
        CheckpointState: {s.id for s in MACHINES["checkpoint"].states},
        CheckpointEvent: {e.id for e in MACHINES["checkpoint"].events},
    }
    for cls, graph in graphs.items():
        assert names(cls) == graph, cls.__name__
    # The ledger names no state or event as a bare string: every one goes through a class.
    tree = ast.parse(inspect.getsource(ledger_module))
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    every_name = set().union(*graphs.values())
    assert not literals & every_name, sorted(literals & every_name)
