"""The real controller under Hypothesis's interleavings and the exhaustive explorer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from budget import BUDGET, search_settings

from recovery_fsm.search import Scope, Sim, explore, small_config
from recovery_fsm.search.stateful import WIDE_STANDBY, race_search

# Where a failing example's journal lands: keep it after the run to replay it.
TRACES = Path(os.environ.get("RECOVERY_FSM_TRACES", Path(tempfile.gettempdir()) / "recovery-fsm"))

RealControllerRaces = race_search(journal_dir=TRACES)
TestRealControllerRaces = RealControllerRaces.TestCase
TestRealControllerRaces.settings = search_settings(BUDGET.examples)

# The same search with a pool of one standby beside the three groups.
StandbyRaces = race_search(scope=WIDE_STANDBY, journal_dir=TRACES)
TestStandbyRaces = StandbyRaces.TestCase
TestStandbyRaces.settings = search_settings(BUDGET.examples)
# One group and a standby: small enough to explore, with every state settled fairly.
STANDBY_SCOPE = Scope(groups=("g0",), config=small_config(standby=1, standby_boot_budget=2))


def test_explorer_finds_no_violation_in_the_real_controller() -> None:
    result = explore(BUDGET.depth, journal_dir=TRACES)
    print(result.report())
    assert not result.found, result.report()
    # Exhaustive: every level up to the depth was reached and had new states.
    assert len(result.new_states) == BUDGET.depth and all(result.new_states)


def test_every_state_settles_when_failures_stop() -> None:
    result = explore(BUDGET.liveness_depth, liveness=True, journal_dir=TRACES)
    assert not result.found, result.report()


def test_explorer_finds_no_violation_with_a_standby_pool() -> None:
    result = explore(BUDGET.liveness_depth, STANDBY_SCOPE, liveness=True, journal_dir=TRACES)
    print(result.report())
    assert not result.found, result.report()
    assert len(result.new_states) == BUDGET.liveness_depth and all(result.new_states)


def test_settle_brings_a_group_back_through_a_current_standby() -> None:
    sim = _walk(Sim(STANDBY_SCOPE), ["standby_booted(standby-1)", "sync", "fail(g0)"])
    assert sim.world.procs["g0"].via == "standby"
    assert sim.settle() == []
    assert sim.outcomes() == {"g0": "active as #2 (standby restart)"}
    assert sorted(sim.controller.standbys()) == ["standby-2"]


def test_settle_brings_failed_groups_back() -> None:
    sim = Sim(Scope(groups=("g0", "g1", "g2")))
    for name in ["export", "fail(g0)", "fail(g1)", "export_fails(0)", "sync", "fail(g2)"]:
        action = next(a for a in sim.actions() if str(a) == name)
        assert sim.step(action) == []
    assert {sim.controller.group_state(g) for g in ("g0", "g1", "g2")} != {"active"}
    assert sim.settle() == []
    assert [sim.controller.group_state(g) for g in ("g0", "g1", "g2")] == ["active"] * 3


def _walk(sim: Sim, names: list[str]) -> Sim:
    for name in names:
        action = next((a for a in sim.actions() if str(a) == name), None)
        assert action is not None, f"{name} not enabled; enabled: {sim.actions()}"
        assert sim.step(action) == []
    return sim


def test_keys_identify_states_up_to_order_and_clocks() -> None:
    """Orders that reach the same situation share a key; a different situation does not."""
    a = _walk(Sim(), ["export", "commit(0)", "fail(g0)", "fail(g1)"])
    b = _walk(Sim(), ["export", "commit(0)", "fail(g1)", "fail(g0)"])
    assert set(a.controller.leases) == set(b.controller.leases) == {"g0#2", "g1#2"}
    assert a.key() == b.key()
    # A different situation: g0 waits for an export instead of loading.
    c = _walk(Sim(), ["sync", "fail(g0)"])
    assert c.controller.group_state("g0") == "awaiting_checkpoint" and c.key() != a.key()


def test_fork_is_independent_of_its_parent() -> None:
    parent = _walk(Sim(), ["export", "commit(0)"])
    before = parent.key()
    child = _walk(parent.fork(), ["fail(g0)", "sync"])
    assert parent.key() == before and child.key() != before
    assert parent.controller.group_state("g0") == "active"
    assert child.controller.group_state("g0") == "loading"
    assert parent.controller.checkpoint_state(0) == "ready"
    assert child.controller.checkpoint_state(0) == "superseded"
    # The copy's machines act on the copy's records: its guard sees the copy's lease.
    ck = child.controller.rules.checkpoints[0]
    assert ck.machine.model is ck.record and not ck.record.reapable
