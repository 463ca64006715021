"""The state machines. They hold the legal state graph and every choice a state can make
on its own data: where an event has several targets, the guards pick one, so the diagrams show
the decision. The rules (``rules.py``) decide which event to send and when.

A choice that keeps the state (a self-loop such as ``sync`` on an active group that got the
weights) changes nothing and is not journaled as a transition.

Each machine keeps its state on an attrs record (python-statemachine's "model"), so guards
read plain data and a snapshot is a copy of records. The named state sets at the end are the
one vocabulary the rules, the invariants and the search share; most are read off the graph.
"""

from __future__ import annotations

import functools
import inspect
from typing import Final

import attrs
from statemachine import State, StateMachine


@attrs.define(eq=False)
class Fleet:
    """Shared by every group record: the weight version the fleet serves now."""

    version: int


@attrs.define(eq=False)
class CheckpointRecord:
    version: int
    pinned: bool = False
    path: str | None = None
    leases: int = 0
    state: str | None = None
    # Newer than the version a trainer resumed at: a future the run does not follow. Its
    # version is synced and exported anew once it is gone.
    abandoned_future: bool = False

    @property
    def reapable(self) -> bool:
        """May be deleted: nobody loads from it and the user does not keep it."""
        return self.leases == 0 and not self.pinned


@attrs.define(eq=False)
class GroupRecord:
    name: str
    fleet: Fleet
    version: int | None
    incarnation: int = 1  # the current start of the group's process
    probe_failures: int = 0
    restarts: int = 0  # every restart of the run
    since: float | None = None  # when the current wait (a deadline's clock) began
    state: str | None = None
    restart_budget: int = 5
    restart_window_s: float | None = None  # None: every restart of the run counts
    # With a window: when each failure still counted against the budget happened, oldest
    # first (at most ``restart_budget`` of them).
    restarted_at: list[float] = attrs.Factory(list)

    @property
    def serves_current(self) -> bool:
        return self.version == self.fleet.version

    @property
    def ahead_of_fleet(self) -> bool:
        """It holds a version above the fleet's: a push in flight reached it before its
        claim was checked, and the sync that reports that push is still to come."""
        return self.version is not None and self.version > self.fleet.version

    def counted(self, now: float) -> list[float]:
        """With a window, the failures that count against the budget at ``now``: those less
        than ``restart_window_s`` ago (the budget refills as they age out)."""
        window = self.restart_window_s
        return [t for t in self.restarted_at if window is not None and now - t < window]

    def budget_spent(self, now: float) -> bool:
        if self.restart_window_s is None:
            return self.restarts >= self.restart_budget  # every restart of the run counts
        return len(self.counted(now)) >= self.restart_budget

    def count_restart(self, now: float) -> None:
        if self.restart_window_s is not None:
            self.restarted_at = [*self.counted(now), now][-self.restart_budget :]
        self.restarts += 1

    @staticmethod
    def may_load_checkpoints(switch_state: str) -> bool:
        """Its immediate-recovery switch allows loading the recovery checkpoint (``switch_state``
        is passed with the event: the switch is another machine)."""
        return switch_state == SwitchState.ENABLED

    @staticmethod
    def checkpoint_ready(checkpoint_path: str | None) -> bool:
        """C(v) is committed and current: ``checkpoint_path`` is its path, passed with the event."""
        return checkpoint_path is not None


@attrs.define(eq=False)
class StandbyRecord:
    """A warm engine kept booted for the next failed group; never routed."""

    name: str
    fleet: Fleet
    version: int | None = None  # the weights it holds while up
    since: float | None = None  # when its boot or its load began (a deadline's clock)
    ever_ready: bool = False  # it held the fleet's weights once: its boot succeeded
    state: str | None = None

    @property
    def holds_current(self) -> bool:
        return self.version == self.fleet.version

    @staticmethod
    def checkpoint_ready(checkpoint_path: str | None) -> bool:
        """C(v) is committed and current (its path is passed with the event)."""
        return checkpoint_path is not None


@attrs.define(eq=False)
class PoolRecord:
    """The standby pool: its size, and how many standbys in a row were lost before they
    ever held the fleet's weights (a pool that keeps failing to boot stops trying)."""

    size: int
    boot_budget: int
    failed_boots: int = 0
    state: str | None = None

    @property
    def spent(self) -> bool:
        return self.failed_boots >= self.boot_budget


