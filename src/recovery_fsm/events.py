"""Inputs to the controller: frozen records sent by the trainer, health manager and adapters.

Every event carries ``at`` (keyword-only), the sender's clock in seconds; the controller never
reads a clock. Field validation happens here, at construction, so a malformed event never
reaches a machine. Events about a process name the ``incarnation`` they are about: the number
the controller gave that start of the group's process (1 at registration, then one per
restart, carried by the effect that asked for the restart).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from .errors import MalformedEvent


def _check_version(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise MalformedEvent(f"{attr.name} must be an int >= 0, got {value!r}")


def _check_incarnation(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise MalformedEvent(f"{attr.name} must be an int >= 1, got {value!r}")


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


def _check_bool(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise MalformedEvent(f"{attr.name} must be True or False, got {value!r}")


def _to_incarnations(value: Any) -> dict[str, int]:
    """A mapping group -> incarnation; a set of names cannot say which process got the
    weights, so it is refused rather than guessed."""
    if not isinstance(value, Mapping):
        raise MalformedEvent(
            f"groups must map each group name to the incarnation that received the weights, "
            f"got {value!r}"
        )
    out: dict[str, int] = {}
    for name, incarnation in value.items():
        if not isinstance(name, str) or not name or name != name.strip():
            raise MalformedEvent(f"groups must be keyed by group names, got {name!r}")
        if type(incarnation) is not int or incarnation < 1:
            raise MalformedEvent(
                f"groups[{name!r}] must be an incarnation (int >= 1), got {incarnation!r}"
            )
        out[name] = incarnation
    return dict(sorted(out.items()))


@attrs.frozen
class Event:
    """Base class; ``kind`` names the event in the journal."""

    if TYPE_CHECKING:  # every event has it, keyword-only; declared per class
        at: float

    @property
    def kind(self) -> str:
        return type(self).__name__


# -- from the trainer ------------------------------------------------------------------------


@attrs.frozen
class WeightsSynced(Event):
    """The trainer pushed weight ``version`` to exactly the processes in ``groups``
    (group name -> incarnation). An entry for an older incarnation does not count: that
    process is gone, and its successor never received the weights."""

    version: int = attrs.field(validator=_check_version)
    groups: dict[str, int] = attrs.field(converter=_to_incarnations, hash=False)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class ExportStarted(Event):
    """The exporter began writing the recovery checkpoint of ``version``."""

    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)
    pinned: bool = attrs.field(default=False, validator=_check_bool)


@attrs.frozen
class ExportCommitted(Event):
    """The checkpoint of ``version`` was renamed into place at ``path``."""

    version: int = attrs.field(validator=_check_version)
    path: str = attrs.field(validator=_check_name)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class ExportFailed(Event):
    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)
    error: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class ExportCancelled(Event):
    """The exporter confirmed that it stopped writing ``version`` and removed its files."""

    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class CheckpointPinned(Event):
    """The user keeps checkpoint ``version`` (e.g. it is a regular HF save): never delete it."""

    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class CheckpointDeleted(Event):
    """The adapter removed checkpoint ``version`` from disk."""

    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class Shutdown(Event):
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class Tick(Event):
    """Time passes: deadlines (waiting for an export, a load, a relaunch) fire on it. The
    runtime sends it on an interval well under the shortest deadline (e.g. every second)."""

    at: float = attrs.field(validator=_check_time, kw_only=True)


# -- from the health manager and the runtime, about one incarnation of a group --------------


@attrs.frozen
class GroupRegistered(Event):
    """Group ``group`` is up (incarnation 1) and holds weight ``version``."""

    group: str = attrs.field(validator=_check_name)
    version: int = attrs.field(validator=_check_version)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class ProbeFailed(Event):
    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class ProbeOk(Event):
    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class GroupFailed(Event):
    """That process is dead (actor died, the health manager gave up on it, or it was killed
    after a deadline)."""

    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)
    reason: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class RestartLoaded(Event):
    """The process started by RestartFromCheckpoint finished loading its checkpoint."""

    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class RestartLoadFailed(Event):
    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)
    error: str = attrs.field(default="", validator=_check_text)


@attrs.frozen
class Relaunched(Event):
    """A cold restart finished: that process is up with no current weights."""

    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)


@attrs.frozen
class RelaunchFailed(Event):
    group: str = attrs.field(validator=_check_name)
    incarnation: int = attrs.field(validator=_check_incarnation)
    at: float = attrs.field(validator=_check_time, kw_only=True)
    error: str = attrs.field(default="", validator=_check_text)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        WeightsSynced,
        ExportStarted,
        ExportCommitted,
        ExportFailed,
        ExportCancelled,
        CheckpointPinned,
        CheckpointDeleted,
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
    )
}

# The outcomes that end a process start (RestartFromCheckpoint or RestartCold).
LOAD_OUTCOMES = (RestartLoaded, RestartLoadFailed)
RELAUNCH_OUTCOMES = (Relaunched, RelaunchFailed)
