"""The controller in a simulated cluster: every enabled next step, and checks after each.

A ``Sim`` owns a real controller (or one with broken rules) and a ``World``. ``actions()``
lists what may happen next: the trainer syncs (also reporting a push that reached a process
since replaced), exports, pins and unpins, lets time pass by amounts that land on and just
before each deadline, or shuts down; the health manager reports failures and probes; the scheduler
completes any pending effect, with success or failure, in any order (an effect never chosen
is one that hangs), including the late outcome of a start killed at its deadline; the journal
sink may fail. ``step`` turns an action into an event, sends it, feeds the world, and returns
every violation: the controller's invariants, the world's checks, a crash, a real completion
refused, or a journal with a gap nobody marked. Hypothesis and the explorer both drive this
one class.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import attrs

from .. import events as ev
from ..codec import encode
from ..config import RecoveryConfig
from ..controller import RecoveryController
from ..errors import RecoveryError
from ..machines import SERVING, GroupState
from ..rules import Rules
from .world import PROC_RUNNING, SPARE_RUNNING, ProcStatus, SpareStatus, World

TRAINER, HEALTH, SCHEDULER = "trainer", "health", "scheduler"

# Completions about a checkpoint, named by its version alone.
_OF_A_CHECKPOINT = (
    ev.ExportCommitted,
    ev.ExportFailed,
    ev.ExportCancelled,
    ev.CheckpointDeleted,
)
# Completions that must be refused when delivered a second time.
_DUPLICABLE = (
    *_OF_A_CHECKPOINT,
    ev.RestartLoaded,
    ev.RestartLoadFailed,
    ev.Relaunched,
    ev.RelaunchFailed,
    ev.GroupVerified,
    ev.StandbyVerified,
    ev.StandbyBooted,
    ev.StandbyLoaded,
    ev.StandbyFailed,
)


# The scheduler's moves that report the outcome of something the controller asked for.
_ANSWERS = frozenset({
    "commit", "export_fails", "export_cancelled", "deleted", "standby_booted", "standby_loaded",
    "standby_verified", "loaded", "loaded_ahead", "loaded_synced", "load_fails", "relaunched",
    "relaunch_fails", "verified", "late_verified",
})  # fmt: skip
_OF_A_STANDBY = frozenset({"StandbyBooted", "StandbyLoaded", "StandbyVerified"})


def _about(e: ev.Event) -> tuple[object, ...]:
    """What a report answers: its kind and the process (and version) it is about. A
    verification's answer may name any version: that is what the process holds."""
    if isinstance(e, ev.StandbyLoaded):
        return (e.kind, e.standby, e.version)
    if isinstance(e, (ev.StandbyBooted, ev.StandbyVerified)):
        return (e.kind, e.standby)
    if isinstance(e, _OF_A_CHECKPOINT):
        return (e.kind, e.version)
    if isinstance(e, ev.RestartLoaded):  # a claim's check may say what it found instead
        return (e.kind, e.group, e.incarnation, e.version)
    assert isinstance(e, (*ev.LOAD_OUTCOMES, *ev.RELAUNCH_OUTCOMES, ev.GroupVerified))
    return (e.kind, e.group, e.incarnation)


def _target_of(key: tuple[object, ...]) -> tuple[object, ...]:
    """The process (or checkpoint) a report's ``_about`` key names, its version aside."""
    return key[1:2] if key[0] in _OF_A_STANDBY else key[1:3]


def _target(e: ev.Event) -> tuple[object, ...]:
    return _target_of(_about(e))


def small_config(**changes: Any) -> RecoveryConfig:
    """Small numbers, so budgets, cooldowns and deadlines are reached in a few steps; the
    deadlines differ so that each can be hit alone."""
    base = RecoveryConfig(
        clean_syncs_to_reenable=2,
        suspect_threshold=2,
        restart_budget=2,
        await_checkpoint_timeout_s=10.0,
        load_timeout_s=20.0,
        relaunch_timeout_s=15.0,
    )
    return attrs.evolve(base, **changes)


