"""Journal records as JSON lines, so an incident can be replayed through a fresh controller."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ..errors import MalformedEvent


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
    """Each line's record, checked to be a JSON object (a damaged line raises
    ``MalformedEvent`` naming the file and line)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise MalformedEvent(f"{path}:{lineno}: not UTF-8 text: {err}") from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as err:
                raise MalformedEvent(f"{path}:{lineno}: not a JSON line: {err}") from err
            if not isinstance(record, dict):
                raise MalformedEvent(
                    f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            yield record
