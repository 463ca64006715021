"""Deliberately broken rules, one known bug each: the search must find every one.

Each is the real ``Rules`` with one rule changed the way ad-hoc recovery code gets it
wrong. Some bypass the machines' guards by writing a record's state directly, as a flag
would; that is the point of them. ``HOSTING_MUTANTS`` break the hosting instead (the
controller's journal) with the real rules inside. Never use them outside tests and
benchmarks.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from .. import effects as fx
from .. import events as ev
from ..config import RecoveryConfig
from ..controller import RecoveryController
from ..rules import Rules
from ..state import CheckpointSlot, GroupSlot, Lease, Start
from .sim import checkpoint_path


class DeleteIgnoringLeases(Rules):
    """Deletes a superseded checkpoint at once, even while a restarting group loads it."""

    def _reap(self, ck: CheckpointSlot) -> None:
        if ck.record.state == "superseded" and not ck.record.pinned:
            ck.record.state = "deletable"  # skips the lease guard
            assert ck.record.path is not None
            self._emit(fx.DeleteCheckpoint(ck.record.version, ck.record.path))


class ReadyBeforeCommit(Rules):
    """Publishes the checkpoint's path as ready when the export starts, not when it lands."""

    def on_ExportStarted(self, e: ev.ExportStarted) -> None:
        super().on_ExportStarted(e)
        ck = self.checkpoints[e.version]
        ck.record.path = checkpoint_path(e.version)
        ck.record.state = "ready"
        for g in self._awaiting():
            self._restart_from(g, ck)

    def on_ExportCommitted(self, e: ev.ExportCommitted) -> None:
        ck = self.checkpoints.get(e.version)
        if ck is not None and ck.record.state == "ready":
            return  # already "ready"
        super().on_ExportCommitted(e)


class LeaseOnSuperseded(Rules):
    """Restarts a failed group from the newest checkpoint on disk when the current one is
    not ready, though that checkpoint holds an older version."""

    def _fail(self, g: GroupSlot, kill: str | None = None) -> None:
        current = self.checkpoints.get(self.fleet.version)
        older = [
            ck
            for v, ck in sorted(self.checkpoints.items())
            if v < self.fleet.version and ck.record.state in {"superseded", "deletable"}
        ]
        if (
            g.recovery.state != "enabled"
            or (current is not None and current.record.state == "ready")
            or not older
            or g.record.restarts >= self.config.restart_budget
        ):
            super()._fail(g, kill)
            return
        ck = older[-1]
        self._fire_group(g, "fail")
        if kill is not None:
            self._emit(fx.StopGroup(g.record.name, g.record.incarnation, kill))
        g.record.probe_failures, g.record.version = 0, None
        g.record.restarts += 1
        r = self._next_incarnation(g)
        lease = Lease(r.name, r.incarnation, ck.record.version, self.fleet.version)
        self.starts[(r.name, r.incarnation)] = Start("load", lease)
        ck.record.leases += 1
        self._fire_group(g, "load")
        assert ck.record.path is not None
        self._emit(fx.RestartFromCheckpoint(r.name, r.incarnation, lease.version, ck.record.path))


class ReadmitStale(Rules):
    """Assumes a restarted group loaded the latest weights, and readmits it, though the
    fleet moved on while it was loading."""

    def on_RestartLoaded(self, e: ev.RestartLoaded) -> None:
        g = self._current(e, frozenset({"loading"}))
        if g is None:
            return
        self._end_start(g)
        g.record.version = self.fleet.version  # should be the lease's version
        self._fire_group(g, "admit")


class DisableOnSlowExport(Rules):
    """Turns immediate recovery off for good after one export missed its sync."""

    def _count_sync(self, g: GroupSlot, missed: bool) -> None:
        if missed and g.recovery.state != "disabled":
            self._fire(g.recovery_machine, f"recovery:{g.record.name}", "disable")
            return
        super()._count_sync(g, missed)


class DoubleRelease(Rules):
    """On a failed load, gives the checkpoint's lease back by hand and then releases the
    lease as well: the count drops below the loads still running."""

    def on_RestartLoadFailed(self, e: ev.RestartLoadFailed) -> None:
        start = self.starts.get((e.group, e.incarnation))
        if start is not None and start.lease is not None:
            self.checkpoints[start.lease.version].record.leases -= 1
        super().on_RestartLoadFailed(e)


