"""handle()'s contract (controller.py's docstring), whatever raises:

* a journal sink that raises never undoes an accepted event: it is counted and marked;
* any non-RecoveryError inside the rules (or a refusal after something changed) stops the
  controller for good, and every later event is refused with ControllerBroken;
* a sink may read the controller; an event sent from inside a sink is refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest

from recovery_fsm import (
    ControllerBroken,
    DeleteCheckpoint,
    EventNotAllowed,
    MalformedEvent,
    RecoveryController,
    RecoveryError,
    RestartFromCheckpoint,
    Rules,
)
from recovery_fsm import events as ev

Record = dict[str, Any]


class FlakySink:
    """A journal sink that keeps what it takes, and raises while ``failing`` is set."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.failing = False

    def __call__(self, record: Record) -> None:
        if self.failing:
            raise OSError("disk full")
        self.records.append(record)


def _superseded_while_loading(c: RecoveryController) -> int:
    """g1 boots from C(1), then v2 is synced: C(1) is superseded but leased by the loading
    incarnation. Returns that incarnation."""
    c.handle(ev.GroupRegistered("g1", 0, at=1.0))
    c.handle(ev.GroupRegistered("g2", 0, at=2.0))
    c.handle(ev.WeightsSynced(1, c.up_groups(), at=3.0))
    c.handle(ev.ExportStarted(1, at=4.0))
    c.handle(ev.ExportCommitted(1, "/ckpt/step-1", at=5.0))
    _, restart = c.handle(ev.GroupFailed("g1", 1, at=6.0))
    assert isinstance(restart, RestartFromCheckpoint)
    assert c.handle(ev.WeightsSynced(2, c.up_groups(), at=7.0)) == ()
    assert c.checkpoint_state(1) == "superseded"
    return restart.incarnation


# -- (1) a journal sink that raises ----------------------------------------------------------


def test_a_failing_sink_does_not_undo_the_event(caplog: pytest.LogCaptureFixture) -> None:
    sink = FlakySink()
    c = RecoveryController(journal=sink)
    incarnation = _superseded_while_loading(c)

    sink.failing = True
    effects = c.handle(ev.RestartLoaded("g1", incarnation, at=8.0))
    sink.failing = False

    # The load's lease is gone, so C(1) may go: the effect is returned all the same...
    assert effects == (DeleteCheckpoint(1, "/ckpt/step-1"),)
    # ...and the state moved: nothing is rolled back because the record was lost.
    assert c.checkpoint_state(1) == "deletable"
    assert c.group_state("g1") == "pending_weights"
    assert c.leases == {}
    assert c.broken is None
    assert c.journal_failures == 1
    assert "journal sink failed" in caplog.text
    lost_step = sink.records[-1]["step"] + 1

    # The next record says one before it is missing; the one after says nothing.
    c.handle(ev.CheckpointDeleted(1, at=9.0))
    assert sink.records[-1]["step"] == lost_step + 1
    assert sink.records[-1]["lost"] == 1
    c.handle(ev.Shutdown(at=10.0))
    assert "lost" not in sink.records[-1]
    assert c.journal_failures == 1
    assert c.drained
    assert c.check_invariants() == []


def test_lost_records_accumulate_until_one_is_written() -> None:
    sink = FlakySink()
    c = RecoveryController(journal=sink)
    c.handle(ev.GroupRegistered("g1", 0, at=1.0))
    sink.failing = True
    c.handle(ev.ProbeFailed("g1", 1, at=2.0))
    with pytest.raises(EventNotAllowed):  # a refusal's record is lost (and counted) too
        c.handle(ev.GroupRegistered("g1", 0, at=3.0))
    c.handle(ev.ProbeOk("g1", 1, at=4.0))
    sink.failing = False
    c.handle(ev.Tick(at=5.0))
    assert c.journal_failures == 3
    assert [(r["step"], r.get("lost")) for r in sink.records] == [(0, None), (1, None), (5, 3)]