@attrs.define(eq=False)
class RecoveryRecord:
    group: str
    required_clean_syncs: int
    clean_streak: int = 0
    state: str | None = None

    @property
    def cooled_down(self) -> bool:
        return self.clean_streak >= self.required_clean_syncs

    def completes_streak(self) -> bool:
        """This clean sync is the Nth in a row."""
        return self.clean_streak + 1 >= self.required_clean_syncs

    def count_clean(self) -> None:
        self.clean_streak += 1

    def restart_count(self) -> None:
        self.clean_streak = 0


class CheckpointMachine(StateMachine):
    """One exported recovery checkpoint C(v)."""

    exporting = State(initial=True)
    ready = State()
    superseded = State()
    abandoned = State()
    deletable = State()
    deleted = State(final=True)
    failed = State(final=True)
    discarded = State(final=True)

    # The write finished. A stale (abandoned) write is removed at once unless pinned.
    commit = (
        exporting.to(ready) | abandoned.to(deletable, cond="reapable") | abandoned.to(superseded)
    )
    # A newer version was synced: a ready C(v) is no longer the recovery source.
    supersede = ready.to(superseded)
    # A newer version was synced while C(v) was still being written: it must never be used.
    abandon = exporting.to(abandoned)
    fail = exporting.to(failed) | abandoned.to(discarded)
    cancel = exporting.to(discarded) | abandoned.to(discarded)
    # The only way to deletion: no lease holds it and it is not pinned. Offered when it is
    # superseded and whenever a lease ends; a ready C(v) is still the recovery source.
    reap = (
        superseded.to(deletable, cond="reapable")
        | superseded.to(superseded, unless="reapable")
        | ready.to(ready)
    )
    remove = deletable.to(deleted)
    # The trainer resumed at this version: its committed checkpoint is the source again.
    revive = superseded.to(ready)


# The guard of a load in place; both facts come with the event.
_CATCH_UP = "may_load_checkpoints and checkpoint_ready and not ahead_of_fleet"


class WorkerGroupMachine(StateMachine):
    """One rollout worker group."""

    active = State(initial=True)
    suspect = State()
    failed = State()
    awaiting_checkpoint = State()
    loading = State()
    claiming = State()
    relaunching = State()
    pending_weights = State()
    # The trainer resumed: its process (if any survived) has not yet said what it holds.
    resuming = State()
    retired = State(final=True)
    stopped = State(final=True)

    probe_failed = active.to(suspect)
    probe_ok = suspect.to(active)
    fail = (
        active.to(failed)
        | suspect.to(failed)
        | pending_weights.to(failed)
        | loading.to(failed)
        | claiming.to(failed)
        | relaunching.to(failed)
        | resuming.to(failed)
    )
    await_checkpoint = failed.to(awaiting_checkpoint)
    # A warm standby becomes the group's next process: admitted as it is if it holds the
    # fleet's version, else after it loads C(v) in place.
    claim = failed.to(claiming) | awaiting_checkpoint.to(claiming)
    load = failed.to(loading) | awaiting_checkpoint.to(loading)
    relaunch = failed.to(relaunching) | awaiting_checkpoint.to(relaunching)
    # A load finished: it serves if it loaded the fleet's version, else it holds stale weights
    # (a sync landed during the load).
    loaded = (
        loading.to(active, cond="serves_current")
        | loading.to(pending_weights, unless="serves_current")
        | claiming.to(active, cond="serves_current")
        | claiming.to(pending_weights, unless="serves_current")
    )
    relaunched = relaunching.to(pending_weights)
    # A process that holds older weights (or none) loads C(v) in place, without a restart,
    # if C(v) is ready and its switch allows it; otherwise it waits for the next sync.
    reload = pending_weights.to(loading, cond=_CATCH_UP) | pending_weights.to(
        pending_weights, unless=_CATCH_UP
    )
    # A weight sync, offered to every up group: only a group holding the fleet's version
    # serves, so a waiting one is admitted and one the trainer left out is demoted.
    sync = (
        pending_weights.to(active, cond="serves_current")
        | pending_weights.to(pending_weights, unless="serves_current")
        | active.to(pending_weights, unless="serves_current")
        | active.to(active, cond="serves_current")
        | suspect.to(pending_weights, unless="serves_current")
        | suspect.to(suspect, cond="serves_current")
    )
    # A failed group whose restart budget is spent retires; else it stays failed and
    # recovers. With a window the budget refills as restarts age out of it.
    retire = failed.to(retired, cond="budget_spent") | failed.to(failed, unless="budget_spent")
    # After the trainer's restart nothing is trusted: every process must say what it holds.
    resume = (
        active.to(resuming)
        | suspect.to(resuming)
        | pending_weights.to(resuming)
        | loading.to(resuming)
        | claiming.to(resuming)
        | relaunching.to(resuming)
    )
    # It answered: it serves if it holds the fleet's version, else it holds stale weights.
    verified = resuming.to(active, cond="serves_current") | resuming.to(
        pending_weights, unless="serves_current"
    )
    stop = (
        active.to(stopped)
        | suspect.to(stopped)
        | failed.to(stopped)
        | awaiting_checkpoint.to(stopped)
        | loading.to(stopped)
        | claiming.to(stopped)
        | relaunching.to(stopped)
        | pending_weights.to(stopped)
        | resuming.to(stopped)
    )


