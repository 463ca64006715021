"""Every bad input raises a typed error that says what was expected and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from conftest import Driver

from recovery_fsm import (
    EventNotAllowed,
    LeaseError,
    MalformedEvent,
    RecoveryConfig,
    RecoveryController,
    RecoveryError,
    UnknownGroup,
    UnknownVersion,
)
from recovery_fsm import events as ev
from recovery_fsm.effects import RestartFromCheckpoint

T = 1000.0  # later than anything the fixture sent


def _loading(d: Driver) -> str:
    (restart,) = d.send(ev.GroupFailed, "g1")
    assert isinstance(restart, RestartFromCheckpoint)
    return restart.lease


def _released(d: Driver) -> str:
    lease = _loading(d)
    d.send(ev.RestartLoaded, "g1", lease)
    return lease


def _exporting(d: Driver) -> None:
    d.sync(2)
    d.send(ev.ExportStarted, 2)


def _shutdown(d: Driver) -> None:
    d.send(ev.Shutdown)


def _nothing(d: Driver) -> None:
    return None


# (name, setup, event built from setup's return value, expected error, words in the message)
CASES: list[tuple[str, Callable[[Driver], object], Callable[[object], ev.Event], type, str]] = [
    ("probe unknown group", _nothing, lambda _: ev.ProbeFailed("gX", T), UnknownGroup, "gX"),
    ("probe ok unknown", _nothing, lambda _: ev.ProbeOk("gX", T), UnknownGroup, "registered"),
    ("fail unknown group", _nothing, lambda _: ev.GroupFailed("gX", T), UnknownGroup, "gX"),
    ("relaunched unknown", _nothing, lambda _: ev.Relaunched("gX", T), UnknownGroup, "gX"),
    (
        "sync unknown group",
        _nothing,
        lambda _: ev.WeightsSynced(2, {"g1", "gX"}, T),
        UnknownGroup,
        "gX",
    ),
    (
        "sync same version",
        _nothing,
        lambda _: ev.WeightsSynced(1, {"g1"}, T),
        EventNotAllowed,
        "above 1",
    ),
    (
        "sync older version",
        _nothing,
        lambda _: ev.WeightsSynced(0, {"g1"}, T),
        EventNotAllowed,
        "above 1",
    ),
    (
        "export wrong version",
        _nothing,
        lambda _: ev.ExportStarted(3, T),
        UnknownVersion,
        "current version",
    ),
    (
        "export twice",
        _nothing,
        lambda _: ev.ExportStarted(1, T),
        EventNotAllowed,
        "already started",
    ),
    (
        "second export in flight",
        _exporting,
        lambda _: ev.ExportStarted(2, T),
        EventNotAllowed,
        "already started",
    ),
    (
        "commit unknown version",
        _nothing,
        lambda _: ev.ExportCommitted(7, "/p", T),
        UnknownVersion,
        "no such checkpoint",
    ),
    (
        "commit twice",
        _nothing,
        lambda _: ev.ExportCommitted(1, "/p", T),
        EventNotAllowed,
        "expects it in one of",
    ),
    (
        "fail a ready export",
        _nothing,
        lambda _: ev.ExportFailed(1, "x", T),
        EventNotAllowed,
        "ready",
    ),
    (
        "cancel a ready export",
        _nothing,
        lambda _: ev.ExportCancelled(1, T),
        EventNotAllowed,
        "ready",
    ),
    (
        "delete a ready checkpoint",
        _nothing,
        lambda _: ev.CheckpointDeleted(1, T),
        EventNotAllowed,
        "deletable",
    ),
    ("delete unknown", _nothing, lambda _: ev.CheckpointDeleted(9, T), UnknownVersion, "9"),
    ("pin unknown", _nothing, lambda _: ev.CheckpointPinned(9, T), UnknownVersion, "9"),
    (
        "lease never granted",
        _loading,
        lambda _: ev.RestartLoaded("g1", "L999", T),
        LeaseError,
        "never granted",
    ),
    (
        "lease released twice",
        _released,
        lambda lease: ev.RestartLoaded("g1", lease, T),  # type: ignore[arg-type]
        LeaseError,
        "already released",
    ),
    (
        "load failed twice",
        _released,
        lambda lease: ev.RestartLoadFailed("g1", lease, T),  # type: ignore[arg-type]
        LeaseError,
        "already released",
    ),
    (
        "lease of another group",
        _loading,
        lambda lease: ev.RestartLoaded("g2", lease, T),  # type: ignore[arg-type]
        LeaseError,
        "belongs to group",
    ),
    (
        "relaunched not relaunching",
        _nothing,
        lambda _: ev.Relaunched("g1", T),
        EventNotAllowed,
        "relaunching",
    ),
    (
        "relaunch failed not relaunching",
        _nothing,
        lambda _: ev.RelaunchFailed("g1", T),
        EventNotAllowed,
        "relaunching",
    ),
    (
        "probe a loading group",
        _loading,
        lambda _: ev.ProbeFailed("g1", T),
        EventNotAllowed,
        "loading",
    ),
    (
        "register twice",
        _nothing,
        lambda _: ev.GroupRegistered("g1", 1, T),
        EventNotAllowed,
        "already registered",
    ),
    (
        "register future version",
        _nothing,
        lambda _: ev.GroupRegistered("g9", 5, T),
        UnknownVersion,
        "only reached 1",
    ),
    ("time goes backwards", _nothing, lambda _: ev.ProbeOk("g1", 0.5), MalformedEvent, "backwards"),
    (
        "sync after shutdown",
        _shutdown,
        lambda _: ev.WeightsSynced(2, {"g1"}, T),
        EventNotAllowed,
        "after Shutdown",
    ),
    (
        "export after shutdown",
        _shutdown,
        lambda _: ev.ExportStarted(1, T),
        EventNotAllowed,
        "after Shutdown",
    ),
    (
        "register after shutdown",
        _shutdown,
        lambda _: ev.GroupRegistered("g9", 1, T),
        EventNotAllowed,
        "after Shutdown",
    ),
    ("shutdown twice", _shutdown, lambda _: ev.Shutdown(T), EventNotAllowed, "after Shutdown"),
    (
        "fail a stopped group",
        _shutdown,
        lambda _: ev.GroupFailed("g1", T),
        EventNotAllowed,
        "stopped",
    ),
]


@pytest.mark.parametrize(
    ("name", "setup", "make", "error", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_event_raises_typed_error_and_changes_nothing(
    driver: Driver,
    name: str,
    setup: Callable[[Driver], object],
    make: Callable[[object], ev.Event],
    error: type,
    words: str,
) -> None:
    context = setup(driver)
    before = driver.c.snapshot()
    with pytest.raises(error) as info:
        driver.c.handle(make(context))
    assert isinstance(info.value, RecoveryError)
    assert words in str(info.value)
    assert driver.c.snapshot() == before
    assert driver.c.check_invariants() == []


def test_group_failed_twice_is_not_allowed(driver: Driver) -> None:
    driver.sync(2)
    driver.send(ev.ExportStarted, 2)
    driver.send(ev.GroupFailed, "g1")  # awaiting_checkpoint
    before = driver.c.snapshot()
    with pytest.raises(EventNotAllowed, match="awaiting_checkpoint"):
        driver.c.handle(ev.GroupFailed("g1", T))
    assert driver.c.snapshot() == before


def test_pin_after_delete_was_requested_is_refused(driver: Driver) -> None:
    driver.sync(2)  # C(1) deletable, delete in flight
    before = driver.c.snapshot()
    with pytest.raises(EventNotAllowed, match="deletable"):
        driver.c.handle(ev.CheckpointPinned(1, T))
    assert driver.c.snapshot() == before
    driver.send(ev.CheckpointDeleted, 1)
    with pytest.raises(EventNotAllowed, match="already deleted"):
        driver.c.handle(ev.CheckpointPinned(1, T))


def test_not_an_event_is_refused(driver: Driver) -> None:
    before = driver.c.snapshot()
    with pytest.raises(MalformedEvent, match="expected one of"):
        driver.c.handle("WeightsSynced")  # type: ignore[arg-type]
    assert driver.c.snapshot() == before


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: ev.WeightsSynced(-1, frozenset(), 1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(True, frozenset(), 1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(1.0, frozenset(), 1.0), "int >= 0"),
        (lambda: ev.WeightsSynced(1, frozenset({""}), 1.0), "non-empty string"),
        (lambda: ev.WeightsSynced(1, "g1", 1.0), "set of group names"),
        (lambda: ev.WeightsSynced(1, frozenset(), math.nan), "finite"),
        (lambda: ev.ProbeFailed(" g1", 1.0), "surrounding spaces"),
        (lambda: ev.ProbeFailed("g1", "now"), "finite"),
        (lambda: ev.ExportCommitted(1, "", 1.0), "non-empty"),
        (lambda: ev.ExportFailed(1, None, 1.0), "string"),
        (lambda: ev.ExportStarted(1, 1.0, pinned="yes"), "bool"),
        (lambda: ev.Tick(math.inf), "finite"),
    ],
)
def test_malformed_fields_are_refused_at_construction(
    build: Callable[[], ev.Event], words: str
) -> None:
    with pytest.raises((MalformedEvent, TypeError)) as info:
        build()
    assert words in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clean_syncs_to_reenable": 0},
        {"suspect_threshold": -1},
        {"restart_budget": 1.5},
        {"await_checkpoint_timeout_s": -1},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(MalformedEvent):
        RecoveryConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_initial_version_is_refused() -> None:
    with pytest.raises(MalformedEvent, match="initial_version"):
        RecoveryController(initial_version=-3)
