"""Journal records as JSON lines, so an incident can be replayed through a fresh controller."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import MalformedEvent

if TYPE_CHECKING:
    from .owner import JournalOwner


class MixedJournal(MalformedEvent):
    """A journal holding more than one run: a header after its first record, most often a
    second run appended to the same path. Every reader refuses it alike, because whatever
    it rebuilt or counted from it would be a mix that no run was."""


def mixed_journal(source: str | os.PathLike[str] | None, line: int, step: object) -> MixedJournal:
    """The one refusal of a mixed journal, for every reader: which file, where the second
    run starts, and what to do. ``source`` None: records fed one by one (a ``Ledger``), and
    ``line`` counts records."""
    where, at = (
        ("a ledger fed record by record", f"record {line}")
        if source is None
        else (os.fspath(source), f"line {line}")
    )
    return MixedJournal(
        f"{where}: a second run's header at {at} (step {step}): this journal holds more than "
        f"one run, appended to one file. Split it before {at} and use each run's own journal; "
        "a resume never rebuilds a controller from a mix of runs"
    )


class JsonlJournal:
    """A journal sink writing one JSON object per line; flushed per record so a crash keeps
    everything up to the last event."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        owner: JournalOwner | None = None,
        epoch: int | None = None,
    ) -> None:
        """``owner``, ``epoch``: write only while that run epoch owns the journal
        (``owner.py``, claimed by the caller); a record refused raises ``Fenced``."""
        self.path = Path(path)
        self.owner = owner
        self.epoch = epoch
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._fsync = fsync

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self.owner is None or self.epoch is None:
            self._write(line)
            return
        with self.owner.holding(self.epoch):
            self._write(line)

    def _write(self, line: str) -> None:
        self._file.write(line)
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
        if self.owner is not None:
            self.owner.close()

    def __enter__(self) -> JsonlJournal:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def read_journal(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Each line's record, checked to be a JSON object (a damaged line raises
    ``MalformedEvent`` naming the file and line), in a file holding one run: a header after
    the first record raises ``MixedJournal``. Every reader of a journal file goes through
    here, so none of them (replay, rebuild, resume, ledger, timeline, CLI) reads a mix."""
    first = True
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
            if "header" in record and not first:
                raise mixed_journal(path, lineno, record.get("step"))
            first = False
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
