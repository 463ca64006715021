"""A second opinion on the controller: what the real system would hold after each event.

The controller's invariants are its own contract. ``World`` is kept independently by the
search: it learns only from the events that happened and the effects the controller asked
for, tracks what is on disk and in each group's process, and flags every request that would
hurt in the real system (a delete under a reader, a restart from a file that is not there,
a group routed with weights it does not hold, a lease the controller forgot).

It is fed accepted events only, so ``recovery-fsm replay`` can run it over any journal.
"""

from __future__ import annotations

import attrs

from .. import effects as fx
from .. import events as ev
from ..controller import RecoveryConfig, RecoveryController


@attrs.define
class Load:
    lease: str
    path: str
    version: int


@attrs.define
class Proc:
    """One group's process as the runtime sees it."""

    # up | down | loading | relaunching | retired | stopped
    status: str = "up"
    holds: int | None = None  # the weight version in memory while up
    load: Load | None = None  # a loader reading a checkpoint (survives a stop until it reports)
    probe_failures: int = 0


@attrs.define
class Export:
    pinned: bool
    cancel_requested: bool = False


@attrs.define
class Recovery:
    """The spec of immediate recovery, restated: cool on a missed export or a failed
    restart, back after N clean syncs in a row."""

    state: str
    streak: int = 0


