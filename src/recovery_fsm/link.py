"""A thin, thread-safe front for one controller: stamps each event with the time under a lock.

Events come from several threads (trainer, health manager, export writer). If each stamped
its own time before taking the controller's lock, a later stamp could arrive first and the
controller would rightly refuse time going backwards. ``ControllerLink.send`` reads the clock
and hands the event over in one critical section, then runs the adapter's ``execute`` on the
effects (re-entrantly: an executor may report outcomes straight back through ``send``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .controller import RecoveryController
from .effects import Effect
from .events import Event


class ControllerLink:
    def __init__(
        self,
        controller: RecoveryController,
        *,
        clock: Callable[[], float] = time.monotonic,
        execute: Callable[[tuple[Effect, ...]], None] | None = None,
    ) -> None:
        self.controller = controller
        self._clock = clock
        self._execute = execute
        self._lock = threading.RLock()
        self._last = float("-inf")

    def send(self, cls: type[Event], **fields: Any) -> tuple[Effect, ...]:
        with self._lock:
            self._last = max(self._last, self._clock())
            effects = self.controller.handle(cls(at=self._last, **fields))  # type: ignore[call-arg]
            if self._execute is not None and effects:
                self._execute(effects)
            return effects
