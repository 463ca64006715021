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
* A standby is a warm engine the controller keeps booted (``config.standby`` of them, named
  ``standby-<n>``), never routed. It stays current as a group does: a sync's push reaches it,
  or it loads C(v) in place under a lease when C(v) commits. A failed group claims one (its
  process becomes the group's next incarnation) before any restart. The pool refills after
  every event once no claim is being checked (a boot beside the check slows it), and stops
  refilling once ``standby_boot_budget`` standbys in a row were lost before they ever held
  the fleet's weights.

One line per event (``on_<Event>`` below, in this order):

* WeightsSynced(v, {g: i})  the fleet moves to v (a standby listed as ``standby-<n>: 1``
  got the push; one claimed meanwhile is ignored). The previous version's checkpoint stops
  being a recovery source. The sync is *clean* if that checkpoint had committed (each cooling
  switch counts it; N in a row re-enable) or *missed* if its export was started but had not
  committed (every switch cools, streak 0). Each up group whose listed incarnation is its
  current one now holds v (a pending one is admitted); a serving group not so listed is
  demoted; a standby is current or stale likewise. A group awaiting the previous
  checkpoint takes a current standby, or goes cold.
* ExportStarted(v)          C(v) is being written (v current, once per version).
* ExportCommitted(v, path)  C(v) is ready and wakes every group awaiting it, and every up
  group or standby holding older weights loads it in place (``_catch_up``); a late commit of an
  abandoned export is deleted at once unless pinned. A path in use is refused.
* ExportFailed / ExportCancelled(v)  C(v) is gone; groups awaiting it go cold.
* CheckpointPinned(v)       the user keeps C(v): it is never deleted (refused once a stale
  export was asked to stop).
* CheckpointUnpinned(v)     the user lets C(v) go: deleted once superseded and unleased; a
  stale export of it is cancelled. A ready C(v) stays the recovery source.
* CheckpointDeleted(v)      the files are gone.
* Resumed(v, epoch, found)   the trainer restarted from its checkpoint of v, and a new
  runtime took over as a higher epoch (an epoch not above the run's is refused): the engines
  it found learned that epoch, so the runtime it replaces can no longer act. The fleet is at
  v again; what the old runtime had in flight died with it. Every process found that is no
  group's current one nor a live standby is stopped first (``StopFound``). Exports end;
  checkpoints newer than v are deleted once unleased (pinned or not: that future is not
  followed), and a committed C(v) is the recovery source again; deletes are asked again.
  Every group whose current process answered is ``resuming``: not routed, its start (and
  lease) kept until it says what it holds (``VerifyGroup``); one whose process is gone, or
  did not answer (stopped), has failed and recovers (not a failed load: nobody knows whether
  it ran); a group awaiting a checkpoint recovers anew. Every standby that answered is
  ``resuming`` likewise (``VerifyStandby``): never claimed or pushed to before it answers,
  so a standby that survived costs no boot; the others are lost.
* Shutdown                  every group and standby stops; checkpoints stop being sources.
  Outcomes of starts still in flight are accepted afterwards, and drain the controller.
* Tick                      deadlines: a wait for C(v) past its timeout goes cold; a load or a
  relaunch past its deadline is killed and counts as a failed restart; a process that does
  not answer its verification within the load deadline is killed and has failed; a standby's
  boot, load or verification past its deadline is killed and the standby is lost.
* GroupRegistered(g, v)     incarnation 1 of g, serving if v is the fleet's version.
* ProbeFailed / ProbeOk     a serving group turns suspect; at the threshold it has failed and
  its process is stopped.
* GroupFailed(g, i)         incarnation i is dead: its lease (if loading) ends with it, and a
  death while loading (a restart, or a load in place) is a failed load from the checkpoint
  (recovery cools; not while resuming, when nobody knows whether the load ran).
* GroupVerified(g, i, v')   a resuming process answered holding v': its start ends (and its
  lease); it serves if v' is the fleet's version, else it catches up like any stale process.
  Only a verification the rules asked for (its ``verify`` start) is answered; the answer of
  one killed at its deadline ends that start only.

Every outcome report answers a start of its own kind (a load's, a claim's, a relaunch's, a
verification's, a standby's boot, load or verification of that version); any other is refused
and changes nothing, so a stray report never ends a start still running or frees its lease.
* RestartLoaded(g, i)       its load finished: the lease is released (which may reap C); it
  serves if it loaded the fleet's version, else it catches up from C(v) if that is ready
  (``LoadCheckpoint``, same process) or waits for the next sync. A standby claimed as it is
  may be found holding a newer version (``version=``: a push reached it before its check):
  it serves if the fleet has moved there, else it waits, never loading, for the sync of that
  push until the load deadline, after which its weights are nobody's and it catches up.
* RestartLoadFailed(g, i)   the lease is released, recovery cools, the group has failed.
* Relaunched / RelaunchFailed(g, i)  a cold start came up (catches up from a ready C(v) if
  its switch is enabled, else waits for weights) or failed.
* StandbyBooted(s)          its engine is up without weights: it catches up from C(v) if ready.
* StandbyLoaded(s)          its load in place finished (the lease is released): current, it
  is offered to a group awaiting a checkpoint; stale, it catches up again.
* StandbyFailed(s)          it is lost (its lease, if loading, ends with it); lost before it
  ever held the fleet's weights (and not while resuming), it counts against the pool's boot
  budget.
* StandbyVerified(s, v')    a resuming standby answered holding v' (weights above the fleet's
  count as none): its start ends (and its lease); current, it is offered to a group
  awaiting a checkpoint; stale, it catches up.

A failed group (``_fail``) is retired once its restart budget is spent (every failure it
recovered from, or with ``restart_window_s`` those of the last window, counted from the
failure's time: the budget refills as they age out); otherwise
(``_recover``) it claims a standby that holds the fleet's version (admitted as it is, whatever
its switch: no checkpoint is read); else, if C(v) is ready and its switch is enabled, it
claims a standby that loads C(v) in place (one already loading first), or boots from C(v);
else it waits if C(v) is being written (or about to be: a sync announced v and
``export_every_sync`` says its export follows), and goes cold in every other case. A claim,
like a restart, spends the restart budget; a claim that fails its load or its admission check
has failed like a restart (it cools the switch only if it read the checkpoint).

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
    STANDBY_FINAL,
    STANDBY_UP,
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
    PoolEvent,
    PoolRecord,
    PoolState,
    RecoveryRecord,
    StandbyEvent,
    StandbyRecord,
    StandbyState,
    SwitchEvent,
    SwitchState,
    WorkerGroupMachine,
    sources,
    stays,
    sync_verdict,
)
from .state import CheckpointSlot, GroupSlot, Lease, PoolSlot, StandbySlot, Start, StartKind

# Final checkpoint states remembered (for clear refusals and queries about recent versions).
FINISHED_KEPT = 16
# Standbys are named by the rules: this prefix and a serial number. No group may take it.
STANDBY_PREFIX = "standby-"


# Which group states accept an event, read off the worker-group graph.
_FAILABLE = sources(WorkerGroupMachine, GroupEvent.FAIL)
# A checkpoint the user may still pin: its files exist or are being written.
_PINNABLE = frozenset(
    {CheckpointState.EXPORTING, CheckpointState.READY, CheckpointState.SUPERSEDED}
)
# A pinned checkpoint not yet deletable: a stale export is kept running only while pinned.
_UNPINNABLE = _PINNABLE | {CheckpointState.ABANDONED}
# A group's start, by kind: the states its group is in while it waits on it, and the reports
# that end it (besides a death). A report of another kind answers nothing and is refused.
_WAITS_IN = {
    StartKind.LOAD: LOADING,
    StartKind.CLAIM: LOADING,
    StartKind.RELAUNCH: RELAUNCHING,
    StartKind.VERIFY: frozenset({GroupState.RESUMING}),
}
_OUTCOMES: dict[StartKind, tuple[type[ev.Event], ...]] = {
    StartKind.LOAD: ev.LOAD_OUTCOMES,
    StartKind.CLAIM: ev.LOAD_OUTCOMES,
    StartKind.RELAUNCH: ev.RELAUNCH_OUTCOMES,
    StartKind.VERIFY: (ev.GroupVerified,),
}


@attrs.frozen
class Orphan:
    """What a process event's check found when it is the outcome of an earlier start that
    is still in flight: the rule only ends that start."""

    group: GroupSlot
    incarnation: int


@attrs.frozen
class StandbyOrphan:
    """The outcome of a standby's boot or load that was killed, stopped or claimed."""

    name: str


def _nothing_to_check(_e: ev.Event) -> None:
    """The check of an event every state accepts (``Tick``)."""


def _check_rule_names(cls: type) -> None:
    """A ``check_``/``on_`` method is found by its event's name: a misspelt one would never
    run (a check skipped in silence), so a rules class naming no event is refused."""
    known = {c.__name__ for c in ev.EVENT_TYPES.values()}
    stray = sorted(
        name
        for name in dir(cls)
        if name.startswith(("check_", "on_")) and name.partition("_")[2] not in known
    )
    if stray:
        raise TypeError(
            f"{cls.__name__}: {', '.join(stray)} name no event; a rule is check_<Event> or "
            f"on_<Event> for one of {', '.join(sorted(known))}"
        )


class Rules:
    """The state every rule reads, and the rules. Driven only through ``apply``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_rule_names(cls)

    def __init__(self, config: RecoveryConfig, initial_version: int) -> None:
        self.config = config
        self.fleet = Fleet(initial_version)
        self.initial_version = initial_version
        # A sync announced the fleet's version (its export follows, with export_every_sync);
        # not so for the first version, nor for the one a trainer resumed at.
        self.announced = False
        # The version the trainer last resumed at: a resuming process gets no push of the
        # new run, so weights it answers holding above it are the abandoned future's.
        self.resumed_at: int | None = None
        # The run's epoch: 1 for the run that started, raised by every resume. Engines refuse
        # an older epoch's commands, so a replaced runtime that still runs cannot act.
        self.epoch = 1
        self.closed = False
        self.checkpoints: dict[int, CheckpointSlot] = {}
        self.finished: dict[int, str] = {}  # versions whose checkpoint reached a final state
        self.groups: dict[str, GroupSlot] = {}
        self.starts: dict[tuple[str, int], Start] = {}  # (group, incarnation) -> start
        # Standbys not yet handed over, lost or stopped (or with a start still in flight);
        # their starts are in ``starts`` under (name, 1).
        self.standbys: dict[str, StandbySlot] = {}
        self.standby_serial = 0  # the last standby's number
        self.pool = PoolSlot(
            PoolRecord(config.standby, config.standby_boot_budget, state=PoolState.FILLING)
        )
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
        self._refill()
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
            if self._standby_number(name) is not None:
                if incarnation != 1:
                    raise WrongIncarnation(
                        f"WeightsSynced lists standby {name!r} as incarnation {incarnation}; "
                        "a standby is one process, incarnation 1"
                    )
                continue
            g = self._require_group(name)
            if incarnation > g.record.incarnation:
                raise WrongIncarnation(
                    f"WeightsSynced lists incarnation {incarnation} of group {name!r}, "
                    f"which was never started (current: {g.record.incarnation})"
                )

    def on_WeightsSynced(self, e: ev.WeightsSynced, _: None) -> None:
        outcome = self._export_outcome(self.fleet.version)
        self.fleet.version = e.version
        self.announced = True
        self._make_checkpoints_stale()
        for sb in list(self.standbys.values()):
            s = sb.record
            if s.state in {StandbyState.STALE, StandbyState.READY}:
                if e.groups.get(s.name) == 1:
                    s.version = e.version
                self._fire_standby(sb, StandbyEvent.SYNC)  # current or stale: the graph decides
        for g in list(self.groups.values()):
            if outcome is not None:
                self._count_sync(g, missed=outcome == SYNC_MISSED)
            r = g.record
            if r.state in UP:
                if e.groups.get(r.name) == r.incarnation:
                    r.version = e.version
                self._fire_group(g, GroupEvent.SYNC)  # admits or demotes: the graph decides
            elif r.state == GroupState.AWAITING_CHECKPOINT:
                # It waited for the old version's export; that checkpoint is stale now.
                self._recover(g, may_wait=False)

    def _export_outcome(self, old: int) -> str | None:
        """How the export of ``old`` fared by the sync that leaves it (``sync_verdict``), or
        None if it never started: the sync does not count."""
        ck = self.checkpoints.get(old)
        if ck is not None and ck.record.abandoned_future:
            return None  # the run never exported this version since it resumed
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
            raise EventNotAllowed(
                f"an export of version {e.version} was already started (or its checkpoint "
                "from before a resume is still being deleted)"
            )

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
                self._recover(g, may_wait=False)
            for sb in self._standbys_in(StandbyState.STALE):
                self._catch_up_standby(sb)
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
                self._recover(g, may_wait=False)

    def check_CheckpointPinned(self, e: ev.CheckpointPinned) -> CheckpointSlot:
        # An abandoned export was asked to stop (unless already pinned): too late to keep it.
        return self._require_checkpoint(e, e.version, states=_PINNABLE)

    def on_CheckpointPinned(self, e: ev.CheckpointPinned, ck: CheckpointSlot) -> None:
        ck.record.pinned = True

    def check_CheckpointUnpinned(self, e: ev.CheckpointUnpinned) -> CheckpointSlot:
        ck = self._require_checkpoint(e, e.version, states=_UNPINNABLE)
        if not ck.record.pinned:
            raise EventNotAllowed(
                f"{e.kind} for checkpoint {e.version}, which is not pinned (a resume unpins "
                f"the checkpoints of the future it abandons)"
            )
        return ck

    def on_CheckpointUnpinned(self, e: ev.CheckpointUnpinned, ck: CheckpointSlot) -> None:
        ck.record.pinned = False
        if ck.record.state == CheckpointState.ABANDONED:
            self._emit(fx.CancelExport(ck.record.version))  # stale, and nobody keeps it now
        elif ck.record.state == CheckpointState.SUPERSEDED:
            self._reap(ck)

    def check_CheckpointDeleted(self, e: ev.CheckpointDeleted) -> CheckpointSlot:
        return self._require_checkpoint(e, e.version, CheckpointEvent.REMOVE)

    def on_CheckpointDeleted(self, e: ev.CheckpointDeleted, ck: CheckpointSlot) -> None:
        self._fire_ck(ck, CheckpointEvent.REMOVE)
        self._forget(ck)

    def check_Resumed(self, e: ev.Resumed) -> None:
        self._require_open(e)
        if e.version > self.fleet.version:
            raise UnknownVersion(
                f"Resumed at version {e.version}, but the fleet has only reached "
                f"{self.fleet.version}: a trainer resumes from a checkpoint it wrote"
            )
        if e.epoch <= self.epoch:
            raise EventNotAllowed(
                f"Resumed as epoch {e.epoch}, but the run is at epoch {self.epoch} already: "
                "a resume fences the run it replaces with a higher epoch"
            )

    def on_Resumed(self, e: ev.Resumed, _: None) -> None:
        v = self.fleet.version = self.resumed_at = e.version
        self.epoch = e.epoch
        self.announced = False  # nobody exports v again: a failure does not wait for it
        current = self._current_processes()
        answered = set(e.found)
        # First: whatever was found and is nobody's current process goes, before any lease
        # it might hold ends below (so a checkpoint it reads is deleted only after the kill).
        for pid in sorted((answered | set(e.silent)) - set(current)):
            name, _sep, number = pid.rpartition("#")
            self._emit(fx.StopFound(name, int(number), "nobody's process at the resume"))
        self._resume_checkpoints(v)
        for sb in list(self.standbys.values()):
            if sb.record.state in STANDBY_FINAL:  # its start's process is stopped above, or gone
                self._end_standby_start(sb)
                self._forget_standby(sb)
        self._end_orphaned_starts()
        for pid, slot in current.items():
            self._resume_process(slot, pid in answered)
        for pid, slot in current.items():
            if pid not in answered:
                self._resume_lost(slot, pid in e.silent)
        for g in list(self.groups.values()):
            if g.record.state == GroupState.AWAITING_CHECKPOINT:
                self._recover(g, may_wait=False)  # the export it awaited died

    def _end_orphaned_starts(self) -> None:
        """A start of a process that is no group's current one ends at a resume: that
        process was stopped by the resume's first effects, or was gone already."""
        for (name, incarnation), start in list(self.starts.items()):
            g = self.groups.get(name)
            if g is not None and self._orphaned(g, incarnation, start):
                self._end_start(g, incarnation)

    def _current_processes(self) -> dict[str, GroupSlot | StandbySlot]:
        """Every process the rules count as a group's current one or a standby, by name."""
        out: dict[str, GroupSlot | StandbySlot] = {}
        for g in self.groups.values():
            r = g.record
            if r.state in UP | LOADING | RELAUNCHING | {GroupState.RESUMING}:
                out[f"{r.name}#{r.incarnation}"] = g
        for sb in self.standbys.values():
            if sb.record.state not in STANDBY_FINAL:
                out[f"{sb.record.name}#1"] = sb
        return out

    def _resume_checkpoints(self, v: int) -> None:
        """Exports end; the future's checkpoints go once unleased; C(v) serves again."""
        for ck in list(self.checkpoints.values()):
            rec = ck.record
            if rec.state in {CheckpointState.EXPORTING, CheckpointState.ABANDONED}:
                self._fire_ck(ck, CheckpointEvent.FAIL)  # its writer died with the trainer
                self._forget(ck)
                continue
            if rec.version > v:
                rec.pinned, rec.abandoned_future = False, True  # not followed, so not kept
                if rec.state == CheckpointState.READY:
                    self._fire_ck(ck, CheckpointEvent.SUPERSEDE)
            elif (
                rec.version == v
                and rec.state == CheckpointState.SUPERSEDED
                and not rec.abandoned_future  # an earlier resume's future is not v's weights
            ):
                self._fire_ck(ck, CheckpointEvent.REVIVE)
            if rec.state == CheckpointState.SUPERSEDED:
                self._reap(ck)
            elif rec.state == CheckpointState.DELETABLE:
                assert rec.path is not None  # asked before; that runtime died: ask again
                self._emit(fx.DeleteCheckpoint(rec.version, rec.path))
        for version in [x for x in self.finished if x > v]:
            del self.finished[version]  # versions above v will be synced and exported anew

    def _resume_process(self, slot: GroupSlot | StandbySlot, answered: bool) -> None:
        """A current process at a resume is ``resuming``: found and answering, it must say
        what it holds before it is trusted (its start and lease go on until it does)."""
        if isinstance(slot, StandbySlot):
            s = slot.record
            if s.state != StandbyState.RESUMING:  # else: its verification died unanswered
                self._fire_standby(slot, StandbyEvent.RESUME)
            s.version, s.since = None, self.now
            if answered:
                start = self.starts.get((s.name, 1))
                lease = None if start is None else start.lease
                self.starts[(s.name, 1)] = Start(StartKind.VERIFY, lease)
                self._emit(fx.VerifyStandby(s.name))
            return
        r = slot.record
        if r.state != GroupState.RESUMING:
            self._fire_group(slot, GroupEvent.RESUME)
        r.version, r.since = None, self.now
        if answered:  # the answer, not the dead runtime's outcome, ends what it ran
            start = self.starts.get((r.name, r.incarnation))
            lease = None if start is None else start.lease
            self.starts[(r.name, r.incarnation)] = Start(StartKind.VERIFY, lease)
            self._emit(fx.VerifyGroup(r.name, r.incarnation))

    def _resume_lost(self, slot: GroupSlot | StandbySlot, silent: bool) -> None:
        """A current process the resume did not find answering: gone, or stopped here for
        its silence. It has failed (a group recovers, a standby is lost), not as a failed
        load: nobody knows whether its load ran. After every survivor is ``resuming``, so a
        recovery here never claims a standby that has not answered yet."""
        if isinstance(slot, StandbySlot):
            if silent:
                self._emit(fx.StopStandby(slot.record.name, "silent at the resume"))
            self._lose_standby(slot)
            return
        r = slot.record
        if silent:
            self._emit(fx.StopGroup(r.name, r.incarnation, "silent at the resume"))
        self._end_start(slot)
        self._fail(slot)

    def check_Shutdown(self, e: ev.Shutdown) -> None:
        self._require_open(e)

    def on_Shutdown(self, e: ev.Shutdown, _: None) -> None:
        self.closed = True
        for g in self.groups.values():
            r = g.record
            if r.state in GROUP_FINAL:
                continue
            has_process = r.state in UP | LOADING | RELAUNCHING | {GroupState.RESUMING}
            self._fire_group(g, GroupEvent.STOP)
            if has_process:
                self._emit(fx.StopGroup(r.name, r.incarnation, "shutdown"))
        for sb in list(self.standbys.values()):
            if sb.record.state not in STANDBY_FINAL:
                self._fire_standby(sb, StandbyEvent.STOP)
                self._emit(fx.StopStandby(sb.record.name, "shutdown"))
                self._forget_standby(sb)
        if self.pool.record.state != PoolState.CLOSED:
            self._fire(self.pool.machine, Label.of(Label.POOL, "standby"), PoolEvent.CLOSE)
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
                start = self.starts.get((r.name, r.incarnation))
                if start is not None and start.lease is not None:
                    self._cool(g)  # the load from the checkpoint failed
                self._fail(g, kill="load deadline")  # its lease waits for the killed start
            elif r.state in RELAUNCHING and waited >= c.deadline("relaunch"):
                self._fail(g, kill="relaunch deadline")
            elif r.state == GroupState.RESUMING and waited >= c.deadline("load"):
                self._fail(g, kill="verify deadline")  # its start, if any, awaits the answer
            elif r.ahead_of_fleet and waited >= c.deadline("load"):
                r.version, r.since = None, None  # no sync reported that push: nobody's
                self._catch_up(g)
        for sb in list(self.standbys.values()):
            s = sb.record
            if s.since is None:
                continue
            waited = e.at - s.since
            if s.state == StandbyState.BOOTING and waited >= c.deadline("relaunch"):
                self._lose_standby(sb, kill="boot deadline")
            elif s.state == StandbyState.LOADING and waited >= c.deadline("load"):
                self._lose_standby(sb, kill="load deadline")  # its lease waits for the outcome
            elif s.state == StandbyState.RESUMING and waited >= c.deadline("load"):
                self._lose_standby(sb, kill="verify deadline")  # its start awaits the answer

    # -- the health manager and the runtime, about one incarnation -----------------------------

    def check_GroupRegistered(self, e: ev.GroupRegistered) -> None:
        self._require_open(e)
        if e.group in self.groups:
            raise EventNotAllowed(f"group {e.group!r} is already registered")
        if e.group.startswith(STANDBY_PREFIX):
            raise EventNotAllowed(
                f"group {e.group!r}: names starting with {STANDBY_PREFIX!r} are the standbys'"
            )
        if e.version > self.fleet.version:
            raise UnknownVersion(
                f"group {e.group!r} claims version {e.version}, "
                f"but the fleet has only reached {self.fleet.version}"
            )

    def on_GroupRegistered(self, e: ev.GroupRegistered, _: None) -> None:
        start = GroupState.ACTIVE if e.version == self.fleet.version else GroupState.PENDING_WEIGHTS
        record = GroupRecord(
            e.group,
            self.fleet,
            e.version,
            state=start,
            restart_budget=self.config.restart_budget,
            restart_window_s=self.config.restart_window_s,
        )
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
        resuming = g.record.state == GroupState.RESUMING
        start = self._end_start(g)  # the process that read the checkpoint is gone, and its lease
        if start is not None and start.lease is not None and not resuming:
            self._cool(g)  # it died loading from the checkpoint: a failed immediate restart
        self._fail(g)

    def check_GroupVerified(self, e: ev.GroupVerified) -> GroupSlot | Orphan:
        """Only an answer to a ``VerifyGroup`` the rules asked (its ``verify`` start): one
        nobody asked for would end a start still running, and free its lease."""
        g = self._require_group(e.group)
        r = g.record
        if e.incarnation > r.incarnation:
            raise WrongIncarnation(
                f"GroupVerified for incarnation {e.incarnation} of group {e.group!r}, which "
                f"was never started (current: {r.incarnation})"
            )
        start = self.starts.get((e.group, e.incarnation))
        if start is None or start.kind != StartKind.VERIFY:
            raise EventNotAllowed(
                f"GroupVerified for incarnation {e.incarnation} of group {e.group!r}, which "
                f"nobody asked to verify (the group is {r.state}, incarnation {r.incarnation})"
            )
        if e.incarnation == r.incarnation and r.state == GroupState.RESUMING:
            return g
        return Orphan(g, e.incarnation)  # killed at its deadline: the answer ends its start

    def on_GroupVerified(self, e: ev.GroupVerified, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        self._end_start(g)  # what it was loading when the trainer died has finished
        # Weights of the future a resume abandoned are not the weights a re-run gives that
        # number (even once the fleet reached it again): they count as none.
        g.record.version = None if self._abandoned(e.version) else e.version
        self._fire_group(g, GroupEvent.VERIFIED)  # serves, or holds stale weights
        if g.record.state == GroupState.PENDING_WEIGHTS:
            self._catch_up(g)

    def check_RestartLoaded(self, e: ev.RestartLoaded) -> GroupSlot | Orphan:
        found = self._current(e, LOADING)
        if e.version is not None:
            start = self.starts[(e.group, e.incarnation)]
            if start.kind != StartKind.CLAIM or start.lease is not None:
                raise EventNotAllowed(
                    f"RestartLoaded for {e.group}#{e.incarnation} names version {e.version}: "
                    "only a standby claimed as it is may be found holding another"
                )
            if start.version is None or e.version <= start.version:
                raise EventNotAllowed(
                    f"RestartLoaded for {e.group}#{e.incarnation} found version {e.version}, "
                    f"not above the {start.version} it was claimed holding: only a push "
                    "brings a claimed standby another version (whose sync may have landed)"
                )
        return found

    def on_RestartLoaded(self, e: ev.RestartLoaded, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        start = self._end_start(g)
        assert start is not None
        r = g.record
        r.version = start.lease.version if start.lease is not None else start.version
        if e.version is not None:  # a push in flight reached the standby before its check
            r.version = e.version
        self._fire_group(g, GroupEvent.LOADED)  # serves, or holds stale weights
        if r.state == GroupState.PENDING_WEIGHTS:
            self._catch_up(g)  # a sync landed during the load; one ahead waits for its sync
            if r.ahead_of_fleet:
                r.since = self.now  # its sync is due within the load deadline

    def check_RestartLoadFailed(self, e: ev.RestartLoadFailed) -> GroupSlot | Orphan:
        return self._current(e, LOADING)

    def on_RestartLoadFailed(self, e: ev.RestartLoadFailed, found: GroupSlot | Orphan) -> None:
        g = self._settle(found)
        if g is None:
            return
        start = self._end_start(g)
        if start is not None and start.lease is not None:
            self._cool(g)  # a claim that only failed its admission read no checkpoint
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

    # -- the runtime, about one standby --------------------------------------------------------

    def check_StandbyBooted(self, e: ev.StandbyBooted) -> StandbySlot | StandbyOrphan:
        return self._standby(e, frozenset({StandbyState.BOOTING}), StartKind.BOOT)

    def on_StandbyBooted(self, e: ev.StandbyBooted, found: StandbySlot | StandbyOrphan) -> None:
        sb = self._settle_standby(found)
        if sb is None:
            return
        self._end_standby_start(sb)
        sb.record.version = None
        self._fire_standby(sb, StandbyEvent.BOOTED)
        self._catch_up_standby(sb)

    def check_StandbyLoaded(self, e: ev.StandbyLoaded) -> StandbySlot | StandbyOrphan:
        found = self._standby(e, frozenset({StandbyState.LOADING}), StartKind.LOAD)
        lease = self.starts[(e.standby, 1)].lease
        assert lease is not None
        if lease.version != e.version:
            raise EventNotAllowed(
                f"StandbyLoaded for standby {e.standby!r} reports version {e.version}, but the "
                f"load in flight is of version {lease.version}"
            )
        return found

    def on_StandbyLoaded(self, e: ev.StandbyLoaded, found: StandbySlot | StandbyOrphan) -> None:
        sb = self._settle_standby(found)
        if sb is None:
            return
        start = self.starts[(sb.record.name, 1)]
        self._end_standby_start(sb)
        assert start.lease is not None
        sb.record.version = start.lease.version
        self._fire_standby(sb, StandbyEvent.LOADED)  # current, or stale after a sync
        if sb.record.state == StandbyState.STALE:
            self._catch_up_standby(sb)
        else:
            for g in self._awaiting():
                if not self._claim_ready(g):
                    break

    def check_StandbyFailed(self, e: ev.StandbyFailed) -> StandbySlot | StandbyOrphan:
        return self._standby(e, STANDBY_UP | {StandbyState.BOOTING, StandbyState.RESUMING}, None)

    def on_StandbyFailed(self, e: ev.StandbyFailed, found: StandbySlot | StandbyOrphan) -> None:
        sb = self._settle_standby(found)
        if sb is None:
            return
        self._lose_standby(sb)

    # -- recovery rules ----------------------------------------------------------------------

    def check_StandbyVerified(self, e: ev.StandbyVerified) -> StandbySlot | StandbyOrphan:
        return self._standby(e, frozenset({StandbyState.RESUMING}), StartKind.VERIFY)

    def on_StandbyVerified(self, e: ev.StandbyVerified, found: StandbySlot | StandbyOrphan) -> None:
        sb = self._settle_standby(found)
        if sb is None:
            return
        self._end_standby_start(sb)  # what it was booting or loading has finished
        sb.record.version = None if self._abandoned(e.version) else e.version
        self._fire_standby(sb, StandbyEvent.VERIFIED)  # current, or stale
        if sb.record.state == StandbyState.STALE:
            self._catch_up_standby(sb)
        else:
            for g in self._awaiting():  # offered as a load that finished is
                if not self._claim_ready(g):
                    break

    def _abandoned(self, version: int | None) -> bool:
        """An answer's weights are of the future the last resume abandoned."""
        return version is not None and self.resumed_at is not None and version > self.resumed_at

    def _fail(self, g: GroupSlot, kill: str | None = None) -> None:
        """The group is down (``kill``: the controller decided so, and its process must be
        stopped first): choose retire, immediate restart, wait, or cold restart."""
        r = g.record
        self._fire_group(g, GroupEvent.FAIL)
        if kill is not None:
            self._emit(fx.StopGroup(r.name, r.incarnation, kill))
        r.version = None
        self._fire_group(g, GroupEvent.RETIRE, now=self.now)
        if r.state == GroupState.RETIRED:
            self._emit(fx.RetireGroup(r.name))
            return
        r.count_restart(self.now)
        self._recover(g, may_wait=True)

    def _recover(self, g: GroupSlot, may_wait: bool) -> None:
        """Bring a failed (or waiting) group back the fastest way the rules allow: a current
        standby; a standby loading C(v) in place; a restart from C(v); a wait for C(v) (only
        from ``failed``: a wait that ended does not start again); a cold start."""
        if self._claim_ready(g):
            return
        r = g.record
        if g.recovery.state != SwitchState.ENABLED:
            self._relaunch(g)
            return
        current = self.checkpoints.get(self.fleet.version)
        if current is not None and current.record.state == CheckpointState.READY:
            standby = self._first_standby(StandbyState.LOADING, StandbyState.STALE)
            if standby is not None:
                self._claim(g, standby, current)
            else:
                self._restart_from(g, current)
        elif may_wait and (
            (current is not None and current.record.state == CheckpointState.EXPORTING)
            or (
                current is None
                and self.config.export_every_sync
                and self.announced  # a sync announced v: its export follows
                and self.fleet.version not in self.finished
            )
        ):
            self._fire_group(g, GroupEvent.AWAIT_CHECKPOINT)
            r.since = self.now
        else:
            self._relaunch(g)

    def _claim_ready(self, g: GroupSlot) -> bool:
        """Claim a standby that holds the fleet's version, if there is one."""
        standby = self._first_standby(StandbyState.READY)
        if standby is None:
            return False
        self._claim(g, standby, None)
        return True

    def _claim(self, g: GroupSlot, sb: StandbySlot, ck: CheckpointSlot | None) -> None:
        """The standby's process becomes the group's next incarnation; with ``ck`` it loads
        C(v) first, under a lease of the group's (a load of its own still in flight is
        orphaned: its outcome only ends it)."""
        r = self._next_incarnation(g)
        s = sb.record
        lease = None
        if ck is not None:
            assert ck.record.state == CheckpointState.READY and ck.record.path is not None
            lease = Lease(r.name, r.incarnation, ck.record.version, self.fleet.version)
            ck.record.leases += 1
        self.starts[(r.name, r.incarnation)] = Start(StartKind.CLAIM, lease, s.version)
        self._fire_group(g, GroupEvent.CLAIM)
        self._fire_standby(sb, StandbyEvent.CLAIM)
        self._forget_standby(sb)
        version = lease.version if lease is not None else s.version
        assert version is not None
        path = ck.record.path if ck is not None else None
        self._emit(fx.ClaimStandby(r.name, r.incarnation, s.name, version, path))

    def _catch_up_standby(self, sb: StandbySlot) -> None:
        """A stale standby loads C(v) in place if it is ready, under a lease; else it waits."""
        s = sb.record
        ck = self._recovery_source()
        self._fire_standby(
            sb, StandbyEvent.RELOAD, checkpoint_path=None if ck is None else ck.record.path
        )
        if s.state != StandbyState.LOADING:
            return
        assert ck is not None and ck.record.path is not None
        s.since = self.now
        lease = Lease(s.name, 1, ck.record.version, self.fleet.version)
        self.starts[(s.name, 1)] = Start(StartKind.LOAD, lease)
        ck.record.leases += 1
        self._emit(fx.LoadStandby(s.name, lease.version, ck.record.path))

    def _lose_standby(self, sb: StandbySlot, kill: str | None = None) -> None:
        """The standby is gone (``kill``: the controller decided so and stops it; its start
        stays until its outcome arrives). Lost before it ever held the fleet's weights, it
        is a failed boot of the pool; not while resuming: what it was booting died with the
        trainer that asked for it."""
        s = sb.record
        resuming = s.state == StandbyState.RESUMING
        if kill is None:
            self._end_standby_start(sb)
        self._fire_standby(sb, StandbyEvent.FAIL)
        if kill is not None:
            self._emit(fx.StopStandby(s.name, kill))
        if not s.ever_ready and not resuming:
            self.pool.record.failed_boots += 1
            self._fire(self.pool.machine, Label.of(Label.POOL, "standby"), PoolEvent.BOOT_FAILED)
        self._forget_standby(sb)

    def _refill(self) -> None:
        """Boot standbys until the pool has its size again (while open and not exhausted),
        once no claim is being checked: a boot started beside a claim's admission check
        competes with it for the host's cores (``benchmarks/bench_claim.py``)."""
        pool = self.pool.record
        if self.closed or pool.state != PoolState.FILLING:
            return
        alive = sum(1 for sb in self.standbys.values() if sb.record.state not in STANDBY_FINAL)
        if alive >= pool.size or self._claim_checked():  # full first: a scan of every group
            return  # after every event would make an event's cost grow with the fleet
        for _ in range(pool.size - alive):
            self.standby_serial += 1
            name = f"{STANDBY_PREFIX}{self.standby_serial}"
            record = StandbyRecord(name, self.fleet, since=self.now, state=StandbyState.BOOTING)
            self.standbys[name] = StandbySlot(record, build=True)
            self.starts[(name, 1)] = Start(StartKind.BOOT, None)
            self.transitions.append(
                (Label.of(Label.STANDBY, name), Label.CREATE, "", StandbyState.BOOTING)
            )
            self._emit(fx.StartStandby(name))

    def _claim_checked(self) -> bool:
        """A claim of a standby awaits its outcome (its load or admission check)."""
        return any(g.record.state == GroupState.CLAIMING for g in self.groups.values())

    def _first_standby(self, *states: str) -> StandbySlot | None:
        """The oldest standby in the first of ``states`` that has one."""
        for state in states:
            for sb in self.standbys.values():
                if sb.record.state == state:
                    return sb
        return None

    def _standbys_in(self, state: str) -> list[StandbySlot]:
        return [sb for sb in self.standbys.values() if sb.record.state == state]

    def _end_standby_start(self, sb: StandbySlot) -> None:
        """A standby's boot or load reported (or it died): forget it, free its lease."""
        start = self.starts.pop((sb.record.name, 1), None)
        if start is not None and start.lease is not None:
            ck = self.checkpoints[start.lease.version]
            ck.record.leases -= 1
            self._reap(ck)

    def _forget_standby(self, sb: StandbySlot) -> None:
        """A standby in a final state is kept only while a start of it is in flight."""
        if sb.record.state in STANDBY_FINAL and (sb.record.name, 1) not in self.starts:
            del self.standbys[sb.record.name]

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
        self.starts[(r.name, r.incarnation)] = Start(StartKind.LOAD, lease)
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
        self.starts[(r.name, r.incarnation)] = Start(StartKind.LOAD, lease)
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
        self.starts[(r.name, r.incarnation)] = Start(StartKind.RELAUNCH, None)
        self._fire_group(g, GroupEvent.RELAUNCH)
        self._emit(fx.RestartCold(r.name, r.incarnation))

    def _next_incarnation(self, g: GroupSlot) -> GroupRecord:
        r = g.record
        r.incarnation += 1
        r.since = self.now
        return r

    def _end_start(self, g: GroupSlot, incarnation: int | None = None) -> Start | None:
        """The outcome of a start arrived (or its process died): forget it, free its lease."""
        key = (g.record.name, g.record.incarnation if incarnation is None else incarnation)
        start = self.starts.pop(key, None)
        if start is None or start.lease is None:
            return start
        ck = self.checkpoints[start.lease.version]
        ck.record.leases -= 1
        self._reap(ck)
        return start

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
        if ck.record.abandoned_future:
            return  # its version comes anew after the resume
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
            if name in self.standbys:
                what = "the boot" if start.lease is None else f"a load of C({start.lease.version})"
                if start.kind == StartKind.VERIFY:
                    what = "the answer since the resume"
                out.append(f"{what} of standby {name!r} has not reported")
                continue
            what = {
                StartKind.RELAUNCH: "a cold start", StartKind.CLAIM: "a claim of a standby"
            }.get(start.kind, f"a load of C({start.lease.version if start.lease else '?'})")
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
            elif g.record.state == GroupState.RESUMING:
                out.append(f"group {name!r} has not answered since the resume")
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
        if (
            start is not None
            and self._orphaned(g, e.incarnation, start)
            and isinstance(e, (ev.GroupFailed, *_OUTCOMES[start.kind]))
        ):
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
        waiting = _WAITS_IN[start.kind]
        return incarnation != g.record.incarnation or g.record.state not in waiting

    def _standby_number(self, name: str) -> int | None:
        """The serial of a standby this controller named, or None for any other name."""
        number = name.removeprefix(STANDBY_PREFIX)
        if name == number or not number.isdigit() or str(int(number)) != number:
            return None
        n = int(number)
        return n if 1 <= n <= self.standby_serial else None

    def _standby(
        self,
        e: ev.StandbyBooted | ev.StandbyLoaded | ev.StandbyFailed | ev.StandbyVerified,
        states: frozenset[str],
        kind: StartKind | None,
    ) -> StandbySlot | StandbyOrphan:
        """The standby, when ``e`` is about it in one of ``states`` with a start of ``kind``
        in flight (None: any or none); a ``StandbyOrphan`` when ``e`` is the outcome of a
        start of a standby that was lost, stopped or claimed since. Anything else is refused."""
        sb = self.standbys.get(e.standby)
        if sb is None:
            known = self._standby_number(e.standby) is not None
            raise EventNotAllowed(
                f"{e.kind} for standby {e.standby!r}, which was handed over, lost or stopped"
                if known
                else f"{e.kind} for unknown standby {e.standby!r}"
            )
        start = self.starts.get((e.standby, 1))
        state = sb.record.state
        if state in states and (kind is None or (start is not None and start.kind == kind)):
            return sb
        if state in STANDBY_FINAL and start is not None and kind in (None, start.kind):
            return StandbyOrphan(e.standby)
        raise EventNotAllowed(
            f"{e.kind} for standby {e.standby!r} expects it in one of {sorted(states)}, "
            f"but it is {state}"
        )

    def _settle_standby(self, found: StandbySlot | StandbyOrphan) -> StandbySlot | None:
        """The standby an event acts on; an orphan's outcome only ends its start."""
        if isinstance(found, StandbyOrphan):
            sb = self.standbys[found.name]
            self._end_standby_start(sb)
            self._forget_standby(sb)
            return None
        return found

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

    def _fire_standby(self, sb: StandbySlot, event: str, **facts: Any) -> None:
        """Move a standby; the first time it holds the fleet's weights its boot succeeded."""
        s = sb.record
        self._fire(sb.machine, Label.of(Label.STANDBY, s.name), event, **facts)
        if s.state not in {StandbyState.BOOTING, StandbyState.LOADING, StandbyState.RESUMING}:
            s.since = None
        if s.state == StandbyState.READY and not s.ever_ready:
            s.ever_ready = True
            self.pool.record.failed_boots = 0

    def _fire_ck(self, ck: CheckpointSlot, event: str) -> None:
        self._fire(ck.machine, Label.of(Label.CHECKPOINT, ck.record.version), event)

    def _fire_group(self, g: GroupSlot, event: str, **facts: Any) -> None:
        """Move a group; when that changes whether it may serve, tell the router."""
        r = g.record
        was_serving = r.state in SERVING
        self._fire(g.machine, Label.of(Label.GROUP, r.name), event, **facts)
        if r.state not in WAITING and not r.ahead_of_fleet:  # ahead: it waits for its sync
            r.since = None
        serving = r.state in SERVING
        if serving and not was_serving:
            self._emit(fx.RouteTraffic(r.name, r.incarnation, self.fleet.version))
        elif was_serving and not serving:
            r.probe_failures = 0  # probes count within one spell of serving
            self._emit(fx.WithdrawTraffic(r.name, r.incarnation))

    def _emit(self, effect: fx.Effect) -> None:
        self.effects.append(effect)


_check_rule_names(Rules)