class StandbyMachine(StateMachine):
    """One warm standby engine: booted without weights, kept current (a sync's push, or a
    load of C(v) in place), handed to exactly one failed group."""

    booting = State(initial=True)
    stale = State()
    loading = State()
    ready = State()
    # The trainer resumed: the standby, if it survived, has not yet said what it holds.
    resuming = State()
    claimed = State(final=True)
    lost = State(final=True)
    stopped = State(final=True)

    booted = booting.to(stale)
    # Up with older weights (or none): load C(v) in place if it is ready, else wait.
    reload = stale.to(loading, cond="checkpoint_ready") | stale.to(stale, unless="checkpoint_ready")
    loaded = loading.to(ready, cond="holds_current") | loading.to(stale, unless="holds_current")
    # A sync: the standby is current if the push reached it, stale if it was left out.
    sync = (
        stale.to(ready, cond="holds_current")
        | stale.to(stale, unless="holds_current")
        | ready.to(stale, unless="holds_current")
        | ready.to(ready, cond="holds_current")
    )
    # A failed group takes it: as it is when ready; stale or loading, after a load of C(v).
    claim = ready.to(claimed) | stale.to(claimed) | loading.to(claimed)
    # After the trainer's restart nothing is trusted: the standby must say what it holds.
    resume = booting.to(resuming) | stale.to(resuming) | loading.to(resuming) | ready.to(resuming)
    # It answered: current if it holds the fleet's version, else stale (it catches up).
    verified = resuming.to(ready, cond="holds_current") | resuming.to(stale, unless="holds_current")
    # Died, failed its boot, its load or its check, or was killed at a deadline.
    fail = booting.to(lost) | stale.to(lost) | loading.to(lost) | ready.to(lost) | resuming.to(lost)
    stop = (
        booting.to(stopped)
        | stale.to(stopped)
        | loading.to(stopped)
        | ready.to(stopped)
        | resuming.to(stopped)
    )


class StandbyPoolMachine(StateMachine):
    """The pool refills after every claim or loss, until standbys keep failing to boot."""

    filling = State(initial=True)
    exhausted = State()
    closed = State(final=True)

    # A standby was lost before it ever held the fleet's weights: at the budget, stop.
    boot_failed = (
        filling.to(exhausted, cond="spent")
        | filling.to(filling, unless="spent")
        | exhausted.to(exhausted)
    )
    close = filling.to(closed) | exhausted.to(closed)


class ImmediateRecoveryMachine(StateMachine):
    """Whether one group may boot from the recovery checkpoint when it fails."""

    enabled = State(initial=True)
    cooldown = State()
    # Immediate recovery off for the whole run: a start state the configuration chooses, so
    # no transition leads to it.
    disabled = State()
    validate_disconnected_states = False

    # A missed export or a failed load from the checkpoint: take the cold path for a while;
    # while cooling already, the count of clean syncs starts again.
    cool = (
        enabled.to(cooldown, on="restart_count")
        | cooldown.to(cooldown, on="restart_count")
        | disabled.to(disabled)
    )
    # A clean sync: counted while cooling; the Nth in a row re-enables.
    clean_sync = (
        cooldown.to(enabled, cond="completes_streak", on="restart_count")
        | cooldown.to(cooldown, unless="completes_streak", on="count_clean")
        | enabled.to(enabled)
        | disabled.to(disabled)
    )


# -- names, checked against the graphs --------------------------------------------------
# The rules, the invariants and the ledger name states and events through these classes,
# never as bare strings: a misspelt name fails at import (``_check`` below), not in a race.


class CheckpointState:
    EXPORTING: Final = "exporting"
    READY: Final = "ready"
    SUPERSEDED: Final = "superseded"
    ABANDONED: Final = "abandoned"
    DELETABLE: Final = "deletable"
    DELETED: Final = "deleted"
    FAILED: Final = "failed"
    DISCARDED: Final = "discarded"


class CheckpointEvent:
    COMMIT: Final = "commit"
    SUPERSEDE: Final = "supersede"
    ABANDON: Final = "abandon"
    FAIL: Final = "fail"
    CANCEL: Final = "cancel"
    REAP: Final = "reap"
    REMOVE: Final = "remove"
    REVIVE: Final = "revive"


