"""A second opinion on the controller: what the real system would hold after each event.

The controller's invariants are its own contract. ``World`` is kept independently by the
search: it learns only from the events that happened and the effects the controller asked
for, tracks what is on disk, which process of each group runs and what it holds, which
loaders read which path and what the router sends traffic to, and restates every rule of
recovery in its own terms: the restart budget, each deadline, the clean-sync streak, the
choice between an immediate and a cold restart. It flags every request that would hurt in
the real system and every rule the controller did not keep.

It is fed accepted events only, so ``recovery-fsm replay`` can run it over any journal.
"""

from __future__ import annotations

import attrs

from .. import effects as fx
from .. import events as ev
from ..config import RecoveryConfig
from ..controller import RecoveryController
from ..machines import SERVING


@attrs.define
class Load:
    path: str
    version: int


@attrs.define
class Proc:
    """A group's current process as the runtime sees it."""

    incarnation: int = 1
    # up | down | loading | relaunching | retired | stopped
    status: str = "up"
    holds: int | None = None  # the weight version in memory while up
    since: float = 0.0  # when the current status began
    probe_failures: int = 0
    restarts: int = 0
    via: str | None = None  # how the last restart went: "immediate" or "cold"


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
        if self.state == "enabled":
            self.state = "cooldown"


