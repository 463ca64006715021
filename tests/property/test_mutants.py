"""Proof the search has teeth: each broken controller (``variants.py``: the rules' source,
patched) must be caught by Hypothesis (on every seed, not one lucky one) and by the explorer,
and the trace each writes must replay to the same violation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from budget import BUDGET, PROFILE, search_settings
from hypothesis import seed
from hypothesis.stateful import run_state_machine_as_test
from variants import (
    HOSTINGS,
    RULES_VARIANTS,
    VARIANTS,
    PatchError,
    Variant,
    explored,
    install,
    load,
    searched,
)

from recovery_fsm import Rules
from recovery_fsm.search import Scope, Sim, explore
from recovery_fsm.search.replay import replay, rules_class
from recovery_fsm.search.stateful import RaceFound, race_search


def test_each_variant_is_a_module_replay_loads_by_name() -> None:
    for v in VARIANTS:
        cls = load(v.name)
        assert rules_class(f"{v.module}:{v.class_name}") is cls
        assert cls.__doc__ == v.bug


def test_a_patch_that_no_longer_fits_fails_naming_its_variant() -> None:
    gone = Variant("gone", "a bug", (("this snippet is not in rules.py", "x"),))
    with pytest.raises(PatchError, match=r"variant 'gone'.* 0 times in rules\.py"):
        gone.source()
    twice = Variant("twice", "a bug", (("self", "this"),))
    with pytest.raises(PatchError, match="variant 'twice'"):
        twice.source()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recovery_fsm.cli", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(install()), *sys.path])}
    return subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)


def test_a_broken_controller_trace_replays_to_its_violation(tmp_path: Path) -> None:
    sim = Sim(rules=load("delete-ignoring-leases"))
    for name in ["export", "commit(0)", "fail(g0)"]:
        assert sim.step(next(a for a in sim.actions() if str(a) == name)) == []
    problems = sim.step(next(a for a in sim.actions() if str(a) == "sync"))
    assert any("while g0#2 is loading it" in p for p in problems)
    path = sim.write_journal(tmp_path / "trace.jsonl")

    report = replay(path)  # the header names the broken controller
    assert report.controller == "DeleteIgnoringLeases" and report.violation_step == 6
    assert set(problems) <= set(report.violations)
    done = _cli("replay", str(path))
    assert done.returncode == 1 and "step 6: violation" in done.stdout
    assert replay(path, Rules).violation_step is None
    real = _cli("replay", str(path), "--controller", "recovery_fsm.rules:Rules")
    assert "no violation" in real.stdout and "divergence: step 6" in real.stdout


@pytest.mark.parametrize("name", RULES_VARIANTS)
def test_hypothesis_finds_the_broken_controller(name: str, tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    machine = race_search(load(name), searched(name), journal_dir=trace_dir)
    # Derandomized, so CI either always or never finds it; no shrinking, to stay fast.
    budget = search_settings(BUDGET.mutant_examples, shrink=False, derandomize=True)
    with pytest.raises(RaceFound) as found:
        run_state_machine_as_test(machine, settings=budget)
    journal = found.value.journal
    assert journal is not None and journal.exists()
    report = replay(journal)
    assert report.controller == load(name).__name__
    assert report.violation_step is not None and not report.divergences
    replayed = {v.removeprefix("(recorded by the search) ") for v in report.violations}
    assert replayed & set(found.value.violations)


# Seeds the search must find every broken variant on, each within the profile's budget.
SEEDS = range(BUDGET.seeds)


@pytest.mark.parametrize("number", SEEDS)
@pytest.mark.parametrize("name", RULES_VARIANTS)
def test_hypothesis_finds_the_broken_controller_on_every_seed(name: str, number: int) -> None:
    """Found on some seeds is not found: a variant missed on one seed would pass or fail CI
    by luck once the seed changes (``miss-keeps-streak`` used to be missed on seed 1)."""
    machine = seed(number)(race_search(load(name), searched(name)))
    with pytest.raises(RaceFound):
        run_state_machine_as_test(
            machine, settings=search_settings(BUDGET.mutant_examples, shrink=False)
        )


# The streak bug shows at depth 7 (a failed load cools, a clean sync, a missed one): about
# 50 s of exploring (20558 states).
# Hypothesis proves that one, on every seed; test_search_checks replays its shortest trace.
# The resume variants below need two resumes or a sync and a deadline after one: beyond the
# explorer's scope of one resume; Hypothesis finds them on every seed. A resume at a stale
# epoch is a refusal, and so is an unasked report: the explorer sends none (the search's
# wrong-event rule finds them). Its resume scope has no pins, so no pin the resume drops.
BEYOND_THE_EXPLORER = {
    "resume-unpins-the-past",
    "stale-epoch-resume-accepted",
    "unasked-verification-accepted",
    "miss-keeps-streak",
    "revive-the-abandoned-future",
    "wait-after-resume",
    "late-answer-refused",
}


# Within the explorer's reach, but only after minutes of exploring here: the deep profile
# explores these, CI leaves them to Hypothesis (found on every seed above). A claim ahead
# kept past its deadline shows at depth 6 in the standby world (17 057 states, 65-95 s); a
# resume that keeps the future at depth 6 in the resume world (50 296 states, 250-400 s).
SLOW_TO_EXPLORE = {"claim-ahead-kept-forever", "resume-keeps-the-future"}
EXPLORED_VARIANTS = set(RULES_VARIANTS) - BEYOND_THE_EXPLORER
if PROFILE != "deep":
    EXPLORED_VARIANTS -= SLOW_TO_EXPLORE


@pytest.mark.parametrize("name", sorted(EXPLORED_VARIANTS))
def test_explorer_finds_the_broken_controller_by_depth_8(name: str, tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    result = explore(8, explored(name), rules=load(name), journal_dir=trace_dir)
    assert result.found, f"{name} survived the explorer:\n{result.report()}"
    assert result.trace is not None and result.journal is not None
    # Breadth-first: found at the level it was reached (test_search_checks shows, once, that
    # the level above holds none; run here for every variant it doubled their cost).
    assert len(result.trace) == result.depth
    again = replay(result.journal)
    assert again.violation_step is not None
    # A refusal is the search's own finding: the replay holds it if it answered the same.
    assert {v.removeprefix("(recorded by the search) ") for v in again.violations} & set(
        result.violations
    )
    # The real controller, fed the same events, stays safe.
    assert replay(result.journal, Rules).violation_step is None


# -- a broken hosting: the real rules, a journal that hides what it lost ----------------------

# Hostings whose records hold something else than what the event did: a replay diverges.
RECORDS_DIVERGE = {"compact-record-drops-effects"}


@pytest.mark.parametrize("number", SEEDS)
@pytest.mark.parametrize("name", HOSTINGS)
def test_hypothesis_finds_the_broken_hosting_on_every_seed(
    name: str, number: int, tmp_path: Path
) -> None:
    machine = seed(number)(race_search(host=load(name), journal_dir=tmp_path))
    with pytest.raises(RaceFound) as found:
        run_state_machine_as_test(
            machine, settings=search_settings(BUDGET.mutant_examples, shrink=False)
        )
    assert any("journal" in v for v in found.value.violations), found.value
    journal = found.value.journal
    assert journal is not None and journal.name == f"race-{load(name).__name__}.jsonl"
    report = replay(journal)
    if name in RECORDS_DIVERGE:  # a record that holds less than the event did: replay says so
        assert report.divergences and report.violation_step is None, report
        return
    # The journal the search kept is whole: replayed, it ends on the recorded finding.
    assert not report.divergences
    replayed = {v.removeprefix("(recorded by the search) ") for v in report.violations}
    assert replayed and replayed <= set(found.value.violations)


# The explorer never sends a refusal (no misuse, no duplicate), and its scope with sink
# failures has no pins, so no unpin cancels an export: it cannot see these two.
NOT_EXPLORED = {"journals-accepted-only", "compact-record-drops-effects"}


@pytest.mark.parametrize("name", sorted(set(HOSTINGS) - NOT_EXPLORED))
def test_explorer_finds_the_broken_hosting(name: str) -> None:
    result = explore(6, Scope(sink_failures=True), host=load(name))
    assert result.found, f"{name} survived the explorer:\n{result.report()}"
    assert result.trace is not None and "sink_fails" in result.trace
    real = explore(result.depth, Scope(sink_failures=True))
    assert not real.found, real.report()
