"""Inputs to the controller: frozen records sent by the trainer, health manager and adapters.

Every event carries ``at``, the sender's clock in seconds; the controller never reads a clock.
Field validation happens here, at construction, so a malformed event never reaches a machine.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from .errors import MalformedEvent


def _check_version(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise MalformedEvent(f"{attr.name} must be an int >= 0, got {value!r}")


def _check_name(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value or value != value.strip():
        raise MalformedEvent(
            f"{attr.name} must be a non-empty string without surrounding spaces, got {value!r}"
        )


def _check_time(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedEvent(f"{attr.name} must be a finite number of seconds, got {value!r}")


def _check_text(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise MalformedEvent(f"{attr.name} must be a string, got {value!r}")


def _to_groups(value: Any) -> frozenset[str]:
    """Any iterable of names; a bare string would silently become a set of letters."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise MalformedEvent(f"groups must be a set of group names, got {value!r}")
    return frozenset(value)


def _check_groups(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    for name in value:
        _check_name(_inst, attr, name)


_time = attrs.field(validator=_check_time)


@attrs.frozen
class Event:
    """Base class; ``kind`` names the event in the journal."""

    if TYPE_CHECKING:  # every event has it; declared per class to keep field order natural
        at: float

    @property
    def kind(self) -> str:
        return type(self).__name__


# -- from the trainer ------------------------------------------------------------------------


@attrs.frozen
class WeightsSynced(Event):
    """The trainer pushed weight ``version`` to exactly the groups in ``groups``."""

    version: int = attrs.field(validator=_check_version)
    groups: frozenset[str] = attrs.field(
        converter=_to_groups, validator=_check_groups, repr=lambda g: repr(sorted(g))
    )
    at: float = _time


@attrs.frozen
class ExportStarted(Event):
    """The exporter began writing the recovery checkpoint of ``version``."""

    version: int = attrs.field(validator=_check_version)
    at: float = _time
    pinned: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen
class ExportCommitted(Event):
    """The checkpoint of ``version`` was renamed into place at ``path``."""

    version: int = attrs.field(validator=_check_version)
    path: str = attrs.field(validator=_check_name)
    at: float = _time


@attrs.frozen
class ExportFailed(Event):
    version: int = attrs.field(validator=_check_version)
    error: str = attrs.field(validator=_check_text)
    at: float = _time


@attrs.frozen
class ExportCancelled(Event):
    """The exporter confirmed that it stopped writing ``version`` and removed its files."""

    version: int = attrs.field(validator=_check_version)
    at: float = _time


@attrs.frozen
class CheckpointPinned(Event):
    """The user keeps checkpoint ``version`` (e.g. it is a regular HF save): never delete it."""

    version: int = attrs.field(validator=_check_version)
    at: float = _time


@attrs.frozen
class Shutdown(Event):
    at: float = _time


@attrs.frozen
class Tick(Event):
    """Time passes; lets deadlines (such as waiting for an export) fire."""

    at: float = _time


# -- from the health manager and the runtime --------------------------------------------------


@attrs.frozen
class GroupRegistered(Event):
    """Group ``group`` is up and holds weight ``version``."""

    group: str = attrs.field(validator=_check_name)
    version: int = attrs.field(validator=_check_version)
    at: float = _time


@attrs.frozen
class ProbeFailed(Event):
    group: str = attrs.field(validator=_check_name)
    at: float = _time


@attrs.frozen
class ProbeOk(Event):
    group: str = attrs.field(validator=_check_name)
    at: float = _time


@attrs.frozen
class GroupFailed(Event):
    """The group is dead (actor died, or the health manager gave up on it)."""

    group: str = attrs.field(validator=_check_name)
    at: float = _time
    reason: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class RestartLoaded(Event):
    """The group restarted under ``lease`` finished loading its checkpoint."""

    group: str = attrs.field(validator=_check_name)
    lease: str = attrs.field(validator=_check_name)
    at: float = _time


@attrs.frozen
class RestartLoadFailed(Event):
    group: str = attrs.field(validator=_check_name)
    lease: str = attrs.field(validator=_check_name)
    at: float = _time
    error: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class Relaunched(Event):
    """A cold restart finished: the group is up with no current weights."""

    group: str = attrs.field(validator=_check_name)
    at: float = _time


@attrs.frozen
class RelaunchFailed(Event):
    group: str = attrs.field(validator=_check_name)
    at: float = _time
    error: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class CheckpointDeleted(Event):
    """The adapter removed checkpoint ``version`` from disk."""

    version: int = attrs.field(validator=_check_version)
    at: float = _time


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        WeightsSynced,
        ExportStarted,
        ExportCommitted,
        ExportFailed,
        ExportCancelled,
        CheckpointPinned,
        Shutdown,
        Tick,
        GroupRegistered,
        ProbeFailed,
        ProbeOk,
        GroupFailed,
        RestartLoaded,
        RestartLoadFailed,
        Relaunched,
        RelaunchFailed,
        CheckpointDeleted,
    )
}
