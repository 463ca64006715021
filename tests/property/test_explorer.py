"""The exhaustive explorer over the real controller: every interleaving of the small scopes'
events up to a depth, each state also settled fairly (liveness). The slowest tests of the
property suite, in a file collected first and ordered slowest first, so that the parallel run
of ``./scripts/test`` starts them at once rather than last."""

from __future__ import annotations

from budget import BUDGET, TRACES

from recovery_fsm.search import Scope, explore
from recovery_fsm.search.stateful import small_resume, small_standby, small_window

# One group and a standby; one group whose budget of two refills 25 s after each restart.
STANDBY_SCOPE = small_standby()
WINDOW_SCOPE = small_window()


def _finds_nothing(
    depth: int, scope: Scope | None = None, *, liveness: bool, every_level: bool = True
) -> None:
    result = explore(depth, scope, liveness=liveness, journal_dir=TRACES)
    print(result.report())
    assert not result.found, result.report()
    if every_level:  # exhaustive: every level up to the depth was reached and had new states
        assert len(result.new_states) == depth and all(result.new_states)


def test_explorer_finds_no_violation_across_a_resume() -> None:
    _finds_nothing(BUDGET.liveness_depth, small_resume(), liveness=True)


def test_explorer_finds_no_violation_in_the_real_controller() -> None:
    _finds_nothing(BUDGET.depth, liveness=False)


def test_explorer_finds_no_violation_with_a_standby_pool() -> None:
    _finds_nothing(BUDGET.liveness_depth, STANDBY_SCOPE, liveness=True)


def test_every_state_settles_when_failures_stop() -> None:
    _finds_nothing(BUDGET.liveness_depth, liveness=True, every_level=False)


def test_explorer_finds_no_violation_with_a_refilling_restart_budget() -> None:
    _finds_nothing(BUDGET.liveness_depth, WINDOW_SCOPE, liveness=True)