class GroupState:
    ACTIVE: Final = "active"
    SUSPECT: Final = "suspect"
    FAILED: Final = "failed"
    AWAITING_CHECKPOINT: Final = "awaiting_checkpoint"
    LOADING: Final = "loading"
    CLAIMING: Final = "claiming"
    RELAUNCHING: Final = "relaunching"
    PENDING_WEIGHTS: Final = "pending_weights"
    RESUMING: Final = "resuming"
    RETIRED: Final = "retired"
    STOPPED: Final = "stopped"


class GroupEvent:
    PROBE_FAILED: Final = "probe_failed"
    PROBE_OK: Final = "probe_ok"
    FAIL: Final = "fail"
    AWAIT_CHECKPOINT: Final = "await_checkpoint"
    CLAIM: Final = "claim"
    LOAD: Final = "load"
    RELAUNCH: Final = "relaunch"
    LOADED: Final = "loaded"
    RELAUNCHED: Final = "relaunched"
    RELOAD: Final = "reload"
    SYNC: Final = "sync"
    RETIRE: Final = "retire"
    RESUME: Final = "resume"
    VERIFIED: Final = "verified"
    STOP: Final = "stop"


class StandbyState:
    BOOTING: Final = "booting"
    STALE: Final = "stale"
    LOADING: Final = "loading"
    READY: Final = "ready"
    RESUMING: Final = "resuming"
    CLAIMED: Final = "claimed"
    LOST: Final = "lost"
    STOPPED: Final = "stopped"


class StandbyEvent:
    BOOTED: Final = "booted"
    RELOAD: Final = "reload"
    LOADED: Final = "loaded"
    SYNC: Final = "sync"
    CLAIM: Final = "claim"
    RESUME: Final = "resume"
    VERIFIED: Final = "verified"
    FAIL: Final = "fail"
    STOP: Final = "stop"


class PoolState:
    FILLING: Final = "filling"
    EXHAUSTED: Final = "exhausted"
    CLOSED: Final = "closed"


class PoolEvent:
    BOOT_FAILED: Final = "boot_failed"
    CLOSE: Final = "close"


class SwitchState:
    """A group's immediate-recovery switch."""

    ENABLED: Final = "enabled"
    COOLDOWN: Final = "cooldown"
    DISABLED: Final = "disabled"


class SwitchEvent:
    COOL: Final = "cool"
    CLEAN_SYNC: Final = "clean_sync"


class Label:
    """How a journal's transition record names its machine: ``<kind>:<name>``."""

    CHECKPOINT: Final = "checkpoint"
    GROUP: Final = "group"
    RECOVERY: Final = "recovery"
    STANDBY: Final = "standby"
    POOL: Final = "pool"
    # The pseudo-event of a machine's creation (its source state is "").
    CREATE: Final = "create"

    @staticmethod
    def of(kind: str, name: object) -> str:
        return f"{kind}:{name}"


def names(cls: type) -> frozenset[str]:
    """The values of a names class."""
    return frozenset(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))


def _check(machine: type[StateMachine], states: type, events: type) -> None:
    graph_states = {s.id for s in machine.states}
    graph_events = {e.id for e in getattr(machine, "events")}  # noqa: B009 (untyped here)
    if names(states) != graph_states or names(events) != graph_events:
        raise AssertionError(
            f"{machine.__name__}: names {sorted(names(states))}/{sorted(names(events))} "
            f"differ from the graph's {sorted(graph_states)}/{sorted(graph_events)}"
        )


_check(CheckpointMachine, CheckpointState, CheckpointEvent)
_check(WorkerGroupMachine, GroupState, GroupEvent)
_check(ImmediateRecoveryMachine, SwitchState, SwitchEvent)
_check(StandbyMachine, StandbyState, StandbyEvent)
_check(StandbyPoolMachine, PoolState, PoolEvent)


@functools.cache
def sources(machine: type[StateMachine], event: str) -> frozenset[str]:
    """The states in which ``machine`` accepts ``event``, read off its graph."""
    return frozenset(
        state.id for state in machine.states for t in state.transitions if event in t.events
    )


