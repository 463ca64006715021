"""Every bad input raises a typed error that says what was expected, changes nothing, and is
journaled with that error (so a replay sees the refusal too)."""

from __future__ import annotations

import copy
import json
import math
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import Driver

from recovery_fsm import (
    EventNotAllowed,
    MalformedEvent,
    RecoveryConfig,
    RecoveryController,
    RecoveryError,
    UnknownGroup,
    UnknownVersion,
    WrongIncarnation,
)
from recovery_fsm import events as ev
from recovery_fsm.codec import decode_event, encode
from recovery_fsm.effects import DeleteCheckpoint, RestartFromCheckpoint
from recovery_fsm.journal import JsonlJournal, read_journal

T = 1000.0  # later than anything the fixture sent


@pytest.fixture
def journal(driver: Driver) -> list[dict[str, Any]]:
    """The fixture's controller, swapped for a fork that journals: every refusal below must
    reach the journal."""
    records: list[dict[str, Any]] = []
    driver.c = driver.c.fork(journal=records.append)
    return records


def _refused(
    c: RecoveryController, records: list[dict[str, Any]], event: object, error: type[Exception]
) -> RecoveryError:
    """Send ``event``, expect ``error``; check nothing changed and the refusal was journaled."""
    before = c.snapshot()
    seen = len(records)
    with pytest.raises(error) as info:
        c.handle(event)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, RecoveryError)
    assert c.snapshot() == before
    assert c.check_invariants() == []
    assert c.broken is None
    (record,) = records[seen:]
    assert record["event"] == encode(event)
    assert record["error"] == {"type": type(err).__name__, "message": str(err)}
    assert "effects" not in record and "transitions" not in record
    return err


def _loading(d: Driver) -> int:
    """g1 fails and boots from C(1); returns the incarnation that loads."""
    _, restart = d.about(ev.GroupFailed, "g1")
    assert isinstance(restart, RestartFromCheckpoint)
    return restart.incarnation


def _released(d: Driver) -> int:
    """g1's load finished (its lease released); returns that incarnation."""
    incarnation = _loading(d)
    d.send(ev.RestartLoaded, "g1", incarnation)
    return incarnation


def _exporting(d: Driver) -> None:
    d.sync(2)
    d.send(ev.ExportStarted, 2)


def _shutdown(d: Driver) -> None:
    d.send(ev.Shutdown)


def _nothing(d: Driver) -> None:
    return None