def test_a_failing_sink_on_the_header_does_not_stop_construction() -> None:
    sink = FlakySink()
    sink.failing = True
    c = RecoveryController(journal=sink)
    sink.failing = False
    c.handle(ev.GroupRegistered("g1", 0, at=1.0))
    assert c.journal_failures == 1
    assert sink.records == [sink.records[0]] and sink.records[0]["lost"] == 1


# -- (2) fail-stop -----------------------------------------------------------------------------


class ExplodingRules(Rules):
    """A bug half-way through GroupFailed: the group already moved when it raises."""

    def on_GroupFailed(self, e: ev.GroupFailed, found: Any) -> None:
        super().on_GroupFailed(e, found)
        raise RuntimeError("boom")


class LateRefusalRules(Rules):
    """A refusal raised after something changed: the event is half applied."""

    def on_ProbeFailed(self, e: ev.ProbeFailed, found: Any) -> None:
        super().on_ProbeFailed(e, found)
        raise EventNotAllowed("too late to refuse")


class EarlyRefusalRules(Rules):
    """A refusal from the check, before anything changed, is an ordinary refusal."""

    def check_ProbeFailed(self, e: ev.ProbeFailed) -> Any:
        raise EventNotAllowed("not now")


def _registered(rules: type[Rules], sink: FlakySink) -> RecoveryController:
    c = RecoveryController(journal=sink, rules=rules)
    c.handle(ev.GroupRegistered("g1", 0, at=1.0))
    c.handle(ev.GroupRegistered("g2", 0, at=2.0))
    return c


def _assert_refuses_everything(c: RecoveryController, sink: FlakySink, first: str) -> None:
    """Every later event, of any kind and however valid, is refused naming the first error,
    changes nothing, and is journaled with ControllerBroken."""
    before = c.snapshot()
    later: list[ev.Event] = [
        ev.Tick(at=10.0),
        ev.ProbeOk("g2", 1, at=11.0),
        ev.GroupRegistered("g3", 0, at=12.0),
        ev.Shutdown(at=13.0),
    ]
    for event in later:
        with pytest.raises(ControllerBroken) as info:
            c.handle(event)
        assert first in str(info.value)
        assert sink.records[-1]["event"]["kind"] == event.kind
        assert sink.records[-1]["error"]["type"] == "ControllerBroken"
    assert c.snapshot() == before


def test_an_internal_error_stops_the_controller_for_good(caplog: pytest.LogCaptureFixture) -> None:
    sink = FlakySink()
    c = _registered(ExplodingRules, sink)
    with pytest.raises(ControllerBroken) as info:
        c.handle(ev.GroupFailed("g1", 1, reason="oom", at=3.0))
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and str(cause) == "boom"
    assert info.value.first is cause
    assert c.broken is cause
    assert "RuntimeError: boom" in str(info.value)
    assert c.snapshot()["broken"] == repr(cause)
    assert "recovery controller stopped" in caplog.text
    # The event that broke it is journaled, with the error that broke it.
    assert sink.records[-1]["event"]["kind"] == "GroupFailed"
    assert sink.records[-1]["error"] == {"type": "RuntimeError", "message": "boom"}
    _assert_refuses_everything(c, sink, "RuntimeError: boom")


def test_a_refusal_after_a_change_breaks_the_controller() -> None:
    sink = FlakySink()
    c = _registered(LateRefusalRules, sink)
    with pytest.raises(ControllerBroken) as info:
        c.handle(ev.ProbeFailed("g1", 1, at=3.0))
    assert isinstance(info.value.__cause__, EventNotAllowed)
    assert isinstance(c.broken, EventNotAllowed)
    assert sink.records[-1]["error"]["type"] == "EventNotAllowed"
    _assert_refuses_everything(c, sink, "too late to refuse")


