"""Journal records as JSON lines, so an incident can be replayed through a fresh controller."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

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
    cls = EVENT_TYPES.get(data["kind"])
    if cls is None:
        raise MalformedEvent(f"unknown event kind {data['kind']!r}; known: {sorted(EVENT_TYPES)}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    try:
        return cls(**fields)
    except TypeError as err:
        raise MalformedEvent(f"bad fields for {data['kind']}: {err}") from err


class JsonlJournal:
    """A journal sink writing one JSON object per line; flushed per record so a crash keeps
    everything up to the last event."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._fsync = fsync

    def __call__(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlJournal:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def read_journal(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise MalformedEvent(f"{path}:{lineno}: not a JSON line: {err}") from err