@functools.cache
def _choices(
    machine: type[StateMachine], state: str, event: str
) -> tuple[tuple[str, tuple[tuple[str, bool], ...] | None, tuple[str, ...]], ...]:
    """``event``'s transitions out of ``state`` in the order the machine tries them: (target,
    its guards as (name, negated) or None if one is not a plain name, its action names)."""
    out = []
    for s in machine.states:
        if s.id != state:
            continue
        for t in s.transitions:
            if event not in t.events:
                continue
            guards: list[tuple[str, bool]] | None = []
            for spec in t.cond:
                name = str(spec)
                negated = name.startswith("!")
                name = name.removeprefix("!")
                if guards is not None and name.isidentifier():
                    guards.append((name, negated))
                else:
                    guards = None
            # Every callback a dispatch would run: the transition's, and the state's own
            # exit and entry (a self-loop here is external: it leaves and enters again).
            callbacks = (*t.validators, *t.before, *t.on, *t.after, *s.exit, *s.enter)
            out.append((t.target.id, None if guards is None else tuple(guards),
                        tuple(str(a) for a in callbacks)))  # fmt: skip
    return tuple(out)


@functools.cache
def _runs_callbacks(
    machine: type[StateMachine], record: type, state: str, event: str
) -> tuple[bool, ...]:
    """For each of ``event``'s transitions out of ``state``: whether the machine's or the
    record's class defines one of the callbacks a dispatch of it would run."""
    return tuple(
        any(
            callable(getattr(record, a, None)) or callable(getattr(machine, a, None))
            for a in actions
        )
        for _, _, actions in _choices(machine, state, event)
    )


def stays(sm: StateMachine, event: str) -> bool:
    """True when sending ``event`` would take a self-loop that runs no callback: the state and
    the record stay as they are, so the send can be skipped (a self-loop's dispatch costs as
    much as a transition's, and a sync offers one to every group). Read off the graph and
    the record's plain guards; anything else (a guard that takes the event's facts, a guard
    or a callback the machine's or the record's class defines, no transition allowed) answers
    False and the machine decides. Listeners are not consulted: the rules attach none."""
    model = sm.model
    choices = _choices(type(sm), model.state, event)
    record: type = type(model)
    runs = _runs_callbacks(type(sm), record, model.state, event)
    for (target, guards, _), callbacks in zip(choices, runs, strict=True):
        if guards is None:
            return False
        passed = True
        for name, negated in guards:
            if not hasattr(model, name) or hasattr(type(sm), name):
                return False  # a guard the machine itself holds
            value = getattr(model, name)
            if callable(value):
                if inspect.signature(value).parameters:
                    return False  # it takes the event's facts
                value = value()
            if bool(value) == negated:
                passed = False
                break
        if passed:
            return target == model.state and not callbacks
    return False


def _final(machine: type[StateMachine]) -> frozenset[str]:
    return frozenset(state.id for state in machine.states if state.final)


# -- the shared vocabulary ----------------------------------------------------------------
# A group's process may serve traffic (the router sends it requests).
SERVING = frozenset({GroupState.ACTIVE, GroupState.SUSPECT})
# A group's process is up and can receive a weight push.
UP = SERVING | {GroupState.PENDING_WEIGHTS}
# A start of the group's process (from a checkpoint, or cold) is in flight.
LOADING = sources(WorkerGroupMachine, GroupEvent.LOADED)
RELAUNCHING = sources(WorkerGroupMachine, GroupEvent.RELAUNCHED)
# The group waits under a deadline.
WAITING = LOADING | RELAUNCHING | {GroupState.AWAITING_CHECKPOINT, GroupState.RESUMING}
GROUP_FINAL = _final(WorkerGroupMachine)
# A standby's process is up (booted) and not handed over.
STANDBY_UP = frozenset({StandbyState.STALE, StandbyState.LOADING, StandbyState.READY})
STANDBY_FINAL = _final(StandbyMachine)
# Checkpoint states whose files are complete on disk.
COMMITTED = frozenset(
    {CheckpointState.READY, CheckpointState.SUPERSEDED, CheckpointState.DELETABLE}
)

MACHINES: dict[str, type[StateMachine]] = {
    "checkpoint": CheckpointMachine,
    "worker_group": WorkerGroupMachine,
    "immediate_recovery": ImmediateRecoveryMachine,
    "standby": StandbyMachine,
    "standby_pool": StandbyPoolMachine,
}


# How the export of the version a sync leaves had fared by that sync: the one vocabulary of
# the rules (which cool on a miss), the ledger and the trainer hooks.
SYNC_CLEAN, SYNC_MISSED, SYNC_NONE = "clean", "missed", "none"
SYNC_VERDICTS = (SYNC_CLEAN, SYNC_MISSED, SYNC_NONE)


def sync_verdict(export_committed: bool | None) -> str:
    """``clean`` if the export committed, ``missed`` if it started and did not (still
    writing, failed or cancelled), ``none`` if it never started (the sync does not count)."""
    if export_committed is None:
        return SYNC_NONE
    return SYNC_CLEAN if export_committed else SYNC_MISSED
