"""Nothing the controller and the runtime's parts keep grows with the length of a run.

Hundreds of restarts, loads in place, syncs and deletes go through the real controller,
and its effects through the runtime's real bookkeeping parts (actor table, safety counters,
router, ledger), exactly as the Ray runner calls them; actor handles are plain tokens (the
parts never call them). The sizes after 300 rounds must equal those after 50.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest

pytest.importorskip("ray")

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import effects as fx
from recovery_fsm import events as ev
from recovery_fsm.journal.ledger import Ledger
from recovery_fsm.ray.actors import ActorTable
from recovery_fsm.ray.router import TrafficRouter
from recovery_fsm.ray.safety import SafetyCounters

GROUPS = ("g0", "g1", "g2")


class Parts:
    """The runtime's bookkeeping, fed the controller's effects as the runner feeds them."""

    def __init__(self, keep: int) -> None:
        self.ledger = Ledger(keep=keep)
        self.controller = RecoveryController(
            RecoveryConfig(restart_budget=10_000), journal=self.ledger
        )
        self.table = ActorTable()
        self.counters = SafetyCounters(remember=16)
        self.router = TrafficRouter(self.table, call_timeout_s=1.0)
        self.clock = itertools.count(1)
        self.outcomes: collections.deque[tuple[type[ev.Event], dict[str, Any]]] = (
            collections.deque()
        )

    def send(self, cls: type[ev.Event], **fields: Any) -> None:
        effects = self.controller.handle(cls(at=float(next(self.clock)), **fields))  # type: ignore[call-arg]
        for e in effects:
            self.execute(e)
        while self.outcomes:
            cls, fields = self.outcomes.popleft()
            self.send(cls, **fields)

    def execute(self, e: fx.Effect) -> None:
        match e:
            case fx.RouteTraffic() | fx.WithdrawTraffic():
                self.router.apply(e)
            case fx.StopGroup(group=g, incarnation=i):
                self.table.take(g, i)
            case fx.RetireGroup(group=g):
                self.table.take(g)
            case fx.LoadCheckpoint(group=g, incarnation=i, previous=p, path=path):
                self.counters.load_in_place(g)
                self.table.renumber(g, p, i)
                self.counters.load_begins(path)
                self.counters.load_ends(path)
                self.outcomes.append((ev.RestartLoaded, {"group": g, "incarnation": i}))
            case fx.RestartFromCheckpoint(group=g, incarnation=i, path=path):
                self.counters.load_begins(path)
                self.table.replace(g, i, [object()])
                self.counters.load_ends(path)
                self.outcomes.append((ev.RestartLoaded, {"group": g, "incarnation": i}))
            case fx.RestartCold(group=g, incarnation=i):
                self.table.replace(g, i, [object()])
                self.outcomes.append((ev.Relaunched, {"group": g, "incarnation": i}))
            case fx.DeleteCheckpoint(version=v, path=path):
                self.counters.delete_begins(path)
                self.counters.deleted(path)
                self.outcomes.append((ev.CheckpointDeleted, {"version": v}))
            case fx.CancelExport():
                pass

    def sizes(self) -> dict[str, int]:
        rules = self.controller.rules
        return {
            **{f"actors.{k}": v for k, v in self.table.sizes().items()},
            **{f"safety.{k}": v for k, v in self.counters.sizes().items()},
            **{f"router.{k}": v for k, v in self.router.sizes().items()},
            "rules.finished": len(rules.finished),
            "rules.checkpoints": len(rules.checkpoints),
            "rules.starts": len(rules.starts),
            "ledger.spans": len(self.ledger.spans()),
            "ledger.crashes": len(self.ledger.crashes),
            "ledger.recoveries": len(self.ledger.recoveries),
            "ledger.syncs": len(self.ledger.syncs),
            "ledger.exports": len(self.ledger.exports),
        }


def one_round(p: Parts, v: int) -> None:
    """A sync to v with its export, then a death of one group and a hang of another (both
    boot from C(v) at once)."""
    p.send(ev.WeightsSynced, version=v, groups=p.controller.up_groups())
    p.send(ev.ExportStarted, version=v)
    p.send(ev.ExportCommitted, version=v, path=f"/ckpt/step-{v}")
    victim = GROUPS[v % len(GROUPS)]
    p.send(ev.GroupFailed, group=victim, incarnation=p.controller.incarnation(victim))
    hung = GROUPS[(v + 1) % len(GROUPS)]  # missed probes: the health manager stops it
    for _ in range(p.controller.config.suspect_threshold):
        p.send(ev.ProbeFailed, group=hung, incarnation=p.controller.incarnation(hung))


def test_bookkeeping_stays_bounded_over_hundreds_of_restarts_and_syncs() -> None:
    p = Parts(keep=40)
    for g in GROUPS:
        p.table.replace(g, 1, [object()])
        p.send(ev.GroupRegistered, group=g, version=0)
    v = 0
    for _ in range(100):  # past every bound (the killed processes kept: 64)
        v += 1
        one_round(p, v)
    early = p.sizes()
    for _ in range(250):
        v += 1
        one_round(p, v)
    late = p.sizes()
    assert late == early, {k: (early[k], late[k]) for k in late if late[k] != early[k]}
    # Bounded, and still exact where it counts: every failure and recovery is counted.
    assert p.ledger.failures == 700
    assert sum(p.ledger.recovered.values()) == 700
    assert p.ledger.metrics()["recovery/failures"] == 700
    assert p.counters.snapshot().loads_from_deleted == 0
    assert all(r is not None for r in p.router.routes.values())
    p.controller.assert_invariants()
