"""A second opinion on the controller: what the real system would hold after each event.

The controller's invariants are its own contract. ``World`` is kept independently by the
search: it learns only from the events that happened and the effects the controller asked
for, tracks what is on disk, which process of each group runs and what it holds, which
loaders read which path and what the router sends traffic to, which standby engines run and
what they hold, and restates every rule of recovery in its own terms: the restart budget,
each deadline, the clean-sync streak, the choice between a standby, an immediate and a cold
restart, the standby pool's size and boot budget. It flags every request that would hurt in
the real system and every rule the controller did not keep.

It is fed accepted events only, so ``recovery-fsm replay`` can run it over any journal.
"""

from __future__ import annotations

from typing import Final

import attrs

from .. import effects as fx
from .. import events as ev
from ..config import RecoveryConfig
from ..controller import RecoveryController
from ..errors import RecoveryError
from ..machines import (
    SERVING,
    CheckpointState,
    GroupState,
    PoolState,
    StandbyState,
    SwitchState,
)
from ..rules import FINISHED_KEPT


class ProcStatus:
    """What a group's process is doing as the runtime sees it: the world's own terms, not the
    group machine's states, so the two can be compared."""

    UP: Final = "up"  # running, with weights or not
    DOWN: Final = "down"  # dead: waits for a restart (or for a checkpoint to restart from)
    LOADING: Final = "loading"  # starting from a checkpoint, or a claimed standby's check
    RELAUNCHING: Final = "relaunching"  # starting cold
    RETIRED: Final = "retired"
    STOPPED: Final = "stopped"


class SpareStatus:
    """What a standby's engine is doing as the runtime sees it."""

    BOOTING: Final = "booting"
    UP: Final = "up"
    LOADING: Final = "loading"
    CLAIMED: Final = "claimed"
    LOST: Final = "lost"
    STOPPED: Final = "stopped"


# A process runs (a resume would find it).
PROC_RUNNING: Final = frozenset({ProcStatus.UP, ProcStatus.LOADING, ProcStatus.RELAUNCHING})
SPARE_RUNNING: Final = frozenset({SpareStatus.BOOTING, SpareStatus.UP, SpareStatus.LOADING})


@attrs.define
class Load:
    path: str | None  # None: a standby claimed as it is (its admission check only)
    version: int
    claim: bool = False  # a group's claim of a standby, until its outcome
    # Run by a runtime that died (the trainer resumed since): its outcome is reported by
    # the verification, never by itself.
    resumed: bool = False


@attrs.define
class Spare:
    """A standby engine as the runtime sees it."""

    status: str = SpareStatus.BOOTING
    holds: int | None = None
    since: float = 0.0
    ever_current: bool = False  # it held the fleet's weights once
    # Since the trainer resumed it owes its answer (kept after a kill until that comes).
    verifying: bool = False


@attrs.define
class Proc:
    """A group's current process as the runtime sees it."""

    incarnation: int = 1
    status: str = ProcStatus.UP
    holds: int | None = None  # the weight version in memory while up
    since: float = 0.0  # when the current status began
    probe_failures: int = 0
    # When the failure that spent each restart (or claim) took the process down.
    restarted: list[float] = attrs.Factory(list)
    via: str | None = None  # how the last restart went: "standby", "immediate" or "cold"
    # Since the trainer resumed, it has not said what it holds (a load or relaunch of it
    # that was in flight goes on; the answer comes after it).
    verifying: bool = False


@attrs.define
class Export:
    pinned: bool
    cancel_requested: bool = False


@attrs.define
class Recovery:
    """Immediate recovery restated: cool on a missed export or a failed restart (also one
    killed at its deadline), back after N clean syncs in a row."""

    state: str
    streak: int = 0

    def cool(self) -> None:
        self.streak = 0
        if self.state == SwitchState.ENABLED:
            self.state = SwitchState.COOLDOWN