def test_a_refusal_before_any_change_is_just_a_refusal() -> None:
    sink = FlakySink()
    c = _registered(EarlyRefusalRules, sink)
    before = c.snapshot()
    with pytest.raises(EventNotAllowed, match="not now"):
        c.handle(ev.ProbeFailed("g1", 1, at=3.0))
    assert c.broken is None
    assert c.snapshot() == before
    c.handle(ev.ProbeOk("g1", 1, at=4.0))  # the controller goes on


def _refusing_after(handler: str) -> type[Rules]:
    """Rules whose ``handler`` runs to completion, then refuses once ``armed``: whatever
    the handler changed (a machine, or only a record or a counter) is already changed."""

    def late(self: Rules, e: ev.Event, found: Any) -> None:
        getattr(Rules, handler)(self, e, found)
        if getattr(self, "armed", False):
            raise EventNotAllowed("refused after the fact")

    return type(f"Late{handler}", (Rules,), {handler: late})


# (handler, events before, the event): each changes state without firing any machine.
QUIET_CHANGES: list[tuple[str, list[ev.Event], ev.Event]] = [
    ("on_WeightsSynced", [], ev.WeightsSynced(1, {}, at=1.0)),  # only the fleet's version
    ("on_ExportStarted", [], ev.ExportStarted(0, at=1.0)),  # a new checkpoint record
    ("on_CheckpointPinned", [ev.ExportStarted(0, at=1.0)], ev.CheckpointPinned(0, at=2.0)),
    (
        "on_ProbeFailed",  # a suspect group's second failed probe: a counter
        [ev.GroupRegistered("g1", 0, at=1.0), ev.ProbeFailed("g1", 1, at=2.0)],
        ev.ProbeFailed("g1", 1, at=3.0),
    ),
    (
        "on_GroupRegistered",  # a group that waits for weights: no effect, no transition
        [ev.WeightsSynced(1, {}, at=1.0)],
        ev.GroupRegistered("g1", 0, at=2.0),
    ),
]


@pytest.mark.parametrize(
    ("handler", "before", "event"), QUIET_CHANGES, ids=[c[0] for c in QUIET_CHANGES]
)
def test_a_refusal_after_any_change_breaks_the_controller(
    handler: str, before: list[ev.Event], event: ev.Event
) -> None:
    """'A refused event changes nothing': a refusal that comes after the event changed
    anything at all, not only after a machine moved, must stop the controller."""
    c = RecoveryController(rules=_refusing_after(handler))
    for e in before:
        c.handle(e)
    c.rules.armed = True  # type: ignore[attr-defined]
    snapshot = c.snapshot()
    with pytest.raises(RecoveryError) as info:
        c.handle(event)
    assert c.snapshot() != snapshot  # (the case is meaningful: the handler did change state)
    assert isinstance(info.value, ControllerBroken), (
        f"{handler} changed the state, then was refused with "
        f"{type(info.value).__name__}, and the controller carries on"
    )
    assert c.broken is not None


class InterruptedRules(Rules):
    """A KeyboardInterrupt (or SystemExit from a signal handler) lands half-way through."""

    def on_GroupFailed(self, e: ev.GroupFailed, found: Any) -> None:
        super().on_GroupFailed(e, found)
        raise KeyboardInterrupt


def test_an_interrupt_half_way_through_an_event_also_stops_the_controller() -> None:
    """The state is half applied whatever interrupted the rules, so the controller must
    not take another event on top of it. The interrupt itself may propagate as it is."""
    sink = FlakySink()
    c = _registered(InterruptedRules, sink)
    with pytest.raises((KeyboardInterrupt, ControllerBroken)):
        c.handle(ev.GroupFailed("g1", 1, at=3.0))
    assert c.broken is not None
    with pytest.raises(ControllerBroken):
        c.handle(ev.Tick(at=4.0))


