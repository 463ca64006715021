"""Typed errors. Every refusal leaves the controller exactly as it was; ``ControllerBroken``
is the one error that says it is not."""

from __future__ import annotations

import pickle
from typing import Any


class RecoveryError(Exception):
    """Base class of everything recovery_fsm raises on purpose."""


class MalformedEvent(RecoveryError, ValueError):
    """An event whose fields are of the wrong type or out of range."""


class UnknownGroup(RecoveryError, KeyError):
    """An event names a worker group the controller has never registered."""

    def __str__(self) -> str:  # KeyError would quote the message.
        return str(self.args[0]) if self.args else ""


class UnknownVersion(RecoveryError, KeyError):
    """An event names a weight version the controller has no checkpoint or sync for."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class EventNotAllowed(RecoveryError):
    """The event is well formed but not allowed in the current state."""


class WrongIncarnation(RecoveryError):
    """An event about a start of a group's process that is not its current one (an older
    process, already replaced) or one never started."""


class ControllerBroken(RecoveryError):
    """An internal error stopped the controller for good; it refuses every later event.
    Rebuild it by replaying its journal (see the README). ``first`` is that error."""

    def __init__(self, message: str, first: BaseException) -> None:
        super().__init__(message)
        self.first = first

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (across Ray, from a hosted controller) with its cause, or the cause's repr
        where the cause itself does not pickle."""
        return (type(self), (str(self), _portable(self.first)))


class Fenced(RecoveryError):
    """A command or a journal record from a run epoch older than the one that now owns the
    fleet: a resume replaced that run, and what it sends is refused (by the engine, or by
    the journal's owner file), never executed."""


class ControllerStopped(RecoveryError):
    """The runtime stopped because its controller broke (fail-stop): no effect runs any
    more, and every call of the trainer's raises this. ``journal`` is where the controller's
    record is (None if it kept none); rebuild from it with
    ``recovery_fsm.search.replay.rebuild``."""

    def __init__(self, first: BaseException, journal: str | None) -> None:
        where = (
            f"rebuild it from its journal: recovery_fsm.search.replay.rebuild({journal!r}), "
            "then start a new runtime"
            if journal
            else "it kept no journal, so it cannot be rebuilt: start a new runtime"
        )
        if isinstance(first, Fenced):
            message = (
                f"this runtime was replaced by a resume ({first}); it executes nothing more: "
                "the resumed runtime owns the fleet and the journal"
            )
        else:
            message = (
                f"the recovery controller stopped after an internal error ({first}); the "
                f"runtime executes nothing more; {where}"
            )
        super().__init__(message)
        self.first = first
        self.journal = journal

    def __reduce__(self) -> tuple[Any, ...]:
        return (_stopped, (str(self), _portable(self.first), self.journal))


class InvariantViolation(RecoveryError, AssertionError):
    """A safety rule does not hold; carries every violated rule."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__("; ".join(violations))
        self.violations = violations


class UnsafePath(RecoveryError, ValueError):
    """A delete or load outside the checkpoint root's naming scheme was refused."""


class CorruptCheckpoint(RecoveryError):
    """A checkpoint directory does not match its manifest (or has none)."""


class ExportCancelledError(RecoveryError):
    """The export was cancelled (a newer version started, or cancel() was called)."""


class BadExportInput(RecoveryError, ValueError):
    """export() was given something it cannot write; nothing was started."""


class ExporterClosed(BadExportInput):
    """export() after the exporter was closed; nothing was started."""


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles, else a ``RuntimeError`` carrying its type and message."""
    try:
        pickle.dumps(err)
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def _stopped(message: str, first: BaseException, journal: str | None) -> ControllerStopped:
    """Rebuild a ``ControllerStopped`` with its message as it was sent."""
    err = ControllerStopped(first, journal)
    err.args = (message,)
    return err
