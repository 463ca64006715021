"""Hosting the rules: one lock, a journal, fail-stop, and the queries a runtime needs.

Sans-I/O in the manner of h11: the controller reads no clock, touches no file and starts no
thread. The rules live in ``rules.py``; this module only decides how an event reaches them.

The contract of :meth:`RecoveryController.handle`, whatever raises:

* a refused event raises a ``RecoveryError`` and changes nothing;
* an accepted event is applied completely and its effects are returned. A journal sink that
  raises afterwards does not undo that: the failure is logged, counted in
  ``journal_failures`` and marked in the next record the sink takes (``"lost"``);
* any other error inside the rules is a bug: the controller stops for good (fail-stop, as h11
  does) and refuses every later event with ``ControllerBroken`` naming the first error.
  Recover by building a fresh controller from the journal (``recovery_fsm.search.replay``).

Events from several threads are serialized under one re-entrant lock and run to completion;
a sink may read the controller, but an event sent from inside another is refused.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import attrs

from . import effects as fx
from . import events as ev
from .codec import encode
from .config import RecoveryConfig
from .errors import (
    ControllerBroken,
    EventNotAllowed,
    InvariantViolation,
    MalformedEvent,
    RecoveryError,
    UnknownGroup,
    UnknownVersion,
)
from .invariants import violations
from .machines import LOADING, RELAUNCHING, SERVING, STANDBY_FINAL, UP, StandbyState
from .rules import FINISHED_KEPT, Rules
from .state import Lease

__all__ = [
    "CheckpointView",
    "GroupView",
    "JournalSink",
    "Lease",
    "RecoveryConfig",
    "RecoveryController",
]

JournalSink = Callable[[dict[str, Any]], None]
log = logging.getLogger(__name__)
_EVENT_CLASSES = frozenset(ev.EVENT_TYPES.values())


@attrs.frozen
class GroupView:
    name: str
    state: str
    incarnation: int
    version: int | None  # the weights its current process holds, if up
    recovery: str  # its immediate-recovery switch: enabled, cooldown or disabled
    restarts: int
    lease: Lease | None  # held by its current incarnation while its load runs

    @property
    def serving(self) -> bool:
        """Routed: requests may go to its current process."""
        return self.state in SERVING

    @property
    def up(self) -> bool:
        """Its current process runs and can take a weight push."""
        return self.state in UP

    @property
    def loading(self) -> bool:
        """Its current process loads a checkpoint (a restart's, or in place)."""
        return self.state in LOADING

    @property
    def starting(self) -> bool:
        """A start of its process is in flight (from a checkpoint, in place, or cold)."""
        return self.state in LOADING | RELAUNCHING


@attrs.frozen
class StandbyView:
    name: str
    state: str  # booting, stale, loading, ready or resuming (handed-over, lost: forgotten)
    version: int | None  # the weights it holds, if up

    @property
    def ready(self) -> bool:
        """It holds the fleet's version: a failed group takes it as it is."""
        return self.state == StandbyState.READY


@attrs.frozen
class CheckpointView:
    version: int
    state: str
    path: str | None
    pinned: bool
    leases: int


class RecoveryController:
    """Owns every machine; the single entry point is :meth:`handle`."""

    def __init__(
        self,
        config: RecoveryConfig | None = None,
        *,
        initial_version: int = 0,
        journal: JournalSink | None = None,
        rules: type[Rules] = Rules,
    ) -> None:
        if type(initial_version) is not int or initial_version < 0:
            raise MalformedEvent(f"initial_version must be an int >= 0, got {initial_version!r}")
        if config is not None and not isinstance(config, RecoveryConfig):
            raise MalformedEvent(f"config must be a RecoveryConfig, got {config!r}")
        self.config = config if config is not None else RecoveryConfig()
        self._rules = rules(self.config, initial_version)
        self._lock = threading.RLock()
        self._journal = journal
        self._now: float | None = None
        self._steps = 0
        self._running = False
        self._broken: BaseException | None = None
        self._journal_failures = 0
        self._unjournaled = 0
        if journal is not None:
            self._write_journal(self._journal_header())

    # -- the one entry point -----------------------------------------------------------------

    def handle(self, event: ev.Event) -> tuple[fx.Effect, ...]:
        """Apply one event, run to completion, and return the effects to execute."""
        with self._lock:
            try:
                at = self._admit(event)
            except RecoveryError as err:
                if not self._running:  # not from inside a sink, which is mid-record
                    self._refused(event, err)
                raise
            self._running = True
            try:
                effects = tuple(self._rules.apply(event))
            except BaseException as err:
                self._running = False
                if isinstance(err, RecoveryError) and not self._rules.applying:
                    self._refused(event, err)
                    raise
                # A bug, an interrupt, or a refusal after the checks passed: the event may be
                # half applied, so stop for good.
                broken = self._break(event, err)
                self._refused(event, err, broke=True)
                if not isinstance(err, Exception):
                    raise  # KeyboardInterrupt and the like go on; the controller stays stopped
                raise broken from err
            self._running = False
            self._now = at
            self._steps += 1
            self._write_journal(self._record(event, effects=effects))
            return effects

    def _refused(self, event: Any, err: BaseException, *, broke: bool = False) -> None:
        """Journal an event that did not apply (``broke``: it stopped the controller)."""
        self._steps += 1
        record = self._record(event, error=err)
        if broke:
            record["broke"] = True
        self._write_journal(record)

    def _admit(self, event: Any) -> float:
        """Checks that need no rule: the controller works, it is an event, time is sane."""
        if self._running:
            raise EventNotAllowed(
                f"{type(event).__name__} sent while another event runs (from a journal sink?)"
            )
        if self._broken is not None:
            raise ControllerBroken(
                f"the controller stopped after an internal error: "
                f"{type(self._broken).__name__}: {self._broken}; rebuild it from its journal",
                self._broken,
            )
        if type(event) not in _EVENT_CLASSES:
            raise MalformedEvent(
                f"expected one of the recovery_fsm events, got {type(event).__name__}: "
                f"{event!r:.80}"
            )
        # Checked again here, every field and what containers hold: an event changed
        # behind its frozen fields' back must not reach a rule (``events.admit``).
        ev.admit(event)
        at: float = event.at
        if self._now is not None and at < self._now:
            raise MalformedEvent(
                f"time went backwards: event at {at} after an event at {self._now}"
            )
        return at

    def _break(self, event: Any, err: BaseException) -> ControllerBroken:
        self._broken = err
        log.error("recovery controller stopped on %r", event, exc_info=err)
        return ControllerBroken(
            f"internal error on {type(event).__name__}: {type(err).__name__}: {err}; "
            "the controller refuses every later event: rebuild it from its journal",
            err,
        )

    # -- copies ------------------------------------------------------------------------------

    def fork(self, *, journal: JournalSink | None = None) -> RecoveryController:
        """An independent copy of the whole state, writing to ``journal`` (not to this
        controller's): explorers branch on it to try every next event from one state."""
        with self._lock:
            twin = copy.deepcopy(self)
        twin._journal = journal
        twin._running = False  # a copy taken from inside a sink is idle
        twin._journal_failures = twin._unjournaled = 0
        return twin

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_journal"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def continue_journal(self, journal: JournalSink, after_step: int) -> None:
        """Journal from now on to ``journal``, numbering records after ``after_step``: a
        controller rebuilt from a journal goes on writing that same journal (no second
        header), so the whole run replays as one."""
        with self._lock:
            if self._journal is not None:
                raise EventNotAllowed("this controller journals already")
            if type(after_step) is not int or after_step < self._steps:
                raise MalformedEvent(
                    f"after_step must be an int >= {self._steps} (the events it handled), "
                    f"got {after_step!r}"
                )
            self._journal, self._steps = journal, after_step

    @property
    def now(self) -> float | None:
        """The time of the last event it took (None before the first): a link that takes
        over a rebuilt controller stamps from there on."""
        return self._now

    # -- queries -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weight version the fleet serves."""
        return self._rules.fleet.version

    @property
    def epoch(self) -> int:
        """The run's epoch: 1, then one above each resume's predecessor (engines refuse an
        older epoch's commands)."""
        return self._rules.epoch

    @property
    def closed(self) -> bool:
        return self._rules.closed

    @property
    def broken(self) -> BaseException | None:
        """The internal error that stopped the controller, if one did."""
        return self._broken

    @property
    def journal_failures(self) -> int:
        """Journal records the sink raised on (logged; the events were applied)."""
        return self._journal_failures

    @property
    def rules(self) -> Rules:
        """The rules' state, for the invariants and the search; change it only via handle."""
        return self._rules

    @property
    def last_transitions(self) -> tuple[tuple[str, str, str, str], ...]:
        """(machine, event, source, target) of every transition the last event caused."""
        return tuple(self._rules.transitions)

    def group_state(self, group: str) -> str:
        return self.group(group).state

    def recovery_state(self, group: str) -> str:
        return self.group(group).recovery

    def incarnation(self, group: str) -> int:
        return self.group(group).incarnation

    def group(self, name: str) -> GroupView:
        with self._lock:
            g = self._rules.groups.get(name)
            if g is None:
                raise UnknownGroup(
                    f"unknown group {name!r}; registered: {sorted(self._rules.groups)}"
                )
            r = g.record
            start = self._rules.starts.get((name, r.incarnation))
            return GroupView(
                name,
                str(r.state),
                r.incarnation,
                r.version,
                str(g.recovery.state),
                r.restarts,
                start.lease if start is not None else None,
            )

    def groups(self) -> dict[str, GroupView]:
        with self._lock:
            return {name: self.group(name) for name in sorted(self._rules.groups)}

    def up_groups(self) -> dict[str, int]:
        """The processes a weight sync should push to: group name -> incarnation. Pass the
        ones that received the weights to WeightsSynced."""
        with self._lock:
            return {
                name: g.record.incarnation
                for name, g in sorted(self._rules.groups.items())
                if g.record.state in UP
            }

    def standbys(self) -> dict[str, StandbyView]:
        """The standbys not yet handed over, lost or stopped."""
        with self._lock:
            return {
                name: StandbyView(name, str(s.record.state), s.record.version)
                for name, s in self._rules.standbys.items()
                if s.record.state not in STANDBY_FINAL
            }

    def up_standbys(self) -> list[str]:
        """The standbys a weight sync may push to (list each that got it in WeightsSynced
        with incarnation 1); one claimed during the push is ignored there."""
        with self._lock:
            return [
                name
                for name, s in self._rules.standbys.items()
                if s.record.state in {StandbyState.STALE, StandbyState.READY}
            ]

    @property
    def pool_state(self) -> str:
        """filling, exhausted (standbys kept failing to boot: no more are started) or closed."""
        with self._lock:
            return str(self._rules.pool.record.state)

    def lease_of(self, group: str) -> Lease | None:
        return self.group(group).lease

    def checkpoint_state(self, version: int) -> str:
        with self._lock:
            ck = self._rules.checkpoints.get(version)
            if ck is not None:
                return str(ck.record.state)
            if version in self._rules.finished:
                return self._rules.finished[version]
        raise UnknownVersion(
            f"no checkpoint of version {version} (final states are kept for the latest "
            f"{FINISHED_KEPT} finished checkpoints)"
        )

    def checkpoints(self) -> dict[int, CheckpointView]:
        """Checkpoints not yet in a final state (their files may be on disk)."""
        with self._lock:
            return {
                v: CheckpointView(
                    v, str(c.record.state), c.record.path, c.record.pinned, c.record.leases
                )
                for v, c in sorted(self._rules.checkpoints.items())
            }

    @property
    def leases(self) -> dict[str, Lease]:
        """Every live lease by id, including those of starts killed after a deadline."""
        with self._lock:
            return {s.lease.id: s.lease for s in self._rules.starts.values() if s.lease is not None}

    def outstanding(self) -> list[str]:
        """What keeps the controller from being drained, one sentence each (empty: drained)."""
        with self._lock:
            return ([] if self._rules.closed else ["no Shutdown yet"]) + self._rules.outstanding()

    @property
    def drained(self) -> bool:
        """Shut down with nothing outstanding: no export, start or delete still owed."""
        return not self.outstanding()

    def snapshot(self) -> dict[str, Any]:
        """Every piece of mutable state, as plain data; equal snapshots mean equal controllers."""
        with self._lock:
            r = self._rules
            return {
                "version": r.fleet.version,
                "now": self._now,
                "closed": r.closed,
                "broken": None if self._broken is None else repr(self._broken),
                "checkpoints": {
                    v: attrs.asdict(c.record) for v, c in sorted(r.checkpoints.items())
                },
                "finished": dict(sorted(r.finished.items())),
                "groups": {
                    name: {
                        **attrs.asdict(g.record, filter=lambda a, _v: a.name != "fleet"),
                        "recovery": attrs.asdict(g.recovery),
                    }
                    for name, g in sorted(r.groups.items())
                },
                "starts": {
                    f"{name}#{inc}": attrs.asdict(s) for (name, inc), s in sorted(r.starts.items())
                },
                "standbys": {
                    name: attrs.asdict(s.record, filter=lambda a, _v: a.name != "fleet")
                    for name, s in sorted(r.standbys.items())
                },
                "pool": attrs.asdict(r.pool.record),
                "standby_serial": r.standby_serial,
                "resumed_at": r.resumed_at,
            }

    def check_invariants(self) -> list[str]:
        """The safety rules; returns every one that does not hold (empty: all hold)."""
        with self._lock:
            return violations(self._rules)

    def assert_invariants(self) -> None:
        found = self.check_invariants()
        if found:
            raise InvariantViolation(found)

    # -- the journal -------------------------------------------------------------------------

    def _journal_header(self) -> dict[str, Any]:
        """Step 0 of a journal: what a replay needs to rebuild this controller."""
        cls = type(self._rules)
        return {
            "step": 0,
            "header": {
                "format": 2,
                "rules": f"{cls.__module__}:{cls.__qualname__}",
                "config": attrs.asdict(self.config),
                "initial_version": self._rules.fleet.version,
            },
        }

    def _record(
        self,
        event: Any,
        *,
        effects: tuple[fx.Effect, ...] = (),
        error: BaseException | None = None,
    ) -> dict[str, Any]:
        record: dict[str, Any] = {"step": self._steps, "event": encode(event)}
        if error is not None:
            record["error"] = {"type": type(error).__name__, "message": str(error)}
        elif self._rules.transitions or effects:
            record["transitions"] = [list(t) for t in self._rules.transitions]
            record["effects"] = [encode(f) for f in effects]
        # An event that changed nothing (most ticks) is recorded without either list: a long
        # run's journal grows by what happened, plus a few dozen bytes per tick.
        return record

    def _write_journal(self, record: dict[str, Any]) -> None:
        """Hand one record to the sink; a sink that raises never undoes an event."""
        if self._journal is None:
            return
        if self._unjournaled:
            record = {**record, "lost": self._unjournaled}
        was_running, self._running = self._running, True  # events sent from a sink are refused
        try:
            self._journal(record)
        except Exception:
            self._journal_failures += 1
            self._unjournaled += 1
            log.exception("journal sink failed on step %s; the event stands", record.get("step"))
        else:
            self._unjournaled = 0
        finally:
            self._running = was_running
