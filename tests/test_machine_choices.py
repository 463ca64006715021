"""``machines.stays``: the rules skip sending an event whose graph can only keep the state.
A skip must never hide a move: for every state of every machine, every event it accepts and
records drawn at random (all five machines), when ``stays`` says so, sending the event
changes nothing."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery_fsm.machines import (
    CheckpointMachine,
    CheckpointRecord,
    Fleet,
    GroupRecord,
    ImmediateRecoveryMachine,
    PoolRecord,
    RecoveryRecord,
    StandbyMachine,
    StandbyPoolMachine,
    StandbyRecord,
    WorkerGroupMachine,
    stays,
)

small = st.integers(min_value=0, max_value=3)
versions = st.one_of(st.none(), small)


@st.composite
def machine_and_event(draw: st.DrawFn) -> tuple[object, str, bool]:
    kind = draw(st.sampled_from(["checkpoint", "group", "switch", "standby", "pool"]))
    if kind == "checkpoint":
        cls: type = CheckpointMachine
        record: object = CheckpointRecord(draw(small), pinned=draw(st.booleans()),
                                          leases=draw(small))  # fmt: skip
    elif kind == "group":
        cls = WorkerGroupMachine
        record = GroupRecord("g", Fleet(draw(small)), draw(versions))
    elif kind == "switch":
        cls = ImmediateRecoveryMachine
        record = RecoveryRecord("g", required_clean_syncs=draw(st.integers(1, 3)),
                                clean_streak=draw(st.integers(0, 2)))  # fmt: skip
    elif kind == "standby":
        cls = StandbyMachine
        record = StandbyRecord("s", Fleet(draw(small)), draw(versions),
                               ever_ready=draw(st.booleans()))  # fmt: skip
    else:
        cls = StandbyPoolMachine
        record = PoolRecord(draw(small), boot_budget=draw(st.integers(1, 3)),
                            failed_boots=draw(small))  # fmt: skip
    state = draw(st.sampled_from([s.id for s in cls.states if s.transitions]))
    event = draw(st.sampled_from(sorted({e for t in cls.states_map[state].transitions
                                          for e in t.events})))  # fmt: skip
    machine = cls(model=record, start_value=state)
    return machine, event, stays(machine, event)


@settings(max_examples=600, deadline=None)
@given(machine_and_event())
def test_a_skipped_event_would_have_changed_nothing(drawn: tuple[object, str, bool]) -> None:
    machine, event, skipped = drawn
    if not skipped:
        return
    record = machine.model  # type: ignore[attr-defined]
    before = attrs.asdict(record, recurse=False)
    machine.send(event)  # type: ignore[attr-defined]
    assert attrs.asdict(record, recurse=False) == before, (event, before)


def test_the_common_sync_is_skipped_and_a_real_choice_is_not() -> None:
    fleet = Fleet(2)
    listed = WorkerGroupMachine(model=GroupRecord("g", fleet, 2), start_value="active")
    assert stays(listed, "sync")  # got the weights: nothing to do
    left_out = WorkerGroupMachine(model=GroupRecord("g", fleet, 1), start_value="active")
    assert not stays(left_out, "sync")  # demoted
    cooling = ImmediateRecoveryMachine(model=RecoveryRecord("g", 3), start_value="cooldown")
    assert not stays(cooling, "clean_sync")  # counts: an action, even on its self-loop
    enabled = ImmediateRecoveryMachine(model=RecoveryRecord("g", 3), start_value="enabled")
    assert stays(enabled, "clean_sync")
    pending = WorkerGroupMachine(model=GroupRecord("g", fleet, 1), start_value="pending_weights")
    assert not stays(pending, "reload")  # its guard takes the event's facts


def test_a_callback_on_a_self_loop_is_never_skipped() -> None:
    @attrs.define(eq=False)
    class Watched(GroupRecord):
        entered: int = 0

        def on_enter_active(self) -> None:  # runs on the self-loop's re-entry
            self.entered += 1

    record = Watched("g", Fleet(2), 2)
    machine = WorkerGroupMachine(model=record, start_value="active")
    assert not stays(machine, "sync")
    entered = record.entered  # the machine entered its start state once already
    machine.send("sync")
    assert record.entered == entered + 1