@attrs.define
class World:
    config: RecoveryConfig
    fleet: int = 0
    closed: bool = False
    procs: dict[str, Proc] = attrs.Factory(dict)
    recovery: dict[str, Recovery] = attrs.Factory(dict)
    exports: dict[int, Export] = attrs.Factory(dict)  # in flight
    started: set[int] = attrs.Factory(set)
    committed: set[int] = attrs.Factory(set)
    pinned: set[int] = attrs.Factory(set)
    disk: dict[str, int] = attrs.Factory(dict)  # committed directories: path -> version
    deleting: dict[str, int] = attrs.Factory(dict)  # deletes asked for, not done yet
    leases_seen: set[str] = attrs.Factory(set)

    # -- what happened -------------------------------------------------------------------

    def observe(self, event: ev.Event, effects: tuple[fx.Effect, ...]) -> list[str]:
        """Apply one accepted event and the effects it produced; return what went wrong."""
        out: list[str] = []
        self._event(event, out)
        for effect in effects:
            self._effect(effect, out)
        return out

    def _event(self, e: ev.Event, out: list[str]) -> None:
        if isinstance(e, ev.GroupRegistered):
            self.procs[e.group] = Proc("up", holds=e.version)
            start = "enabled" if self.config.immediate_recovery else "disabled"
            self.recovery[e.group] = Recovery(start)
        elif isinstance(e, ev.WeightsSynced):
            self._sync(e, out)
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
        elif isinstance(e, ev.CheckpointPinned):
            self.pinned.add(e.version)
            if e.version in self.exports:
                self.exports[e.version].pinned = True
        elif isinstance(e, ev.CheckpointDeleted):
            self._deleted(e.version, out)
        elif isinstance(e, ev.Shutdown):
            self.closed = True
        elif isinstance(e, ev.ProbeFailed):
            p = self.procs[e.group]
            p.probe_failures += 1
            if p.probe_failures >= self.config.suspect_threshold:
                # The health manager gives up on it; the runtime kills it before a restart.
                p.status, p.holds, p.probe_failures = "down", None, 0
        elif isinstance(e, ev.ProbeOk):
            self.procs[e.group].probe_failures = 0
        elif isinstance(e, ev.GroupFailed):
            p = self.procs[e.group]
            p.status, p.holds, p.load, p.probe_failures = "down", None, None, 0
        elif isinstance(e, (ev.RestartLoaded, ev.RestartLoadFailed)):
            self._load_done(e, out)
        elif isinstance(e, ev.Relaunched):
            p = self.procs[e.group]
            p.status, p.holds = "up", None
        elif isinstance(e, ev.RelaunchFailed):
            self.procs[e.group].status = "down"

    def _sync(self, e: ev.WeightsSynced, out: list[str]) -> None:
        old = self.fleet
        clean = old in self.committed
        missed = old in self.started and not clean
        for rec in self.recovery.values():
            if missed:
                rec.streak = 0
                if rec.state == "enabled":
                    rec.state = "cooldown"
            elif clean and rec.state == "cooldown":
                rec.streak += 1
                if rec.streak >= self.config.clean_syncs_to_reenable:
                    rec.state, rec.streak = "enabled", 0
        self.fleet = e.version
        for name in e.groups:
            p = self.procs[name]
            if p.status == "up":  # the trainer's push reaches only live processes
                p.holds = e.version

    def _deleted(self, version: int, out: list[str]) -> None:
        paths = [p for p, v in self.deleting.items() if v == version]
        if not paths:
            out.append(f"checkpoint {version} was deleted, but nobody asked for that")
            return
        for path in paths:
            for name in self._readers(path):
                out.append(f"{path} was deleted while group {name} was still loading it")
            self.deleting.pop(path)
            self.disk.pop(path, None)

    def _load_done(self, e: ev.RestartLoaded | ev.RestartLoadFailed, out: list[str]) -> None:
        p = self.procs[e.group]
        load = p.load
        if load is None or load.lease != e.lease:
            out.append(f"group {e.group} reported lease {e.lease}, but no such load runs")
            return
        p.load = None
        if p.status != "loading":
            return  # stopped meanwhile: the loader only reports to give its lease back
        if isinstance(e, ev.RestartLoadFailed):
            p.status = "down"
            rec = self.recovery[e.group]
            rec.streak = 0
            if rec.state == "enabled":
                rec.state = "cooldown"
            return
        if load.path not in self.disk:
            out.append(f"group {e.group} finished loading {load.path}, which is not on disk")
        p.status, p.holds = "up", self.disk.get(load.path)

    def _effect(self, f: fx.Effect, out: list[str]) -> None:
        if isinstance(f, fx.RestartFromCheckpoint):
            self._restart(f, out)
        elif isinstance(f, fx.RestartCold):
            self._down(f.group, "cold restart", out).status = "relaunching"
        elif isinstance(f, fx.ReadmitGroup):
            p = self.procs[f.group]
            if p.status != "up" or p.holds != f.version:
                out.append(
                    f"group {f.group} readmitted as serving version {f.version}, but it is "
                    f"{p.status} holding version {p.holds}"
                )
            if f.version != self.fleet:
                out.append(
                    f"group {f.group} readmitted on version {f.version}; fleet is {self.fleet}"
                )
        elif isinstance(f, fx.RetireGroup):
            self._down(f.group, "retirement", out).status = "retired"
        elif isinstance(f, fx.StopGroup):
            self.procs[f.group].status = "stopped"
        elif isinstance(f, fx.CancelExport):
            if f.version in self.exports:
                self.exports[f.version].cancel_requested = True
        elif isinstance(f, fx.DeleteCheckpoint):
            self._delete_asked(f, out)

    def _restart(self, f: fx.RestartFromCheckpoint, out: list[str]) -> None:
        if f.lease in self.leases_seen:
            out.append(f"lease {f.lease} was granted twice")
        self.leases_seen.add(f.lease)
        if f.path not in self.disk:
            out.append(f"group {f.group} restarts from {f.path}, which is not a checkpoint on disk")
        elif self.disk[f.path] != f.version:
            out.append(f"{f.path} holds version {self.disk[f.path]}, not {f.version}")
        if f.path in self.deleting:
            out.append(f"group {f.group} restarts from {f.path}, whose delete is under way")
        if f.version != self.fleet:
            out.append(f"group {f.group} restarts from version {f.version}; fleet is {self.fleet}")
        p = self._down(f.group, "restart", out)
        p.status, p.holds, p.load = "loading", None, Load(f.lease, f.path, f.version)

    def _down(self, group: str, what: str, out: list[str]) -> Proc:
        """The process an effect acts on, which must be dead by then."""
        p = self.procs[group]
        if p.status != "down":
            out.append(f"{what} of group {group}, which is {p.status}")
        return p

    def _delete_asked(self, f: fx.DeleteCheckpoint, out: list[str]) -> None:
        if self.disk.get(f.path) != f.version:
            out.append(f"delete of {f.path} (version {f.version}), which is not on disk as such")
        if f.version in self.pinned:
            out.append(f"delete of pinned checkpoint {f.version}")
        for name in self._readers(f.path):
            out.append(f"delete of {f.path} asked while group {name} is loading it")
        if f.path in self.deleting:
            out.append(f"delete of {f.path} asked twice")
        self.deleting[f.path] = f.version

    def _readers(self, path: str) -> list[str]:
        return sorted(
            n for n, p in self.procs.items() if p.load is not None and p.load.path == path
        )

    # -- checks after every step -----------------------------------------------------------

    @property
    def quiescent(self) -> bool:
        """Nothing outstanding in the real world: no write, load, relaunch or delete."""
        return not (
            self.exports
            or self.deleting
            or any(p.load is not None or p.status == "relaunching" for p in self.procs.values())
        )

    def check(self, c: RecoveryController) -> list[str]:
        out: list[str] = []
        snap = c.snapshot()
        live = {p.load.lease for p in self.procs.values() if p.load is not None}
        if set(snap["leases"]) != live:
            out.append(
                f"controller holds leases {sorted(snap['leases'])}; loaders hold {sorted(live)}"
            )
        for v, ck in snap["checkpoints"].items():
            readers = sum(1 for p in self.procs.values() if p.load and p.load.version == v)
            if ck["leases"] != readers:
                out.append(
                    f"checkpoint {v} counts {ck['leases']} leases; {readers} loaders read it"
                )
        for name, g in snap["groups"].items():
            p = self.procs[name]
            if g["state"] in {"active", "suspect"} and (p.status != "up" or p.holds != self.fleet):
                out.append(
                    f"group {name} is {g['state']} but its process is {p.status} "
                    f"holding version {p.holds}; fleet is {self.fleet}"
                )
            expected = self.recovery[name].state
            if g["recovery"]["state"] != expected:
                out.append(
                    f"immediate recovery of {name} is {g['recovery']['state']}, expected {expected}"
                )
        for v, x in self.exports.items():
            stale = v < self.fleet or self.closed
            if stale and not x.pinned and not x.cancel_requested:
                out.append(f"stale export of version {v} keeps running: nobody cancelled it")
        if self.quiescent:
            kept = sorted(v for v in self.disk.values() if v not in self.pinned)
            if self.closed and not c.drained:
                out.append("shut down with nothing outstanding, yet the controller is not drained")
            if self.closed and kept:
                out.append(f"shut down and quiescent, yet unpinned checkpoints {kept} remain")
            if not self.closed and any(v != self.fleet for v in kept):
                out.append(f"quiescent with stale unpinned checkpoints {kept} on disk")
        return out