class ForgetCancel(Rules):
    """On a new sync, marks the running export stale but never asks the exporter to stop."""

    def _emit(self, effect: fx.Effect) -> None:
        if not isinstance(effect, fx.CancelExport):
            super()._emit(effect)


class CountOldIncarnation(Rules):
    """Trusts a sync's group names and ignores which process got the weights: a group
    restarted since is marked as holding them."""

    def on_WeightsSynced(self, e: ev.WeightsSynced) -> None:
        current = {n: self.groups[n].record.incarnation for n in e.groups if n in self.groups}
        super().on_WeightsSynced(attrs.evolve(e, groups={**e.groups, **current}))


class DemoteSilently(Rules):
    """Demotes a group left out of a sync without telling the router."""

    def _fire_group(self, g: GroupSlot, event: str) -> None:
        if event == "demote":
            self._fire(g.machine, f"group:{g.record.name}", event)
        else:
            super()._fire_group(g, event)


class NoLoadDeadline(Rules):
    """Never gives up on a load: a hung loader keeps its group down for ever."""

    def __init__(self, config: RecoveryConfig, initial_version: int) -> None:
        super().__init__(attrs.evolve(config, load_timeout_s=math.inf), initial_version)


class MissKeepsStreak(Rules):
    """A missed export while already cooling down does not restart the clean-sync count."""

    def _cool(self, g: GroupSlot) -> None:
        if g.recovery.state == "enabled":
            super()._cool(g)


class NoCatchUp(Rules):
    """A process that came up with older weights waits for the next sync, though the
    current checkpoint is ready (the group idles up to a whole step)."""

    def _catch_up(self, g: GroupSlot) -> None:
        pass


class CatchUpWhileCooling(Rules):
    """Loads the current checkpoint in place even while immediate recovery cools down."""

    def _catch_up(self, g: GroupSlot) -> None:
        state = g.recovery.state
        g.recovery.state = "enabled"  # a flag read instead of the switch
        try:
            super()._catch_up(g)
        finally:
            g.recovery.state = state


MUTANTS: dict[str, type[Rules]] = {
    "delete-ignoring-leases": DeleteIgnoringLeases,
    "ready-before-commit": ReadyBeforeCommit,
    "lease-on-superseded": LeaseOnSuperseded,
    "readmit-stale": ReadmitStale,
    "disable-on-slow-export": DisableOnSlowExport,
    "double-release": DoubleRelease,
    "forget-cancel": ForgetCancel,
    "count-old-incarnation": CountOldIncarnation,
    "demote-silently": DemoteSilently,
    "no-load-deadline": NoLoadDeadline,
    "miss-keeps-streak": MissKeepsStreak,
    "no-catch-up": NoCatchUp,
    "catch-up-while-cooling": CatchUpWhileCooling,
}


# -- broken hosting: the real rules, a journal that hides what it lost ------------------------


class ForgetsLostMarker(RecoveryController):
    """Counts a record its journal sink failed on, but never marks the next record: the
    journal reads as complete, and a replay rebuilds a state that never was."""

    def _write_journal(self, record: dict[str, Any]) -> None:
        self._unjournaled = 0
        super()._write_journal(record)


class SwallowsSinkErrors(RecoveryController):
    """Treats a journal sink's failure as nothing happened: neither counted nor marked."""

    def _write_journal(self, record: dict[str, Any]) -> None:
        super()._write_journal(record)
        self._journal_failures = self._unjournaled = 0


class JournalsAcceptedOnly(RecoveryController):
    """Journals accepted events only: a refusal leaves no record, so a replay cannot tell a
    refused report from one never sent."""

    def _refused(self, event: Any, err: BaseException, *, broke: bool = False) -> None:
        if broke:
            super()._refused(event, err, broke=broke)


HOSTING_MUTANTS: dict[str, type[RecoveryController]] = {
    "forgets-lost-marker": ForgetsLostMarker,
    "swallows-sink-errors": SwallowsSinkErrors,
    "journals-accepted-only": JournalsAcceptedOnly,
}
