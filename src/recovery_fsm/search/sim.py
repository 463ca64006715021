"""The controller in a simulated cluster: every enabled next step, and checks after each.

A ``Sim`` owns a real controller (or a broken variant of it) and a ``World``. ``actions()``
lists what may happen next: the trainer syncs, exports, pins or shuts down; the health
manager reports failures and probes; the scheduler completes any pending effect, with
success or failure, in any order (an effect never chosen is one that hangs). ``step``
turns an action into an event, sends it, feeds the world, and returns every violation:
the controller's invariants, the world's checks, a crash, or a real completion refused.
Hypothesis and the explorer both drive this one class, so they search the same space.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import attrs

from .. import events as ev
from ..controller import RecoveryConfig, RecoveryController
from ..errors import RecoveryError
from .world import World

TRAINER, HEALTH, SCHEDULER = "trainer", "health", "scheduler"

# Completions that must be refused when delivered a second time. Relaunched and
# RelaunchFailed carry no attempt id, so a late copy cannot be told from a new report.
_DUPLICABLE = (
    ev.ExportCommitted,
    ev.ExportFailed,
    ev.ExportCancelled,
    ev.RestartLoaded,
    ev.RestartLoadFailed,
    ev.CheckpointDeleted,
)


def small_config() -> RecoveryConfig:
    """Small numbers, so budgets, cooldowns and timeouts are reached in a few steps."""
    return RecoveryConfig(
        clean_syncs_to_reenable=1,
        suspect_threshold=2,
        restart_budget=2,
        await_checkpoint_timeout_s=10.0,
    )


@attrs.frozen
class Scope:
    """How big a world to search. The defaults are the explorer's small scope."""

    groups: tuple[str, ...] = ("g0", "g1")
    max_version: int = 2  # syncs stop here: versions 0..max_version
    max_failures: int = 3  # GroupFailed reports in all
    probes: bool = False
    pins: bool = False
    partial_syncs: bool = False  # the trainer may leave one up group out of a sync
    shutdown: bool = True
    config: RecoveryConfig = attrs.field(factory=small_config)


@attrs.frozen
class Action:
    actor: str
    kind: str
    target: str | int | None = None

    def __str__(self) -> str:
        return self.kind if self.target is None else f"{self.kind}({self.target})"


