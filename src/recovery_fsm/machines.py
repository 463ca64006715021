"""The three state machines. They hold the legal state graph and the guards that protect the
safety rules; the rules (``rules.py``) decide which event to send and when.

Each machine keeps its state on an attrs record (python-statemachine's "model"), so guards
read plain data and a snapshot is a copy of records. The named state sets at the end are the
one vocabulary the rules, the invariants and the search share; most are read off the graph.
"""

from __future__ import annotations

import functools

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
    restarts: int = 0
    since: float | None = None  # when the current wait (a deadline's clock) began
    state: str | None = None

    @property
    def serves_current(self) -> bool:
        return self.version == self.fleet.version


@attrs.define(eq=False)
class RecoveryRecord:
    group: str
    required_clean_syncs: int
    clean_streak: int = 0
    state: str | None = None

    @property
    def cooled_down(self) -> bool:
        return self.clean_streak >= self.required_clean_syncs


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
    # The only way to deletion: no lease holds it and it is not pinned.
    reap = superseded.to(deletable, cond="reapable")
    remove = deletable.to(deleted)


class WorkerGroupMachine(StateMachine):
    """One rollout worker group."""

    active = State(initial=True)
    suspect = State()
    failed = State()
    awaiting_checkpoint = State()
    loading = State()
    relaunching = State()
    pending_weights = State()
    retired = State(final=True)
    stopped = State(final=True)

    probe_failed = active.to(suspect)
    probe_ok = suspect.to(active)
    fail = (
        active.to(failed)
        | suspect.to(failed)
        | pending_weights.to(failed)
        | loading.to(failed)
        | relaunching.to(failed)
    )
    await_checkpoint = failed.to(awaiting_checkpoint)
    load = failed.to(loading) | awaiting_checkpoint.to(loading)
    relaunch = failed.to(relaunching) | awaiting_checkpoint.to(relaunching)
    loaded_stale = loading.to(pending_weights)
    relaunched = relaunching.to(pending_weights)
    # A process that holds older weights loads the current checkpoint without a restart.
    reload = pending_weights.to(loading)
    # Re-admission is guarded: only a group holding the fleet's current weights serves.
    admit = loading.to(active, cond="serves_current") | pending_weights.to(
        active, cond="serves_current"
    )
    # An up group the trainer left out of a weight sync holds stale weights.
    demote = active.to(pending_weights) | suspect.to(pending_weights)
    retire = failed.to(retired)
    stop = (
        active.to(stopped)
        | suspect.to(stopped)
        | failed.to(stopped)
        | awaiting_checkpoint.to(stopped)
        | loading.to(stopped)
        | relaunching.to(stopped)
        | pending_weights.to(stopped)
    )


class ImmediateRecoveryMachine(StateMachine):
    """Whether one group may boot from the recovery checkpoint when it fails."""

    enabled = State(initial=True)
    cooldown = State()
    disabled = State(final=True)

    # A missed export or a failed immediate restart: take the cold path for a while.
    cool = enabled.to(cooldown)
    # Back after N consecutive clean syncs.
    reenable = cooldown.to(enabled, cond="cooled_down")
    disable = enabled.to(disabled) | cooldown.to(disabled)


@functools.cache
def sources(machine: type[StateMachine], event: str) -> frozenset[str]:
    """The states in which ``machine`` accepts ``event``, read off its graph."""
    return frozenset(
        state.id for state in machine.states for t in state.transitions if event in t.events
    )


def _final(machine: type[StateMachine]) -> frozenset[str]:
    return frozenset(state.id for state in machine.states if state.final)


# -- the shared vocabulary ----------------------------------------------------------------
# A group's process may serve traffic (the router sends it requests).
SERVING = frozenset({"active", "suspect"})
# A group's process is up and can receive a weight push.
UP = SERVING | {"pending_weights"}
# A start of the group's process (from a checkpoint, or cold) is in flight.
LOADING = sources(WorkerGroupMachine, "loaded_stale")
RELAUNCHING = sources(WorkerGroupMachine, "relaunched")
# The group waits under a deadline.
WAITING = LOADING | RELAUNCHING | {"awaiting_checkpoint"}
GROUP_FINAL = _final(WorkerGroupMachine)
# Checkpoint states whose files are complete on disk.
COMMITTED = frozenset({"ready", "superseded", "deletable"})

MACHINES: dict[str, type[StateMachine]] = {
    "checkpoint": CheckpointMachine,
    "worker_group": WorkerGroupMachine,
    "immediate_recovery": ImmediateRecoveryMachine,
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
