"""The simulator's own checks fire: a refused real completion, an accepted duplicate, a group
left waiting forever, a journal with a gap nobody marked. (The world model's checks are shown
by the broken variants.)"""

from __future__ import annotations

from typing import Any

import attrs
from variants import load

from recovery_fsm import RecoveryController, Rules
from recovery_fsm import events as ev
from recovery_fsm.search import Scope, Sim
from recovery_fsm.search.explorer import explore
from recovery_fsm.search.stateful import small_resume
from recovery_fsm.state import CheckpointSlot, GroupSlot


def _walk(sim: Sim, names: list[str]) -> list[str]:
    found: list[str] = []
    for name in names:
        found = sim.step(next(a for a in sim.actions() if str(a) == name))
        if found:
            break
    return found


class RefusesCommits(Rules):
    def check_ExportCommitted(self, e: ev.ExportCommitted) -> CheckpointSlot:
        return self._require_checkpoint(e, e.version, states=frozenset())  # refuses every one


class IgnoresDuplicateCommits(Rules):
    def check_ExportCommitted(self, e: ev.ExportCommitted) -> Any:
        ck = self.checkpoints.get(e.version)
        if e.version in self.finished or (ck is not None and ck.record.state != "exporting"):
            return None  # "idempotent": a repeated commit is silently accepted
        return super().check_ExportCommitted(e)

    def on_ExportCommitted(self, e: ev.ExportCommitted, ck: Any) -> None:
        if ck is not None:
            super().on_ExportCommitted(e, ck)


class ForgetsWaitingGroups(Rules):
    """Neither the export's commit nor the timeout ends a wait."""

    def on_Tick(self, e: ev.Tick, _: None) -> None:
        pass

    def _restart_from(self, g: GroupSlot, ck: CheckpointSlot) -> None:
        if g.record.state == "awaiting_checkpoint":
            return  # the group that waited for this export is never restarted
        super()._restart_from(g, ck)


def test_a_refused_real_completion_is_a_finding() -> None:
    sim = Sim(rules=RefusesCommits)
    found = _walk(sim, ["export", "commit(0)"])
    assert found and "refused ExportCommitted" in found[0]
    assert sim.records[-1]["finding"] == found  # written for replay


def test_an_accepted_duplicate_is_a_finding_and_a_refused_one_is_not() -> None:
    real = Sim()
    assert _walk(real, ["export", "commit(0)"]) == []
    assert real.duplicate(0) == []
    lax = Sim(rules=IgnoresDuplicateCommits)
    assert _walk(lax, ["export", "commit(0)"]) == []
    found = lax.duplicate(0)
    assert found and "which it must refuse" in found[0]


def test_misdirected_and_unasked_reports_are_refused_and_caught_when_accepted() -> None:
    """g0 restarts from C(0): its load owes a report. A verification answer sent to it is
    misdirected; a report about g1, which owes none, is unasked."""
    steps = ["export", "commit(0)", "fail(g0)"]
    real = Sim()
    assert _walk(real, steps) == []
    for misdirected in (True, False):
        assert all(real.wrong_report(i, misdirected=misdirected) == [] for i in range(40))
    assert "wrong(GroupVerified)" in real.trace and "wrong(StandbyLoaded)" in real.trace
    lax = Sim(rules=load("unasked-verification-accepted"))
    assert _walk(lax, steps) == []
    found = [f for i in range(40) for f in lax.wrong_report(i, misdirected=True)]
    assert any("GroupVerified" in f and "which it must refuse" in f for f in found)
    assert any("answered a verification nobody asked for" in f for f in found)


class SyncsAfterShutdown(Rules):
    def _require_open(self, e: ev.Event) -> None:
        pass  # forgets that Shutdown closed it


def test_misuse_is_refused_by_the_real_rules_and_caught_when_accepted() -> None:
    real = Sim()
    assert _walk(real, ["shutdown"]) == []
    assert all(real.misuse(i) == [] for i in range(8))
    lax = Sim(rules=SyncsAfterShutdown)
    assert _walk(lax, ["shutdown"]) == []
    found = [f for i in range(8) for f in lax.misuse(i)]
    assert found and all("which it must refuse" in f for f in found)


def test_a_group_left_waiting_is_a_finding() -> None:
    """The world restates the deadline: a wait past it is flagged at the tick that should
    have ended it; a commit that wakes nobody is flagged when it lands."""
    sim = Sim(rules=ForgetsWaitingGroups)
    assert _walk(sim, ["sync", "fail(g0)"]) == []
    found = _walk(sim, ["tick(10.0)"])
    assert found and "g0 waits for a checkpoint 10 s, past its 10 s" in found[0]
    woken = Sim(rules=ForgetsWaitingGroups)
    found = _walk(woken, ["sync", "fail(g0)", "export", "commit(1)"])
    assert found and "still waits though C(1) is committed" in found[0]
    real = Sim()
    assert _walk(real, ["sync", "fail(g0)", "tick(9.0)"]) == []
    assert real.controller.group_state("g0") == "awaiting_checkpoint"
    assert _walk(real, ["tick(1.0)"]) == [] and real.settle() == []


def test_a_wrong_clean_sync_streak_is_a_finding_at_the_sync_that_got_it_wrong() -> None:
    """A missed export while cooling down must restart the count: the world sees the count
    itself, so the bug shows at the miss, not several syncs later at an early re-enable."""
    steps = ["export", "commit(0)", "fail(g0)", "load_fails(g0#2)", "sync", "export", "sync"]
    assert _walk(Sim(), steps) == []
    sim = Sim(rules=load("miss-keeps-streak"))
    found = _walk(sim, steps)
    assert found == ["immediate recovery of g0 counts 1 clean syncs in a row, expected 0"]
    assert len(sim.trace) == len(steps)  # at the last sync, the miss


