"""The runtime's parts without a cluster: the one send policy, on a real controller behind a
transport that fails, and the runner's retry of routing effects.

``Flaky`` stands between the reporter and a real ``ControllerLink`` the way the network
stands between the runtime and a controller actor: it can lose an answer after the event
landed, or lose every send. No Ray cluster is needed.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("ray")

from recovery_fsm import ControllerStopped, RecoveryController, Rules
from recovery_fsm import events as ev
from recovery_fsm.host import ControllerLink
from recovery_fsm.ray.reporter import FailStop, Reporter
from recovery_fsm.ray.safety import SafetyCounters


class Flaky:
    """A transport: ``land_then_time_out`` sends land and then time out; ``down`` loses
    every send before it lands."""

    def __init__(self, link: ControllerLink) -> None:
        self.link = link
        self.land_then_time_out = 0
        self.down = False
        self.attempts = 0

    def send(self, cls: type[ev.Event], **fields: Any) -> Any:
        self.attempts += 1
        if self.down:
            raise TimeoutError("the controller did not answer")
        out = self.link.send(cls, **fields)
        if self.land_then_time_out:
            self.land_then_time_out -= 1
            raise TimeoutError("the answer was lost")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)


def _setup(rules: type[Rules] = Rules) -> tuple[Flaky, SafetyCounters, FailStop, Reporter]:
    ticks = itertools.count(1)
    c = RecoveryController(rules=rules)
    flaky = Flaky(ControllerLink(c, clock=lambda: float(next(ticks))))
    counters = SafetyCounters()
    failstop = FailStop("/runs/7/journal.jsonl")
    reporter = Reporter(flaky, counters, failstop, backoff_s=0.0)  # type: ignore[arg-type]
    reporter.send(ev.GroupRegistered, group="g0", version=0)
    return flaky, counters, failstop, reporter


def test_a_retry_of_a_report_that_had_landed_is_a_duplicate_not_a_refusal() -> None:
    flaky, counters, _, reporter = _setup()
    flaky.land_then_time_out = 1
    assert reporter.report(ev.GroupFailed, group="g0", incarnation=1) is False
    snap = counters.snapshot()
    assert (snap.duplicate_reports, snap.refused_reports, snap.lost_reports) == (1, 0, 0)
    assert flaky.link.controller.incarnation("g0") == 2  # it did land, once


def test_a_stale_report_is_refused_and_counted_once_without_a_retry() -> None:
    flaky, counters, _, reporter = _setup()
    reporter.report(ev.GroupFailed, group="g0", incarnation=1)
    before = flaky.attempts
    assert reporter.report(ev.ProbeOk, group="g0", incarnation=1) is False
    assert flaky.attempts == before + 1
    assert counters.snapshot().refused_reports == 1


def test_a_report_to_a_controller_that_never_answers_is_tried_twice_then_lost() -> None:
    flaky, counters, _, reporter = _setup()
    flaky.down = True
    before = flaky.attempts
    assert reporter.report(ev.Tick) is False
    assert flaky.attempts - before == 2  # bounded: the monitor's thread moves on
    assert counters.snapshot().lost_reports == 1


class BrokenOnTick(Rules):
    def on_Tick(self, e: Any, _: None) -> None:
        raise RuntimeError("a bug in the rules")


def test_the_first_broken_answer_trips_fail_stop_for_every_later_call() -> None:
    flaky, counters, failstop, reporter = _setup(BrokenOnTick)
    tripped: list[str] = []
    failstop.on_trip(lambda: tripped.append("runner halted"))
    assert reporter.report(ev.Tick) is False
    assert tripped == ["runner halted"]
    assert counters.snapshot().refused_reports == 0  # a broken controller is not a refusal
    attempts = flaky.attempts
    with pytest.raises(ControllerStopped, match=r"replay\.rebuild\('/runs/7/journal.jsonl'\)"):
        reporter.send(ev.WeightsSynced, version=1, groups={"g0": 1})
    assert reporter.report(ev.Tick) is False
    assert flaky.attempts == attempts  # nothing more was sent
    failstop.trip(RuntimeError("again"))
    assert tripped == ["runner halted"]  # listeners run once


def test_a_retried_routing_effect_that_a_newer_one_replaced_is_dropped(tmp_path: Any) -> None:
    """The user's router raised on RouteTraffic; the group was withdrawn since; a retry must
    not route to it again (its weights may be stale by then)."""
    from recovery_fsm import effects as fx
    from recovery_fsm.export import CheckpointStore
    from recovery_fsm.ray.actors import ActorTable, Launcher
    from recovery_fsm.ray.engine import ReferenceEngine
    from recovery_fsm.ray.router import TrafficRouter
    from recovery_fsm.ray.runner import EffectRunner

    seen: list[str] = []

    def user_router(effect: Any) -> None:
        seen.append(effect.kind)
        if len(seen) == 1:
            raise RuntimeError("the load balancer was down")

    table = ActorTable()
    router = TrafficRouter(table, call_timeout_s=1.0, user=user_router)
    _, counters, _, reporter = _setup()
    launcher = Launcher(table, ReferenceEngine, {}, actors_per_group=1, actor_options={},
                        call_timeout_s=1.0)  # fmt: skip
    runner = EffectRunner(launcher=launcher, reporter=reporter, counters=counters,
                          router=router, store=CheckpointStore(tmp_path), cancel_export=print,
                          max_parallel=1)  # fmt: skip
    runner.execute(fx.RouteTraffic("g0", 3, 5))
    assert [f.effect.kind for f in runner.errors] == ["RouteTraffic"]
    runner.execute(fx.WithdrawTraffic("g0", 3))
    assert runner.retry_failed() == 1
    assert router.routes == {"g0": None} and seen == ["RouteTraffic", "WithdrawTraffic"]
    # With nothing newer, the retry does run.
    runner.execute(fx.RouteTraffic("g0", 4, 5))
    assert runner.errors == () and router.routes == {"g0": (4, 5)}
    runner.close(1.0)


def test_waiting_for_a_route_ends_when_it_or_a_newer_one_is_applied() -> None:
    """``synced`` waits on this: by value (a remote link's effects are copies), satisfied by
    a newer routing effect of the group, and bounded."""
    import threading
    import time

    from recovery_fsm import effects as fx
    from recovery_fsm.ray.actors import ActorTable
    from recovery_fsm.ray.router import TrafficRouter

    router = TrafficRouter(ActorTable(), call_timeout_s=1.0)
    route = fx.RouteTraffic("g0", 2, 5)
    assert not router.wait_routed([route], timeout=0.05)  # nothing applied yet
    later = threading.Timer(0.2, router.apply, [fx.RouteTraffic("g0", 2, 5)])  # a copy
    later.start()
    started = time.monotonic()
    assert router.wait_routed([route, fx.StopGroup("g1", 1, "x")], timeout=10)
    assert time.monotonic() - started >= 0.15  # it did wait for the apply
    assert router.routes == {"g0": (2, 5)}
    router.apply(fx.WithdrawTraffic("g0", 2))  # superseded since: reached too
    assert router.wait_routed([route], timeout=0.05)
    # An older incarnation's withdrawal does not count for a newer route.
    assert not router.wait_routed([fx.RouteTraffic("g0", 3, 6)], timeout=0.05)