@attrs.frozen
class Scope:
    """How big a world to search. The defaults are the explorer's small scope."""

    groups: tuple[str, ...] = ("g0", "g1")
    max_version: int = 2  # syncs stop here: versions 0..max_version
    max_failures: int = 3  # GroupFailed reports in all
    probes: bool = False
    pins: bool = False
    partial_syncs: bool = True  # the trainer may leave one up group out of a sync
    late_syncs: bool = True  # a sync may list a group's previous incarnation
    sink_failures: bool = False  # the journal sink may raise
    deadlines: bool = True  # time may pass (ticks)
    shutdown: bool = True
    # With ``config.standby``: standbys that booted, loaded or died count as scheduler moves;
    # a sync pushes to every up standby (``sync_without`` may leave one out).
    standby_deaths: bool = True
    # The trainer may crash and resume this many times, at the fleet's version or the one
    # before (what the runtime held in flight dies; every process must answer first).
    resumes: int = 0
    config: RecoveryConfig = attrs.field(factory=small_config)


@attrs.frozen
class Action:
    actor: str
    kind: str
    target: str | int | float | None = None

    def __str__(self) -> str:
        return self.kind if self.target is None else f"{self.kind}({self.target})"


def _proc(target: str) -> tuple[str, int]:
    group, _, incarnation = target.partition("#")
    return group, int(incarnation)


class SinkFailure(OSError):
    """The simulated journal sink's failure (a full disk)."""