def test_settle_says_which_way_each_group_came_back() -> None:
    sim = Sim()
    steps = ["export", "commit(0)", "fail(g0)", "sync", "export", "export_fails(1)", "fail(g1)"]
    assert _walk(sim, steps) == []
    assert sim.settle() == []
    assert sim.outcomes() == {
        "g0": "active as #2 (immediate restart)",
        "g1": "active as #2 (cold restart)",
    }


def test_a_failing_sink_loses_no_effect() -> None:
    """The sink raises on the record of a restart: the restart still happens."""
    sim = Sim(Scope(sink_failures=True))
    assert _walk(sim, ["export", "commit(0)", "sink_fails", "fail(g0)"]) == []
    assert sim.controller.journal_failures == 1
    assert sim.world.procs["g0"].status == "loading"
    assert sim.settle() == []


# -- the journal: a gap only where the sink failed, and marked ("lost") in the next record ----


def test_consecutive_sink_failures_are_marked_and_are_no_finding() -> None:
    sim = Sim(Scope(sink_failures=True))
    steps = ["export", "sink_fails", "commit(0)", "sink_fails", "fail(g0)", "loaded(g0#2)"]
    assert _walk(sim, steps) == []
    assert sim.controller.journal_failures == 2
    # The simulator keeps every record (for replay), marker stripped; none is missing.
    assert [r["step"] for r in sim.records] == list(range(len(sim.records)))
    assert sim.settle() == []


def test_a_gap_nobody_marked_is_a_finding() -> None:
    sim = Sim(Scope(sink_failures=True), host=load("forgets-lost-marker"))
    found = _walk(sim, ["export", "commit(0)", "sink_fails", "fail(g0)", "loaded(g0#2)"])
    assert found == ["journal record 6 says 0 records before it were lost; the sink failed on 1"]
    assert sim.records[-1]["finding"] == found  # written for replay


def test_an_uncounted_sink_failure_is_a_finding() -> None:
    sim = Sim(Scope(sink_failures=True), host=load("swallows-sink-errors"))
    found = _walk(sim, ["export", "sink_fails", "commit(0)"])
    assert found == ["the controller counts 0 journal failures; the sink failed 1 times"]


class MarksLossesThatNeverHappened(RecoveryController):
    """Marks a Tick's record as following a lost one, though the sink lost nothing."""

    def _write_journal(self, record: dict[str, Any]) -> None:
        if record.get("event", {}).get("kind") == "Tick":
            self._unjournaled = 1
        super()._write_journal(record)


def test_a_marker_without_a_sink_failure_is_a_finding() -> None:
    sim = Sim(host=MarksLossesThatNeverHappened)
    found = _walk(sim, ["sync", "fail(g0)", "tick(10.0)"])
    assert found == ["journal record 5 says 1 records before it were lost; the sink failed on 0"]


class SkipsTickNumbers(RecoveryController):
    """Numbers a Tick's record one past its step, as if a record before it had gone."""

    def _write_journal(self, record: dict[str, Any]) -> None:
        if record.get("event", {}).get("kind") == "Tick":
            record = {**record, "step": record["step"] + 1}
        super()._write_journal(record)


def test_a_record_missing_from_the_numbering_is_a_finding() -> None:
    sim = Sim(host=SkipsTickNumbers)
    found = _walk(sim, ["sync", "fail(g0)", "tick(10.0)"])
    assert found and "journal record 6 came where record 5 was due" in found[0]


def test_a_refusal_left_out_of_the_journal_is_a_finding() -> None:
    real = Sim()
    assert real.misuse(0) == []
    assert real.records[-1]["error"]["type"] == "EventNotAllowed"
    lax = Sim(host=load("journals-accepted-only"))
    found = lax.misuse(0)
    assert found and "left 0 journal records, not one" in found[0]


def test_a_version_exported_again_after_a_resume_owes_its_own_delete_not_a_duplicate() -> None:
    # The abandoned future's C(1) is deleted after the resume; the new run exports 1 again
    # and its sync to 2 asks that C(1)'s delete: CheckpointDeleted(1) is owed, not repeated.
    # (A fresh clone's random search took it for an accepted duplicate.)
    sim = Sim(scope=attrs.evolve(small_resume(), resumes=2))
    steps = [
        "export",
        "commit(0)",
        "sync",
        "export",
        "commit(1)",
        "resume(0)",
        "deleted(1)",
        "verified(g0)",
        "standby_verified(standby-1)",
        "sync",
        "export",
        "commit(1)",
        "sync",
    ]
    assert _walk(sim, steps) == []
    assert not [d for d in sim.delivered if isinstance(d, ev.CheckpointDeleted)]
    assert all(sim.fork().duplicate(i) == [] for i in range(len(sim.delivered)))


def test_the_explorer_reports_a_shortest_counterexample() -> None:
    """Breadth-first with states merged by key: what it finds at depth d, no search of depth
    d - 1 finds (the broken-variant tests rely on this rather than exploring twice)."""
    broken = load("delete-ignoring-leases")
    found = explore(8, Scope(), rules=broken)
    assert found.found and found.trace is not None and len(found.trace) == found.depth > 1
    shallower = explore(found.depth - 1, Scope(), rules=broken)
    assert not shallower.found and shallower.depth == found.depth - 1
