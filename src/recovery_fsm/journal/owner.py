"""Who may write a run's journal: one run epoch at a time, named in ``<journal>.owner``.

A resume claims the next epoch before it reads the journal; from then on every record the
replaced runtime tries to write is refused with ``Fenced`` (it still runs when a supervisor
killed only its wrapper, or a partition healed). The check and the write happen under one
``flock`` of the owner file, and a claim takes it exclusively, so a record is never written
by an epoch that was already replaced. POSIX only (Linux, macOS), like the runtime.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ..errors import Fenced, RecoveryError


class JournalHeld(RecoveryError):
    """A start found the journal owned by a run already (its epoch, process and host)."""


def owner_path(journal: str | os.PathLike[str]) -> Path:
    p = Path(journal)
    return p.with_name(p.name + ".owner")


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"epoch {holder.get('epoch')} (pid {holder.get('pid')} on {holder.get('host')}, "
        f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('since', 0)))})"
    )


class JournalOwner:
    """The owner file of one journal, held open for the writer's life."""

    def __init__(self, journal: str | os.PathLike[str]) -> None:
        self.path = owner_path(journal)
        self._file: IO[str] = self.path.open("a+", encoding="utf-8")

    def _read(self) -> dict[str, Any]:
        self._file.seek(0)
        text = self._file.read()
        try:
            holder = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            holder = {}
        return holder if isinstance(holder, dict) else {}

    def holder(self) -> dict[str, Any]:
        """Who holds the journal now (empty: nobody ever did)."""
        fcntl.flock(self._file, fcntl.LOCK_SH)
        try:
            return self._read()
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def claim(self, epoch: int | None = None, *, fresh: bool = False) -> int:
        """Take the journal as ``epoch`` (None: the next epoch above the holder's) and
        return it; refused (``JournalHeld``) if the holder's epoch is not below it. A resume
        claims above whoever holds it, which fences that run. ``fresh``: a new run on a
        journal holding no run, whatever an owner file left by a killed start says."""
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            holder = self._read()
            held = holder.get("epoch")
            held = held if type(held) is int and not fresh else 0
            if epoch is None:
                epoch = held + 1
            elif held >= epoch:
                raise JournalHeld(
                    f"the journal {self.path.with_suffix('')} is held by {_describe(holder)}: "
                    "resume that run (RecoveryRuntime.resume), or give this run a journal "
                    "of its own"
                )
            me = {"epoch": epoch, "pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.time()}  # fmt: skip
            self._file.seek(0)
            self._file.truncate()
            self._file.write(json.dumps(me))
            self._file.flush()
            os.fsync(self._file.fileno())
            return epoch
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    @contextmanager
    def holding(self, epoch: int) -> Iterator[None]:
        """Run the body only while ``epoch`` still owns the journal (a claim waits for it);
        else raise ``Fenced`` naming who replaced it."""
        fcntl.flock(self._file, fcntl.LOCK_SH)
        try:
            holder = self._read()
            if holder.get("epoch") != epoch:
                raise Fenced(
                    f"run epoch {epoch} no longer owns the journal "
                    f"{self.path.with_suffix('')}: it is held by {_describe(holder)}"
                )
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def close(self) -> None:
        self._file.close()