def test_broken_survives_a_fork() -> None:
    """A fork of a broken controller is just as broken (its state is just as half-applied)."""
    c = _registered(ExplodingRules, FlakySink())
    with pytest.raises(ControllerBroken):
        c.handle(ev.GroupFailed("g1", 1, at=3.0))
    twin = c.fork()
    with pytest.raises(ControllerBroken, match="boom"):
        twin.handle(ev.Tick(at=4.0))


# -- (3) sinks that call back ----------------------------------------------------------------


def _run_with_timeout(fn: Callable[[], object], timeout: float = 10.0) -> object:
    """Run ``fn`` on a thread: a deadlock fails the test instead of hanging the suite."""
    out: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "deadlocked"
    if errors:
        raise errors[0]
    return out[0]


def test_a_sink_may_read_the_controller() -> None:
    seen: list[tuple[str, list[str], dict[str, int]]] = []
    c: RecoveryController | None = None

    def sink(record: Record) -> None:
        if c is not None and "event" in record:
            seen.append((c.group_state("g1"), c.outstanding(), c.up_groups()))
            # The whole event is applied before its record is written, its time included.
            assert c.snapshot()["now"] == record["event"]["at"]
            assert c.check_invariants() == []
            c.groups()
            c.checkpoints()

    c = RecoveryController(journal=sink)
    _run_with_timeout(lambda: _superseded_while_loading(c))
    assert c.journal_failures == 0
    # The sink sees the state after the event: here, after the failure of g1.
    assert seen[5][0] == "loading"
    assert "a load of C(1) of group 'g1' incarnation 2 has not reported" in seen[5][1]


def _reentrant_sink(
    get: Callable[[], RecoveryController | None], answers: list[BaseException | None]
) -> Callable[[Record], None]:
    """A sink that sends an event from inside every record it takes (except the header).
    It tries once per outer record, so a controller that wrongly accepts the nested event
    fails the test instead of recursing."""
    nested = threading.local()

    def sink(record: Record) -> None:
        c = get()
        if c is None or "event" not in record or getattr(nested, "active", False):
            return
        nested.active = True
        try:
            # Valid in every way but one: it is sent from inside another event.
            now = c.snapshot()["now"] or 0.0
            c.handle(ev.GroupRegistered(f"nested{record['step']}", 0, at=now))
        except RecoveryError as err:
            answers.append(err)
        else:
            answers.append(None)
        finally:
            nested.active = False

    return sink


def test_an_event_sent_from_a_sink_is_refused_and_the_outer_event_stands() -> None:
    answers: list[BaseException | None] = []
    box: list[RecoveryController] = []
    c = RecoveryController(journal=_reentrant_sink(lambda: box[0] if box else None, answers))
    box.append(c)

    # An accepted event, a refusal by the rules, and a refusal before the rules run.
    effects = _run_with_timeout(lambda: c.handle(ev.GroupRegistered("g1", 0, at=1.0)))
    assert [e.kind for e in effects] == ["RouteTraffic"]  # type: ignore[attr-defined]
    with pytest.raises(EventNotAllowed, match="already registered"):
        _run_with_timeout(lambda: c.handle(ev.GroupRegistered("g1", 0, at=2.0)))
    with pytest.raises(MalformedEvent):
        _run_with_timeout(lambda: c.handle("not an event"))  # type: ignore[arg-type]

    assert len(answers) == 3
    assert all(isinstance(a, EventNotAllowed) for a in answers), answers
    assert all("while another event runs" in str(a) for a in answers)
    assert sorted(c.groups()) == ["g1"]  # no nested registration got in
    assert c.broken is None
    assert c.journal_failures == 0
    c.handle(ev.ProbeOk("g1", 1, at=3.0))  # and the controller goes on


