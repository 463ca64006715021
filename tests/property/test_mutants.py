"""Proof the search has teeth: each broken controller must be caught by Hypothesis (on every
seed, not one lucky one) and by the explorer, and the trace each writes must replay to the
same violation."""

from __future__ import annotations

from pathlib import Path

import pytest
from budget import BUDGET, search_settings
from hypothesis import seed
from hypothesis.stateful import run_state_machine_as_test

from recovery_fsm import Rules
from recovery_fsm.replay import replay
from recovery_fsm.search import HOSTING_MUTANTS, MUTANTS, Scope, explore
from recovery_fsm.search.stateful import RaceFound, race_search


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_hypothesis_finds_the_broken_controller(name: str, tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    machine = race_search(MUTANTS[name], journal_dir=trace_dir)
    # Derandomized, so CI either always or never finds it; no shrinking, to stay fast.
    budget = search_settings(BUDGET.mutant_examples, shrink=False, derandomize=True)
    with pytest.raises(RaceFound) as found:
        run_state_machine_as_test(machine, settings=budget)
    journal = found.value.journal
    assert journal is not None and journal.exists()
    report = replay(journal)
    assert report.controller == MUTANTS[name].__name__
    assert report.violation_step is not None and not report.divergences
    replayed = {v.removeprefix("(recorded by the search) ") for v in report.violations}
    assert replayed & set(found.value.violations)


# Seeds the search must find every broken variant on, each within the profile's budget.
SEEDS = range(BUDGET.seeds)


@pytest.mark.parametrize("number", SEEDS)
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_hypothesis_finds_the_broken_controller_on_every_seed(name: str, number: int) -> None:
    """Found on some seeds is not found: a variant missed on one seed would pass or fail CI
    by luck once the seed changes (``miss-keeps-streak`` used to be missed on seed 1)."""
    machine = seed(number)(race_search(MUTANTS[name]))
    with pytest.raises(RaceFound):
        run_state_machine_as_test(
            machine, settings=search_settings(BUDGET.mutant_examples, shrink=False)
        )


# The streak bug shows at depth 7 (a failed load cools, a clean sync, a missed one): about
# 50 s of exploring (20558 states), and as long again to show nothing shallower does.
# Hypothesis proves that one, on every seed; test_search_checks replays its shortest trace.
BEYOND_THE_EXPLORER = {"miss-keeps-streak"}


@pytest.mark.parametrize("name", sorted(set(MUTANTS) - BEYOND_THE_EXPLORER))
def test_explorer_finds_the_broken_controller_by_depth_8(name: str, tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    result = explore(8, rules=MUTANTS[name], journal_dir=trace_dir)
    assert result.found, f"{name} survived the explorer:\n{result.report()}"
    assert result.trace is not None and result.journal is not None
    # Shortest: the same search one level shallower finds nothing.
    assert not explore(result.depth - 1, rules=MUTANTS[name]).found
    again = replay(result.journal)
    assert again.violation_step is not None
    assert set(again.violations) & set(result.violations)
    # The real controller, fed the same events, stays safe.
    assert replay(result.journal, Rules).violation_step is None


# -- a broken hosting: the real rules, a journal that hides what it lost ----------------------


@pytest.mark.parametrize("number", SEEDS)
@pytest.mark.parametrize("name", sorted(HOSTING_MUTANTS))
def test_hypothesis_finds_the_broken_hosting_on_every_seed(
    name: str, number: int, tmp_path: Path
) -> None:
    machine = seed(number)(race_search(host=HOSTING_MUTANTS[name], journal_dir=tmp_path))
    with pytest.raises(RaceFound) as found:
        run_state_machine_as_test(
            machine, settings=search_settings(BUDGET.mutant_examples, shrink=False)
        )
    assert any("journal" in v for v in found.value.violations), found.value
    # The journal the search kept is whole: replayed, it ends on the recorded finding.
    journal = found.value.journal
    assert journal is not None and journal.name == f"race-{HOSTING_MUTANTS[name].__name__}.jsonl"
    report = replay(journal)
    assert not report.divergences
    replayed = {v.removeprefix("(recorded by the search) ") for v in report.violations}
    assert replayed and replayed <= set(found.value.violations)


# The explorer never sends a refusal (no misuse, no duplicate), so it cannot see that one.
NO_REFUSALS = {"journals-accepted-only"}


@pytest.mark.parametrize("name", sorted(set(HOSTING_MUTANTS) - NO_REFUSALS))
def test_explorer_finds_the_broken_hosting(name: str) -> None:
    result = explore(6, Scope(sink_failures=True), host=HOSTING_MUTANTS[name])
    assert result.found, f"{name} survived the explorer:\n{result.report()}"
    assert result.trace is not None and "sink_fails" in result.trace
    real = explore(result.depth, Scope(sink_failures=True))
    assert not real.found, real.report()
