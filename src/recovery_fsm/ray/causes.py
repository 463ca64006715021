"""The engine's own error behind a Ray error, in one line a user can act on.

Ray wraps what went wrong in an engine: an exception in a method comes back as a
``RayTaskError`` whose first line is a banner (``ray::Engine.load() (pid=.., ip=..)``), an
exception in the constructor as an ``ActorDiedError`` carrying the whole traceback as text,
and a process that crashed (a signal, an illegal instruction) as an ``ActorDiedError`` that
knows only that the worker's connection closed. A failure reported by its first line said
none of that. ``cause_of`` gives the engine's exception type and message, and for a crash the
fatal line the process wrote to its log, when that log is on this machine.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import ray

__all__ = ["cause_of"]

_LIMIT = 600  # characters of a cause kept: a journal line, not a log
_PID = re.compile(r"^\s*pid: (\d+)$", re.MULTILINE)
_EXIT_DETAIL = re.compile(r"Worker exit detail: ([^.]*\.)")


def cause_of(err: BaseException) -> str:
    """``"<engine's exception type>: <its message>"`` for an error Ray raised about an
    engine, else the error's own type and message."""
    if isinstance(err, ray.exceptions.RayTaskError):
        inner = err.cause
        if isinstance(inner, BaseException) and not isinstance(inner, ray.exceptions.RayError):
            return _clip(f"{type(inner).__name__}: {inner}")
        return _clip(_traceback_tail(str(err)) or _first_line(err))
    if isinstance(err, ray.exceptions.ActorDiedError):
        text = err.error_msg
        if err.actor_init_failed:
            return _clip(_traceback_tail(text) or _first_line(err))
        return _clip(_crash(text))
    return _clip(_first_line(err))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _traceback_tail(text: str) -> str | None:
    """The ``Type: message`` a Python traceback ends with (its message may span lines)."""
    lines = text.splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")),
                     default=None)  # fmt: skip
    if last_frame is None:
        return None
    rest = lines[last_frame + 1 :]
    while rest and (not rest[0].strip() or rest[0][:1].isspace()):
        rest = rest[1:]  # the frame's source line and its carets
    tail = "\n".join(rest).strip()
    return tail or None


def _crash(text: str) -> str:
    """A process that died without a Python exception: pid, Ray's exit detail, and the
    fatal line the process wrote (``Fatal Python error: Illegal instruction``) if its log
    is readable here."""
    pid = _PID.search(text)
    detail = _EXIT_DETAIL.search(text)
    out = "ActorDiedError: the engine process"
    out += f" (pid {pid.group(1)})" if pid else ""
    out += " died"
    out += f" ({detail.group(1)})" if detail else ""
    fatal = _fatal_line(int(pid.group(1))) if pid else None
    return f"{out}: {fatal}" if fatal else out


def _fatal_line(pid: int) -> str | None:
    """The last ``Fatal Python error`` (or signal) line in that worker's stderr log."""
    logs = _logs_dir()
    if logs is None:
        return None
    for path in glob.glob(os.path.join(logs, f"worker-*-{pid}.err")):
        try:
            with open(path, errors="replace") as f:
                lines = f.read()[-64_000:].splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if line.startswith(("Fatal Python error", "Segmentation fault", "Killed")):
                return line.strip()
    return None


def _logs_dir() -> str | None:
    """This node's Ray log folder (from Ray's private worker module: absent, none read)."""
    try:
        from ray._private import worker

        node: Any = worker._global_node
        return str(node.get_logs_dir_path())
    except Exception:
        return None


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."
