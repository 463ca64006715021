"""One way to tell the controller what happened, for every part of the runtime.

Two kinds of send, one policy each:

- ``send``: the trainer's own events and the exporter's (a sync, an export starting). A
  refusal is the caller's business and raises to it.
- ``report``: an outcome (a boot, a death, a probe). It never raises: a refusal (a stale
  incarnation) is counted, a transport error (the controller actor did not answer in time)
  is retried once after a short pause, then counted as lost. A retry that is refused after
  a timed-out attempt is counted as a duplicate, not a refusal: the first attempt landed.

Either way, the first ``ControllerBroken`` trips the fail-stop latch: the runner and the
monitor stop, no effect runs any more, and every later call raises ``ControllerStopped``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import ControllerBroken, ControllerStopped, RecoveryError
from .. import effects as fx
from .. import events as ev
from ..host import Link
from .safety import SafetyCounters

log = logging.getLogger(__name__)


class FailStop:
    """A latch set by the first ``ControllerBroken``; the parts it stops listen to it.
    Lock order: leaf (listeners run after the lock is released)."""

    def __init__(self, journal: str | None) -> None:
        self._lock = threading.Lock()
        self.journal = journal  # named by ControllerStopped: the journal to rebuild from
        self._error: ControllerStopped | None = None
        self._listeners: list[Callable[[], object]] = []

    def on_trip(self, listener: Callable[[], object]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def trip(self, err: BaseException) -> ControllerStopped:
        with self._lock:
            first = self._error is None
            if first:
                self._error = ControllerStopped(err, self.journal)
            error = self._error
            listeners = list(self._listeners) if first else []
        assert error is not None
        if first:
            log.error("the controller broke; the runtime stops: %s", error)
        for listener in listeners:
            try:
                listener()
            except Exception:
                log.exception("a fail-stop listener raised")
        return error

    @property
    def error(self) -> ControllerStopped | None:
        with self._lock:
            return self._error

    def check(self) -> None:
        """Raise ``ControllerStopped`` once the controller broke."""
        error = self.error
        if error is not None:
            raise error


class Reporter:
    def __init__(
        self,
        link: Link,
        counters: SafetyCounters,
        failstop: FailStop,
        *,
        attempts: int = 2,
        backoff_s: float = 0.1,
    ) -> None:
        self._link = link
        self._counters = counters
        self._failstop = failstop
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._sent = threading.Condition()  # notified after every send (wait_drained)

    def send(self, cls: type[ev.Event], **fields: Any) -> tuple[fx.Effect, ...]:
        """Send for a caller that wants refusals raised (the trainer, the exporter)."""
        self._failstop.check()
        try:
            effects = self._link.send(cls, **fields)
        except ControllerBroken as err:
            raise self._failstop.trip(err) from err
        finally:
            self._notify()
        self._failstop.check()  # tripped by this very event (its journal was fenced)
        return effects

    def report(self, cls: type[ev.Event], **fields: Any) -> bool:
        """Report an outcome; True if the controller took it. Never raises."""
        return self._report(cls, self._attempts, fields)

    def report_once(self, cls: type[ev.Event], **fields: Any) -> bool:
        """Report without a retry: for an event the controller would count twice if a
        timed-out first attempt had landed (a probe result)."""
        return self._report(cls, 1, fields)

    def _report(self, cls: type[ev.Event], attempts: int, fields: dict[str, Any]) -> bool:
        if self._failstop.error is not None:
            log.debug("not reported after fail-stop: %s%s", cls.__name__, fields)
            return False
        try:
            for attempt in range(attempts):
                try:
                    self._link.send(cls, **fields)
                    return True
                except ControllerBroken as err:
                    self._failstop.trip(err)
                    return False
                except RecoveryError as err:
                    if attempt:
                        self._counters.duplicate()
                        log.info("%s%s landed before its retry: %s", cls.__name__, fields, err)
                    else:
                        self._counters.refused()
                        log.info("the controller refused %s%s: %s", cls.__name__, fields, err)
                    return False
                except Exception:
                    log.warning("reporting %s%s failed (attempt %d of %d)", cls.__name__,
                                fields, attempt + 1, attempts, exc_info=True)  # fmt: skip
                    if attempt + 1 < attempts:
                        time.sleep(self._backoff_s)
            self._counters.lost()
            log.error("reporting %s%s failed for good", cls.__name__, fields)
            return False
        finally:
            self._notify()

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``condition()`` holds, looking again after every send (and at least
        every 0.2 s, for senders elsewhere: the controller actor's other reporters)."""
        deadline = time.monotonic() + timeout
        while not condition():  # read outside the lock: it may ask a remote controller
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._sent:
                self._sent.wait(min(0.2, left))
        return True

    def _notify(self) -> None:
        with self._sent:
            self._sent.notify_all()
