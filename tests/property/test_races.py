"""The real controller under Hypothesis's interleavings and the exhaustive explorer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from budget import BUDGET, search_settings

from recovery_fsm.search import Scope, Sim, explore
from recovery_fsm.search.stateful import race_search

# Where a failing example's journal lands: keep it after the run to replay it.
TRACES = Path(os.environ.get("RECOVERY_FSM_TRACES", Path(tempfile.gettempdir()) / "recovery-fsm"))

RealControllerRaces = race_search(journal_dir=TRACES)
TestRealControllerRaces = RealControllerRaces.TestCase
TestRealControllerRaces.settings = search_settings(BUDGET.examples)


def test_explorer_finds_no_violation_in_the_real_controller() -> None:
    result = explore(BUDGET.depth, journal_dir=TRACES)
    print(result.report())
    assert not result.found, result.report()
    # Exhaustive: every level up to the depth was reached and had new states.
    assert len(result.new_states) == BUDGET.depth and all(result.new_states)


def test_every_state_settles_when_failures_stop() -> None:
    result = explore(BUDGET.liveness_depth, liveness=True, journal_dir=TRACES)
    assert not result.found, result.report()


def test_settle_brings_failed_groups_back() -> None:
    sim = Sim(Scope(groups=("g0", "g1", "g2")))
    for name in ["export", "fail(g0)", "fail(g1)", "export_fails(0)", "sync", "fail(g2)"]:
        action = next(a for a in sim.actions() if str(a) == name)
        assert sim.step(action) == []
    assert {sim.controller.group_state(g) for g in ("g0", "g1", "g2")} != {"active"}
    assert sim.settle() == []
    assert [sim.controller.group_state(g) for g in ("g0", "g1", "g2")] == ["active"] * 3


def test_keys_identify_states_up_to_lease_ids_and_clocks() -> None:
    """Two orders that lead to the same situation share a key; different ones do not."""
    a, b = Sim(), Sim()
    for sim, order in ((a, ["fail(g0)", "fail(g1)"]), (b, ["fail(g1)", "fail(g0)"])):
        for name in order:
            assert sim.step(next(x for x in sim.actions() if str(x) == name)) == []
    assert a.key() == b.key()
    c = Sim()
    assert c.step(next(x for x in c.actions() if str(x) == "fail(g0)")) == []
    assert c.key() != a.key()