@attrs.define
class World:
    config: RecoveryConfig
    fleet: int = 0
    now: float = 0.0
    closed: bool = False
    procs: dict[str, Proc] = attrs.Factory(dict)
    loads: dict[tuple[str, int], Load] = attrs.Factory(dict)  # loaders still running
    relaunches: set[tuple[str, int]] = attrs.Factory(set)  # cold starts still running
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

    # -- what happened -------------------------------------------------------------------

    def observe(self, event: ev.Event, effects: tuple[fx.Effect, ...]) -> list[str]:
        """Apply one accepted event and the effects it produced; return what went wrong."""
        out: list[str] = []
        self.now = event.at
        self.must_stop = None
        self._event(event, out)
        for effect in effects:
            self._effect(effect, out)
        if self.must_stop is not None:
            g, i = self.must_stop
            out.append(f"{g}#{i} failed {self.config.suspect_threshold} probes; nobody stopped it")
        if isinstance(event, ev.Tick):
            self._deadlines(out)
        return out

    def _event(self, e: ev.Event, out: list[str]) -> None:
        if isinstance(e, ev.GroupRegistered):
            self.procs[e.group] = Proc(holds=e.version, since=e.at)
            start = "enabled" if self.config.immediate_recovery else "disabled"
            self.recovery[e.group] = Recovery(start)
        elif isinstance(e, ev.WeightsSynced):
            self._sync(e)
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
            self.gone[e.version] = frozenset({"failed"} if failed else {"discarded"})
        elif isinstance(e, ev.CheckpointPinned):
            self.pinned.add(e.version)
            if e.version in self.exports:
                self.exports[e.version].pinned = True
        elif isinstance(e, ev.CheckpointDeleted):
            self._deleted(e.version, out)
        elif isinstance(e, ev.Shutdown):
            self.closed = True
            for p in self.procs.values():
                if p.status == "down":  # waiting for a checkpoint: nothing left to stop
                    p.status = "stopped"
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
            if p.incarnation == e.incarnation and p.status == "relaunching":
                up = isinstance(e, ev.Relaunched)
                p.status, p.holds, p.since = ("up" if up else "down"), None, e.at

    def _dies(self, group: str, incarnation: int) -> None:
        """That process is gone, and with it whatever it was reading."""
        self.loads.pop((group, incarnation), None)
        self.relaunches.discard((group, incarnation))
        p = self.procs[group]
        if p.incarnation == incarnation and p.status == "loading":
            self.recovery[group].cool()  # it died booting from the checkpoint
        if p.incarnation == incarnation and p.status not in {"retired", "stopped"}:
            p.status, p.holds, p.probe_failures, p.since = "down", None, 0, self.now

    def _sync(self, e: ev.WeightsSynced) -> None:
        old = self.fleet
        clean = old in self.committed
        missed = old in self.started and not clean
        for rec in self.recovery.values():
            if missed:
                rec.cool()
            elif clean and rec.state == "cooldown":
                rec.streak += 1
                if rec.streak >= self.config.clean_syncs_to_reenable:
                    rec.state, rec.streak = "enabled", 0
        self.fleet = e.version
        for name, incarnation in e.groups.items():
            p = self.procs[name]
            # The push reached that process only; a successor never got it.
            if p.incarnation == incarnation and p.status == "up":
                p.holds = e.version

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
            self.gone[version] = frozenset({"deleted"})

    def _load_done(self, e: ev.RestartLoaded | ev.RestartLoadFailed, out: list[str]) -> None:
        load = self.loads.pop((e.group, e.incarnation), None)
        if load is None:
            out.append(f"group {e.group} incarnation {e.incarnation} reported a load none runs")
            return
        p = self.procs[e.group]
        if p.incarnation != e.incarnation or p.status != "loading":
            return  # killed or stopped meanwhile: the loader only reports to end its start
        if isinstance(e, ev.RestartLoadFailed):
            p.status, p.since = "down", e.at
            self.recovery[e.group].cool()
            return
        if load.path not in self.disk:
            out.append(f"group {e.group} finished loading {load.path}, which is not on disk")
        p.status, p.holds, p.since = "up", self.disk.get(load.path), e.at

    def _effect(self, f: fx.Effect, out: list[str]) -> None:
        if isinstance(f, fx.RestartFromCheckpoint):
            self._restart_from(f, out)
        elif isinstance(f, fx.LoadCheckpoint):
            self._load_in_place(f, out)
        elif isinstance(f, fx.RestartCold):
            p = self._start(f.group, f.incarnation, "cold restart", out)
            if self.recovery[f.group].state == "enabled" and self._current_ready():
                out.append(
                    f"cold restart of group {f.group}, though C({self.fleet}) is committed "
                    "and its immediate recovery is enabled"
                )
            p.status, p.via = "relaunching", "cold"
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
            if p.status != "down":
                out.append(f"retirement of group {f.group}, which is {p.status}")
            if p.restarts < self.config.restart_budget:
                out.append(
                    f"group {f.group} retired after {p.restarts} restarts; the budget is "
                    f"{self.config.restart_budget}"
                )
            p.status = "retired"
        elif isinstance(f, fx.StopGroup):
            self._stop(f, out)
        elif isinstance(f, fx.CancelExport):
            if f.version in self.exports:
                self.exports[f.version].cancel_requested = True
        elif isinstance(f, fx.DeleteCheckpoint):
            self._delete_asked(f, out)

    def _start(self, group: str, incarnation: int, what: str, out: list[str]) -> Proc:
        """A new incarnation of a dead group's process, within its restart budget."""
        p = self.procs[group]
        if p.status != "down":
            out.append(f"{what} of group {group}, which is {p.status}")
        if incarnation != p.incarnation + 1:
            out.append(
                f"{what} of group {group} as incarnation {incarnation} after {p.incarnation}"
            )
        if p.restarts >= self.config.restart_budget:
            out.append(f"{what} of group {group} beyond its budget of {p.restarts} restarts")
        p.incarnation, p.holds, p.since, p.probe_failures = incarnation, None, self.now, 0
        p.restarts += 1
        return p

    def _restart_from(self, f: fx.RestartFromCheckpoint, out: list[str]) -> None:
        self._check_source(f, out)
        p = self._start(f.group, f.incarnation, "restart", out)
        p.status, p.via = "loading", "immediate"
        self.loads[(f.group, f.incarnation)] = Load(f.path, f.version)

    def _load_in_place(self, f: fx.LoadCheckpoint, out: list[str]) -> None:
        """The running process loads the current checkpoint: no restart, no budget."""
        self._check_source(f, out)
        p = self.procs[f.group]
        if p.incarnation != f.previous or p.status != "up" or p.holds == self.fleet:
            out.append(
                f"{f.group}#{f.previous} asked to load C({f.version}) in place, but its "
                f"process #{p.incarnation} is {p.status} holding version {p.holds}"
            )
        if f.incarnation != p.incarnation + 1:
            out.append(f"load in place of {f.group} as #{f.incarnation} after #{p.incarnation}")
        if self.routed.get(f.group) is not None:
            out.append(f"{f.group} loads in place while the router sends it traffic")
        p.incarnation, p.status, p.since = f.incarnation, "loading", self.now
        self.loads[(f.group, f.incarnation)] = Load(f.path, f.version)

    def _check_source(
        self, f: fx.RestartFromCheckpoint | fx.LoadCheckpoint, out: list[str]
    ) -> None:
        """A load may read only the fleet's committed checkpoint, under an enabled switch."""
        if f.path not in self.disk:
            out.append(f"group {f.group} loads {f.path}, which is not a checkpoint on disk")
        elif self.disk[f.path] != f.version:
            out.append(f"{f.path} holds version {f.version}, not {self.disk[f.path]}")
        if f.path in self.deleting:
            out.append(f"group {f.group} loads {f.path}, whose delete is under way")
        if f.version != self.fleet:
            out.append(f"group {f.group} loads version {f.version}; fleet is {self.fleet}")
        if self.recovery[f.group].state != "enabled":
            out.append(
                f"group {f.group} loads a checkpoint while its immediate recovery "
                f"is {self.recovery[f.group].state}"
            )

    def _route(self, f: fx.RouteTraffic, out: list[str]) -> None:
        p = self.procs[f.group]
        if p.incarnation != f.incarnation or p.status != "up" or p.holds != f.version:
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
            p.status = "stopped"
            return
        if f.reason == "failed probes":
            if p.status != "up" or self.must_stop != (f.group, f.incarnation):
                out.append(f"{f.group}#{f.incarnation} stopped for failed probes while {p.status}")
            self.must_stop = None
            p.status, p.holds, p.probe_failures, p.since = "down", None, 0, self.now
            return
        # A start past its deadline: killed; it counts as a failed restart. Its loader keeps
        # its lease until it reports, so the world keeps it reading until then.
        if p.status not in {"loading", "relaunching"}:
            out.append(f"{f.group}#{f.incarnation} killed for a {f.reason} while {p.status}")
        if p.status == "loading":
            self.recovery[f.group].cool()
        p.status, p.holds, p.since = "down", None, self.now

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
        return any(v == self.fleet for p, v in self.disk.items() if p not in self.deleting)

    def _deadlines(self, out: list[str]) -> None:
        """After a Tick no wait may be past its deadline."""
        c = self.config
        limits = {
            "down": c.deadline("checkpoint"),
            "loading": c.deadline("load"),
            "relaunching": c.deadline("relaunch"),
        }
        for name, p in self.procs.items():
            limit = limits.get(p.status)
            if limit is not None and self.now - p.since >= limit:
                what = "waits for a checkpoint" if p.status == "down" else f"is {p.status}"
                out.append(f"group {name} {what} {self.now - p.since:g} s, past its {limit:g} s")

    # -- checks after every step -----------------------------------------------------------

    @property
    def quiescent(self) -> bool:
        """Nothing outstanding in the real world: no write, load, relaunch or delete."""
        return not (self.exports or self.deleting or self.loads or self.relaunches)

    def check(self, c: RecoveryController) -> list[str]:
        out: list[str] = []
        live = {f"{g}#{i}" for g, i in self.loads}
        if set(c.leases) != live:
            out.append(f"controller holds leases {sorted(c.leases)}; loaders hold {sorted(live)}")
        for v, ck in c.checkpoints().items():
            readers = sum(1 for load in self.loads.values() if load.version == v)
            if ck.leases != readers:
                out.append(f"checkpoint {v} counts {ck.leases} leases; {readers} loaders read it")
        for name, g in c.groups().items():
            p = self.procs[name]
            if g.state in SERVING and (p.status != "up" or p.holds != self.fleet):
                out.append(
                    f"group {name} is {g.state} but its process #{p.incarnation} is {p.status} "
                    f"holding version {p.holds}; fleet is {self.fleet}"
                )
            if (g.state in SERVING) != (self.routed.get(name) == g.incarnation):
                out.append(
                    f"group {name} is {g.state} (#{g.incarnation}) but the router sends to "
                    f"{self.routed.get(name)}"
                )
            if g.state in SERVING:
                health = "suspect" if p.probe_failures else "active"
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
            stale = p.status == "up" and p.holds != self.fleet and not self.closed
            if stale and expected == "enabled" and self._current_ready():
                out.append(
                    f"group {name} holds version {p.holds} though C({self.fleet}) is "
                    "committed: it should load it in place"
                )
            if p.status == "down" and expected == "enabled":
                if self._current_ready():
                    out.append(f"group {name} still waits though C({self.fleet}) is committed")
                elif self.fleet in self.started and self.fleet not in self.exports:
                    out.append(f"group {name} still waits for C({self.fleet}), whose export ended")
        for v, allowed in self.gone.items():
            if c.checkpoint_state(v) not in allowed:
                out.append(f"checkpoint {v} is {c.checkpoint_state(v)}, expected {sorted(allowed)}")
        for name, incarnation in self.routed.items():
            p = self.procs[name]
            if p.incarnation != incarnation or p.status != "up" or p.holds != self.fleet:
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
