"""Events and effects as plain JSON-ready dicts, and back: the journal's record format."""

from __future__ import annotations

from typing import Any

import attrs

from .errors import MalformedEvent
from .events import EVENT_TYPES, Event


def encode(obj: Any) -> dict[str, Any]:
    """An event or effect as a JSON-ready dict with its ``kind``; anything else (a refused
    non-event) as its type and repr, so the refusal is journaled too."""
    if not attrs.has(type(obj)):
        return {"kind": type(obj).__name__, "repr": repr(obj)[:200]}
    return {"kind": type(obj).__name__, **attrs.asdict(obj, recurse=False)}


def decode_event(data: dict[str, Any]) -> Event:
    if not isinstance(data, dict) or "kind" not in data:
        raise MalformedEvent(f"expected an event object with a 'kind', got {data!r}")
    kind = data["kind"]
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedEvent(f"unknown event kind {data['kind']!r}; known: {sorted(EVENT_TYPES)}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    try:
        return cls(**fields)
    except TypeError as err:
        raise MalformedEvent(f"bad fields for {data['kind']}: {err}") from err