def test_a_sink_whose_nested_send_escapes_is_only_a_journal_failure() -> None:
    """The sink lets the refusal of its nested event escape: that is a failing sink (counted,
    logged), not a refusal of the outer event."""
    c: RecoveryController | None = None
    nested = threading.local()

    def sink(record: Record) -> None:
        if c is None or "event" not in record or getattr(nested, "active", False):
            return
        nested.active = True
        try:
            c.handle(ev.Tick(at=record["event"]["at"]))
        finally:
            nested.active = False

    c = RecoveryController(journal=sink)
    effects = c.handle(ev.GroupRegistered("g1", 0, at=1.0))
    assert [e.kind for e in effects] == ["RouteTraffic"]
    assert c.group_state("g1") == "active"
    assert c.journal_failures == 1
    assert c.broken is None
    assert c.snapshot()["now"] == 1.0


def test_one_deadline_table_bounds_every_wait() -> None:
    """The rules, the world model and the simulator read deadlines from one table; every
    timeout knob is in it, and it reads the configured value."""
    import attrs

    from recovery_fsm.config import DEADLINES, RecoveryConfig

    knobs = {f.name for f in attrs.fields(RecoveryConfig) if f.name.endswith("_timeout_s")}
    assert set(DEADLINES.values()) == knobs
    config = RecoveryConfig(load_timeout_s=7.0)
    assert config.deadline("load") == 7.0


def test_every_check_is_pure_even_for_the_outcome_of_a_killed_start() -> None:
    """``check_<Event>`` changes nothing, whatever it finds: here every event type is
    checked (not applied) in a state with a load killed at its deadline, whose late outcome
    is an orphan the rule, not the check, must end."""
    from conftest import Driver

    from recovery_fsm import RecoveryConfig

    d = Driver(RecoveryConfig(load_timeout_s=5.0, restart_budget=3), ["g1", "g2"])
    d.step(1)
    d.about(ev.GroupFailed, "g1")  # g1#2 loads C(1)
    for _ in range(6):
        d.send(ev.Tick)  # past the deadline: g1#2 is killed, its lease waits for its outcome
    assert d.c.leases, "the killed load still holds its lease"
    rules = d.c.rules
    events = [
        ev.RestartLoadFailed("g1", 2, at=100.0),  # the orphan's outcome
        ev.GroupFailed("g2", 1, at=100.0),
        ev.ProbeFailed("g2", 1, at=100.0),
        ev.WeightsSynced(2, d.c.up_groups(), at=100.0),
        ev.ExportStarted(1, at=100.0),
        ev.CheckpointPinned(1, at=100.0),
        ev.GroupRegistered("g3", 1, at=100.0),
        ev.Shutdown(at=100.0),
        ev.Tick(at=100.0),
    ]
    before = d.c.snapshot()
    for e in events:
        check, _rule = rules._handlers[type(e)]
        with contextlib.suppress(RecoveryError):
            check(e)
        assert d.c.snapshot() == before, f"checking {e.kind} changed the controller"
    assert rules.effects == [] and rules.transitions == []
    # Applying the orphan's outcome does end that start and free its lease.
    d.send(ev.RestartLoadFailed, "g1", 2)
    assert not [lease for lease in d.c.leases.values() if lease.incarnation == 2]


@pytest.mark.parametrize("name", ["check_WeightSynced", "on_GroupDead", "on_Synced"])
def test_a_rule_named_for_no_event_is_refused_when_its_class_is_made(name: str) -> None:
    # Found by name, a misspelt check would be skipped in silence and a misspelt rule never
    # run: the class itself is refused, naming it.
    with pytest.raises(TypeError, match=name):
        type("Misspelt", (Rules,), {name: lambda self, e: None})


def test_every_rule_and_check_of_the_rules_names_an_event() -> None:
    known = {c.__name__ for c in ev.EVENT_TYPES.values()}
    rules = {n.partition("_")[2] for n in dir(Rules) if n.startswith("on_")}
    assert rules == known  # one rule per event, none left over
    checks = {n.partition("_")[2] for n in dir(Rules) if n.startswith("check_")}
    assert checks <= known and checks
