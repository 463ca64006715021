"""The rules of recovery: every decision the controller makes, read top to bottom.

Theory of operation
-------------------
Three kinds of machine (``machines.py``) are coupled through one number, the fleet's weight
version v, and through leases:

* C(v), one per exported checkpoint, is the only recovery source, and only while it is
  ``ready`` (committed, of the current version). A newer sync makes it ``superseded`` (or an
  export still running ``abandoned``); it becomes ``deletable`` only when no lease holds it
  and the user has not pinned it.
* A worker group runs one process at a time; each start of it is an *incarnation* numbered
  by these rules. A start from C(v) holds a lease on C(v) until that incarnation's outcome is
  reported (or it is reported dead). Only a process holding the fleet's version serves.
* A group's immediate-recovery switch decides between booting from C(v) and a cold start,
  and whether a process up with older weights loads C(v) in place rather than waiting for
  the next sync.

One line per event (``on_<Event>`` below, in this order):

* WeightsSynced(v, {g: i})  the fleet moves to v. The previous version's checkpoint stops
  being a recovery source. The sync is *clean* if that checkpoint had committed (each cooling
  switch counts it; N in a row re-enable) or *missed* if its export was started but had not
  committed (every switch cools, streak 0). Each up group whose listed incarnation is its
  current one now holds v (a pending one is admitted); a serving group not so listed is
  demoted. A group awaiting the previous checkpoint goes cold.
* ExportStarted(v)          C(v) is being written (v current, once per version).
* ExportCommitted(v, path)  C(v) is ready and wakes every group awaiting it, and every up
  group holding older weights loads it in place (``_catch_up``); a late commit of an
  abandoned export is deleted at once unless pinned. A path in use is refused.
* ExportFailed / ExportCancelled(v)  C(v) is gone; groups awaiting it go cold.
* CheckpointPinned(v)       the user keeps C(v): it is never deleted (refused once a stale
  export was asked to stop).
* CheckpointDeleted(v)      the files are gone.
* Shutdown                  every group stops; checkpoints stop being sources. Outcomes of
  starts still in flight are accepted afterwards, and drain the controller.
* Tick                      deadlines: a wait for C(v) past its timeout goes cold; a load or a
  relaunch past its deadline is killed and counts as a failed restart.
* GroupRegistered(g, v)     incarnation 1 of g, serving if v is the fleet's version.
* ProbeFailed / ProbeOk     a serving group turns suspect; at the threshold it has failed and
  its process is stopped.
* GroupFailed(g, i)         incarnation i is dead: its lease (if loading) ends with it, and a
  death while loading (a restart, or a load in place) is a failed load from the checkpoint
  (recovery cools).
* RestartLoaded(g, i)       its load finished: the lease is released (which may reap C); it
  serves if it loaded the fleet's version, else it catches up from C(v) if that is ready
  (``LoadCheckpoint``, same process) or waits for the next sync.
* RestartLoadFailed(g, i)   the lease is released, recovery cools, the group has failed.
* Relaunched / RelaunchFailed(g, i)  a cold start came up (catches up from a ready C(v) if
  its switch is enabled, else waits for weights) or failed.

A failed group (``_fail``) is retired once its restart budget is spent; otherwise it boots
from C(v) if that is ready and its switch is enabled, waits if C(v) is being written (or
about to be: a sync announced v and ``export_every_sync`` says its export follows), and goes
cold in every other case.

Three consequences a reader may miss:

* a group registered on weights older than the fleet's is up but not serving: it catches up
  like any stale process (loads C(v) in place once ready, or is admitted by the next sync);
* a load killed at its deadline cools the group's switch (the checkpoint path failed), a
  relaunch killed at its deadline does not (no checkpoint was involved);
* a commit loads C(v) in place only into processes whose switch is enabled; a cooling group
  waits for the next sync, as the cold path does.

Where a state chooses among targets on its own data (the reap, a load's outcome, admission or
demotion on a sync, a load in place, cooling, re-enabling), a rule offers the machine the event
and the machine's guards choose (``machines.py``), so the diagrams show the choice; the rule
then acts on the state it finds.

Every event is checked completely before anything changes: ``check_<Event>`` is pure (it
raises a typed ``RecoveryError`` or returns what the rule acts on), and ``apply`` runs the
rule ``on_<Event>`` only after it passed, so the boundary between checking and changing is
one line in ``apply``. The hosting code (``controller.py``) serializes events, journals them
and stops for good on any other error, or on a refusal raised after the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
from statemachine import StateMachine

from . import effects as fx
from . import events as ev
from .config import RecoveryConfig
from .errors import (
    EventNotAllowed,
    UnknownGroup,
    UnknownVersion,
    WrongIncarnation,
)
from .machines import (
    COMMITTED,
    GROUP_FINAL,
    LOADING,
    RELAUNCHING,
    SERVING,
    SYNC_MISSED,
    UP,
    WAITING,
    CheckpointEvent,
    CheckpointMachine,
    CheckpointRecord,
    CheckpointState,
    Fleet,
    GroupEvent,
    GroupRecord,
    GroupState,
    Label,
    RecoveryRecord,
    SwitchEvent,
    SwitchState,
    WorkerGroupMachine,
    sources,
    stays,
    sync_verdict,
)
from .state import CheckpointSlot, GroupSlot, Lease, Start

# Final checkpoint states remembered (for clear refusals and queries about recent versions).
FINISHED_KEPT = 16


# Which group states accept an event, read off the worker-group graph.
_FAILABLE = sources(WorkerGroupMachine, GroupEvent.FAIL)
# A checkpoint the user may still pin: its files exist or are being written.
_PINNABLE = frozenset(
    {CheckpointState.EXPORTING, CheckpointState.READY, CheckpointState.SUPERSEDED}
)


@attrs.frozen
class Orphan:
    """What a process event's check found when it is the outcome of an earlier start that
    is still in flight: the rule only ends that start."""

    group: GroupSlot
    incarnation: int


def _nothing_to_check(_e: ev.Event) -> None:
    """The check of an event every state accepts (``Tick``)."""


class Rules:
    """The state every rule reads, and the rules. Driven only through ``apply``."""

    def __init__(self, config: RecoveryConfig, initial_version: int) -> None:
        self.config = config
        self.fleet = Fleet(initial_version)
        self.initial_version = initial_version
        self.closed = False
        self.checkpoints: dict[int, CheckpointSlot] = {}
        self.finished: dict[int, str] = {}  # versions whose checkpoint reached a final state
        self.groups: dict[str, GroupSlot] = {}
        self.starts: dict[tuple[str, int], Start] = {}  # (group, incarnation) -> start
        # Filled while one event runs.
        self.effects: list[fx.Effect] = []
        self.transitions: list[tuple[str, str, str, str]] = []
        self.now = 0.0
        # True once the event's check passed and its rule runs: a refusal after that point
        # would leave the event half applied, so the controller treats it as a bug.
        self.applying = False
        self._bind()

    def apply(self, e: ev.Event) -> list[fx.Effect]:
        """Check the event (pure: a refusal changes nothing), then apply its rule to what
        the check found. The one place where checking ends and changing begins."""
        self.effects, self.transitions, self.applying = [], [], False
        self.now = e.at
        check, rule = self._handlers[type(e)]
        found = check(e)
        self.applying = True
        rule(e, found)
        return self.effects

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        del state["_handlers"]  # bound methods: rebuilt for the copy
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._bind()

    def _bind(self) -> None:
        """Each event type to its check, ``check_<Event>`` (none: nothing to check), and its
        rule, ``on_<Event>``, which takes what the check found."""
        self._handlers: dict[type[ev.Event], tuple[Any, Any]] = {
            cls: (
                getattr(self, f"check_{cls.__name__}", _nothing_to_check),
                getattr(self, f"on_{cls.__name__}"),
            )
            for cls in ev.EVENT_TYPES.values()
        }

    # -- the trainer -------------------------------------------------------------------------

    def check_WeightsSynced(self, e: ev.WeightsSynced) -> None:
        self._require_open(e)
        if e.version <= self.fleet.version:
            raise EventNotAllowed(
                f"WeightsSynced must move to a version above {self.fleet.version}, got {e.version}"
            )
        for name, incarnation in e.groups.items():
            g = self._require_group(name)
            if incarnation > g.record.incarnation:
                raise WrongIncarnation(
                    f"WeightsSynced lists incarnation {incarnation} of group {name!r}, "
                    f"which was never started (current: {g.record.incarnation})"
                )

    def on_WeightsSynced(self, e: ev.WeightsSynced, _: None) -> None:
        outcome = self._export_outcome(self.fleet.version)
        self.fleet.version = e.version
        self._make_checkpoints_stale()
        for g in self.groups.values():
            if outcome is not None:
                self._count_sync(g, missed=outcome == SYNC_MISSED)
            r = g.record
            if r.state in UP:
                if e.groups.get(r.name) == r.incarnation:
                    r.version = e.version
                self._fire_group(g, GroupEvent.SYNC)  # admits or demotes: the graph decides
            elif r.state == GroupState.AWAITING_CHECKPOINT:
                # It waited for the old version's export; that checkpoint is stale now.
                self._relaunch(g)

    def _export_outcome(self, old: int) -> str | None:
        """How the export of ``old`` fared by the sync that leaves it (``sync_verdict``), or
        None if it never started: the sync does not count."""
        ck = self.checkpoints.get(old)
        state = ck.record.state if ck is not None else self.finished.get(old)
        if state is None:
            return None
        return sync_verdict(state in COMMITTED or state == CheckpointState.DELETED)

    def _count_sync(self, g: GroupSlot, missed: bool) -> None:
        """A missed export cools immediate recovery down; N clean syncs in a row end it (the
        switch counts them)."""
        if missed:
            self._cool(g)
        else:
            self._fire_switch(g, SwitchEvent.CLEAN_SYNC)

    def check_ExportStarted(self, e: ev.ExportStarted) -> None:
        self._require_open(e)
        if e.version != self.fleet.version:
            raise UnknownVersion(
                f"ExportStarted for version {e.version}, but the fleet serves "
                f"{self.fleet.version}: only the current version is exported"
            )
        if e.version in self.checkpoints or e.version in self.finished:
            raise EventNotAllowed(f"an export of version {e.version} was already started")

    def on_ExportStarted(self, e: ev.ExportStarted, _: None) -> None:
        record = CheckpointRecord(e.version, pinned=e.pinned, state=CheckpointState.EXPORTING)
        self.checkpoints[e.version] = CheckpointSlot(record, build=True)
        self.transitions.append(
            (Label.of(Label.CHECKPOINT, e.version), Label.CREATE, "", CheckpointState.EXPORTING)
        )

    def check_ExportCommitted(self, e: ev.ExportCommitted) -> CheckpointSlot:
        for other in self.checkpoints.values():
            if other.record.path == e.path:
                raise EventNotAllowed(
                    f"ExportCommitted({e.version}) at {e.path}, which checkpoint "
                    f"{other.record.version} still occupies"
                )
        return self._require_checkpoint(e, e.version, CheckpointEvent.COMMIT)

    def on_ExportCommitted(self, e: ev.ExportCommitted, ck: CheckpointSlot) -> None:
        ck.record.path = e.path
        self._fire_ck(ck, CheckpointEvent.COMMIT)
        if ck.record.state == CheckpointState.DELETABLE:
            self._emit(fx.DeleteCheckpoint(e.version, e.path))
        elif ck.record.state == CheckpointState.READY:
            for g in self._awaiting():
                self._restart_from(g, ck)
            for g in self._pending():
                self._catch_up(g)

    def check_ExportFailed(self, e: ev.ExportFailed) -> CheckpointSlot:
        return self._require_checkpoint(e, e.version, CheckpointEvent.FAIL)

    def on_ExportFailed(self, e: ev.ExportFailed, ck: CheckpointSlot) -> None:
        self._end_export(ck, CheckpointEvent.FAIL)

    def check_ExportCancelled(self, e: ev.ExportCancelled) -> CheckpointSlot:
        return self._require_checkpoint(e, e.version, CheckpointEvent.CANCEL)

    def on_ExportCancelled(self, e: ev.ExportCancelled, ck: CheckpointSlot) -> None:
        self._end_export(ck, CheckpointEvent.CANCEL)

    def _end_export(self, ck: CheckpointSlot, event: str) -> None:
        was_current = ck.record.state == CheckpointState.EXPORTING
        self._fire_ck(ck, event)
        self._forget(ck)
        if was_current:
            for g in self._awaiting():
                self._relaunch(g)

    def check_CheckpointPinned(self, e: ev.CheckpointPinned) -> CheckpointSlot:
        # An abandoned export was asked to stop (unless already pinned): too late to keep it.
        return self._require_checkpoint(e, e.version, states=_PINNABLE)

    def on_CheckpointPinned(self, e: ev.CheckpointPinned, ck: CheckpointSlot) -> None:
        ck.record.pinned = True

    def check_CheckpointDeleted(self, e: ev.CheckpointDeleted) -> CheckpointSlot:
        return self._require_checkpoint(e, e.version, CheckpointEvent.REMOVE)

    def on_CheckpointDeleted(self, e: ev.CheckpointDeleted, ck: CheckpointSlot) -> None:
        self._fire_ck(ck, CheckpointEvent.REMOVE)
        self._forget(ck)

    def check_Shutdown(self, e: ev.Shutdown) -> None:
        self._require_open(e)

    def on_Shutdown(self, e: ev.Shutdown, _: None) -> None:
        self.closed = True
        for g in self.groups.values():
            r = g.record
            if r.state in GROUP_FINAL:
                continue
            has_process = r.state in UP | LOADING | RELAUNCHING
            self._fire_group(g, GroupEvent.STOP)
            if has_process:
                self._emit(fx.StopGroup(r.name, r.incarnation, "shutdown"))
        self._make_checkpoints_stale()

    def on_Tick(self, e: ev.Tick, _: None) -> None:
        c = self.config
        for g in list(self.groups.values()):
            r = g.record
            if r.since is None:
                continue
            waited = e.at - r.since
            if r.state == GroupState.AWAITING_CHECKPOINT and waited >= c.deadline("checkpoint"):
                self._relaunch(g)
            elif r.state in LOADING and waited >= c.deadline("load"):
                self._cool(g)
                self._fail(g, kill="load deadline")  # its lease waits for the killed start
            elif r.state in RELAUNCHING and waited >= c.deadline("relaunch"):
                self._fail(g, kill="relaunch deadline")

    # -- the health manager and the runtime, about one incarnation -----------------------------

    def check_GroupRegistered(self, e: ev.GroupRegistered) -> None:
        self._require_open(e)
        if e.group in self.groups:
            raise EventNotAllowed(f"group {e.group!r} is already registered")
        if e.version > self.fleet.version:
            raise UnknownVersion(
                f"group {e.group!r} claims version {e.version}, "
                f"but the fleet has only reached {self.fleet.version}"
            )

    def on_GroupRegistered(self, e: ev.GroupRegistered, _: None) -> None:
        start = GroupState.ACTIVE if e.version == self.fleet.version else GroupState.PENDING_WEIGHTS
        record = GroupRecord(e.group, self.fleet, e.version, state=start)
        recovery = RecoveryRecord(
            e.group,
            self.config.clean_syncs_to_reenable,
            state=SwitchState.ENABLED if self.config.immediate_recovery else SwitchState.DISABLED,
        )
        self.groups[e.group] = GroupSlot(record, recovery, build=True)
        self.transitions.append((Label.of(Label.GROUP, e.group), Label.CREATE, "", start))
        if start == GroupState.ACTIVE:
            self._emit(fx.RouteTraffic(e.group, record.incarnation, e.version))
        else:
            self._catch_up(self.groups[e.group])

    def check_ProbeFailed(self, e: ev.ProbeFailed) -> GroupSlot | Orphan:
        return self._current(e, SERVING)

    def on_ProbeFailed(self, e: ev.ProbeFailed, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        r = g.record
        r.probe_failures += 1
        if r.probe_failures >= self.config.suspect_threshold:
            self._fail(g, kill="failed probes")  # it may still run: make sure it is gone
        elif r.state == GroupState.ACTIVE:
            self._fire_group(g, GroupEvent.PROBE_FAILED)

    def check_ProbeOk(self, e: ev.ProbeOk) -> GroupSlot | Orphan:
        return self._current(e, SERVING)

    def on_ProbeOk(self, e: ev.ProbeOk, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        g.record.probe_failures = 0
        if g.record.state == GroupState.SUSPECT:
            self._fire_group(g, GroupEvent.PROBE_OK)

    def check_GroupFailed(self, e: ev.GroupFailed) -> GroupSlot | Orphan:
        return self._current(e, _FAILABLE)

    def on_GroupFailed(self, e: ev.GroupFailed, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        if g.record.state in LOADING:
            self._cool(g)  # it died booting from the checkpoint: a failed immediate restart
        self._end_start(g)  # the process that read the checkpoint is gone, and its lease
        self._fail(g)

    def check_RestartLoaded(self, e: ev.RestartLoaded) -> GroupSlot | Orphan:
        return self._current(e, LOADING)

    def on_RestartLoaded(self, e: ev.RestartLoaded, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        lease = self._end_start(g)
        assert lease is not None
        g.record.version = lease.version
        self._fire_group(g, GroupEvent.LOADED)  # serves, or holds stale weights
        if g.record.state == GroupState.PENDING_WEIGHTS:
            self._catch_up(g)  # a sync landed during the load

    def check_RestartLoadFailed(self, e: ev.RestartLoadFailed) -> GroupSlot | Orphan:
        return self._current(e, LOADING)

    def on_RestartLoadFailed(self, e: ev.RestartLoadFailed, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        self._end_start(g)
        self._cool(g)
        self._fail(g)

    def check_Relaunched(self, e: ev.Relaunched) -> GroupSlot | Orphan:
        return self._current(e, RELAUNCHING)

    def on_Relaunched(self, e: ev.Relaunched, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        self._end_start(g)
        g.record.version = None
        self._fire_group(g, GroupEvent.RELAUNCHED)
        self._catch_up(g)

    def check_RelaunchFailed(self, e: ev.RelaunchFailed) -> GroupSlot | Orphan:
        return self._current(e, RELAUNCHING)

    def on_RelaunchFailed(self, e: ev.RelaunchFailed, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        self._end_start(g)
        self._fail(g)

    # -- recovery rules ----------------------------------------------------------------------

    def _fail(self, g: GroupSlot, kill: str | None = None) -> None:
        """The group is down (``kill``: the controller decided so, and its process must be
        stopped first): choose retire, immediate restart, wait, or cold restart."""
        r = g.record
        self._fire_group(g, GroupEvent.FAIL)
        if kill is not None:
            self._emit(fx.StopGroup(r.name, r.incarnation, kill))
        r.version = None
        if r.restarts >= self.config.restart_budget:
            self._fire_group(g, GroupEvent.RETIRE)
            self._emit(fx.RetireGroup(r.name))
            return
        r.restarts += 1
        if g.recovery.state != SwitchState.ENABLED:
            self._relaunch(g)
            return
        current = self.checkpoints.get(self.fleet.version)
        if current is not None and current.record.state == CheckpointState.READY:
            self._restart_from(g, current)
        elif (current is not None and current.record.state == CheckpointState.EXPORTING) or (
            current is None
            and self.config.export_every_sync
            and self.fleet.version != self.initial_version  # no sync announced it yet
            and self.fleet.version not in self.finished
        ):
            self._fire_group(g, GroupEvent.AWAIT_CHECKPOINT)
            r.since = self.now
        else:
            self._relaunch(g)

    def _make_checkpoints_stale(self) -> None:
        """No existing checkpoint may serve recovery any more (a newer sync, or shutdown):
        a ready one is superseded (and deleted once unleased), a running export abandoned
        and, unless the user keeps it, cancelled."""
        for ck in list(self.checkpoints.values()):
            if ck.record.state == CheckpointState.READY:
                self._fire_ck(ck, CheckpointEvent.SUPERSEDE)
                self._reap(ck)
            elif ck.record.state == CheckpointState.EXPORTING:
                self._fire_ck(ck, CheckpointEvent.ABANDON)
                if not ck.record.pinned:
                    self._emit(fx.CancelExport(ck.record.version))

    def _restart_from(self, g: GroupSlot, ck: CheckpointSlot) -> None:
        """Lease the current committed checkpoint and start a new incarnation from it."""
        assert ck.record.state == CheckpointState.READY and ck.record.version == self.fleet.version
        assert ck.record.path is not None
        r = self._next_incarnation(g)
        lease = Lease(r.name, r.incarnation, ck.record.version, self.fleet.version)
        self.starts[(r.name, r.incarnation)] = Start("load", lease)
        ck.record.leases += 1
        self._fire_group(g, GroupEvent.LOAD)
        self._emit(fx.RestartFromCheckpoint(r.name, r.incarnation, lease.version, ck.record.path))

    def _catch_up(self, g: GroupSlot) -> None:
        """Offer a process up with older weights (or none) C(v): the graph loads it in place,
        without a restart, if C(v) is ready and the switch allows it, or keeps it waiting
        for the next sync's push. The load is leased as a restart's is, and runs under a new
        incarnation, so that an earlier report about that process can never pass for this
        load's outcome."""
        r = g.record
        ck = self._recovery_source()
        self._fire_group(
            g,
            GroupEvent.RELOAD,
            switch_state=g.recovery.state,
            checkpoint_path=None if ck is None else ck.record.path,
        )
        if r.state != GroupState.LOADING:
            return
        assert ck is not None and ck.record.path is not None
        previous = r.incarnation
        self._next_incarnation(g)  # the same process, renumbered (no restart is counted)
        lease = Lease(r.name, r.incarnation, ck.record.version, self.fleet.version)
        self.starts[(r.name, r.incarnation)] = Start("load", lease)
        ck.record.leases += 1
        self._emit(
            fx.LoadCheckpoint(r.name, r.incarnation, lease.version, ck.record.path, previous)
        )

    def _recovery_source(self) -> CheckpointSlot | None:
        """C(v) of the fleet's version, if it is ready: the only checkpoint to recover from."""
        ck = self.checkpoints.get(self.fleet.version)
        if ck is None or ck.record.state != CheckpointState.READY:
            return None
        return ck

    def _relaunch(self, g: GroupSlot) -> None:
        r = self._next_incarnation(g)
        self.starts[(r.name, r.incarnation)] = Start("relaunch", None)
        self._fire_group(g, GroupEvent.RELAUNCH)
        self._emit(fx.RestartCold(r.name, r.incarnation))

    def _next_incarnation(self, g: GroupSlot) -> GroupRecord:
        r = g.record
        r.incarnation += 1
        r.since = self.now
        return r

    def _end_start(self, g: GroupSlot, incarnation: int | None = None) -> Lease | None:
        """The outcome of a start arrived (or its process died): forget it, free its lease."""
        key = (g.record.name, g.record.incarnation if incarnation is None else incarnation)
        start = self.starts.pop(key, None)
        if start is None or start.lease is None:
            return None
        ck = self.checkpoints[start.lease.version]
        ck.record.leases -= 1
        self._reap(ck)
        return start.lease

    def _cool(self, g: GroupSlot) -> None:
        self._fire_switch(g, SwitchEvent.COOL)

    def _reap(self, ck: CheckpointSlot) -> None:
        """Offer the checkpoint deletion; its graph's guard decides (no lease, not pinned)."""
        self._fire_ck(ck, CheckpointEvent.REAP)
        if ck.record.state == CheckpointState.DELETABLE:
            assert ck.record.path is not None
            self._emit(fx.DeleteCheckpoint(ck.record.version, ck.record.path))

    def _forget(self, ck: CheckpointSlot) -> None:
        """Keep only the final state; of those, only the latest ``FINISHED_KEPT`` (the rules
        read the current and the previous version's: an older one is refused as unknown)."""
        del self.checkpoints[ck.record.version]
        self.finished[ck.record.version] = str(ck.record.state)
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[min(self.finished)]

    def _awaiting(self) -> Iterator[GroupSlot]:
        return self._in_state(GroupState.AWAITING_CHECKPOINT)

    def _pending(self) -> Iterator[GroupSlot]:
        return self._in_state(GroupState.PENDING_WEIGHTS)

    def _in_state(self, state: str) -> Iterator[GroupSlot]:
        return (g for g in list(self.groups.values()) if g.record.state == state)

    # -- what is outstanding -----------------------------------------------------------------

    def outstanding(self) -> list[str]:
        """Everything still owed by the world (an export, a start, a delete, a wait), one
        sentence each; empty means quiescent."""
        out: list[str] = []
        for (name, incarnation), start in sorted(self.starts.items()):
            what = "a cold start" if start.lease is None else f"a load of C({start.lease.version})"
            out.append(f"{what} of group {name!r} incarnation {incarnation} has not reported")
        for v, ck in sorted(self.checkpoints.items()):
            state = ck.record.state
            if state in {CheckpointState.EXPORTING, CheckpointState.ABANDONED}:
                out.append(f"the export of version {v} is still running ({state})")
            elif state == CheckpointState.DELETABLE:
                out.append(f"the delete of checkpoint {v} has not been reported")
        for name, g in sorted(self.groups.items()):
            if g.record.state == GroupState.AWAITING_CHECKPOINT:
                out.append(f"group {name!r} is waiting for a checkpoint")
        return out

    # -- checks (no change) ----------------------------------------------------------------

    def _require_open(self, e: ev.Event) -> None:
        if self.closed:
            raise EventNotAllowed(f"{e.kind} after Shutdown: the controller is closed")

    def _require_group(self, name: str) -> GroupSlot:
        g = self.groups.get(name)
        if g is None:
            raise UnknownGroup(f"unknown group {name!r}; registered: {sorted(self.groups)}")
        return g

    def _current(
        self,
        e: ev.ProbeFailed
        | ev.ProbeOk
        | ev.GroupFailed
        | ev.RestartLoaded
        | ev.RestartLoadFailed
        | ev.Relaunched
        | ev.RelaunchFailed,
        states: frozenset[str],
    ) -> GroupSlot | Orphan:
        """The group, when ``e`` is about its current incarnation in one of ``states``
        (the check every process event passes; it changes nothing).

        An ``Orphan`` when ``e`` is the outcome of an earlier start still in flight (killed
        after a deadline, or stopped by Shutdown): that outcome only ends the start and
        frees its lease (``_settle``). Anything else about another incarnation is refused."""
        g = self._require_group(e.group)
        r = g.record
        if e.incarnation == r.incarnation and r.state in states:
            return g
        start = self.starts.get((e.group, e.incarnation))
        if start is not None and self._orphaned(g, e.incarnation, start):
            ends = (
                ev.GroupFailed,
                *(ev.LOAD_OUTCOMES if start.kind == "load" else ev.RELAUNCH_OUTCOMES),
            )
            if isinstance(e, ends):
                return Orphan(g, e.incarnation)
        if e.incarnation != r.incarnation:
            raise WrongIncarnation(
                f"{e.kind} for incarnation {e.incarnation} of group {e.group!r}, whose "
                f"current incarnation is {r.incarnation} ({r.state})"
            )
        raise EventNotAllowed(
            f"{e.kind} for group {e.group!r} expects it in one of {sorted(states)}, "
            f"but it is {r.state}"
        )

    def _settle(self, found: GroupSlot | Orphan) -> GroupSlot | None:
        """The group a process event acts on; an orphan's outcome only ends its start."""
        if isinstance(found, Orphan):
            self._end_start(found.group, found.incarnation)
            return None
        return found

    @staticmethod
    def _orphaned(g: GroupSlot, incarnation: int, start: Start) -> bool:
        """A start the group no longer waits on: killed at a deadline, or stopped."""
        waiting = LOADING if start.kind == "load" else RELAUNCHING
        return incarnation != g.record.incarnation or g.record.state not in waiting

    def _require_checkpoint(
        self, e: ev.Event, version: int, event: str = "", states: frozenset[str] | None = None
    ) -> CheckpointSlot:
        """The checkpoint of ``version``, if it accepts machine ``event`` (or is in
        ``states``). Export outcomes, pins and deletions are accepted after shutdown."""
        allowed = states if states is not None else sources(CheckpointMachine, event)
        ck = self.checkpoints.get(version)
        if ck is None:
            if version in self.finished:
                raise EventNotAllowed(
                    f"{e.kind} for checkpoint {version}, which is already {self.finished[version]}"
                )
            raise UnknownVersion(f"{e.kind} for version {version}: no such checkpoint")
        if ck.record.state not in allowed:
            raise EventNotAllowed(
                f"{e.kind} for checkpoint {version} expects it in one of {sorted(allowed)}, "
                f"but it is {ck.record.state}"
            )
        return ck

    # -- plumbing ----------------------------------------------------------------------------

    def _fire(self, machine: StateMachine, label: str, event: str, **facts: Any) -> None:
        """Send ``event``; where its graph offers several targets, the guards choose (``facts``
        are what a guard needs from another machine). A choice that keeps the state is not
        a transition and is not recorded."""
        if not facts and stays(machine, event):
            return  # a self-loop that changes nothing: read off the graph, not dispatched
        model = machine.model  # the record; cheaper to read than the machine's configuration
        source = model.state
        machine.send(event, **facts)
        if model.state != source:
            self.transitions.append((label, event, source, model.state))

    def _fire_switch(self, g: GroupSlot, event: str) -> None:
        self._fire(g.recovery_machine, Label.of(Label.RECOVERY, g.record.name), event)

    def _fire_ck(self, ck: CheckpointSlot, event: str) -> None:
        self._fire(ck.machine, Label.of(Label.CHECKPOINT, ck.record.version), event)

    def _fire_group(self, g: GroupSlot, event: str, **facts: Any) -> None:
        """Move a group; when that changes whether it may serve, tell the router."""
        r = g.record
        was_serving = r.state in SERVING
        self._fire(g.machine, Label.of(Label.GROUP, r.name), event, **facts)
        if r.state not in WAITING:
            r.since = None
        serving = r.state in SERVING
        if serving and not was_serving:
            self._emit(fx.RouteTraffic(r.name, r.incarnation, self.fleet.version))
        elif was_serving and not serving:
            r.probe_failures = 0  # probes count within one spell of serving
            self._emit(fx.WithdrawTraffic(r.name, r.incarnation))

    def _emit(self, effect: fx.Effect) -> None:
        self.effects.append(effect)
