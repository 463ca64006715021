"""A thread-safe front for one controller: time stamping, and effects run off every lock.

Events come from several threads (trainer, health manager, export writer). If each stamped
its own time before taking the controller's lock, a later stamp could arrive first and the
controller would rightly refuse time going backwards, so ``send`` reads the clock and hands
the event over in one critical section.

Effects go to the adapter's ``execute`` one at a time, in order, on the link's own
dispatcher thread, outside every lock: a slow load never stalls the trainer or the export
writer, ``execute`` may read the controller or report back through ``send``, and an
``execute`` that raises is logged and kept in ``errors`` (with its effect, to retry) while
the effects after it still run. Effects run one at a time, in order, so ``execute`` must not
block on slow work: it starts a load or a relaunch and returns, and the outcome is reported
later through ``send`` (a routing effect queued behind a blocking load would wait for it).
Without ``execute``, ``send`` only returns the effects: then
every sender must run them itself, so give the link an ``execute`` whenever a component that
ignores return values (the exporter's ``report``) sends through it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from .. import CheckpointView, Effect, Event, GroupView, RecoveryController, StandbyView
from ..events import build

log = logging.getLogger(__name__)


@attrs.frozen
class EffectError:
    """``execute(effect)`` raised ``error``."""

    effect: Effect
    error: BaseException


class FailedEffects:
    """The one policy of every effect executor (this link, the remote link, the Ray runner):
    an effect whose execution raised is kept here, counted and retryable, and never counted
    as done. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[EffectError] = []
        self.total = 0  # every failure ever kept, retried or not

    def add(self, effect: Effect, error: BaseException) -> None:
        with self._lock:
            self._kept.append(EffectError(effect, error))
            self.total += 1

    def take(self) -> list[EffectError]:
        """Every kept failure, oldest first; they are no longer kept (to be retried)."""
        with self._lock:
            taken, self._kept = self._kept, []
            return taken

    @property
    def kept(self) -> tuple[EffectError, ...]:
        with self._lock:
            return tuple(self._kept)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


class Link(Protocol):
    """What a runtime needs from a link to its controller, in-process or remote."""

    def send(self, cls: type[Event], **fields: Any) -> tuple[Effect, ...]: ...

    @property
    def errors(self) -> tuple[EffectError, ...]: ...

    def retry_failed(self) -> int: ...

    def join(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> bool: ...


class ControllerQueries(Protocol):
    """The read-only queries a runtime asks of its controller, in-process or remote."""

    @property
    def version(self) -> int: ...

    @property
    def drained(self) -> bool: ...

    @property
    def epoch(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def up_groups(self) -> dict[str, int]: ...

    def group(self, name: str) -> GroupView: ...

    def groups(self) -> dict[str, GroupView]: ...

    def incarnation(self, group: str) -> int: ...

    def group_state(self, group: str) -> str: ...

    def recovery_state(self, group: str) -> str: ...

    def checkpoint_state(self, version: int) -> str: ...

    def checkpoints(self) -> dict[int, CheckpointView]: ...

    def outstanding(self) -> list[str]: ...

    def standbys(self) -> dict[str, StandbyView]: ...

    def up_standbys(self) -> list[str]: ...

    @property
    def pool_state(self) -> str: ...


class ControllerLink:
    def __init__(
        self,
        controller: RecoveryController,
        *,
        clock: Callable[[], float] = time.monotonic,
        execute: Callable[[Effect], None] | None = None,
    ) -> None:
        self.controller = controller
        self._clock = clock
        self._execute = execute
        self._lock = threading.RLock()
        self._last = float("-inf")
        # A controller rebuilt in another process (or on another host) took events at times
        # of another clock: stamp from its last one on, never behind it.
        last = controller.now
        self._offset = 0.0 if last is None else max(0.0, last - clock())
        self._cv = threading.Condition()
        self._queue: collections.deque[Effect] = collections.deque()
        self._busy = 0  # effects taken off the queue and not finished
        self.failed = FailedEffects()
        self._closing = False
        self._thread: threading.Thread | None = None
        if execute is not None:
            self._thread = threading.Thread(
                target=self._dispatch, name="recovery-fsm-effects", daemon=True
            )
            self._thread.start()

    def send(self, cls: type[Event], **fields: Any) -> tuple[Effect, ...]:
        """Stamp, handle, queue the effects for ``execute``; return them."""
        with self._lock:
            self._last = max(self._last, self._clock() + self._offset)
            effects = self.controller.handle(build(cls, fields, self._last))
            if self._execute is None or not effects:
                return effects
            with self._cv:
                if not self._closing:
                    self._queue.extend(effects)
                    self._cv.notify_all()
                    return effects
        # Closed: no dispatcher any more, so the caller runs them (late reports at shutdown).
        for effect in effects:
            self._run(effect)
        return effects

    @property
    def errors(self) -> tuple[EffectError, ...]:
        """Effects whose ``execute`` raised, oldest first, until ``retry_failed``."""
        return self.failed.kept

    @property
    def pending(self) -> int:
        """Effects queued or running."""
        with self._cv:
            return len(self._queue) + self._busy

    def retry_failed(self) -> int:
        """Run again every effect whose ``execute`` raised, in their order, after what is
        queued; returns how many. By then later effects may have run: an adapter should
        check a retried effect against ``controller.group(...)`` before acting on it."""
        failed = self.failed.take()
        with self._cv:
            if not self._closing:
                self._queue.extend(f.effect for f in failed)
                self._cv.notify_all()
                return len(failed)
        for f in failed:  # closed: no dispatcher any more
            self._run(f.effect)
        return len(failed)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every queued effect ran; False on timeout. From inside ``execute`` it
        cannot wait for the queue behind it, and says whether that queue is empty."""
        with self._cv:
            if threading.current_thread() is self._thread:
                return not self._queue
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then stop the dispatcher. False if it did not finish in time."""
        done = self.join(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return done

    def __enter__(self) -> ControllerLink:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _dispatch(self) -> None:
        assert self._execute is not None
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                effect = self._queue.popleft()
                self._busy += 1
            try:
                self._run(effect)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _run(self, effect: Effect) -> None:
        assert self._execute is not None
        try:
            self._execute(effect)
        except BaseException as err:  # even SystemExit must not kill the dispatcher silently
            log.exception("executing %r failed; kept in link.errors", effect)
            self.failed.add(effect, err)