# (name, setup, event built from setup's return value, expected error, words in the message)
Case = tuple[str, Callable[[Driver], Any], Callable[[Any], ev.Event], type[Exception], str]
CASES: list[Case] = [
    ("probe unknown group", _nothing, lambda _: ev.ProbeFailed("gX", 1, at=T), UnknownGroup, "gX"),
    (
        "probe ok unknown",
        _nothing,
        lambda _: ev.ProbeOk("gX", 1, at=T),
        UnknownGroup,
        "registered",
    ),
    ("fail unknown group", _nothing, lambda _: ev.GroupFailed("gX", 1, at=T), UnknownGroup, "gX"),
    ("relaunched unknown", _nothing, lambda _: ev.Relaunched("gX", 1, at=T), UnknownGroup, "gX"),
    (
        "sync unknown group",
        _nothing,
        lambda _: ev.WeightsSynced(2, {"g1": 1, "gX": 1}, at=T),
        UnknownGroup,
        "gX",
    ),
    (
        "sync a never-started incarnation",
        _nothing,
        lambda _: ev.WeightsSynced(2, {"g1": 2}, at=T),
        WrongIncarnation,
        "never started",
    ),
    (
        "sync same version",
        _nothing,
        lambda _: ev.WeightsSynced(1, {"g1": 1}, at=T),
        EventNotAllowed,
        "above 1",
    ),
    (
        "sync older version",
        _nothing,
        lambda _: ev.WeightsSynced(0, {"g1": 1}, at=T),
        EventNotAllowed,
        "above 1",
    ),
    (
        "export wrong version",
        _nothing,
        lambda _: ev.ExportStarted(3, at=T),
        UnknownVersion,
        "current version",
    ),
    (
        "export twice",
        _nothing,
        lambda _: ev.ExportStarted(1, at=T),
        EventNotAllowed,
        "already started",
    ),
    (
        "second export in flight",
        _exporting,
        lambda _: ev.ExportStarted(2, at=T),
        EventNotAllowed,
        "already started",
    ),
    (
        "commit unknown version",
        _nothing,
        lambda _: ev.ExportCommitted(7, "/p", at=T),
        UnknownVersion,
        "no such checkpoint",
    ),
    (
        "commit twice",
        _nothing,
        lambda _: ev.ExportCommitted(1, "/p", at=T),
        EventNotAllowed,
        "expects it in one of",
    ),
    (
        "fail a ready export",
        _nothing,
        lambda _: ev.ExportFailed(1, "x", at=T),
        EventNotAllowed,
        "ready",
    ),
    (
        "cancel a ready export",
        _nothing,
        lambda _: ev.ExportCancelled(1, at=T),
        EventNotAllowed,
        "ready",
    ),
    (
        "delete a ready checkpoint",
        _nothing,
        lambda _: ev.CheckpointDeleted(1, at=T),
        EventNotAllowed,
        "deletable",
    ),
    ("delete unknown", _nothing, lambda _: ev.CheckpointDeleted(9, at=T), UnknownVersion, "9"),
    ("pin unknown", _nothing, lambda _: ev.CheckpointPinned(9, at=T), UnknownVersion, "9"),
    ("unpin unknown", _nothing, lambda _: ev.CheckpointUnpinned(9, at=T), UnknownVersion, "9"),
    (
        "unpin not pinned",
        _nothing,
        lambda _: ev.CheckpointUnpinned(1, at=T),
        EventNotAllowed,
        "not pinned",
    ),
    # Was "lease never granted": a report about a start that never happened.
    (
        "loaded for a never-started incarnation",
        _loading,
        lambda inc: ev.RestartLoaded("g1", inc + 1, at=T),
        WrongIncarnation,
        "current incarnation is",
    ),
    # A report from the process the restart replaced.
    (
        "loaded for an older incarnation",
        _loading,
        lambda inc: ev.RestartLoaded("g1", inc - 1, at=T),
        WrongIncarnation,
        "current incarnation is",
    ),
    (
        "failed for an older incarnation",
        _released,
        lambda inc: ev.GroupFailed("g1", inc - 1, at=T),
        WrongIncarnation,
        "incarnation 1 of group 'g1'",
    ),
    (
        "probe an older incarnation",
        _released,
        lambda inc: ev.ProbeFailed("g1", inc - 1, at=T),
        WrongIncarnation,
        "incarnation 1",
    ),
    # Was "lease released twice": the start already reported its outcome.
    (
        "loaded twice",
        _released,
        lambda inc: ev.RestartLoaded("g1", inc, at=T),
        EventNotAllowed,
        "loading",
    ),
    (
        "load failed after loaded",
        _released,
        lambda inc: ev.RestartLoadFailed("g1", inc, at=T),
        EventNotAllowed,
        "loading",
    ),
    # Was "lease of another group": g2 never had a second start.
    (
        "loaded for another group's incarnation",
        _loading,
        lambda inc: ev.RestartLoaded("g2", inc, at=T),
        WrongIncarnation,
        "group 'g2'",
    ),
    (
        "relaunched not relaunching",
        _nothing,
        lambda _: ev.Relaunched("g1", 1, at=T),
        EventNotAllowed,
        "relaunching",
    ),
    (
        "relaunch failed not relaunching",
        _nothing,
        lambda _: ev.RelaunchFailed("g1", 1, at=T),
        EventNotAllowed,
        "relaunching",
    ),
    (
        "relaunched for a loading start",
        _loading,
        lambda inc: ev.Relaunched("g1", inc, at=T),
        EventNotAllowed,
        "loading",
    ),
    (
        "probe a loading group",
        _loading,
        lambda inc: ev.ProbeFailed("g1", inc, at=T),
        EventNotAllowed,
        "loading",
    ),
    (
        "register twice",
        _nothing,
        lambda _: ev.GroupRegistered("g1", 1, at=T),
        EventNotAllowed,
        "already registered",
    ),
    (
        "register future version",
        _nothing,
        lambda _: ev.GroupRegistered("g9", 5, at=T),
        UnknownVersion,
        "only reached 1",
    ),
    (
        "time goes backwards",
        _nothing,
        lambda _: ev.ProbeOk("g1", 1, at=0.5),
        MalformedEvent,
        "backwards",
    ),
    (
        "sync after shutdown",
        _shutdown,
        lambda _: ev.WeightsSynced(2, {"g1": 1}, at=T),
        EventNotAllowed,
        "after Shutdown",
    ),
    (
        "export after shutdown",
        _shutdown,
        lambda _: ev.ExportStarted(1, at=T),
        EventNotAllowed,
        "after Shutdown",
    ),
    (
        "register after shutdown",
        _shutdown,
        lambda _: ev.GroupRegistered("g9", 1, at=T),
        EventNotAllowed,
        "after Shutdown",
    ),
    ("shutdown twice", _shutdown, lambda _: ev.Shutdown(at=T), EventNotAllowed, "after Shutdown"),
    (
        "fail a stopped group",
        _shutdown,
        lambda _: ev.GroupFailed("g1", 1, at=T),
        EventNotAllowed,
        "stopped",
    ),
]


