"""Field validators shared by the events and the configuration: each refuses a value with a
``MalformedEvent`` that names the field and what it expects, before anything is built."""

from __future__ import annotations

import math
from typing import Any

import attrs

from .errors import MalformedEvent


def version(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise MalformedEvent(f"{attr.name} must be an int >= 0, got {value!r}")


def optional_version(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    """A weight version, or None for a process that holds no weights."""
    if value is not None:
        version(inst, attr, value)


def incarnation(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise MalformedEvent(f"{attr.name} must be an int >= 1, got {value!r}")


def name(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value or value != value.strip():
        raise MalformedEvent(
            f"{attr.name} must be a non-empty string without surrounding spaces, got {value!r}"
        )


def process_name(value: Any) -> None:
    """``<name>#<incarnation>``: how a resume names a process it found."""
    name_, sep, number = value.rpartition("#") if isinstance(value, str) else ("", "", "")
    if (
        not sep
        or not name_
        or name_ != name_.strip()
        or not number.isdigit()
        or str(int(number)) != number
        or int(number) < 1
    ):
        raise MalformedEvent(
            f"a process is named '<name>#<incarnation>' (incarnation an int >= 1), got {value!r}"
        )


def time(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedEvent(f"{attr.name} must be a finite number of seconds, got {value!r}")


def text(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise MalformedEvent(f"{attr.name} must be a string, got {value!r}")


def flag(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise MalformedEvent(f"{attr.name} must be True or False, got {value!r}")


def plain_str(value: str) -> str:
    """A ``str`` subclass as the plain string: a subclass may carry attributes, or an
    ``__eq__`` or ``__hash__`` that changes after the checks ran. Anything else is left
    as it is, for the validator to judge."""
    if isinstance(value, str) and type(value) is not str:
        return str.__str__(value)
    return value


def plain_seconds(value: float) -> float:
    """An ``int`` or ``float`` subclass (an IntEnum, numpy's float64) as the plain number,
    for the reason ``plain_str`` gives; a bool is left for the validator to refuse."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return value


def positive_int(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise MalformedEvent(f"{attr.name} must be an int >= 1, got {value!r}")


def seconds(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise MalformedEvent(f"{attr.name} must be a number of seconds >= 0, got {value!r}")


def optional_seconds(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise MalformedEvent(
            f"{attr.name} must be None or a finite number of seconds > 0, got {value!r}"
        )


def count(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise MalformedEvent(f"{attr.name} must be an int >= 0, got {value!r}")
