"""The real controller under Hypothesis's interleavings, and the explorer's simulator on given
walks (the exhaustive searches are in ``test_explorer.py``)."""

from __future__ import annotations

import attrs
from budget import BUDGET, TRACES, search_settings

from recovery_fsm.search import Scope, Sim, small_config
from recovery_fsm.search.sim import TRAINER, Action
from recovery_fsm.search.stateful import (
    WIDE_RESUME,
    WIDE_STANDBY,
    WIDE_WINDOW,
    race_search,
    small_standby,
    small_window,
)

RealControllerRaces = race_search(journal_dir=TRACES)
TestRealControllerRaces = RealControllerRaces.TestCase
TestRealControllerRaces.settings = search_settings(BUDGET.examples)

# The same search with a pool of one standby beside the three groups.
StandbyRaces = race_search(scope=WIDE_STANDBY, journal_dir=TRACES)
TestStandbyRaces = StandbyRaces.TestCase
TestStandbyRaces.settings = search_settings(BUDGET.examples)
# One group and a standby: small enough to explore, with every state settled fairly.
STANDBY_SCOPE = small_standby()

# The same search with a restart budget that refills over a window.
WindowRaces = race_search(scope=WIDE_WINDOW, journal_dir=TRACES)
TestWindowRaces = WindowRaces.TestCase
TestWindowRaces.settings = search_settings(BUDGET.examples)
# One group whose budget of two refills 25 s after each restart.
WINDOW_SCOPE = small_window()

# The standby world where the trainer crashes and resumes (twice at most).
ResumeRaces = race_search(scope=WIDE_RESUME, journal_dir=TRACES)
TestResumeRaces = ResumeRaces.TestCase
TestResumeRaces.settings = search_settings(BUDGET.examples)


def test_a_budget_refilled_by_the_window_restarts_a_group_the_whole_run_would_retire() -> None:
    """Two restarts at 0 s spend a budget of two. With a 25 s window a failure at 25 s
    restarts the group (they no longer count) and one at 24 s retires it; without a
    window a failure retires it at any time."""
    moves = ["fail(g0)", "relaunched(g0#2)", "fail(g0)", "relaunched(g0#3)"]
    cases = [(25.0, 25.0, "relaunching"), (25.0, 24.0, "retired"), (None, 1000.0, "retired")]
    for window, later, outcome in cases:
        config = small_config(restart_window_s=window)
        sim = _walk(Sim(attrs.evolve(WINDOW_SCOPE, config=config)), moves)
        assert sim.step(Action(TRAINER, "tick", later)) == []
        assert sim.step(next(a for a in sim.actions() if str(a) == "fail(g0)")) == []
        assert sim.controller.group("g0").state == outcome, (window, later)


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


def test_a_load_in_place_after_a_claim_does_not_hold_the_refill_back() -> None:
    """The claimed standby held v1; the fleet moved to v2 meanwhile, so the claim's outcome
    is a load of C(2) in place into the same process, and the refill boots beside that load:
    the claim itself has reported. (The world model once took that load for the claim; the
    soak's journal showed it.)"""
    sim = _walk(Sim(STANDBY_SCOPE), ["standby_booted(standby-1)", "sync", "fail(g0)", "sync",
                                     "export", "commit(2)"])  # fmt: skip
    assert sim.controller.group("g0").state == "claiming"
    assert sim.step(next(a for a in sim.actions() if str(a) == "loaded(g0#2)")) == []
    assert sim.controller.group("g0").state == "loading"
    assert sorted(sim.controller.standbys()) == ["standby-2"]