@attrs.define
class World:
    config: RecoveryConfig
    fleet: int = 0
    now: float = 0.0
    closed: bool = False
    procs: dict[str, Proc] = attrs.Factory(dict)
    loads: dict[tuple[str, int], Load] = attrs.Factory(dict)  # loaders still running
    relaunches: set[tuple[str, int]] = attrs.Factory(set)  # cold starts still running
    # Verifications asked since the last resume and not answered (kept after a kill: the
    # answer, or the death of what it asked, ends it). Only these may be answered.
    verifies: set[tuple[str, int]] = attrs.Factory(set)
    routed: dict[str, int] = attrs.Factory(dict)  # group -> incarnation the router uses
    recovery: dict[str, Recovery] = attrs.Factory(dict)
    exports: dict[int, Export] = attrs.Factory(dict)  # in flight
    started: set[int] = attrs.Factory(set)
    committed: set[int] = attrs.Factory(set)
    pinned: set[int] = attrs.Factory(set)
    disk: dict[str, int] = attrs.Factory(dict)  # committed directories: path -> version
    deleting: dict[str, int] = attrs.Factory(dict)  # deletes asked for, not done yet
    gone: dict[int, frozenset[str]] = attrs.Factory(dict)  # ended checkpoints: allowed states
    must_stop: tuple[str, int] | None = None  # a process the current event must stop
    spares: dict[str, Spare] = attrs.Factory(dict)  # every standby ever started
    boots: set[str] = attrs.Factory(set)  # standby boots still running
    failed_boots: int = 0  # standbys lost in a row before they ever held the fleet's weights
    exhausted: bool = False  # the pool reached its boot budget: it never refills again
    # Versions on disk newer than a resume's: that future is deleted, pinned or not, and
    # forgotten (its version is exported anew).
    abandoned: set[int] = attrs.Factory(set)
    # A sync announced the fleet's version: its export follows (not so for the first version
    # nor for the one a trainer resumed at, which nobody exports again).
    announced: bool = False
    resumed_at: int | None = None  # the version of the last resume
    epoch: int = 1  # the run's epoch: raised by every resume
    # Found at the current event's resume and nobody's process: the rules must stop each.
    strays: set[str] = attrs.Factory(set)
    # Current processes that did not answer the resume: each must be stopped, not asked.
    silent: set[str] = attrs.Factory(set)

    # -- what happened -------------------------------------------------------------------

    def observe(self, event: ev.Event, effects: tuple[fx.Effect, ...]) -> list[str]:
        """Apply one accepted event and the effects it produced; return what went wrong."""
        out: list[str] = []
        self.now = event.at
        self.must_stop = None
        self.strays, self.silent = set(), set()
        self._event(event, out)
        for effect in effects:
            self._effect(effect, out)
        for pid in sorted(self.strays):
            out.append(f"{pid} was found at the resume, nobody's process, and not stopped")
        for pid in sorted(self.silent):
            out.append(f"{pid} did not answer the resume and was not stopped")
        if self.must_stop is not None:
            g, i = self.must_stop
            out.append(f"{g}#{i} failed {self.config.suspect_threshold} probes; nobody stopped it")
        if isinstance(event, ev.Tick):
            self._deadlines(out)
        return out

    def _event(self, e: ev.Event, out: list[str]) -> None:
        if isinstance(e, ev.GroupRegistered):
            self.procs[e.group] = Proc(holds=e.version, since=e.at)
            start = SwitchState.ENABLED if self.config.immediate_recovery else SwitchState.DISABLED
            self.recovery[e.group] = Recovery(start)
        elif isinstance(e, ev.WeightsSynced):
            self._sync(e)
        elif isinstance(e, (ev.StandbyBooted, ev.StandbyLoaded, ev.StandbyFailed)):
            self._standby_event(e, out)
        elif isinstance(e, ev.StandbyVerified):
            self._standby_verified(e, out)
        elif isinstance(e, ev.ExportStarted):
            self.exports[e.version] = Export(e.pinned)
            self.started.add(e.version)
            if e.pinned:
                self.pinned.add(e.version)
        elif isinstance(e, ev.ExportCommitted):
            self.exports.pop(e.version, None)
            self.committed.add(e.version)
            self.disk[e.path] = e.version
        elif isinstance(e, (ev.ExportFailed, ev.ExportCancelled)):
            self.exports.pop(e.version, None)
            failed = isinstance(e, ev.ExportFailed) and e.version == self.fleet and not self.closed
            end = CheckpointState.FAILED if failed else CheckpointState.DISCARDED
            self.gone[e.version] = frozenset({end})
        elif isinstance(e, ev.CheckpointPinned):
            self.pinned.add(e.version)
            if e.version in self.exports:
                self.exports[e.version].pinned = True
        elif isinstance(e, ev.CheckpointUnpinned):
            self.pinned.discard(e.version)
            if e.version in self.exports:
                self.exports[e.version].pinned = False
        elif isinstance(e, ev.CheckpointDeleted):
            self._deleted(e.version, out)
        elif isinstance(e, ev.Resumed):
            self._resumed(e, out)
        elif isinstance(e, ev.GroupVerified):
            self._verified(e, out)
        elif isinstance(e, ev.Shutdown):
            self.closed = True
            for p in self.procs.values():
                if p.status == ProcStatus.DOWN:  # waiting for a checkpoint: nothing left to stop
                    p.status = ProcStatus.STOPPED
        elif isinstance(e, ev.ProbeFailed):
            p = self.procs[e.group]
            p.probe_failures += 1
            if p.probe_failures >= self.config.suspect_threshold:
                self.must_stop = (e.group, e.incarnation)  # the controller must stop it
        elif isinstance(e, ev.ProbeOk):
            self.procs[e.group].probe_failures = 0
        elif isinstance(e, ev.GroupFailed):
            self._dies(e.group, e.incarnation)
        elif isinstance(e, (ev.RestartLoaded, ev.RestartLoadFailed)):
            self._load_done(e, out)
        elif isinstance(e, (ev.Relaunched, ev.RelaunchFailed)):
            self.relaunches.discard((e.group, e.incarnation))
            p = self.procs[e.group]
            if p.incarnation == e.incarnation and p.status == ProcStatus.RELAUNCHING:
                up = isinstance(e, ev.Relaunched)
                p.status, p.holds, p.since = (ProcStatus.UP if up else ProcStatus.DOWN), None, e.at

    def _dies(self, group: str, incarnation: int) -> None:
        """That process is gone, and with it whatever it was reading."""
        load = self.loads.pop((group, incarnation), None)
        self.relaunches.discard((group, incarnation))
        self.verifies.discard((group, incarnation))
        p = self.procs[group]
        reading = load is not None and load.path is not None
        current = p.incarnation == incarnation
        if current and p.status == ProcStatus.LOADING and reading and not p.verifying:
            self.recovery[group].cool()  # it died booting from the checkpoint
        if current and p.status not in {ProcStatus.RETIRED, ProcStatus.STOPPED}:
            p.status, p.holds, p.probe_failures, p.since = ProcStatus.DOWN, None, 0, self.now
            p.verifying = False

    def current(self) -> dict[str, str]:
        """Every process a resume would find as some group's or standby's: name -> owner."""
        out = {f"{g}#{p.incarnation}": g for g, p in self.procs.items() if p.status in PROC_RUNNING}
        out |= {f"{n}#1": n for n, s in self.spares.items() if s.status in SPARE_RUNNING}
        return out

    def _resumed(self, e: ev.Resumed, out: list[str]) -> None:
        """The trainer restarted at ``e.version``; the runtime that ran everything in flight
        died (or was fenced), and the new one reports what it found alive."""
        if e.epoch <= self.epoch:
            out.append(
                f"a resume as epoch {e.epoch} accepted while the run was at {self.epoch}: "
                "engines would still take the replaced run's commands"
            )
        self.epoch = e.epoch
        current = self.current()
        self.strays = (set(e.found) | set(e.silent)) - set(current)
        self.silent = set(e.silent) & set(current)
        gone = [pid for pid in current if pid not in e.found]
        v = self.fleet = self.resumed_at = e.version
        self.announced = False
        for x in self.exports:  # their writers died: only temporary files are left
            self.gone[x] = frozenset({CheckpointState.FAILED, CheckpointState.DISCARDED})
        self.exports.clear()
        self.started = {x for x in self.started if x <= v}
        self.committed = {x for x in self.committed if x <= v}
        self.pinned = {x for x in self.pinned if x <= v}
        self.abandoned |= {x for x in self.disk.values() if x > v}
        # The controller keeps the latest FINISHED_KEPT final states and forgets those above
        # v: below them, what it evicted before stays evicted.
        latest = sorted(self.gone.items())[-FINISHED_KEPT:]
        self.gone = {x: s for x, s in latest if x <= v}
        self.deleting.clear()  # asked of the dead runtime: the controller must ask again
        for name, s in self.spares.items():
            s.verifying = s.status in SPARE_RUNNING
            load = self.loads.get((name, 1))
            if not s.verifying:
                self.loads.pop((name, 1), None)  # killed before the event
                continue
            s.since = e.at
            if load is not None:
                load.resumed = True  # it goes on; the answer reports it
        self.boots.clear()  # a boot goes on too; the answer reports it
        for (g, i), load in list(self.loads.items()):
            p = self.procs.get(g)
            if p is None:
                continue
            if p.incarnation == i and p.status == ProcStatus.LOADING:
                load.resumed = True
            else:
                del self.loads[(g, i)]  # killed before the event
        # A cold start's outcome died with the runtime that ran it: the answer reports it.
        self.relaunches.clear()
        for p in self.procs.values():
            if p.status in PROC_RUNNING:
                p.verifying, p.since = True, e.at
        self.verifies = {(g, p.incarnation) for g, p in self.procs.items() if p.verifying}
        for pid in gone:  # gone, or stopped for its silence: it answers nothing
            owner, _, number = pid.rpartition("#")
            if owner in self.spares:
                self.loads.pop((owner, 1), None)
                self._lose(self.spares[owner], boot_failed=False)
                self.spares[owner].verifying = False
            else:
                self._dies(owner, int(number))

    def answers_now(self, group: str, incarnation: int) -> bool:
        """That verification is the group's current one's (not one killed since)."""
        p = self.procs[group]
        return p.incarnation == incarnation and p.verifying

    def answer(self, group: str) -> int | str | None:
        """What a verifying process would answer: the weights it holds once what it was
        doing finished, or ``"gone"`` if that load cannot finish (its files were deleted)."""
        p = self.procs[group]
        if p.status == ProcStatus.LOADING:
            load = self.loads.get((group, p.incarnation))
            if load is None or load.path is None:
                return load.version if load is not None else "gone"
            return self.disk.get(load.path, "gone")
        return p.holds if p.status == ProcStatus.UP else None

    def spare_answer(self, name: str) -> int | str | None:
        """What a verifying standby would answer (as ``answer`` does for a group)."""
        s = self.spares[name]
        load = self.loads.get((name, 1))
        if load is not None and load.path is not None:
            return self.disk.get(load.path, "gone")
        return s.holds if s.status == SpareStatus.UP else None

    def _standby_verified(self, e: ev.StandbyVerified, out: list[str]) -> None:
        s = self.spares[e.standby]
        load = self.loads.pop((e.standby, 1), None)
        verifying, s.verifying = s.verifying, False
        if not verifying or s.status not in SPARE_RUNNING:
            return  # killed or stopped since: the answer only ends what it owed
        if load is not None and load.path is not None and load.path not in self.disk:
            out.append(f"standby {e.standby} finished loading {load.path}, not on disk")
        held = None if self._abandoned(e.version) else e.version
        s.status, s.holds, s.since = SpareStatus.UP, held, e.at
        self._current(s)

    def _verified(self, e: ev.GroupVerified, out: list[str]) -> None:
        p = self.procs[e.group]
        if (e.group, e.incarnation) not in self.verifies:
            out.append(f"{e.group}#{e.incarnation} answered a verification nobody asked for")
            return
        self.verifies.discard((e.group, e.incarnation))
        if p.incarnation != e.incarnation or not p.verifying:
            self.loads.pop((e.group, e.incarnation), None)  # killed at its deadline since
            self.relaunches.discard((e.group, e.incarnation))
            return
        if p.status == ProcStatus.LOADING:
            load = self.loads.pop((e.group, e.incarnation), None)
            if load is not None and load.path is not None and load.path not in self.disk:
                out.append(f"group {e.group} finished loading {load.path}, which is not on disk")
        self.relaunches.discard((e.group, e.incarnation))
        # Weights numbered above the resume's are the abandoned future's (no push reaches an
        # unverified process): none, for the rules, even once the fleet reached that number.
        held = None if self._abandoned(e.version) else e.version
        p.status, p.holds, p.since, p.verifying = ProcStatus.UP, held, e.at, False

    def _abandoned(self, version: int | None) -> bool:
        return version is not None and self.resumed_at is not None and version > self.resumed_at

    def _holds_ahead(self, p: Proc) -> bool:
        """It is up holding a version above the fleet's (a push reached its claim first)."""
        return p.status == ProcStatus.UP and p.holds is not None and p.holds > self.fleet

    def _ahead(self, p: Proc) -> bool:
        """... and that push's sync is still due: within the load deadline."""
        return self._holds_ahead(p) and self.now - p.since < self.config.deadline("load")

    def _sync(self, e: ev.WeightsSynced) -> None:
        old = self.fleet
        clean = old in self.committed
        missed = old in self.started and not clean
        for rec in self.recovery.values():
            if missed:
                rec.cool()
            elif clean and rec.state == SwitchState.COOLDOWN:
                rec.streak += 1
                if rec.streak >= self.config.clean_syncs_to_reenable:
                    rec.state, rec.streak = SwitchState.ENABLED, 0
        self.fleet = e.version
        self.announced = True
        for name, incarnation in e.groups.items():
            if name in self.spares:
                s = self.spares[name]
                if s.status == SpareStatus.UP:
                    s.holds = e.version
                    self._current(s)
                continue
            p = self.procs[name]
            # The push reached that process only; a successor never got it.
            if p.incarnation == incarnation and p.status == ProcStatus.UP:
                p.holds = e.version

    def _current(self, s: Spare) -> None:
        if s.holds == self.fleet and s.status == SpareStatus.UP and not s.ever_current:
            s.ever_current = True
            self.failed_boots = 0

    def _standby_event(
        self, e: ev.StandbyBooted | ev.StandbyLoaded | ev.StandbyFailed, out: list[str]
    ) -> None:
        s = self.spares[e.standby]
        if isinstance(e, ev.StandbyBooted):
            self.boots.discard(e.standby)
            if s.status == SpareStatus.BOOTING:
                s.status, s.holds, s.since = SpareStatus.UP, None, e.at
        elif isinstance(e, ev.StandbyLoaded):
            load = self.loads.pop((e.standby, 1), None)
            if load is None:
                out.append(f"standby {e.standby} reported a load none runs")
                return
            if s.status == SpareStatus.LOADING:
                if load.path not in self.disk:
                    out.append(f"standby {e.standby} finished loading {load.path}, not on disk")
                s.status, s.holds, s.since = SpareStatus.UP, self.disk.get(str(load.path)), e.at
                self._current(s)
        else:
            self.loads.pop((e.standby, 1), None)
            self.boots.discard(e.standby)
            resuming, s.verifying = s.verifying, False
            if s.status in SPARE_RUNNING:
                self._lose(s, boot_failed=not resuming)

    def _lose(self, s: Spare, boot_failed: bool = True) -> None:
        """Gone; before it ever held the fleet's weights, a failed boot (``boot_failed``:
        not one the dead trainer's runtime started, lost before it answered)."""
        if not s.ever_current and boot_failed:
            self.failed_boots += 1
            self.exhausted |= self.failed_boots >= self.config.standby_boot_budget
        s.status, s.holds = SpareStatus.LOST, None

    def _deleted(self, version: int, out: list[str]) -> None:
        paths = [p for p, v in self.deleting.items() if v == version]
        if not paths:
            out.append(f"checkpoint {version} was deleted, but nobody asked for that")
            return
        for path in paths:
            for reader in self._readers(path):
                out.append(f"{path} was deleted while {reader} was still loading it")
            self.deleting.pop(path)
            self.disk.pop(path, None)
            if version in self.abandoned:
                self.abandoned.discard(version)
            else:
                self.gone[version] = frozenset({CheckpointState.DELETED})

    def _load_done(self, e: ev.RestartLoaded | ev.RestartLoadFailed, out: list[str]) -> None:
        load = self.loads.pop((e.group, e.incarnation), None)
        if load is None:
            out.append(f"group {e.group} incarnation {e.incarnation} reported a load none runs")
            return
        p = self.procs[e.group]
        if p.incarnation != e.incarnation or p.status != ProcStatus.LOADING:
            return  # killed or stopped meanwhile: the loader only reports to end its start
        if isinstance(e, ev.RestartLoadFailed):
            p.status, p.since = ProcStatus.DOWN, e.at
            if load.path is not None:  # a claim that only failed its check read no checkpoint
                self.recovery[e.group].cool()
            return
        if load.path is None:  # a standby claimed as it is: what it held, or what a push
            found = e.version if isinstance(e, ev.RestartLoaded) else None  # brought it
            held = load.version if found is None else found
            p.status, p.holds, p.since = ProcStatus.UP, held, e.at
            return
        if load.path not in self.disk:
            out.append(f"group {e.group} finished loading {load.path}, which is not on disk")
        p.status, p.holds, p.since = ProcStatus.UP, self.disk.get(load.path), e.at

    def _effect(self, f: fx.Effect, out: list[str]) -> None:
        if isinstance(f, fx.RestartFromCheckpoint):
            self._restart_from(f, out)
        elif isinstance(f, fx.LoadCheckpoint):
            self._load_in_place(f, out)
        elif isinstance(f, fx.RestartCold):
            self._check_no_better_standby(f.group, "cold restart", out, loads=False)
            p = self._start(f.group, f.incarnation, "cold restart", out)
            if self.recovery[f.group].state == SwitchState.ENABLED and self._current_ready():
                out.append(
                    f"cold restart of group {f.group}, though C({self.fleet}) is committed "
                    "and its immediate recovery is enabled"
                )
            p.status, p.via = ProcStatus.RELAUNCHING, "cold"
            self.relaunches.add((f.group, f.incarnation))
        elif isinstance(f, fx.RouteTraffic):
            self._route(f, out)
        elif isinstance(f, fx.WithdrawTraffic):
            if self.routed.get(f.group) != f.incarnation:
                out.append(f"traffic withdrawn from {f.group}#{f.incarnation}, never routed to")
            self.routed.pop(f.group, None)
            self.procs[f.group].probe_failures = 0  # probes count within one spell of serving
        elif isinstance(f, fx.RetireGroup):
            p = self.procs[f.group]
            if p.status != ProcStatus.DOWN:
                out.append(f"retirement of group {f.group}, which is {p.status}")
            if self._restarts(p) < self.config.restart_budget:
                out.append(
                    f"group {f.group} retired after {self._restarts(p)} restarts{self._within}; "
                    f"the budget is {self.config.restart_budget}"
                )
            p.status = ProcStatus.RETIRED
        elif isinstance(f, fx.StopGroup):
            if f"{f.group}#{f.incarnation}" in self.silent:
                self.silent.discard(f"{f.group}#{f.incarnation}")  # down since the resume
            else:
                self._stop(f, out)
        elif isinstance(f, fx.StopFound):
            pid = f"{f.name}#{f.incarnation}"
            if pid in self.strays:
                self.strays.discard(pid)
            else:
                out.append(f"stop of {pid}, which the resume did not find as nobody's process")
        elif isinstance(f, fx.CancelExport):
            if f.version in self.exports:
                self.exports[f.version].cancel_requested = True
        elif isinstance(f, fx.DeleteCheckpoint):
            self._delete_asked(f, out)
        elif isinstance(f, fx.StartStandby):
            self._start_standby(f, out)
        elif isinstance(f, fx.LoadStandby):
            self._load_standby(f, out)
        elif isinstance(f, fx.StopStandby):
            if f"{f.standby}#1" in self.silent:
                self.silent.discard(f"{f.standby}#1")  # lost since the resume
            else:
                self._stop_standby(f, out)
        elif isinstance(f, fx.VerifyStandby):
            s = self.spares.get(f.standby)
            if s is None or not s.verifying:
                status = "never started" if s is None else s.status
                out.append(f"verification of standby {f.standby}, which is {status}")
        elif isinstance(f, fx.VerifyGroup):
            p = self.procs[f.group]
            if not p.verifying or p.incarnation != f.incarnation:
                out.append(f"verification of {f.group}#{f.incarnation}, which is {p.status}")
        elif isinstance(f, fx.ClaimStandby):
            self._claim(f, out)

    # -- standbys ----------------------------------------------------------------------------

    def _alive(self) -> list[str]:
        return sorted(n for n, s in self.spares.items() if s.status in SPARE_RUNNING)

    def _start_standby(self, f: fx.StartStandby, out: list[str]) -> None:
        if f.standby in self.spares:
            out.append(f"standby {f.standby} started twice")
        if self.closed:
            out.append(f"standby {f.standby} started after shutdown")
        if self.exhausted:
            out.append(
                f"standby {f.standby} started after {self.config.standby_boot_budget} standbys "
                "in a row failed to boot: the pool had given up"
            )
        claims = self._claims_checked()
        if claims:
            out.append(
                f"standby {f.standby} started while group {claims[0]}'s claim is checked: the "
                "refill waits for its outcome"
            )
        self.spares[f.standby] = Spare(since=self.now)
        self.boots.add(f.standby)
        if len(self._alive()) > self.config.standby:
            out.append(f"standbys {self._alive()} alive; the pool's size is {self.config.standby}")

    def _load_standby(self, f: fx.LoadStandby, out: list[str]) -> None:
        s = self.spares[f.standby]
        self._check_path(f"standby {f.standby}", f.path, f.version, out)
        if s.verifying:
            out.append(f"standby {f.standby} asked to load C({f.version}) before it answered")
        if s.status != SpareStatus.UP or s.holds == self.fleet:
            out.append(
                f"standby {f.standby} asked to load C({f.version}) while {s.status} "
                f"holding version {s.holds}"
            )
        s.status, s.since = SpareStatus.LOADING, self.now
        self.loads[(f.standby, 1)] = Load(f.path, f.version)

    def _stop_standby(self, f: fx.StopStandby, out: list[str]) -> None:
        s = self.spares[f.standby]
        if f.reason == "shutdown":
            if not self.closed:
                out.append(f"standby {f.standby} stopped before shutdown")
            s.status = SpareStatus.STOPPED
            return
        if s.status not in {SpareStatus.BOOTING, SpareStatus.LOADING} and not s.verifying:
            out.append(f"standby {f.standby} killed for a {f.reason} while {s.status}")
        self._lose(s, boot_failed=not s.verifying)

    def _claim(self, f: fx.ClaimStandby, out: list[str]) -> None:
        """A failed group takes a standby: one that runs and nobody took, current as it is,
        else after a load of C(v) in place."""
        s = self.spares.get(f.standby)
        if s is None or s.status not in {SpareStatus.UP, SpareStatus.LOADING}:
            status = "never started" if s is None else s.status
            out.append(f"group {f.group} claims standby {f.standby}, which is {status}")
        if s is not None and s.verifying:
            out.append(f"group {f.group} claims standby {f.standby}, unverified since the resume")
        if s is not None and f.path is None:
            if s.holds != self.fleet or f.version != s.holds:
                out.append(
                    f"group {f.group} claims standby {f.standby} as holding version "
                    f"{f.version}, but it holds {s.holds}; fleet is {self.fleet}"
                )
        elif f.path is not None:
            self._check_path(f"group {f.group}", f.path, f.version, out)
            switch = self.recovery[f.group].state
            if switch != SwitchState.ENABLED:
                out.append(
                    f"group {f.group} claims a standby to load C({f.version}) while its "
                    f"immediate recovery is {switch}"
                )
            ready = [n for n in self._alive() if self._holds_current(n)]
            if ready:
                out.append(
                    f"group {f.group} claims {f.standby} to load C({f.version}) though "
                    f"standby {ready[0]} holds it already"
                )
        p = self._start(f.group, f.incarnation, "claim", out)
        p.status, p.via = ProcStatus.LOADING, "standby"
        held = s.holds if s is not None and s.holds is not None else -1
        self.loads[(f.group, f.incarnation)] = Load(f.path, f.version if f.path else held, True)
        if s is not None:
            s.status = SpareStatus.CLAIMED

    def _claims_checked(self) -> list[str]:
        """Groups whose claim of a standby has not reported its outcome yet (a load in place
        after it, into the same process, is not the claim)."""
        return sorted(
            g
            for (g, i), load in self.loads.items()
            if load.claim
            and not load.resumed  # checked by its verification now, as any resumed process
            and self.procs[g].incarnation == i
            and self.procs[g].status == ProcStatus.LOADING
        )

    def _holds_current(self, name: str) -> bool:
        s = self.spares[name]
        return s.status == SpareStatus.UP and s.holds == self.fleet and not s.verifying

    def _check_no_better_standby(self, group: str, what: str, out: list[str], loads: bool) -> None:
        """A restart while a standby would have served sooner: one holding the fleet's version,
        or (``loads``: the restart reads C(v)) one that can load it in place."""
        for name in self._alive():
            s = self.spares[name]
            if self._holds_current(name):
                out.append(f"{what} of group {group} though standby {name} is current")
                return
            if loads and s.status in {SpareStatus.UP, SpareStatus.LOADING} and not s.verifying:
                out.append(f"{what} of group {group} though standby {name} could load C(v)")
                return

    def _start(self, group: str, incarnation: int, what: str, out: list[str]) -> Proc:
        """A new incarnation of a dead group's process, within its restart budget."""
        p = self.procs[group]
        if p.status != ProcStatus.DOWN:
            out.append(f"{what} of group {group}, which is {p.status}")
        if incarnation != p.incarnation + 1:
            out.append(
                f"{what} of group {group} as incarnation {incarnation} after {p.incarnation}"
            )
        if self._restarts(p) >= self.config.restart_budget:
            out.append(
                f"{what} of group {group} beyond its budget: {self._restarts(p)} restarts"
                f"{self._within}"
            )
        p.restarted.append(p.since)  # a restart counts from the failure that spent it
        p.incarnation, p.holds, p.since, p.probe_failures = incarnation, None, self.now, 0
        return p

    def _restarts(self, p: Proc) -> int:
        """Restarts that spend the budget now: all of them, or those of the last window."""
        window = self.config.restart_window_s
        return sum(1 for t in p.restarted if window is None or self.now - t < window)

    @property
    def _within(self) -> str:
        window = self.config.restart_window_s
        return "" if window is None else f" in the last {window:g} s"

    def _restart_from(self, f: fx.RestartFromCheckpoint, out: list[str]) -> None:
        self._check_source(f, out)
        self._check_no_better_standby(f.group, "restart from C", out, loads=True)
        p = self._start(f.group, f.incarnation, "restart", out)
        p.status, p.via = ProcStatus.LOADING, "immediate"
        self.loads[(f.group, f.incarnation)] = Load(f.path, f.version)

    def _load_in_place(self, f: fx.LoadCheckpoint, out: list[str]) -> None:
        """The running process loads the current checkpoint: no restart, no budget."""
        self._check_source(f, out)
        p = self.procs[f.group]
        if self._ahead(p):
            out.append(
                f"{f.group} loads C({f.version}) over version {p.holds}, which a push in "
                "flight brought it and whose sync is still due"
            )
        if p.incarnation != f.previous or p.status != ProcStatus.UP or p.holds == self.fleet:
            out.append(
                f"{f.group}#{f.previous} asked to load C({f.version}) in place, but its "
                f"process #{p.incarnation} is {p.status} holding version {p.holds}"
            )
        if f.incarnation != p.incarnation + 1:
            out.append(f"load in place of {f.group} as #{f.incarnation} after #{p.incarnation}")
        if self.routed.get(f.group) is not None:
            out.append(f"{f.group} loads in place while the router sends it traffic")
        p.incarnation, p.status, p.since = f.incarnation, ProcStatus.LOADING, self.now
        self.loads[(f.group, f.incarnation)] = Load(f.path, f.version)

    def _check_source(
        self, f: fx.RestartFromCheckpoint | fx.LoadCheckpoint, out: list[str]
    ) -> None:
        """A load may read only the fleet's committed checkpoint, under an enabled switch."""
        self._check_path(f"group {f.group}", f.path, f.version, out)
        if self.recovery[f.group].state != SwitchState.ENABLED:
            out.append(
                f"group {f.group} loads a checkpoint while its immediate recovery "
                f"is {self.recovery[f.group].state}"
            )

    def _check_path(self, who: str, path: str, version: int, out: list[str]) -> None:
        """A load reads the fleet's committed checkpoint, whose delete nobody asked for."""
        if path not in self.disk:
            out.append(f"{who} loads {path}, which is not a checkpoint on disk")
        elif self.disk[path] != version:
            out.append(f"{path} holds version {version}, not {self.disk[path]}")
        if path in self.deleting:
            out.append(f"{who} loads {path}, whose delete is under way")
        if version != self.fleet:
            out.append(f"{who} loads version {version}; fleet is {self.fleet}")
        if self.disk.get(path) in self.abandoned:
            out.append(f"{who} loads {path}, of the future a resume abandoned")

    def _route(self, f: fx.RouteTraffic, out: list[str]) -> None:
        p = self.procs[f.group]
        if p.verifying:
            out.append(f"traffic routed to {f.group}#{f.incarnation} before it answered")
        if p.incarnation != f.incarnation or p.status != ProcStatus.UP or p.holds != f.version:
            out.append(
                f"traffic routed to {f.group}#{f.incarnation} on version {f.version}, but "
                f"its process #{p.incarnation} is {p.status} holding version {p.holds}"
            )
        if f.version != self.fleet:
            out.append(f"traffic routed to {f.group} on version {f.version}; fleet is {self.fleet}")
        if f.group in self.routed:
            out.append(f"traffic routed to {f.group} twice without a withdrawal")
        self.routed[f.group] = f.incarnation

    def _stop(self, f: fx.StopGroup, out: list[str]) -> None:
        p = self.procs[f.group]
        if p.incarnation != f.incarnation:
            out.append(f"stop of {f.group}#{f.incarnation}, whose process is #{p.incarnation}")
            return
        if f.reason == "shutdown":
            if not self.closed:
                out.append(f"group {f.group} stopped before shutdown")
            p.status, p.verifying = ProcStatus.STOPPED, False
            return
        if f.reason == "failed probes":
            if p.status != ProcStatus.UP or self.must_stop != (f.group, f.incarnation):
                out.append(f"{f.group}#{f.incarnation} stopped for failed probes while {p.status}")
            self.must_stop = None
            p.status, p.holds, p.probe_failures, p.since = ProcStatus.DOWN, None, 0, self.now
            return
        # A start past its deadline: killed; it counts as a failed restart. Its loader keeps
        # its lease until it reports, so the world keeps it reading until then.
        if p.status not in {ProcStatus.LOADING, ProcStatus.RELAUNCHING} and not p.verifying:
            out.append(f"{f.group}#{f.incarnation} killed for a {f.reason} while {p.status}")
        load = self.loads.get((f.group, f.incarnation))
        reading = p.status == ProcStatus.LOADING and load is not None and load.path is not None
        if reading and not p.verifying:  # a claim that only awaited its check read nothing
            self.recovery[f.group].cool()
        p.status, p.holds, p.since, p.verifying = ProcStatus.DOWN, None, self.now, False

    def _delete_asked(self, f: fx.DeleteCheckpoint, out: list[str]) -> None:
        if self.disk.get(f.path) != f.version:
            out.append(f"delete of {f.path} (version {f.version}), which is not on disk as such")
        if f.version in self.pinned:
            out.append(f"delete of pinned checkpoint {f.version}")
        for reader in self._readers(f.path):
            out.append(f"delete of {f.path} asked while {reader} is loading it")
        if f.path in self.deleting:
            out.append(f"delete of {f.path} asked twice")
        self.deleting[f.path] = f.version

    def _readers(self, path: str) -> list[str]:
        return sorted(f"{g}#{i}" for (g, i), load in self.loads.items() if load.path == path)

    def _current_ready(self) -> bool:
        """C(v) is on disk, not being deleted, and not the future a resume abandoned."""
        return any(
            v == self.fleet and v not in self.abandoned
            for p, v in self.disk.items()
            if p not in self.deleting
        )

    def _deadlines(self, out: list[str]) -> None:
        """After a Tick no wait may be past its deadline."""
        c = self.config
        limits = {
            ProcStatus.DOWN: c.deadline("checkpoint"),
            ProcStatus.LOADING: c.deadline("load"),
            ProcStatus.RELAUNCHING: c.deadline("relaunch"),
        }
        for name, p in self.procs.items():
            if self._holds_ahead(p) and not self._ahead(p):  # no sync reported that push
                p.holds = None  # its weights are nobody's
            limit = c.deadline("load") if p.verifying else limits.get(p.status)
            if limit is not None and self.now - p.since >= limit:
                what = "waits for a checkpoint" if p.status == ProcStatus.DOWN else f"is {p.status}"
                out.append(f"group {name} {what} {self.now - p.since:g} s, past its {limit:g} s")
        spare_limits = {
            SpareStatus.BOOTING: c.deadline("relaunch"),
            SpareStatus.LOADING: c.deadline("load"),
        }
        for name, s in self.spares.items():
            limit = spare_limits.get(s.status)
            if s.verifying and s.status in SPARE_RUNNING:
                limit = c.deadline("load")  # its answer's deadline, whatever it was doing
            if limit is not None and self.now - s.since >= limit:
                waited = self.now - s.since
                out.append(f"standby {name} is {s.status} {waited:g} s, past its {limit:g} s")

    # -- checks after every step -----------------------------------------------------------

    def _check_standbys(self, c: RecoveryController) -> list[str]:
        out: list[str] = []
        views = c.standbys()
        alive = self._alive()
        if sorted(views) != alive:
            out.append(f"the controller keeps standbys {sorted(views)}; running are {alive}")
        for name in alive:
            s, view = self.spares[name], views.get(name)
            if view is None:
                continue
            expected = {
                SpareStatus.BOOTING: StandbyState.BOOTING,
                SpareStatus.LOADING: StandbyState.LOADING,
            }.get(s.status) or (StandbyState.READY if s.holds == self.fleet else StandbyState.STALE)
            if s.verifying:
                expected = StandbyState.RESUMING
            if view.state != expected:
                out.append(
                    f"standby {name} is {view.state}; its engine is {s.status} holding "
                    f"version {s.holds}, fleet {self.fleet}"
                )
            stale = s.status == SpareStatus.UP and s.holds != self.fleet and not s.verifying
            if stale and self._current_ready():
                out.append(
                    f"standby {name} holds version {s.holds} though C({self.fleet}) is "
                    "committed: it should load it in place"
                )
        ready = [n for n in alive if self._holds_current(n)]
        if ready and not self.closed:
            for name, p in self.procs.items():
                if p.status == ProcStatus.DOWN:
                    out.append(f"group {name} waits though standby {ready[0]} is current")
        exhausted = self.exhausted
        full = len(alive) == self.config.standby or (
            self._claims_checked() and len(alive) < self.config.standby
        )
        if not self.closed and not exhausted and not full:
            out.append(f"standbys {alive} alive; the pool's size is {self.config.standby}")
        counted = c.rules.pool.record.failed_boots
        if counted != self.failed_boots:  # the count decides when the pool gives up
            out.append(
                f"the pool counts {counted} failed boots in a row, expected {self.failed_boots}"
            )
        if self.config.standby and not self.closed:
            expected_pool = PoolState.EXHAUSTED if exhausted else PoolState.FILLING
            if c.pool_state != expected_pool:
                out.append(
                    f"the pool is {c.pool_state} after {self.failed_boots} failed boots in a "
                    f"row; expected {expected_pool}"
                )
        return out

    @property
    def quiescent(self) -> bool:
        """Nothing outstanding in the real world: no write, load, relaunch or delete."""
        answers = self.verifies or any(s.verifying for s in self.spares.values())
        return not (
            self.exports or self.deleting or self.loads or self.relaunches or self.boots or answers
        )

    def check(self, c: RecoveryController) -> list[str]:
        out: list[str] = []
        if c.epoch != self.epoch:
            out.append(f"the controller is at epoch {c.epoch}; the run's is {self.epoch}")
        live = {f"{g}#{i}" for (g, i), load in self.loads.items() if load.path is not None}
        if set(c.leases) != live:
            out.append(f"controller holds leases {sorted(c.leases)}; loaders hold {sorted(live)}")
        for v, ck in c.checkpoints().items():
            readers = sum(1 for x in self.loads.values() if x.version == v and x.path is not None)
            if ck.leases != readers:
                out.append(f"checkpoint {v} counts {ck.leases} leases; {readers} loaders read it")
        for name, g in c.groups().items():
            p = self.procs[name]
            if g.state in SERVING and (p.status != ProcStatus.UP or p.holds != self.fleet):
                out.append(
                    f"group {name} is {g.state} but its process #{p.incarnation} is {p.status} "
                    f"holding version {p.holds}; fleet is {self.fleet}"
                )
            if p.status == ProcStatus.UP and p.holds is None and g.version is not None:
                out.append(
                    f"group {name} is taken to hold version {g.version}; its process "
                    f"#{p.incarnation} holds weights no sync or checkpoint vouches for"
                )
            if (g.state in SERVING) != (self.routed.get(name) == g.incarnation):
                out.append(
                    f"group {name} is {g.state} (#{g.incarnation}) but the router sends to "
                    f"{self.routed.get(name)}"
                )
            if g.state in SERVING:
                health = GroupState.SUSPECT if p.probe_failures else GroupState.ACTIVE
                if g.state != health:
                    out.append(f"group {name} is {g.state} after {p.probe_failures} failed probes")
            expected = self.recovery[name].state
            if g.recovery != expected:
                out.append(f"immediate recovery of {name} is {g.recovery}, expected {expected}")
            # The count decides when recovery comes back: a wrong one is a late or early
            # re-enable already decided, several syncs before anyone could see it.
            streak = c.rules.groups[name].recovery.clean_streak
            if streak != self.recovery[name].streak:
                out.append(
                    f"immediate recovery of {name} counts {streak} clean syncs in a row, "
                    f"expected {self.recovery[name].streak}"
                )
            stale = p.status == ProcStatus.UP and p.holds != self.fleet and not self.closed
            stale = stale and not self._ahead(p)  # it waits for the sync of what it holds
            enabled = expected == SwitchState.ENABLED
            if stale and enabled and self._current_ready() and not p.verifying:
                out.append(
                    f"group {name} holds version {p.holds} though C({self.fleet}) is "
                    "committed: it should load it in place"
                )
            if p.status == ProcStatus.DOWN and enabled:
                if self._current_ready():
                    out.append(f"group {name} still waits though C({self.fleet}) is committed")
                elif self.fleet in self.started and self.fleet not in self.exports:
                    out.append(f"group {name} still waits for C({self.fleet}), whose export ended")
                elif self.fleet not in self.started and not self.announced:
                    out.append(
                        f"group {name} waits for C({self.fleet}), which no sync announced: "
                        "nobody will export it"
                    )
        out += self._check_standbys(c)
        # The controller keeps the final states of its latest FINISHED_KEPT checkpoints only.
        for v, allowed in sorted(self.gone.items())[-FINISHED_KEPT:]:
            try:
                state = c.checkpoint_state(v)
            except RecoveryError as err:
                state = f"unknown ({err})"
            if state not in allowed:
                out.append(f"checkpoint {v} is {state}, expected {sorted(allowed)}")
        for name, incarnation in self.routed.items():
            p = self.procs[name]
            if p.verifying:
                out.append(f"traffic goes to {name}#{incarnation}, unverified since the resume")
            if p.incarnation != incarnation or p.status != ProcStatus.UP or p.holds != self.fleet:
                out.append(
                    f"traffic goes to {name}#{incarnation}, whose process #{p.incarnation} is "
                    f"{p.status} holding version {p.holds}; fleet is {self.fleet}"
                )
        for v, x in self.exports.items():
            stale = v < self.fleet or self.closed
            if stale and not x.pinned and not x.cancel_requested:
                out.append(f"stale export of version {v} keeps running: nobody cancelled it")
        drained = c.drained
        if self.quiescent:
            kept = sorted(v for v in self.disk.values() if v not in self.pinned)
            if self.closed and not drained:
                out.append("shut down with nothing outstanding, yet the controller is not drained")
            if self.closed and kept:
                out.append(f"shut down and quiescent, yet unpinned checkpoints {kept} remain")
            if not self.closed and any(v != self.fleet for v in kept):
                out.append(f"quiescent with stale unpinned checkpoints {kept} on disk")
        elif drained:
            out.append("the controller says drained while work is still outstanding")
        return out
