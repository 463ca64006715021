"""Deliberately broken controllers, one known bug each: the search must find every one.

Each is the real controller with one rule changed the way ad-hoc recovery code gets it
wrong. They bypass the machines' guards by writing a record's state directly, as a flag
would; that is the point of them. Never use them outside tests and benchmarks.
"""

from __future__ import annotations

from .. import effects as fx
from .. import events as ev
from ..controller import Lease, RecoveryController, _Checkpoint, _Group
from .sim import checkpoint_path


class DeleteIgnoringLeases(RecoveryController):
    """Deletes a superseded checkpoint at once, even while a restarting group loads it."""

    def _reap(self, ck: _Checkpoint) -> None:
        if ck.record.state == "superseded" and not ck.record.pinned:
            ck.record.state = "deletable"  # skips the lease guard
            assert ck.record.path is not None
            self._emit(fx.DeleteCheckpoint(ck.record.version, ck.record.path))


class ReadyBeforeCommit(RecoveryController):
    """Publishes the checkpoint's path as ready when the export starts, not when it lands."""

    def _on_export_started(self, e: ev.ExportStarted) -> None:
        super()._on_export_started(e)
        ck = self._checkpoints[e.version]
        ck.record.path = checkpoint_path(e.version)
        ck.record.state = "ready"
        for g in self._awaiting():
            self._restart_from(g, ck)

    def _on_export_committed(self, e: ev.ExportCommitted) -> None:
        ck = self._checkpoints.get(e.version)
        if ck is not None and ck.record.state == "ready":
            return  # already "ready"
        super()._on_export_committed(e)


class LeaseOnSuperseded(RecoveryController):
    """Restarts a failed group from the newest checkpoint on disk when the current one is
    not ready, though that checkpoint holds an older version."""

    def _fail(self, g: _Group) -> None:
        current = self._checkpoints.get(self._fleet.version)
        older = [
            ck
            for v, ck in sorted(self._checkpoints.items())
            if v < self._fleet.version and ck.record.state in {"superseded", "deletable"}
        ]
        if (
            g.recovery.state != "enabled"
            or (current is not None and current.record.state == "ready")
            or not older
            or g.record.restarts >= self.config.restart_budget
        ):
            super()._fail(g)
            return
        ck, r = older[-1], g.record
        self._fire_group(g, "fail")
        r.probe_failures, r.version = 0, None
        r.restarts += 1
        self._lease_seq += 1
        lease = Lease(f"L{self._lease_seq}", r.name, ck.record.version, self._fleet.version)
        self._leases[lease.id] = lease
        ck.record.leases += 1
        r.lease = lease.id
        self._fire_group(g, "load")
        assert ck.record.path is not None
        self._emit(fx.RestartFromCheckpoint(r.name, lease.version, ck.record.path, lease.id))


class ReadmitStale(RecoveryController):
    """Assumes a restarted group loaded the latest weights, and readmits it, though the
    fleet moved on while it was loading."""

    def _on_restart_loaded(self, e: ev.RestartLoaded) -> None:
        g, lease = self._require_lease(e)
        self._release(lease.id)
        if g.record.state == "stopped":
            return
        g.record.version = self._fleet.version  # should be lease.version
        self._fire_group(g, "admit")
        self._emit(fx.ReadmitGroup(g.record.name, self._fleet.version))


class DisableOnSlowExport(RecoveryController):
    """Turns immediate recovery off for good after one export missed its sync."""

    def _count_sync(self, g: _Group, missed: bool) -> None:
        if missed and g.recovery.state != "disabled":
            self._fire(g.recovery_machine, f"recovery:{g.record.name}", "disable")
            return
        super()._count_sync(g, missed)


class DoubleRelease(RecoveryController):
    """On a failed load, gives the checkpoint's lease back by hand and then releases the
    lease as well: the count drops below the loads still running."""

    def _on_restart_load_failed(self, e: ev.RestartLoadFailed) -> None:
        _, lease = self._require_lease(e)
        self._checkpoints[lease.version].record.leases -= 1
        super()._on_restart_load_failed(e)


class ForgetCancel(RecoveryController):
    """On a new sync, marks the running export stale but never asks the exporter to stop."""

    def _cancel_abandoned(self, ck: _Checkpoint) -> None:
        pass


MUTANTS: dict[str, type[RecoveryController]] = {
    "delete-ignoring-leases": DeleteIgnoringLeases,
    "ready-before-commit": ReadyBeforeCommit,
    "lease-on-superseded": LeaseOnSuperseded,
    "readmit-stale": ReadmitStale,
    "disable-on-slow-export": DisableOnSlowExport,
    "double-release": DoubleRelease,
    "forget-cancel": ForgetCancel,
}