class Sim:
    """``host`` is the class hosting the rules: the real ``RecoveryController`` unless the
    search is shown a broken one (``tests/property/variants.py``)."""

    def __init__(
        self,
        scope: Scope | None = None,
        rules: type[Rules] = Rules,
        host: type[RecoveryController] = RecoveryController,
    ) -> None:
        self.scope = scope or Scope()
        self.records: list[dict[str, Any]] = []
        self.sink_armed = False
        # What the sink saw: the step it expects next, the records it raised on since it
        # last took one (the next record must say so), every record it raised on, what was
        # wrong with the journal since the last check.
        self.sink_next_step = 0
        self.sink_lost = 0
        self.sink_failures = 0
        self.sink_problems: list[str] = []
        self.controller = host(self.scope.config, journal=self._sink, rules=rules)
        self.world = World(self.scope.config)
        self.now = 0.0
        self.failures = 0
        self.resumes = 0
        self.trace: list[str] = []
        self.delivered: list[ev.Event] = []
        for name in self.scope.groups:
            problems = self._send(ev.GroupRegistered(name, 0, at=self.now))
            assert not problems, problems

    def _sink(self, record: dict[str, Any]) -> None:
        """Keeps every record for replay (so a lost one is kept here, without its marker);
        raises to the controller when armed. A journal may have a gap only where the sink
        failed, and the record after it must say how many records it lacks (``"lost"``):
        a gap nobody marked, or a marker for a gap nobody made, is a finding."""
        step, lost = record.get("step"), record.get("lost", 0)
        if step != self.sink_next_step:
            self.sink_problems.append(
                f"journal record {step} came where record {self.sink_next_step} was due: "
                "records went missing without a trace"
            )
        if lost != self.sink_lost:
            self.sink_problems.append(
                f"journal record {step} says {lost} records before it were lost; the sink "
                f"failed on {self.sink_lost}"
            )
        self.sink_next_step = step + 1 if isinstance(step, int) else self.sink_next_step + 1
        self.records.append({k: v for k, v in record.items() if k != "lost"})
        if self.sink_armed:
            self.sink_armed = False
            self.sink_lost += 1
            self.sink_failures += 1
            raise SinkFailure(28, "No space left on device (simulated)")
        self.sink_lost = 0

    def _journaled(
        self, event: object, records_before: int, effects: tuple[Any, ...] = ()
    ) -> list[str]:
        """What was wrong with the journal while ``event`` was handled: exactly one record per
        event, holding every effect it asked for (a record of an event that changed nothing
        holds none), every sink failure counted, the sink's own findings."""
        out, self.sink_problems = self.sink_problems, []
        written = len(self.records) - records_before
        if written != 1:
            out.append(f"{event!r} left {written} journal records, not one")
        elif self.records[-1].get("effects", []) != [encode(f) for f in effects]:
            out.append(
                f"the journal's record of {event!r} holds effects "
                f"{self.records[-1].get('effects', [])}, but the event asked for {list(effects)}"
            )
        failures = self.controller.journal_failures
        if failures != self.sink_failures:
            out.append(
                f"the controller counts {failures} journal failures; the sink failed "
                f"{self.sink_failures} times"
            )
        return out

    def fork(self) -> Sim:
        """An independent copy: the explorer tries every action from one state."""
        child = Sim.__new__(Sim)
        child.scope = self.scope
        child.records = list(self.records)
        child.sink_armed = self.sink_armed
        # A fork's controller writes a new journal: it owes no marker, counts no failure.
        child.sink_next_step, child.sink_lost, child.sink_failures = self.sink_next_step, 0, 0
        child.sink_problems = []
        child.controller = self.controller.fork(journal=child._sink)
        child.world = copy.deepcopy(self.world)
        child.now = self.now
        child.failures = self.failures
        child.resumes = self.resumes
        child.trace = list(self.trace)
        child.delivered = list(self.delivered)
        return child

    # -- what may happen next ------------------------------------------------------------

    def actions(self) -> list[Action]:
        w, s = self.world, self.scope
        out: list[Action] = []
        if not w.closed and self.resumes < s.resumes:
            out += [Action(TRAINER, "resume", v) for v in sorted({w.fleet, max(w.fleet - 1, 0)})]
            # What the new runtime finds: one process gone, one silent, one stray beside.
            current = sorted(w.current())
            out += [Action(TRAINER, "resume_gone", pid) for pid in current]
            out += [Action(TRAINER, "resume_silent", pid) for pid in current[:1]]
            out.append(Action(TRAINER, "resume_stray"))
        if not w.closed:
            if w.fleet < s.max_version:
                out.append(Action(TRAINER, "sync"))
                if s.partial_syncs:
                    out += [Action(TRAINER, "sync_without", g) for g in self._up()]
                    out += [Action(TRAINER, "sync_without", n) for n in self._up_spares()]
                if s.late_syncs:
                    out += [
                        Action(TRAINER, "sync_late", g)
                        for g, p in w.procs.items()
                        if p.incarnation > 1
                    ]
            if w.fleet not in w.started and w.fleet not in w.abandoned:
                out.append(Action(TRAINER, "export"))
                if s.pins:
                    out.append(Action(TRAINER, "export_pinned"))
        if s.pins:
            out += [Action(TRAINER, "unpin", v) for v in self._unpinnable()]
        if not w.closed:
            if s.pins:
                out += [Action(TRAINER, "pin", v) for v in self._pinnable()]
            if s.shutdown:
                out.append(Action(TRAINER, "shutdown"))
            if self.failures < s.max_failures:
                out += [
                    Action(HEALTH, "fail", g)
                    for g, p in w.procs.items()
                    if p.status in PROC_RUNNING
                ]
            if s.standby_deaths and self.failures < s.max_failures:
                out += [Action(HEALTH, "standby_dies", n) for n in w._alive()]
            if s.probes:
                serving = [g for g, v in self.controller.groups().items() if v.state in SERVING]
                out += [Action(HEALTH, "probe_failed", g) for g in serving]
                out += [Action(HEALTH, "probe_ok", g) for g in serving]
        if s.deadlines:
            out += [Action(TRAINER, "tick", d) for d in self._tick_amounts()]
        if s.sink_failures and not self.sink_armed:
            out.append(Action(SCHEDULER, "sink_fails"))
        for v in sorted(w.exports):
            out += [Action(SCHEDULER, k, v) for k in ("commit", "export_fails", "export_cancelled")]
        for n in sorted(w.boots):
            out += [Action(SCHEDULER, k, n) for k in ("standby_booted", "standby_boot_fails")]
        for g, i in sorted(w.loads):
            if g in w.spares:
                if not w.loads[(g, i)].resumed:  # else its answer reports it
                    kinds = ("standby_loaded", "standby_load_fails")
                    out += [Action(SCHEDULER, k, g) for k in kinds]
            elif not w.loads[(g, i)].resumed:  # else its answer reports it
                out += [Action(SCHEDULER, k, f"{g}#{i}") for k in ("loaded", "load_fails")]
                load = w.loads[(g, i)]
                if load.claim and load.path is None:  # a push reached it before its check:
                    if w.fleet < s.max_version:  # one still in flight,
                        out.append(Action(SCHEDULER, "loaded_ahead", f"{g}#{i}"))
                    if load.version < w.fleet:  # or one whose sync has landed since
                        out.append(Action(SCHEDULER, "loaded_synced", f"{g}#{i}"))
        for g, p in sorted(w.procs.items()):
            if p.verifying:
                answers = w.answer(g) != "gone"
                out += [Action(SCHEDULER, "verified", g)] if answers else []
                out.append(Action(SCHEDULER, "verify_fails", g))
        for n, spare in sorted(w.spares.items()):
            if spare.verifying:  # also after a kill: the answer ends what it owed
                answers = w.spare_answer(n) != "gone"
                out += [Action(SCHEDULER, "standby_verified", n)] if answers else []
                out.append(Action(SCHEDULER, "standby_verify_fails", n))
        for g, i in sorted(w.relaunches):
            if not w.procs[g].verifying:
                out += [Action(SCHEDULER, k, f"{g}#{i}") for k in ("relaunched", "relaunch_fails")]
        killed = {k for k in w.verifies if not w.answers_now(*k)}  # killed since the resume
        out += [Action(SCHEDULER, "late_verified", f"{g}#{i}") for g, i in sorted(killed)]
        ran = {k for k, load in w.loads.items() if k[0] not in w.spares and not load.resumed}
        for g, i in sorted(ran | w.relaunches):
            p = w.procs[g]
            if p.incarnation != i or p.status not in {ProcStatus.LOADING, ProcStatus.RELAUNCHING}:
                killed.add((g, i))
        out += [Action(SCHEDULER, "killed_dies", f"{g}#{i}") for g, i in sorted(killed)]
        out += [Action(SCHEDULER, "deleted", v) for v in sorted(set(w.deleting.values()))]
        return out

    def waits(self) -> list[float]:
        """Seconds until each running wait reaches its deadline, and (with a restart window)
        until each restart still counted ages out of it."""
        c, w = self.scope.config, self.world
        window = c.restart_window_s
        aging = set()
        if window is not None:
            for p in w.procs.values():
                if p.status not in {ProcStatus.RETIRED, ProcStatus.STOPPED}:
                    aging |= {t + window - self.now for t in p.restarted if self.now - t < window}
        limits = {
            ProcStatus.DOWN: c.deadline("checkpoint"),
            ProcStatus.LOADING: c.deadline("load"),
            ProcStatus.RELAUNCHING: c.deadline("relaunch"),
        }
        spare_limits = {
            SpareStatus.BOOTING: c.deadline("relaunch"),
            SpareStatus.LOADING: c.deadline("load"),
        }
        return sorted(
            {p.since + limits[p.status] - self.now for p in w.procs.values() if p.status in limits}
            | {p.since + c.deadline("load") - self.now for p in w.procs.values() if p.verifying}
            | {
                s.since + spare_limits[s.status] - self.now
                for s in w.spares.values()
                if s.status in spare_limits and not s.verifying
            }
            | {
                s.since + c.deadline("load") - self.now
                for s in w.spares.values()
                if s.verifying and s.status in SPARE_RUNNING
            }
            | aging
        )

    def _tick_amounts(self) -> list[float]:
        """Land exactly on the next deadline, and just before it."""
        waits = [d for d in self.waits() if d >= 0]
        if not waits:
            return []
        edge = waits[0]
        return sorted({edge, max(edge - 1.0, 0.0)})

    def _up(self) -> list[str]:
        """Groups a push reaches: up, and answered since any resume."""
        procs = self.world.procs.items()
        return [g for g, p in procs if p.status == ProcStatus.UP and not p.verifying]

    def _up_spares(self) -> list[str]:
        """Standbys a push reaches: up, and answered since any resume."""
        spares = self.world.spares.items()
        return sorted(n for n, s in spares if s.status == SpareStatus.UP and not s.verifying)

    def _pinnable(self) -> list[int]:
        w = self.world
        on_disk = {v for p, v in w.disk.items() if p not in w.deleting}
        running = {v for v, x in w.exports.items() if not x.cancel_requested}
        return sorted((running | on_disk) - w.pinned)

    def _unpinnable(self) -> list[int]:
        """Pinned, and the controller still holds it: on disk, or its export still running."""
        w = self.world
        return sorted(w.pinned & ({v for v in w.disk.values()} | set(w.exports)))

    def event_for(self, a: Action) -> ev.Event:
        w, now = self.world, self.now
        k, t = a.kind, a.target
        if k in {"sync", "sync_without", "sync_late"}:
            pushed = {g: w.procs[g].incarnation for g in self._up() if g != t}
            pushed |= {n: 1 for n in self._up_spares() if n != t}
            if k == "sync_late" and isinstance(t, str):
                pushed[t] = w.procs[t].incarnation - 1  # that process died after the push
            return ev.WeightsSynced(w.fleet + 1, pushed, at=now)
        if k in {"export", "export_pinned"}:
            return ev.ExportStarted(w.fleet, pinned=k == "export_pinned", at=now)
        if k == "tick" and isinstance(t, float):
            return ev.Tick(at=now + t)
        if k == "shutdown":
            return ev.Shutdown(at=now)
        if k.startswith("resume"):
            return self._resumed(k, t)
        if isinstance(t, int):
            if k == "pin":
                return ev.CheckpointPinned(t, at=now)
            if k == "unpin":
                return ev.CheckpointUnpinned(t, at=now)
            if k == "commit":
                return ev.ExportCommitted(t, checkpoint_path(t), at=now)
            if k == "export_fails":
                return ev.ExportFailed(t, "OSError: [Errno 28] No space left on device", at=now)
            if k == "export_cancelled":
                return ev.ExportCancelled(t, at=now)
            if k == "deleted":
                return ev.CheckpointDeleted(t, at=now)
        if isinstance(t, str) and t in w.spares:
            if k == "standby_booted":
                return ev.StandbyBooted(t, at=now)
            if k == "standby_loaded":
                return ev.StandbyLoaded(t, w.loads[(t, 1)].version, at=now)
            if k in {"standby_boot_fails", "standby_load_fails", "standby_dies"}:
                return ev.StandbyFailed(t, reason=k.removeprefix("standby_"), at=now)
            if k == "standby_verified":
                held = w.spare_answer(t)
                assert held != "gone"
                return ev.StandbyVerified(t, held if isinstance(held, int) else None, at=now)
            if k == "standby_verify_fails":
                return ev.StandbyFailed(t, reason="no answer since the resume", at=now)
        if isinstance(t, str) and "#" in t:
            g, i = _proc(t)
            if k == "loaded":
                return ev.RestartLoaded(g, i, at=now)
            if k == "loaded_ahead":
                return ev.RestartLoaded(g, i, at=now, version=w.fleet + 1)
            if k == "loaded_synced":
                return ev.RestartLoaded(g, i, at=now, version=w.fleet)
            if k == "load_fails":
                return ev.RestartLoadFailed(g, i, error="injected", at=now)
            if k == "relaunched":
                return ev.Relaunched(g, i, at=now)
            if k == "relaunch_fails":
                return ev.RelaunchFailed(g, i, error="injected", at=now)
            if k == "killed_dies":
                return ev.GroupFailed(g, i, reason="killed", at=now)
            if k == "late_verified":
                load = w.loads.get((g, i))
                return ev.GroupVerified(g, i, None if load is None else load.version, at=now)
        if isinstance(t, str):
            i = w.procs[t].incarnation
            if k == "verified":
                held = w.answer(t)
                assert held != "gone"
                return ev.GroupVerified(t, i, held if isinstance(held, int) else None, at=now)
            if k == "verify_fails":
                return ev.GroupFailed(t, i, reason="no answer since the resume", at=now)
            if k == "fail":
                return ev.GroupFailed(t, i, reason="injected", at=now)
            if k == "probe_failed":
                return ev.ProbeFailed(t, i, at=now)
            if k == "probe_ok":
                return ev.ProbeOk(t, i, at=now)
        raise ValueError(f"action {a} is not enabled here")

    def _resumed(self, kind: str, target: str | int | float | None) -> ev.Resumed:
        """A resume at ``target`` (or the fleet's version) that finds every current process,
        but for the one ``resume_gone`` loses or ``resume_silent`` finds mute; with
        ``resume_stray`` also a previous incarnation (or a name nobody knows)."""
        w = self.world
        found = set(w.current())
        silent: set[str] = set()
        if kind in {"resume_gone", "resume_silent"} and isinstance(target, str):
            found.discard(target)
            silent = {target} if kind == "resume_silent" else set()
        if kind == "resume_stray":
            older = [f"{g}#{p.incarnation - 1}" for g, p in w.procs.items() if p.incarnation > 1]
            found.add(min(older, default="ghost#1"))
        version = target if isinstance(target, int) else w.fleet
        return ev.Resumed(version, epoch=w.epoch + 1, found=found, silent=silent, at=self.now)

    # -- doing it ------------------------------------------------------------------------

    def step(self, action: Action) -> list[str]:
        """Take one enabled action; return every violation it revealed (empty: none)."""
        self.trace.append(str(action))
        if action.kind == "sink_fails":
            self.sink_armed = True
            return []
        event = self.event_for(action)
        if action.kind in {"fail", "standby_dies"}:
            self.failures += 1
        if action.kind.startswith("resume"):
            self.resumes += 1
        return self._send(event)

    def _found(self, problems: list[str]) -> list[str]:
        """Note in the journal a finding a replay cannot re-check by itself, because it is
        about what the events meant: a real completion refused, a duplicate accepted, no
        progress under fairness."""
        if problems:
            last = self.records[-1]["step"] if self.records else 0
            self.records.append({"step": last, "finding": list(problems)})
        return problems

    def _send(self, event: ev.Event) -> list[str]:
        self.now = event.at
        armed = self.sink_armed
        before = len(self.records)
        try:
            effects = self.controller.handle(event)
        except RecoveryError as err:
            refused = f"the controller refused {event!r}, which really happened: {err}"
            return self._found([*self._journaled(event, before), refused])
        except Exception as err:  # a crash is a finding, not a test error
            lost = " (the journal sink had failed: effects lost)" if armed else ""
            return self._found(
                [f"the controller raised on {event!r}{lost}: {type(err).__name__}: {err}"]
            )
        if isinstance(event, _DUPLICABLE):
            self.delivered.append(event)
        if isinstance(event, ev.Resumed):  # who reported them died: none comes again
            self.delivered = []
        if isinstance(event, ev.ExportStarted):
            # After a resume a version is exported again: its name is a new checkpoint's,
            # and an old completion of it is the new one's own, owed, not a duplicate.
            self.delivered = [
                d for d in self.delivered
                if not (isinstance(d, _OF_A_CHECKPOINT) and d.version == event.version)
            ]  # fmt: skip
        journal = self._journaled(event, before, effects)
        problems = self.world.observe(event, effects)
        problems += self.world.check(self.controller)
        problems += self.controller.check_invariants()
        return self._found(journal) + problems

    def misuse(self, index: int) -> list[str]:
        """Send something the trainer must not (an event after shutdown, a sync that does not
        move forward, an export of another version, a group registered twice): it must be
        refused and change nothing."""
        w, now = self.world, self.now
        first = self.scope.groups[0]
        wrong: list[ev.Event] = [
            ev.WeightsSynced(w.fleet, {}, at=now),
            ev.ExportStarted(w.fleet + 1, at=now),
            ev.GroupRegistered(self.scope.groups[0], w.fleet, at=now),
            ev.Resumed(w.fleet + 1, epoch=w.epoch + 1, found=(), silent=(), at=now),
            # The replaced run's resume, or one racing this run's own: an epoch not above.
            ev.Resumed(w.fleet, epoch=w.epoch, found=sorted(w.current()), silent=(), at=now),
            ev.GroupVerified(first, w.procs[first].incarnation + 1, w.fleet, at=now),
        ]
        if w.closed:
            wrong += [
                ev.WeightsSynced(w.fleet + 1, {}, at=now),
                ev.GroupRegistered("late", w.fleet, at=now),
                ev.Shutdown(at=now),
            ]
            if w.fleet not in w.started:
                wrong.append(ev.ExportStarted(w.fleet, at=now))
        return self._refused(wrong[index % len(wrong)])

    def duplicate(self, index: int) -> list[str]:
        """Deliver an earlier completion again: it must be refused and change nothing."""
        earlier: Any = self.delivered[index % len(self.delivered)]
        return self._refused(attrs.evolve(earlier, at=self.now))

    def wrong_report(self, index: int, *, misdirected: bool) -> list[str]:
        """Report an outcome nobody waits for, as a misbehaving runtime would: refused, and
        nothing changes. ``misdirected``: about a process (or checkpoint) that does owe a
        report, but of another kind, incarnation or version; else about one that owes none."""
        owed = {_about(self.event_for(a)) for a in self.actions() if a.kind in _ANSWERS}
        targets = {_target_of(key) for key in owed}
        wrong = [e for e in self._reports() if _about(e) not in owed]
        chosen = [e for e in wrong if (_target(e) in targets) == misdirected]
        if not chosen:
            return []
        return self._refused(chosen[index % len(chosen)])

    def _reports(self) -> list[ev.Event]:
        """Every outcome report a runtime could send about the processes, incarnations,
        standbys and versions near the world's."""
        w, now = self.world, self.now
        out: list[ev.Event] = []
        for g, p in sorted(w.procs.items()):
            for i in range(max(1, p.incarnation - 1), p.incarnation + 2):
                out += [
                    ev.RestartLoaded(g, i, at=now),
                    *(ev.RestartLoaded(g, i, at=now, version=v) for v in (w.fleet, w.fleet + 1)),
                    ev.RestartLoadFailed(g, i, error="unasked", at=now),
                    ev.Relaunched(g, i, at=now),
                    ev.RelaunchFailed(g, i, error="unasked", at=now),
                    ev.GroupVerified(g, i, w.fleet, at=now),
                ]
        for n in [*sorted(w.spares), f"standby-{len(w.spares) + 1}"]:
            out += [ev.StandbyBooted(n, at=now), ev.StandbyVerified(n, w.fleet, at=now)]
            out += [ev.StandbyLoaded(n, v, at=now) for v in range(max(0, w.fleet - 1), w.fleet + 2)]
        for v in range(max(0, w.fleet - 1), w.fleet + 2):
            out += [
                ev.ExportCommitted(v, checkpoint_path(v), at=now),
                ev.ExportFailed(v, "unasked", at=now),
                ev.ExportCancelled(v, at=now),
                ev.CheckpointDeleted(v, at=now),
            ]
        return out

    def _refused(self, event: ev.Event) -> list[str]:
        self.trace.append(f"wrong({event.kind})")
        before = self.controller.snapshot()
        records = len(self.records)
        try:
            effects = self.controller.handle(event)
        except RecoveryError:
            found = self._journaled(event, records)
            if self.controller.snapshot() != before:
                found.append(f"refusing {event!r} changed the controller")
            return self._found(found)
        except Exception as err:
            return self._found(
                [f"the controller crashed on {event!r}: {type(err).__name__}: {err}"]
            )
        # Accepted, it happened: the world sees it too (a replay finds what it broke).
        seen = self.world.observe(event, effects)
        return self._found([f"the controller accepted {event!r}, which it must refuse", *seen])

    # -- liveness ------------------------------------------------------------------------

    def settle(self, max_steps: int | None = None) -> list[str]:
        """No more failures; every effect completes and the trainer keeps syncing and
        exporting. Within a bounded number of such fair steps (one per outcome owed, ten per
        group) every group must be active, retired or stopped, having come back the way the
        rules say (see ``outcomes``)."""
        w = self.world
        # Each outcome still owed takes one step (a run whose budget refills may have killed
        # many starts at their deadlines), then a few per group to come back.
        owed = len(w.exports) + len(w.deleting) + len(w.loads) + len(w.relaunches) + len(w.boots)
        bound = max_steps if max_steps is not None else owed + 10 * len(self.scope.groups) + 10
        for _ in range(bound):
            problems = self._unsettled()
            if not problems:
                return []
            action = self._fair_next()
            if action is None:
                return self._found([f"stuck with nothing to do: {'; '.join(problems)}"])
            self.trace.append(f"{action}*")
            found = self._send(self.event_for(action))
            if found:
                return found
        leftover = self._unsettled()
        if leftover:
            return self._found([f"not settled after {bound} fair steps: {'; '.join(leftover)}"])
        return []

    def outcomes(self) -> dict[str, str]:
        """Where each group settled and, if it restarted, by which path last."""
        out = {}
        for g, view in self.controller.groups().items():
            p = self.world.procs[g]
            via = f" ({p.via} restart)" if p.via else ""
            out[g] = f"{view.state} as #{view.incarnation}{via}"
        return out

    def _unsettled(self) -> list[str]:
        out = []
        for g, view in self.controller.groups().items():
            if view.state not in {*SERVING, GroupState.RETIRED, GroupState.STOPPED}:
                out.append(f"group {g} is {view.state}")
        if not self.world.quiescent:
            out.append("effects still pending")
        return out

    def _fair_next(self) -> Action | None:
        """Completions first (successes), then the trainer's next move."""
        w = self.world
        if w.deleting:
            return Action(SCHEDULER, "deleted", min(w.deleting.values()))
        for n in sorted(w.boots):
            return Action(SCHEDULER, "standby_booted", n)
        for g, p in sorted(w.procs.items()):  # before loads: a resumed load ends by its answer
            if p.verifying:
                return Action(SCHEDULER, "verified" if w.answer(g) != "gone" else "verify_fails", g)
        for n, spare in sorted(w.spares.items()):
            if spare.verifying:
                gone = w.spare_answer(n) == "gone"
                return Action(SCHEDULER, "standby_verify_fails" if gone else "standby_verified", n)
        for g, i in sorted(w.verifies):
            if not w.answers_now(g, i):  # its process was killed since the resume
                return Action(SCHEDULER, "late_verified", f"{g}#{i}")
        for g, i in sorted(w.loads):
            if g in w.spares:
                return Action(SCHEDULER, "standby_loaded", g)
            if not w.loads[(g, i)].resumed:
                return Action(SCHEDULER, "loaded", f"{g}#{i}")
        for g, i in sorted(w.relaunches):
            return Action(SCHEDULER, "relaunched", f"{g}#{i}")
        if w.exports:
            v, x = min(w.exports.items())
            return Action(SCHEDULER, "export_cancelled" if x.cancel_requested else "commit", v)
        if w.closed:
            return None
        waiting = any(p.status == ProcStatus.DOWN for p in w.procs.values())
        if waiting and w.fleet not in w.started:
            return Action(TRAINER, "export")
        if waiting:
            return Action(TRAINER, "tick", self.waits()[0])
        states = {v.state for v in self.controller.groups().values()}
        if GroupState.PENDING_WEIGHTS in states:
            return Action(TRAINER, "sync")  # beyond max_version: fairness needs progress
        return None

    # -- for the explorer and for reports -------------------------------------------------

    def key(self) -> str:
        """Two states with equal keys behave the same from here on (clocks as time left
        until each deadline), so the explorer visits each once."""
        snap = self.controller.snapshot()
        for g in [*snap["groups"].values(), *snap["standbys"].values()]:
            since = g.pop("since")
            g["waited"] = None if since is None else self.now - since
        w = self.world
        for g in snap["groups"].values():  # ages, and only where a window makes them matter
            g["restarted_at"] = self._ages(g["restarted_at"])
        snap.pop("now")
        world = {
            "fleet": w.fleet,
            "closed": w.closed,
            "procs": {
                n: [
                    p.incarnation,
                    p.status,
                    p.holds,
                    p.probe_failures,
                    self._ages(p.restarted),
                    p.verifying,
                    (
                        self.now - p.since
                        if p.status in {ProcStatus.DOWN, ProcStatus.LOADING, ProcStatus.RELAUNCHING}
                        else None
                    ),
                ]
                for n, p in sorted(w.procs.items())
            },
            "loads": sorted((f"{g}#{i}", x.path, x.resumed) for (g, i), x in w.loads.items()),
            "relaunches": sorted(f"{g}#{i}" for g, i in w.relaunches),
            "routed": sorted(w.routed.items()),
            "recovery": {n: [r.state, r.streak] for n, r in sorted(w.recovery.items())},
            "exports": {v: [x.pinned, x.cancel_requested] for v, x in sorted(w.exports.items())},
            "current": [w.fleet in w.started, w.fleet in w.committed],
            "pinned": sorted(w.pinned),
            "abandoned": sorted(w.abandoned),
            "disk": sorted(w.disk.items()),
            "deleting": sorted(w.deleting.items()),
            "spares": {
                n: [s.status, s.holds, s.ever_current, s.verifying, self.now - s.since]
                for n, s in sorted(w.spares.items())
                if s.status in SPARE_RUNNING or s.verifying
            },
            "boots": sorted(w.boots),
            "failed_boots": [w.failed_boots, w.exhausted],
            "failures": self.failures,
            "resumes": self.resumes,
            "sink": [self.sink_armed, self.sink_lost],
        }
        return json.dumps([snap, world], sort_keys=True, default=str)

    def _ages(self, started: list[float]) -> int | list[float]:
        """Restarts as the budget sees them: a count, or with a window the ages of those
        still in it (older ones no longer count toward it; the total ``restarts`` in the
        controller's snapshot still tells such states apart)."""
        window = self.scope.config.restart_window_s
        if window is None:
            return len(started)
        return [self.now - t for t in started if self.now - t < window]

    def write_journal(self, path: str | os.PathLike[str]) -> Path:
        """The events so far as a journal ``recovery-fsm replay`` reads."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records))
        return out


def checkpoint_path(version: int) -> str:
    return f"/ckpt/step-{version}"


def subject_name(rules: type[Rules], host: type[RecoveryController]) -> str:
    """What a search runs against, for file and class names: the rules, or the hosting when
    that is the broken part."""
    return rules.__name__ if host is RecoveryController else host.__name__