class Sim:
    def __init__(
        self,
        scope: Scope | None = None,
        controller: type[RecoveryController] = RecoveryController,
    ) -> None:
        self.scope = scope or Scope()
        self.records: list[dict[str, Any]] = []
        self.controller = controller(self.scope.config, journal=self.records.append)
        self.world = World(self.scope.config)
        self.now = 0.0
        self.failures = 0
        self.trace: list[str] = []
        self.delivered: list[ev.Event] = []
        for name in self.scope.groups:
            problems = self._send(ev.GroupRegistered(name, 0, self.now))
            assert not problems, problems

    def fork(self) -> Sim:
        """An independent copy: the explorer tries every action from one state."""
        child = Sim.__new__(Sim)
        child.scope = self.scope
        child.records = list(self.records)
        child.controller = self.controller.fork(journal=child.records.append)
        child.world = copy.deepcopy(self.world)
        child.now = self.now
        child.failures = self.failures
        child.trace = list(self.trace)
        child.delivered = list(self.delivered)
        return child

    # -- what may happen next ------------------------------------------------------------

    def actions(self) -> list[Action]:
        w, s = self.world, self.scope
        c = self.controller
        out: list[Action] = []
        if not w.closed:
            up = self._up()
            if w.fleet < s.max_version:
                out.append(Action(TRAINER, "sync"))
                if s.partial_syncs:
                    out += [Action(TRAINER, "sync_without", g) for g in up]
            if w.fleet not in w.started:
                out.append(Action(TRAINER, "export"))
                if s.pins:
                    out.append(Action(TRAINER, "export_pinned"))
            if s.pins:
                out += [Action(TRAINER, "pin", v) for v in self._pinnable()]
            if any(c.group_state(g) == "awaiting_checkpoint" for g in s.groups):
                out.append(Action(TRAINER, "tick"))
            if s.shutdown:
                out.append(Action(TRAINER, "shutdown"))
            if self.failures < s.max_failures:
                out += [
                    Action(HEALTH, "fail", g)
                    for g in s.groups
                    if w.procs[g].status in {"up", "loading", "relaunching"}
                ]
            if s.probes:
                serving = [g for g in s.groups if c.group_state(g) in {"active", "suspect"}]
                out += [Action(HEALTH, "probe_failed", g) for g in serving]
                out += [Action(HEALTH, "probe_ok", g) for g in serving]
        for v in sorted(w.exports):
            out += [Action(SCHEDULER, k, v) for k in ("commit", "export_fails", "export_cancelled")]
        for g in s.groups:
            p = w.procs[g]
            if p.load is not None:
                out += [Action(SCHEDULER, "loaded", g), Action(SCHEDULER, "load_fails", g)]
            if p.status == "relaunching":
                out += [Action(SCHEDULER, "relaunched", g), Action(SCHEDULER, "relaunch_fails", g)]
        out += [Action(SCHEDULER, "deleted", v) for v in sorted(set(w.deleting.values()))]
        return out

    def _up(self) -> list[str]:
        return [g for g in self.scope.groups if self.world.procs[g].status == "up"]

    def _pinnable(self) -> list[int]:
        w = self.world
        on_disk = {v for p, v in w.disk.items() if p not in w.deleting}
        return sorted((set(w.exports) | on_disk) - w.pinned)

    def event_for(self, a: Action) -> ev.Event:
        w, now = self.world, self.now
        k, t = a.kind, a.target
        if k == "sync":
            return ev.WeightsSynced(w.fleet + 1, frozenset(self._up()), now)
        if k == "sync_without":
            return ev.WeightsSynced(w.fleet + 1, frozenset(self._up()) - {t}, now)
        if k in {"export", "export_pinned"}:
            return ev.ExportStarted(w.fleet, now, pinned=k == "export_pinned")
        if k == "tick":
            return ev.Tick(now + self.scope.config.await_checkpoint_timeout_s)
        if k == "shutdown":
            return ev.Shutdown(now)
        if isinstance(t, int):
            if k == "pin":
                return ev.CheckpointPinned(t, now)
            if k == "commit":
                return ev.ExportCommitted(t, checkpoint_path(t), now)
            if k == "export_fails":
                return ev.ExportFailed(t, "OSError: [Errno 28] No space left on device", now)
            if k == "export_cancelled":
                return ev.ExportCancelled(t, now)
            if k == "deleted":
                return ev.CheckpointDeleted(t, now)
        if isinstance(t, str):
            load = w.procs[t].load
            if k == "fail":
                return ev.GroupFailed(t, now, reason="injected")
            if k == "probe_failed":
                return ev.ProbeFailed(t, now)
            if k == "probe_ok":
                return ev.ProbeOk(t, now)
            if k == "loaded" and load is not None:
                return ev.RestartLoaded(t, load.lease, now)
            if k == "load_fails" and load is not None:
                return ev.RestartLoadFailed(t, load.lease, now, error="injected")
            if k == "relaunched":
                return ev.Relaunched(t, now)
            if k == "relaunch_fails":
                return ev.RelaunchFailed(t, now, error="injected")
        raise ValueError(f"action {a} is not enabled here")

    # -- doing it ------------------------------------------------------------------------

    def step(self, action: Action) -> list[str]:
        """Take one enabled action; return every violation it revealed (empty: none)."""
        event = self.event_for(action)
        self.trace.append(str(action))
        if action.kind == "fail":
            self.failures += 1
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
        try:
            effects = self.controller.handle(event)
        except RecoveryError as err:
            return self._found([f"the controller refused {event!r}, which really happened: {err}"])
        except Exception as err:  # a crash is a finding, not a test error
            return [f"the controller crashed on {event!r}: {type(err).__name__}: {err}"]
        if isinstance(event, _DUPLICABLE):
            self.delivered.append(event)
        problems = self.world.observe(event, effects)
        problems += self.world.check(self.controller)
        problems += self.controller.check_invariants()
        return problems

    def duplicate(self, index: int) -> list[str]:
        """Deliver an earlier completion again: it must be refused and change nothing."""
        earlier: Any = self.delivered[index % len(self.delivered)]
        event: ev.Event = attrs.evolve(earlier, at=self.now)
        self.trace.append(f"duplicate({event.kind})")
        before = self.controller.snapshot()
        try:
            self.controller.handle(event)
        except RecoveryError:
            if self.controller.snapshot() != before:
                return self._found([f"refusing the duplicate {event!r} changed the controller"])
            return []
        except Exception as err:
            return self._found(
                [f"the controller crashed on {event!r}: {type(err).__name__}: {err}"]
            )
        return self._found([f"the controller accepted the duplicate {event!r}"])

    # -- liveness ------------------------------------------------------------------------

    def settle(self, max_steps: int | None = None) -> list[str]:
        """No more failures; every effect completes and the trainer keeps syncing. Within
        a bounded number of such fair steps every group must be active, retired or stopped."""
        bound = max_steps if max_steps is not None else 8 * len(self.scope.groups) + 8
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

    def _unsettled(self) -> list[str]:
        out = []
        for g in self.scope.groups:
            state = self.controller.group_state(g)
            if state not in {"active", "suspect", "retired", "stopped"}:
                out.append(f"group {g} is {state}")
        if not self.world.quiescent:
            out.append("effects still pending")
        return out

    def _fair_next(self) -> Action | None:
        """Completions first (successes), then the trainer's next move."""
        w = self.world
        if w.deleting:
            return Action(SCHEDULER, "deleted", min(w.deleting.values()))
        for g in self.scope.groups:
            if w.procs[g].load is not None:
                return Action(SCHEDULER, "loaded", g)
            if w.procs[g].status == "relaunching":
                return Action(SCHEDULER, "relaunched", g)
        if w.exports:
            v, x = min(w.exports.items())
            return Action(SCHEDULER, "export_cancelled" if x.cancel_requested else "commit", v)
        if w.closed:
            return None
        states = {self.controller.group_state(g) for g in self.scope.groups}
        if "awaiting_checkpoint" in states and w.fleet not in w.started:
            return Action(TRAINER, "export")
        if "awaiting_checkpoint" in states:
            return Action(TRAINER, "tick")
        if "pending_weights" in states:
            return Action(TRAINER, "sync")  # beyond max_version: fairness needs progress
        return None

    # -- for the explorer and for reports -------------------------------------------------

    def key(self) -> str:
        """Two states with equal keys behave the same from here on (ids and clocks
        normalised), so the explorer visits each once."""
        snap = self.controller.snapshot()
        timeout = self.scope.config.await_checkpoint_timeout_s
        # A group holds at most one lease: name each by its holder, not by grant order.
        rename = {lid: f"lease-of-{lease['group']}" for lid, lease in snap["leases"].items()}
        for g in snap["groups"].values():
            if g["lease"] is not None:
                g["lease"] = rename.get(g["lease"], g["lease"])
            since = g.pop("awaiting_since")
            g["expired"] = None if since is None else self.now - since >= timeout
        snap["leases"] = {rename[k]: {**v, "id": rename[k]} for k, v in snap["leases"].items()}
        for field in ("now", "lease_seq", "released"):
            snap.pop(field)
        w = self.world
        world = {
            "fleet": w.fleet,
            "closed": w.closed,
            "procs": {
                n: [
                    p.status,
                    p.holds,
                    p.probe_failures,
                    p.load and [rename.get(p.load.lease), p.load.path],
                ]
                for n, p in sorted(w.procs.items())
            },
            "recovery": {n: [r.state, r.streak] for n, r in sorted(w.recovery.items())},
            "exports": {v: [x.pinned, x.cancel_requested] for v, x in sorted(w.exports.items())},
            "current": [w.fleet in w.started, w.fleet in w.committed],
            "pinned": sorted(w.pinned),
            "disk": sorted(w.disk.items()),
            "deleting": sorted(w.deleting.items()),
            "failures": self.failures,
        }
        return json.dumps([snap, world], sort_keys=True, default=str)

    def write_journal(self, path: str | os.PathLike[str]) -> Path:
        """The events so far as a journal ``recovery-fsm replay`` reads."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records))
        return out


def checkpoint_path(version: int) -> str:
    return f"/ckpt/step-{version}"
