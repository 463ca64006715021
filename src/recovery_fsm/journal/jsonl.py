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

    def move(self, path: str | os.PathLike[str]) -> None:
        """Rename the file into ``path`` (atomically, on one file system) and go on writing
        it there: a journal is published once its opening is complete."""
        os.replace(self.path, path)
        self.path = Path(path)

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


def trim_torn_tail(path: str | os.PathLike[str]) -> bytes:
    """Cut a last line the writer did not finish (its process died mid-write: no newline)
    so the journal reads, and can be appended to, cleanly; returns the bytes cut (empty:
    the journal ended on a whole line). A whole line, however damaged, is left for
    ``read_journal`` to refuse: only an unfinished write is a crash's normal trace."""
    p = Path(path)
    with p.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return b""
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return b""
        # Find the last newline: everything after it is the torn line.
        block, end = 1 << 16, size
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        f.seek(keep)
        torn = f.read()
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return torn
