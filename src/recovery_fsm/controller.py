"""The recovery controller: every transition rule in one place, events in, effects out.

Sans-I/O in the manner of h11: the controller reads no clock, touches no file and starts no
thread. ``handle(event)`` validates the event completely, and only then moves machines and
returns the effects an adapter must execute. A rejected event raises a typed error and leaves
every machine, counter and lease as it was.

python-statemachine is not safe to drive from several threads, so the controller owns every
machine and runs each event to completion under one lock.

Reading order: ``handle`` dispatches to one ``_on_<Event>`` method per event type. Each one
first checks (``_require_*`` helpers, no mutation), then applies (``_fire`` and bookkeeping).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
from statemachine import StateMachine

from . import effects as fx
from . import events as ev
from .errors import (
    EventNotAllowed,
    InvariantViolation,
    LeaseError,
    MalformedEvent,
    UnknownGroup,
    UnknownVersion,
)
from .invariants import violations
from .journal import encode
from .machines import (
    CheckpointMachine,
    CheckpointRecord,
    Fleet,
    GroupRecord,
    ImmediateRecoveryMachine,
    RecoveryRecord,
    WorkerGroupMachine,
)

JournalSink = Callable[[dict[str, Any]], None]

# Group states in which the group is up and may receive weights.
_UP = frozenset({"active", "suspect", "pending_weights"})
_SERVING = frozenset({"active", "suspect"})
_FINAL_GROUP = frozenset({"retired", "stopped"})
# Checkpoint states whose files are complete on disk.
_COMMITTED = frozenset({"ready", "superseded", "deletable"})


def _positive_int(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise MalformedEvent(f"{attr.name} must be an int >= 1, got {value!r}")


def _non_negative(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MalformedEvent(f"{attr.name} must be a number >= 0, got {value!r}")


@attrs.frozen
class RecoveryConfig:
    """Knobs. Defaults follow what xtuner and NeMo-RL ship (3 probes, 5 restarts)."""

    immediate_recovery: bool = True
    clean_syncs_to_reenable: int = attrs.field(default=3, validator=_positive_int)
    suspect_threshold: int = attrs.field(default=3, validator=_positive_int)
    restart_budget: int = attrs.field(default=5, validator=_positive_int)
    # A failed group waits this long for the current version's export before going cold.
    await_checkpoint_timeout_s: float = attrs.field(default=300.0, validator=_non_negative)
    # The trainer exports after every sync: a group failing between the sync and the
    # export's start waits for it instead of going cold.
    export_every_sync: bool = True


@attrs.frozen
class Lease:
    id: str
    group: str
    version: int
    # The fleet version when the lease was granted; equals ``version`` by rule.
    granted_at_version: int


@attrs.define(eq=False)
class _Checkpoint:
    record: CheckpointRecord
    machine: CheckpointMachine


@attrs.define(eq=False)
class _Group:
    record: GroupRecord
    machine: WorkerGroupMachine
    recovery: RecoveryRecord
    recovery_machine: ImmediateRecoveryMachine


class RecoveryController:
    """Owns every machine; the single entry point is :meth:`handle`."""

    def __init__(
        self,
        config: RecoveryConfig | None = None,
        *,
        initial_version: int = 0,
        journal: JournalSink | None = None,
    ) -> None:
        if type(initial_version) is not int or initial_version < 0:
            raise MalformedEvent(f"initial_version must be an int >= 0, got {initial_version!r}")
        self.config = config if config is not None else RecoveryConfig()
        self._lock = threading.Lock()
        self._journal = journal
        self._fleet = Fleet(initial_version)
        self._now: float | None = None
        self._closed = False
        self._steps = 0
        self._checkpoints: dict[int, _Checkpoint] = {}
        # Versions whose checkpoint reached a final state, with that state.
        self._finished: dict[int, str] = {}
        self._groups: dict[str, _Group] = {}
        self._leases: dict[str, Lease] = {}
        self._released: set[str] = set()
        self._lease_seq = 0
        # Filled while one event runs; reset at the start of each.
        self._effects: list[fx.Effect] = []
        self._current_at = 0.0
        self._transitions: list[tuple[str, str, str, str]] = []
        self._handlers = self._handler_table()
        if journal is not None:
            journal(self._journal_header())

    def _handler_table(self) -> dict[type[ev.Event], Callable[[Any], None]]:
        return {
            ev.WeightsSynced: self._on_weights_synced,
            ev.ExportStarted: self._on_export_started,
            ev.ExportCommitted: self._on_export_committed,
            ev.ExportFailed: self._on_export_failed,
            ev.ExportCancelled: self._on_export_cancelled,
            ev.CheckpointPinned: self._on_checkpoint_pinned,
            ev.CheckpointDeleted: self._on_checkpoint_deleted,
            ev.Shutdown: self._on_shutdown,
            ev.Tick: self._on_tick,
            ev.GroupRegistered: self._on_group_registered,
            ev.ProbeFailed: self._on_probe_failed,
            ev.ProbeOk: self._on_probe_ok,
            ev.GroupFailed: self._on_group_failed,
            ev.RestartLoaded: self._on_restart_loaded,
            ev.RestartLoadFailed: self._on_restart_load_failed,
            ev.Relaunched: self._on_relaunched,
            ev.RelaunchFailed: self._on_relaunch_failed,
        }

    # -- public API ------------------------------------------------------------------------

    def handle(self, event: ev.Event) -> tuple[fx.Effect, ...]:
        """Apply one event, run to completion, and return the effects to execute."""
        with self._lock:
            handler = self._handlers.get(type(event))
            try:
                if handler is None:
                    raise MalformedEvent(
                        f"expected one of the recovery_fsm events, got {type(event).__name__}"
                    )
                at = event.at
                if self._now is not None and at < self._now:
                    raise MalformedEvent(
                        f"time went backwards: event at {at} after an event at {self._now}"
                    )
                self._effects = []
                self._transitions = []
                self._current_at = at
                handler(event)
            except Exception as err:
                # Refusals, and internal bugs too: the journal must show the event that
                # broke the controller, or a replay would stop short of it.
                self._steps += 1
                if self._journal is not None:
                    self._write_journal(event, error=err)
                raise
            self._now = at
            self._steps += 1
            effects = tuple(self._effects)
            if self._journal is not None:
                self._write_journal(event, effects=effects)
            return effects

    def fork(self, *, journal: JournalSink | None = None) -> RecoveryController:
        """An independent copy of the whole state, writing to ``journal`` (not to this
        controller's): explorers branch on it to try every next event from one state."""
        with self._lock:
            twin = copy.deepcopy(self)
        twin._journal = journal
        return twin

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_handlers"]
        state["_journal"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._handlers = self._handler_table()

    @property
    def version(self) -> int:
        """The weight version the fleet serves."""
        return self._fleet.version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def last_transitions(self) -> tuple[tuple[str, str, str, str], ...]:
        """(machine, event, source, target) of every transition the last event caused."""
        return tuple(self._transitions)

    def group_state(self, group: str) -> str:
        return str(self._require_group(group).record.state)

    def recovery_state(self, group: str) -> str:
        return str(self._require_group(group).recovery.state)

    def checkpoint_state(self, version: int) -> str:
        with self._lock:
            if version in self._checkpoints:
                return str(self._checkpoints[version].record.state)
            if version in self._finished:
                return self._finished[version]
        raise UnknownVersion(f"no checkpoint of version {version}")

    @property
    def leases(self) -> dict[str, Lease]:
        return dict(self._leases)

    @property
    def drained(self) -> bool:
        """Shut down with nothing outstanding: no export running, no lease, no delete owed."""
        with self._lock:
            return self._closed and self._quiescent()

    def snapshot(self) -> dict[str, Any]:
        """Every piece of mutable state, as plain data; equal snapshots mean equal controllers."""
        with self._lock:
            return {
                "version": self._fleet.version,
                "now": self._now,
                "closed": self._closed,
                "lease_seq": self._lease_seq,
                "checkpoints": {
                    v: attrs.asdict(c.record) for v, c in sorted(self._checkpoints.items())
                },
                "finished": dict(sorted(self._finished.items())),
                "groups": {
                    name: {
                        **attrs.asdict(g.record, filter=lambda a, _v: a.name != "fleet"),
                        "recovery": attrs.asdict(g.recovery),
                        "machine": g.machine.current_state_value,
                        "recovery_machine": g.recovery_machine.current_state_value,
                    }
                    for name, g in sorted(self._groups.items())
                },
                "leases": {k: attrs.asdict(v) for k, v in sorted(self._leases.items())},
                "released": sorted(self._released),
            }

    def check_invariants(self) -> list[str]:
        """The safety rules; returns every one that does not hold (empty: all hold)."""
        with self._lock:
            return violations(self)

    def assert_invariants(self) -> None:
        found = self.check_invariants()
        if found:
            raise InvariantViolation(found)

    # -- event handlers: trainer -----------------------------------------------------------

    def _on_weights_synced(self, e: ev.WeightsSynced) -> None:
        self._require_open(e)
        if e.version <= self._fleet.version:
            raise EventNotAllowed(
                f"WeightsSynced must move to a version above {self._fleet.version}, got {e.version}"
            )
        for name in e.groups:
            self._require_group(name)

        old = self._fleet.version
        clean, missed = self._classify_sync(old)
        self._fleet.version = e.version

        self._make_checkpoints_stale()

        if clean or missed:
            for g in self._groups.values():
                self._count_sync(g, missed)

        for g in self._groups.values():
            r = g.record
            if r.state in _UP:
                if r.name in e.groups:
                    r.version = e.version
                    if r.state == "pending_weights":
                        self._fire_group(g, "admit")
                        self._emit(fx.ReadmitGroup(r.name, e.version))
                elif r.state in _SERVING:
                    self._fire_group(g, "demote")
            elif r.state == "awaiting_checkpoint":
                # It waited for the old version's export; that checkpoint is stale now.
                self._relaunch(g)

    def _count_sync(self, g: _Group, missed: bool) -> None:
        """A missed export cools immediate recovery down; N clean syncs in a row end it."""
        rec = g.recovery
        if missed:
            self._cool(g)
        elif rec.state == "cooldown":
            rec.clean_streak += 1
            if rec.cooled_down:
                self._fire(g.recovery_machine, f"recovery:{rec.group}", "reenable")
                rec.clean_streak = 0

    def _classify_sync(self, old: int) -> tuple[bool, bool]:
        """(clean, missed) for the sync that leaves version ``old``."""
        ck = self._checkpoints.get(old)
        state = ck.record.state if ck is not None else self._finished.get(old)
        if state is None:
            return False, False  # no export of that version: neither clean nor missed
        if state in _COMMITTED or state == "deleted":
            return True, False
        return False, True

    def _on_export_started(self, e: ev.ExportStarted) -> None:
        self._require_open(e)
        if e.version != self._fleet.version:
            raise UnknownVersion(
                f"ExportStarted for version {e.version}, but the fleet serves "
                f"{self._fleet.version}: only the current version is exported"
            )
        if e.version in self._checkpoints or e.version in self._finished:
            raise EventNotAllowed(f"an export of version {e.version} was already started")
        running = [v for v, c in self._checkpoints.items() if c.record.state == "exporting"]
        if running:
            raise EventNotAllowed(f"export of version {running[0]} still in flight")

        record = CheckpointRecord(e.version, pinned=e.pinned)
        self._checkpoints[e.version] = _Checkpoint(record, CheckpointMachine(model=record))
        self._transitions.append((f"checkpoint:{e.version}", "create", "", "exporting"))

    def _on_export_committed(self, e: ev.ExportCommitted) -> None:
        ck = self._require_checkpoint(e, e.version, {"exporting", "abandoned"})

        ck.record.path = e.path
        self._fire_ck(ck, "commit")
        if ck.record.state == "deletable":
            self._emit(fx.DeleteCheckpoint(e.version, e.path))
        elif ck.record.state == "ready":
            for g in self._awaiting():
                self._restart_from(g, ck)

    def _on_export_failed(self, e: ev.ExportFailed) -> None:
        ck = self._require_checkpoint(e, e.version, {"exporting", "abandoned"})
        self._end_export(ck, "fail")

    def _on_export_cancelled(self, e: ev.ExportCancelled) -> None:
        ck = self._require_checkpoint(e, e.version, {"exporting", "abandoned"})
        self._end_export(ck, "cancel")

    def _end_export(self, ck: _Checkpoint, event: str) -> None:
        was_current = ck.record.state == "exporting"
        self._fire_ck(ck, event)
        self._forget(ck)
        if was_current:
            for g in self._awaiting():
                self._relaunch(g)

    def _on_checkpoint_pinned(self, e: ev.CheckpointPinned) -> None:
        ck = self._require_checkpoint(
            e, e.version, {"exporting", "ready", "superseded", "abandoned"}
        )
        ck.record.pinned = True

    def _on_checkpoint_deleted(self, e: ev.CheckpointDeleted) -> None:
        ck = self._require_checkpoint(e, e.version, {"deletable"})
        self._fire_ck(ck, "remove")
        self._forget(ck)

    def _on_shutdown(self, e: ev.Shutdown) -> None:
        self._require_open(e)
        self._closed = True
        for g in self._groups.values():
            if g.record.state not in _FINAL_GROUP:
                self._fire_group(g, "stop")
                g.record.awaiting_since = None
                self._emit(fx.StopGroup(g.record.name))
        self._make_checkpoints_stale()

    def _on_tick(self, e: ev.Tick) -> None:
        deadline = e.at - self.config.await_checkpoint_timeout_s
        for g in self._awaiting():
            since = g.record.awaiting_since
            if since is not None and since <= deadline:
                self._relaunch(g)

    # -- event handlers: health manager and runtime ------------------------------------------

    def _on_group_registered(self, e: ev.GroupRegistered) -> None:
        self._require_open(e)
        if e.group in self._groups:
            raise EventNotAllowed(f"group {e.group!r} is already registered")
        if e.version > self._fleet.version:
            raise UnknownVersion(
                f"group {e.group!r} claims version {e.version}, "
                f"but the fleet has only reached {self._fleet.version}"
            )

        record = GroupRecord(e.group, self._fleet, e.version)
        start = "active" if e.version == self._fleet.version else "pending_weights"
        machine = WorkerGroupMachine(model=record, start_value=start)
        recovery = RecoveryRecord(e.group, self.config.clean_syncs_to_reenable)
        recovery_machine = ImmediateRecoveryMachine(
            model=recovery,
            start_value="enabled" if self.config.immediate_recovery else "disabled",
        )
        self._groups[e.group] = _Group(record, machine, recovery, recovery_machine)
        self._transitions.append((f"group:{e.group}", "create", "", start))

    def _on_probe_failed(self, e: ev.ProbeFailed) -> None:
        g = self._require_group_in(e, e.group, _SERVING)

        r = g.record
        r.probe_failures += 1
        if r.probe_failures >= self.config.suspect_threshold:
            self._fail(g)
        elif r.state == "active":
            self._fire_group(g, "probe_failed")

    def _on_probe_ok(self, e: ev.ProbeOk) -> None:
        g = self._require_group_in(e, e.group, _SERVING)

        g.record.probe_failures = 0
        if g.record.state == "suspect":
            self._fire_group(g, "probe_ok")

    def _on_group_failed(self, e: ev.GroupFailed) -> None:
        g = self._require_group_in(
            e, e.group, {"active", "suspect", "pending_weights", "loading", "relaunching"}
        )

        if g.record.state == "loading":
            # The process that read the checkpoint is gone: its lease ends with it.
            self._release(g.record.lease)  # type: ignore[arg-type]
        self._fail(g)

    def _on_restart_loaded(self, e: ev.RestartLoaded) -> None:
        g, lease = self._require_lease(e)

        self._release(lease.id)
        if g.record.state == "stopped":
            return
        g.record.version = lease.version
        if g.record.serves_current:
            self._fire_group(g, "admit")
            self._emit(fx.ReadmitGroup(g.record.name, lease.version))
        else:
            self._fire_group(g, "loaded_stale")

    def _on_restart_load_failed(self, e: ev.RestartLoadFailed) -> None:
        g, lease = self._require_lease(e)

        self._release(lease.id)
        if g.record.state == "stopped":
            return
        self._cool(g)
        self._fail(g)

    def _on_relaunched(self, e: ev.Relaunched) -> None:
        g = self._require_group_in(e, e.group, {"relaunching"})

        g.record.version = None
        self._fire_group(g, "relaunched")

    def _on_relaunch_failed(self, e: ev.RelaunchFailed) -> None:
        g = self._require_group_in(e, e.group, {"relaunching"})
        self._fail(g)

    # -- recovery rules ----------------------------------------------------------------------

    def _fail(self, g: _Group) -> None:
        """The group is down: choose retire, immediate restart, wait, or cold restart."""
        r = g.record
        self._fire_group(g, "fail")
        r.probe_failures = 0
        r.version = None
        if r.restarts >= self.config.restart_budget:
            self._fire_group(g, "retire")
            self._emit(fx.RetireGroup(r.name))
            return
        r.restarts += 1
        if g.recovery.state != "enabled":
            self._relaunch(g)
            return
        current = self._checkpoints.get(self._fleet.version)
        if current is not None and current.record.state == "ready":
            self._restart_from(g, current)
        elif (current is not None and current.record.state == "exporting") or (
            current is None
            and self.config.export_every_sync
            and self._fleet.version not in self._finished
        ):
            self._fire_group(g, "await_checkpoint")
            r.awaiting_since = self._current_at
        else:
            self._relaunch(g)

    def _make_checkpoints_stale(self) -> None:
        """No existing checkpoint may serve recovery any more (a newer sync, or shutdown):
        a ready one is superseded (and deleted once unleased), a running export abandoned."""
        for ck in list(self._checkpoints.values()):
            if ck.record.state == "ready":
                self._fire_ck(ck, "supersede")
                self._reap(ck)
            elif ck.record.state == "exporting":
                self._fire_ck(ck, "abandon")
                self._cancel_abandoned(ck)

    def _cancel_abandoned(self, ck: _Checkpoint) -> None:
        """Stop a stale write, unless the user wants to keep it."""
        if not ck.record.pinned:
            self._emit(fx.CancelExport(ck.record.version))

    def _restart_from(self, g: _Group, ck: _Checkpoint) -> None:
        """Lease the current committed checkpoint and boot the group from it."""
        assert ck.record.state == "ready" and ck.record.version == self._fleet.version
        assert ck.record.path is not None
        self._lease_seq += 1
        lease = Lease(f"L{self._lease_seq}", g.record.name, ck.record.version, self._fleet.version)
        self._leases[lease.id] = lease
        ck.record.leases += 1
        g.record.lease = lease.id
        g.record.awaiting_since = None
        self._fire_group(g, "load")
        self._emit(fx.RestartFromCheckpoint(g.record.name, lease.version, ck.record.path, lease.id))

    def _relaunch(self, g: _Group) -> None:
        g.record.awaiting_since = None
        self._fire_group(g, "relaunch")
        self._emit(fx.RestartCold(g.record.name))

    def _cool(self, g: _Group) -> None:
        g.recovery.clean_streak = 0
        if g.recovery.state == "enabled":
            self._fire(g.recovery_machine, f"recovery:{g.record.name}", "cool")

    def _release(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        self._released.add(lease_id)
        self._groups[lease.group].record.lease = None
        ck = self._checkpoints[lease.version]
        ck.record.leases -= 1
        self._reap(ck)

    def _reap(self, ck: _Checkpoint) -> None:
        """Move a superseded checkpoint to deletion if its guard lets it."""
        if ck.record.state == "superseded" and ck.record.reapable:
            self._fire_ck(ck, "reap")
            assert ck.record.path is not None
            self._emit(fx.DeleteCheckpoint(ck.record.version, ck.record.path))

    def _forget(self, ck: _Checkpoint) -> None:
        del self._checkpoints[ck.record.version]
        self._finished[ck.record.version] = str(ck.record.state)

    def _awaiting(self) -> Iterator[_Group]:
        return (g for g in list(self._groups.values()) if g.record.state == "awaiting_checkpoint")

    def _quiescent(self) -> bool:
        if self._leases:
            return False
        if any(
            c.record.state in {"exporting", "abandoned", "deletable"}
            for c in self._checkpoints.values()
        ):
            return False
        return not any(
            g.record.state in {"loading", "relaunching", "awaiting_checkpoint"}
            for g in self._groups.values()
        )

    # -- checks (no mutation) ----------------------------------------------------------------

    def _require_open(self, e: ev.Event) -> None:
        if self._closed:
            raise EventNotAllowed(f"{e.kind} after Shutdown: the controller is closed")

    def _require_group(self, name: str) -> _Group:
        g = self._groups.get(name)
        if g is None:
            raise UnknownGroup(f"unknown group {name!r}; registered: {sorted(self._groups)}")
        return g

    def _require_group_in(
        self, e: ev.Event, name: str, states: set[str] | frozenset[str]
    ) -> _Group:
        g = self._require_group(name)
        if g.record.state not in states:
            raise EventNotAllowed(
                f"{e.kind} for group {name!r} expects it in one of {sorted(states)}, "
                f"but it is {g.record.state}"
            )
        return g

    def _require_checkpoint(self, e: ev.Event, version: int, states: set[str]) -> _Checkpoint:
        # Export outcomes, pins and deletions are accepted after shutdown: they drain it.
        ck = self._checkpoints.get(version)
        if ck is None:
            if version in self._finished:
                raise EventNotAllowed(
                    f"{e.kind} for checkpoint {version}, which is already {self._finished[version]}"
                )
            raise UnknownVersion(f"{e.kind} for version {version}: no such checkpoint")
        if ck.record.state not in states:
            raise EventNotAllowed(
                f"{e.kind} for checkpoint {version} expects it in one of {sorted(states)}, "
                f"but it is {ck.record.state}"
            )
        return ck

    def _require_lease(self, e: ev.RestartLoaded | ev.RestartLoadFailed) -> tuple[_Group, Lease]:
        g = self._require_group(e.group)
        lease = self._leases.get(e.lease)
        if lease is None:
            if e.lease in self._released:
                raise LeaseError(f"lease {e.lease} was already released")
            raise LeaseError(f"lease {e.lease} was never granted")
        if lease.group != e.group:
            raise LeaseError(f"lease {e.lease} belongs to group {lease.group!r}, not {e.group!r}")
        if g.record.state not in {"loading", "stopped"}:
            raise EventNotAllowed(
                f"{e.kind} for group {e.group!r} expects it loading, but it is {g.record.state}"
            )
        return g, lease

    # -- plumbing ----------------------------------------------------------------------------

    def _fire(self, machine: StateMachine, label: str, event: str) -> None:
        model = machine.model  # the record; cheaper to read than the machine's configuration
        source = model.state
        machine.send(event)
        self._transitions.append((label, event, source, model.state))

    def _fire_ck(self, ck: _Checkpoint, event: str) -> None:
        self._fire(ck.machine, f"checkpoint:{ck.record.version}", event)

    def _fire_group(self, g: _Group, event: str) -> None:
        self._fire(g.machine, f"group:{g.record.name}", event)

    def _emit(self, effect: fx.Effect) -> None:
        self._effects.append(effect)

    def _journal_header(self) -> dict[str, Any]:
        """Step 0 of a journal: what a replay needs to rebuild this controller."""
        cls = type(self)
        return {
            "step": 0,
            "header": {
                "format": 1,
                "controller": f"{cls.__module__}:{cls.__qualname__}",
                "config": attrs.asdict(self.config),
                "initial_version": self._fleet.version,
            },
        }

    def _write_journal(
        self,
        event: Any,
        *,
        effects: tuple[fx.Effect, ...] = (),
        error: Exception | None = None,
    ) -> None:
        record: dict[str, Any] = {"step": self._steps, "event": encode(event)}
        if error is not None:
            record["error"] = {"type": type(error).__name__, "message": str(error)}
        else:
            record["transitions"] = [list(t) for t in self._transitions]
            record["effects"] = [encode(f) for f in effects]
        assert self._journal is not None
        self._journal(record)