@pytest.mark.parametrize(
    ("name", "setup", "make", "error", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_event_raises_typed_error_and_changes_nothing(
    driver: Driver,
    journal: list[dict[str, Any]],
    name: str,
    setup: Callable[[Driver], Any],
    make: Callable[[Any], ev.Event],
    error: type[Exception],
    words: str,
) -> None:
    context = setup(driver)
    err = _refused(driver.c, journal, make(context), error)
    assert words in str(err)


def test_group_failed_twice_is_not_allowed(driver: Driver, journal: list[dict[str, Any]]) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.about(ev.GroupFailed, "g1")  # awaiting_checkpoint: same incarnation, no process
    err = _refused(driver.c, journal, ev.GroupFailed("g1", driver.inc("g1"), at=T),
                   EventNotAllowed)  # fmt: skip
    assert "awaiting_checkpoint" in str(err)


def test_pin_after_delete_was_requested_is_refused(
    driver: Driver, journal: list[dict[str, Any]]
) -> None:
    driver.sync(2)  # C(1) deletable, delete in flight
    err = _refused(driver.c, journal, ev.CheckpointPinned(1, at=T), EventNotAllowed)
    assert "deletable" in str(err)
    driver.send(ev.CheckpointDeleted, 1)
    err = _refused(driver.c, journal, ev.CheckpointPinned(1, at=T + 1), EventNotAllowed)
    assert "already deleted" in str(err)


@pytest.mark.parametrize("thing", ["WeightsSynced", "x", None, {"kind": "Tick", "at": 5.0}])
def test_not_an_event_is_refused_and_journaled(
    driver: Driver, journal: list[dict[str, Any]], thing: object
) -> None:
    err = _refused(driver.c, journal, thing, MalformedEvent)
    assert "expected one of" in str(err)
    assert journal[-1]["event"] == {"kind": type(thing).__name__, "repr": repr(thing)}


def test_an_event_subclass_is_not_an_event(driver: Driver, journal: list[dict[str, Any]]) -> None:
    """Only the event classes themselves: a subclass could carry fields a replay cannot
    rebuild."""

    @attrs.frozen
    class MyTick(ev.Tick):
        pass

    _refused(driver.c, journal, MyTick(at=T), MalformedEvent)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: ev.WeightsSynced(-1, {}, at=1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(True, {}, at=1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(1.0, {}, at=1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(1, {"": 1}, at=1.0), "group names"),
        (lambda: ev.WeightsSynced(1, {" g1": 1}, at=1.0), "group names"),
        (lambda: ev.WeightsSynced(1, {"g1": 0}, at=1.0), "incarnation"),
        (lambda: ev.WeightsSynced(1, {"g1": True}, at=1.0), "incarnation"),
        (lambda: ev.WeightsSynced(1, {"g1": "1"}, at=1.0), "incarnation"),
        (lambda: ev.WeightsSynced(1, "g1", at=1.0), "map each group name"),
        # A set cannot say which process received the weights.
        (lambda: ev.WeightsSynced(1, {"g1"}, at=1.0), "map each group name"),
        (lambda: ev.WeightsSynced(1, frozenset({"g1"}), at=1.0), "map each group name"),
        (lambda: ev.WeightsSynced(1, ["g1"], at=1.0), "map each group name"),
        (lambda: ev.WeightsSynced(1, {}, at=math.nan), "finite"),
        (lambda: ev.ProbeFailed(" g1", 1, at=1.0), "surrounding spaces"),
        (lambda: ev.ProbeFailed("g1", 0, at=1.0), "int >= 1"),
        (lambda: ev.ProbeFailed("g1", 1.0, at=1.0), "int >= 1"),
        (lambda: ev.GroupFailed("g1", True, at=1.0), "int >= 1"),
        (lambda: ev.ProbeFailed("g1", 1, at="now"), "finite"),
        (lambda: ev.ProbeFailed("g1", 1, at=True), "finite"),
        (lambda: ev.ExportCommitted(1, "", at=1.0), "non-empty"),
        (lambda: ev.ExportFailed(1, None, at=1.0), "string"),
        (lambda: ev.ExportStarted(1, pinned="yes", at=1.0), "True or False"),
        (lambda: ev.ExportStarted(1, pinned=1, at=1.0), "True or False"),
        (lambda: ev.Tick(at=math.inf), "finite"),
        (lambda: ev.Resumed(1, epoch=0, found=[], silent=[], at=1.0), "int >= 1"),
        (lambda: ev.Resumed(1, epoch=2, found="g1#1", silent=[], at=1.0), "list of processes"),
        (lambda: ev.Resumed(1, epoch=2, found=["g1"], silent=[], at=1.0), "<name>#<inc"),
        (lambda: ev.Resumed(1, epoch=2, found=["g1#01"], silent=[], at=1.0), "<name>#<inc"),
        (lambda: ev.Resumed(1, epoch=2, found=[" g1#1"], silent=[], at=1.0), "<name>#<inc"),
        (lambda: ev.Resumed(1, epoch=2, found=["g1#1", "g1#1"], silent=[], at=1.0), "twice"),
        (lambda: ev.Resumed(1, epoch=2, found=["g1#1"], silent=["g1#1"], at=1.0), "and as silent"),
    ],
)
def test_malformed_fields_are_refused_at_construction(
    build: Callable[[], ev.Event], words: str
) -> None:
    with pytest.raises(MalformedEvent) as info:
        build()
    assert words in str(info.value)


# A valid value for every field an event takes positionally.
_VALID: dict[str, object] = {
    "version": 1, "group": "g1", "incarnation": 1, "groups": {"g1": 1}, "path": "/p",
    "error": "", "reason": "", "pinned": False, "standby": "standby-1",
    "epoch": 2, "found": ["g1#1"], "silent": [],
}  # fmt: skip


@pytest.mark.parametrize("cls", sorted(ev.EVENT_TYPES.values(), key=lambda c: c.__name__))
def test_at_cannot_be_passed_positionally(cls: type[ev.Event]) -> None:
    """A positional time would silently land in the next field (an error text, a pinned
    flag) when fields are added: ``at`` is keyword-only on every event."""
    assert attrs.fields_dict(cls)["at"].kw_only
    positional = [_VALID[f.name] for f in attrs.fields(cls) if not f.kw_only]
    # Keyword-only fields without a default (a resume's epoch and findings) given as such.
    required = {f.name: _VALID[f.name] for f in attrs.fields(cls)
                if f.kw_only and f.default is attrs.NOTHING and f.name != "at"}  # fmt: skip
    assert isinstance(cls(*positional, at=5.0, **required), cls)  # keyword at: fine
    with pytest.raises(TypeError):
        cls(*positional, 5.0, **required)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clean_syncs_to_reenable": 0},
        {"suspect_threshold": -1},
        {"restart_budget": 1.5},
        {"restart_budget": True},
        {"await_checkpoint_timeout_s": -1},
        {"load_timeout_s": math.nan},
        {"relaunch_timeout_s": "60"},
        {"immediate_recovery": "no"},
        {"immediate_recovery": 0},
        {"export_every_sync": 1},
        {"restart_window_s": 0},
        {"restart_window_s": math.inf},
        {"restart_window_s": "3600"},
        {"restart_window_s": True},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(MalformedEvent):
        RecoveryConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_controller_arguments_are_refused() -> None:
    with pytest.raises(MalformedEvent, match="initial_version"):
        RecoveryController(initial_version=-3)
    with pytest.raises(MalformedEvent, match="initial_version"):
        RecoveryController(initial_version=True)
    with pytest.raises(MalformedEvent, match="RecoveryConfig"):
        RecoveryController({"restart_budget": 3})  # type: ignore[arg-type]


# -- an event is a value: nothing changes it between its checks and the rules ----------------

_MUTATIONS: list[Callable[[Any], object]] = [
    lambda g: g.__setitem__("g1", "one"),
    lambda g: g.__setitem__("gX", 1),
    lambda g: g.__delitem__("g1"),
    lambda g: g.update({"g1": 0}),
    lambda g: g.setdefault("gX", 1),
    lambda g: g.pop("g1"),
    lambda g: g.popitem(),
    lambda g: g.clear(),
    lambda g: g.__ior__({"g1": 0}),
]


@pytest.mark.parametrize("mutate", _MUTATIONS)
def test_a_syncs_groups_cannot_be_changed_after_it_is_built(
    driver: Driver, journal: list[dict[str, Any]], mutate: Callable[[Any], object]
) -> None:
    """Once a changed mapping reached the rules unchecked and stopped the controller for
    good (a str incarnation) or was taken silently (an unknown group)."""
    pushed = {"g1": 1, "g2": 1}
    sync = ev.WeightsSynced(2, pushed, at=T)
    pushed["g1"] = 7  # the caller's dict is not the event's
    with pytest.raises(TypeError, match="read-only"):
        mutate(sync.groups)
    assert sync.groups == {"g1": 1, "g2": 1} and list(sync.groups) == ["g1", "g2"]
    assert driver.c.handle(sync) == (DeleteCheckpoint(1, "/ckpt/step-1"),)  # C(1) superseded
    assert driver.c.broken is None and driver.c.check_invariants() == []
    assert driver.c.version == 2
    assert {v.state for v in driver.c.groups().values()} == {"active"}
    assert journal[-1]["event"]["groups"] == {"g1": 1, "g2": 1}


class _Name(str):
    """A str that can be changed after the checks: it has attributes."""


class _Seconds(float):
    pass


def _values(cls: type[ev.Event]) -> dict[str, object]:
    """A valid value for each field, given as a subclass where the checks allow one."""
    plain: dict[str, object] = {
        "version": 1, "group": _Name("g1"), "incarnation": 1, "path": _Name("/p"),
        "groups": {_Name("g1"): 1}, "error": _Name("e"), "reason": _Name("r"),
        "evidence": _Name("d"),
        "pinned": False, "at": _Seconds(5.0), "standby": _Name("standby-1"),
        "epoch": 2, "found": [_Name("g1#1")], "silent": [_Name("g2#3")],
    }  # fmt: skip
    return {f.name: plain[f.name] for f in attrs.fields(cls)}


@pytest.mark.parametrize("cls", sorted(ev.EVENT_TYPES.values(), key=lambda c: c.__name__))
def test_every_field_of_every_event_is_a_plain_immutable_value(cls: type[ev.Event]) -> None:
    """Exact built-in types (a subclass could change its value, or its equality, later), a
    read-only mapping for a sync's groups; and the event stays a value: hashable, equal
    after a pickle (it crosses Ray) and a deep copy."""
    event = cls(**_values(cls))
    for field in attrs.fields(cls):
        value = getattr(event, field.name)
        if isinstance(value, Mapping):
            assert type(value) is ev.Incarnations
            assert all(type(k) is str and type(v) is int for k, v in value.items())
        elif isinstance(value, tuple):  # processes a resume found
            assert all(type(p) is str for p in value), (field.name, value)
        else:
            assert type(value) in {str, int, float, bool}, (field.name, type(value))
    assert hash(event) == hash(cls(**_values(cls)))
    assert pickle.loads(pickle.dumps(event)) == event
    assert copy.deepcopy(event) == event
    assert decode_event(json.loads(json.dumps(encode(event)))) == event


def test_a_sync_journals_and_replays_as_a_plain_mapping(tmp_path: Path) -> None:
    """The read-only mapping writes the same JSON a dict did, and reads back equal."""
    sync = ev.WeightsSynced(3, {"g2": 1, "g1": 1}, at=2.5)
    with JsonlJournal(tmp_path / "j.jsonl") as sink:
        c = RecoveryController(journal=sink)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        c.handle(ev.GroupRegistered("g2", 0, at=1.0))
        c.handle(sync)
    line = (tmp_path / "j.jsonl").read_text().splitlines()[-1]
    assert ('"event":{"kind":"WeightsSynced","version":3,"groups":{"g1":1,"g2":1},"at":2.5,'
            '"evidence":""}') in line
    record = list(read_journal(tmp_path / "j.jsonl"))[-1]
    assert decode_event(record["event"]) == sync
    assert ev.WeightsSynced(3, {"g1": 1, "g2": 1}, at=2.5) == sync
    assert hash(ev.WeightsSynced(3, {"g1": 1, "g2": 1}, at=2.5)) == hash(sync)
    assert ev.WeightsSynced(3, {"g1": 1, "g2": 2}, at=2.5) != sync


def test_an_event_changed_behind_its_frozen_fields_is_refused_and_changes_nothing(
    driver: Driver,
) -> None:
    """object.__setattr__ gets past attrs' frozen fields; the controller checks every field
    again as the event arrives, so the change is refused, not taken."""
    event = ev.GroupFailed("g1", driver.inc("g1"), at=T)
    object.__setattr__(event, "incarnation", "1")  # a string where an int is expected
    before = driver.c.snapshot()
    with pytest.raises(MalformedEvent, match="incarnation must be an int"):
        driver.c.handle(event)
    assert driver.c.snapshot() == before and driver.c.broken is None


# -- every route an event can be altered by after it was built -------------------------------


class _Sneaky(str):
    """A name that compares equal to the real one at the check and to another later."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


class _Tampered:
    """Pickles as ``event`` with some of its state replaced: a payload altered in transit."""

    def __init__(self, event: ev.Event, **state: object) -> None:
        self.event, self.state = event, state

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self.event)
        state = {**self.event.__getstate__(), **self.state}  # what attrs' __setstate__ takes
        return (cls.__new__, (cls,), state)


def _sync(driver: Driver) -> ev.WeightsSynced:
    return ev.WeightsSynced(2, driver.c.up_groups(), at=T)


def _resumed(driver: Driver) -> ev.Resumed:
    found = [f"{g}#{driver.inc(g)}" for g in ("g1", "g2")]
    return ev.Resumed(1, epoch=2, found=found, silent=[], at=T)


def _setattr(event: ev.Event, field: str, value: object) -> ev.Event:
    object.__setattr__(event, field, value)
    return event


def _write_into(event: ev.Event, field: str, value: object) -> ev.Event:
    """A write into the container itself, past its read-only methods."""
    held = getattr(event, field)
    key, incarnation = value  # type: ignore[misc]
    dict.__setitem__(held, key, incarnation)
    return event


def _unpickled(event: ev.Event, field: str, value: object) -> ev.Event:
    altered: ev.Event = pickle.loads(pickle.dumps(_Tampered(event, **{field: value})))
    return altered


def _deep_copied(event: ev.Event, field: str, value: object) -> ev.Event:
    """A copy of an altered event (a deep copy is how a replay forks) is refused too."""
    copied: ev.Event = copy.deepcopy(_unpickled(event, field, value))
    return copied


ROUTES = {
    "setattr": _setattr,
    "unpickled": _unpickled,
    "deep-copied": _deep_copied,
}
# (event, field, what is put there, the refusal's words): containers and their contents.
ALTERATIONS = [
    (_sync, "groups", {"g1": 1, "g2": 0}, "incarnation"),  # a plain dict, a bad item
    (_sync, "groups", {"g1": 1, "g2": 1}, "Incarnations mapping"),  # a plain dict, good items
    (_sync, "groups", ["g1", "g2"], "must map each group name"),
    (_resumed, "found", ["g1#1", "g2#1"], "tuple of process names"),  # a list
    (_resumed, "found", ("g1#1", "g1#1", "g2#1"), "listed twice"),
    (_resumed, "found", ("g2#1", "g1#1"), "changed after"),  # unsorted
    (_resumed, "found", ("g1#x",), "<name>#<incarnation>"),
    (_resumed, "found", (_Sneaky("g1#1"), "g2#1"), "tuple of process names"),
    (_resumed, "silent", ("g1#1",), "found and as silent"),
    (_resumed, "silent", "g1#1", "tuple of process names"),
]


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(
    ("make", "field", "value", "words"),
    ALTERATIONS,
    ids=[f"{m.__name__.strip('_')}.{f}-{i}" for i, (m, f, _v, _w) in enumerate(ALTERATIONS)],
)
def test_a_container_altered_after_the_event_was_built_is_refused_and_changes_nothing(
    driver: Driver,
    journal: list[dict[str, Any]],
    route: str,
    make: Callable[[Driver], ev.Event],
    field: str,
    value: object,
    words: str,
) -> None:
    """The admission check reads every field again, containers' contents included, whichever
    way the event was altered: nothing moves, and the journal holds the refusal only."""
    event = ROUTES[route](make(driver), field, value)
    before, seen = driver.c.snapshot(), len(journal)
    with pytest.raises(MalformedEvent, match=words):
        driver.c.handle(event)
    assert driver.c.snapshot() == before and driver.c.broken is None
    (record,) = journal[seen:]
    assert record["error"]["type"] == "MalformedEvent" and not record.get("effects")


@pytest.mark.parametrize(
    ("key", "incarnation", "words"),
    [("g2", 0, "incarnation"), ("g0", 1, "changed after"), ("g2", 7, "never started")],
)
def test_a_sync_whose_groups_were_written_into_is_refused_and_changes_nothing(
    driver: Driver, key: str, incarnation: int, words: str
) -> None:
    """``dict.__setitem__`` writes past the read-only mapping: a bad incarnation, or a new
    key out of order, is refused at admission; a good-looking one still meets the rules."""
    event = _write_into(_sync(driver), "groups", (key, incarnation))
    before = driver.c.snapshot()
    with pytest.raises(RecoveryError, match=words):
        driver.c.handle(event)
    assert driver.c.snapshot() == before and driver.c.broken is None


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_scalar_swapped_for_a_subclass_after_the_event_was_built_is_refused(
    driver: Driver, route: str
) -> None:
    """A ``str`` subclass whose equality changes later, put in after the checks of
    construction: refused at admission as not the plain value the field takes."""
    event = ROUTES[route](ev.GroupFailed("g1", driver.inc("g1"), at=T), "group", _Sneaky("g1"))
    before = driver.c.snapshot()
    with pytest.raises(MalformedEvent, match="must hold a plain str"):
        driver.c.handle(event)
    assert driver.c.snapshot() == before and driver.c.broken is None
