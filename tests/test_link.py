"""ControllerLink: effects run in order on the link's own thread, outside every lock; an
execute that raises loses nothing (kept in errors, the rest still run); close() drains."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

import pytest

from recovery_fsm import (
    Effect,
    RecoveryConfig,
    RecoveryController,
    RestartFromCheckpoint,
    RouteTraffic,
    StopGroup,
    WithdrawTraffic,
)
from recovery_fsm import events as ev
from recovery_fsm.host import ControllerLink

WAIT = 5.0  # bounds a wait that should end at once: a hang fails instead of stalling


def _clock() -> Callable[[], float]:
    ticks: Iterator[int] = itertools.count(1)
    return lambda: float(next(ticks))


class Recorder:
    """An execute that records (effect, thread) and can be told to raise or block."""

    def __init__(self) -> None:
        self.ran: list[Effect] = []
        self.threads: set[int] = set()
        self.fail: Callable[[Effect], bool] = lambda _e: False
        self.lock = threading.Lock()

    def __call__(self, effect: Effect) -> None:
        with self.lock:
            self.ran.append(effect)
            self.threads.add(threading.get_ident())
        if self.fail(effect):
            raise RuntimeError(f"adapter failed on {effect.kind}")


def _link(execute: Callable[[Effect], None], groups: int = 3) -> ControllerLink:
    """Groups g1..gN serving v1 with C(1) committed; the effects of the setup already ran."""
    c = RecoveryController(RecoveryConfig(restart_budget=5))
    link = ControllerLink(c, clock=_clock(), execute=execute)
    for i in range(1, groups + 1):
        link.send(ev.GroupRegistered, group=f"g{i}", version=0)
    link.send(ev.WeightsSynced, version=1, groups=c.up_groups())
    link.send(ev.ExportStarted, version=1)
    link.send(ev.ExportCommitted, version=1, path="/ckpt/step-1")
    assert link.join(WAIT)
    return link


@contextlib.contextmanager
def _running(link: ControllerLink) -> Iterator[ControllerLink]:
    """Close with a bound: a dispatcher that died must fail the test, not hang it."""
    try:
        yield link
    finally:
        link.close(WAIT)


def test_a_raising_execute_does_not_drop_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    with _running(_link(rec)) as link:
        rec.ran.clear()
        rec.fail = lambda e: isinstance(e, StopGroup) and e.group == "g2"
        effects = link.send(ev.Shutdown)
        kinds = ["WithdrawTraffic", "StopGroup"] * 3 + ["DeleteCheckpoint"]  # C(1) goes too
        assert [e.kind for e in effects] == kinds
        assert link.join(WAIT)
        assert rec.ran == list(effects)  # all seven, in order, the failing one included
        (failed,) = link.errors
        assert failed.effect == StopGroup("g2", 1, "shutdown")
        assert isinstance(failed.error, RuntimeError)
        assert "adapter failed on StopGroup" in str(failed.error)
        assert "executing StopGroup(group='g2'" in caplog.text
        assert "kept in link.errors" in caplog.text


def test_the_dispatcher_goes_on_after_a_failure() -> None:
    rec = Recorder()
    with _running(_link(rec)) as link:
        rec.fail = lambda e: isinstance(e, WithdrawTraffic)
        withdraw, restart = link.send(ev.GroupFailed, group="g1", incarnation=1)
        assert isinstance(restart, RestartFromCheckpoint)
        assert link.join(WAIT)
        rec.fail = lambda _e: False
        link.send(ev.RestartLoaded, group="g1", incarnation=restart.incarnation)
        assert link.join(WAIT)
        assert rec.ran[-3:] == [withdraw, restart, RouteTraffic("g1", 2, 1)]
        assert [f.effect for f in link.errors] == [withdraw]


def test_execute_runs_off_the_callers_thread_and_outside_every_lock() -> None:
    """A load that blocks the adapter does not stall another thread's send: execute holds
    neither the link's lock nor the controller's."""
    entered, release = threading.Event(), threading.Event()
    rec = Recorder()

    def execute(effect: Effect) -> None:
        rec(effect)
        if isinstance(effect, RestartFromCheckpoint):
            entered.set()
            release.wait(3 * WAIT)  # outlasts the check below

    with _running(_link(execute)) as link:
        link.send(ev.GroupFailed, group="g1", incarnation=1)  # returns with the load queued
        assert entered.wait(WAIT)
        sent: list[tuple[Effect, ...]] = []
        other = threading.Thread(
            target=lambda: sent.append(link.send(ev.GroupFailed, group="g2", incarnation=1))
        )
        other.start()
        other.join(WAIT)
        # Read before the load is released: afterwards a stalled send would catch up.
        finished_while_blocked = not other.is_alive()
        release.set()
        assert finished_while_blocked, "send stalled behind a running execute"
        assert [e.kind for e in sent[0]] == ["WithdrawTraffic", "RestartFromCheckpoint"]
        assert link.controller.group_state("g2") == "loading"
        assert link.join(WAIT)
        assert threading.get_ident() not in rec.threads
        assert other.ident not in rec.threads
        assert len(rec.threads) == 1  # one dispatcher, so effects stay in order


def test_execute_may_query_the_controller_and_send_back() -> None:
    """The adapter reports the outcome of a restart from inside execute."""
    seen: list[str] = []
    link: ControllerLink | None = None

    def execute(effect: Effect) -> None:
        if link is None:
            return  # the setup's effects: _link joins them before it returns
        if isinstance(effect, RestartFromCheckpoint):
            seen.append(link.controller.group_state(effect.group))
            link.controller.snapshot()
            link.send(ev.RestartLoaded, group=effect.group, incarnation=effect.incarnation)
        elif isinstance(effect, RouteTraffic):
            seen.append(link.controller.group_state(effect.group))

    link = _link(execute)
    with _running(link):
        link.send(ev.GroupFailed, group="g1", incarnation=1)
        assert link.join(WAIT)  # also waits for the RouteTraffic the nested send queued
        assert seen[-2:] == ["loading", "active"]
        assert link.controller.group("g1").incarnation == 2
        assert link.controller.leases == {}
        assert link.errors == ()


def test_retry_failed_runs_the_failed_effects_again() -> None:
    rec = Recorder()
    attempts: dict[Effect, int] = {}

    def flaky(effect: Effect) -> bool:
        attempts[effect] = attempts.get(effect, 0) + 1
        return isinstance(effect, RestartFromCheckpoint) and attempts[effect] == 1

    with _running(_link(rec)) as link:
        rec.fail = flaky
        _, restart = link.send(ev.GroupFailed, group="g1", incarnation=1)
        assert link.join(WAIT)
        assert [f.effect for f in link.errors] == [restart]
        assert link.retry_failed() == 1
        assert link.join(WAIT)
        assert link.errors == ()
        assert attempts[restart] == 2
        assert rec.ran[-1] == restart
        assert link.retry_failed() == 0


def test_close_runs_what_is_queued() -> None:
    entered, gate = threading.Event(), threading.Event()
    rec = Recorder()

    def execute(effect: Effect) -> None:
        rec(effect)
        if isinstance(effect, StopGroup) and effect.group == "g1":
            entered.set()
            gate.wait(WAIT)

    link = _link(execute)
    rec.ran.clear()
    effects = link.send(ev.Shutdown)
    assert entered.wait(WAIT)
    assert effects[1] == StopGroup("g1", 1, "shutdown")
    assert link.pending == len(effects) - 1  # g1's StopGroup running, the rest queued
    done: list[bool] = []
    closer = threading.Thread(target=lambda: done.append(link.close(WAIT)))
    closer.start()
    gate.set()
    closer.join(WAIT)
    assert done == [True]
    assert rec.ran == list(effects)
    assert link.pending == 0


def test_close_says_when_it_timed_out() -> None:
    entered, gate = threading.Event(), threading.Event()

    def execute(effect: Effect) -> None:
        if isinstance(effect, StopGroup):
            entered.set()
            gate.wait(WAIT)

    link = _link(execute)
    link.send(ev.Shutdown)
    assert entered.wait(WAIT)
    try:
        assert link.close(0.05) is False  # the effect is held until the gate opens below
    finally:
        gate.set()
    assert link.join(WAIT)


def test_after_close_send_runs_effects_on_the_callers_thread() -> None:
    """Late reports (a load finishing after shutdown) still get their effects run."""
    rec = Recorder()
    link = _link(rec)
    _, restart = link.send(ev.GroupFailed, group="g1", incarnation=1)
    assert link.close(WAIT)
    rec.threads.clear()
    stops = [e for e in link.send(ev.Shutdown) if isinstance(e, StopGroup)]
    assert StopGroup("g1", 2, "shutdown") in stops
    assert rec.threads == {threading.get_ident()}
    assert all(stop in rec.ran for stop in stops)
    # g1's load reports after shutdown: its lease ends and C(1) can go.
    (delete,) = link.send(ev.RestartLoaded, group="g1", incarnation=restart.incarnation)
    assert delete in rec.ran
    link.send(ev.CheckpointDeleted, version=1)
    assert link.controller.drained


def test_send_never_stamps_time_backwards() -> None:
    """A clock that steps back (an NTP slew, a second host) must not get events refused."""
    readings = iter([5.0, 3.0, 4.0, 9.0])
    c = RecoveryController()
    link = ControllerLink(c, clock=lambda: next(readings))
    link.send(ev.GroupRegistered, group="g1", version=0)
    link.send(ev.ProbeFailed, group="g1", incarnation=1)
    link.send(ev.ProbeOk, group="g1", incarnation=1)
    link.send(ev.Tick)
    assert c.snapshot()["now"] == 9.0
