"""The simulator's own checks fire: a refused real completion, an accepted duplicate, a group
left waiting forever. (The world model's checks are shown by the broken variants.)"""

from __future__ import annotations

from recovery_fsm import RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.controller import _Checkpoint
from recovery_fsm.search import Sim


def _walk(sim: Sim, names: list[str]) -> list[str]:
    found: list[str] = []
    for name in names:
        found = sim.step(next(a for a in sim.actions() if str(a) == name))
        if found:
            break
    return found


class RefusesCommits(RecoveryController):
    def _on_export_committed(self, e: ev.ExportCommitted) -> None:
        self._require_checkpoint(e, e.version, set())  # refuses every commit


class IgnoresDuplicateCommits(RecoveryController):
    def _on_export_committed(self, e: ev.ExportCommitted) -> None:
        ck = self._checkpoints.get(e.version)
        if e.version in self._finished or (ck is not None and ck.record.state != "exporting"):
            return  # "idempotent": a repeated commit is silently accepted
        super()._on_export_committed(e)


class ForgetsWaitingGroups(RecoveryController):
    """Neither the export's commit nor the timeout ends a wait."""

    def _on_tick(self, e: ev.Tick) -> None:
        pass

    def _restart_from(self, g: object, ck: _Checkpoint) -> None:
        if getattr(g, "record").state == "awaiting_checkpoint":  # noqa: B009
            return  # the group that waited for this export is never restarted
        super()._restart_from(g, ck)  # type: ignore[arg-type]


def test_a_refused_real_completion_is_a_finding() -> None:
    sim = Sim(controller=RefusesCommits)
    found = _walk(sim, ["export", "commit(0)"])
    assert found and "refused ExportCommitted" in found[0]
    assert sim.records[-1]["finding"] == found  # written for replay


def test_an_accepted_duplicate_is_a_finding_and_a_refused_one_is_not() -> None:
    real = Sim()
    assert _walk(real, ["export", "commit(0)"]) == []
    assert real.duplicate(0) == []
    lax = Sim(controller=IgnoresDuplicateCommits)
    assert _walk(lax, ["export", "commit(0)"]) == []
    found = lax.duplicate(0)
    assert found and "accepted the duplicate" in found[0]


def test_a_group_left_waiting_fails_liveness() -> None:
    sim = Sim(controller=ForgetsWaitingGroups)
    assert _walk(sim, ["fail(g0)"]) == []
    found = sim.settle()
    assert found and "not settled" in found[0] and "g0 is awaiting_checkpoint" in found[0]
    real = Sim()
    assert _walk(real, ["fail(g0)"]) == [] and real.settle() == []
