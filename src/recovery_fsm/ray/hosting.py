"""The controller as a named Ray actor, for a health manager in another process.

``RecoveryControllerActor`` hosts one controller (and its journal) and stamps each event's
time on arrival, as ``ControllerLink`` does in one process. Any actor or process that looks
it up by name reports events with ``send``; the effects every event causes go to one
numbered outbox, in the order the controller handled the events, which the runtime that
executes them drains with ``take_effects``. An effect leaves the outbox only when the runtime
acknowledges it (the number of the last one it executed), so a batch lost to a timeout is
sent again, and none is executed twice. So there is one controller, one order of events,
and one executor, however many reporters.

``RemoteController`` and ``RemoteLink`` give the runtime the same queries and the same
``send`` as a local controller and link.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from .. import (
    CheckpointView,
    GroupView,
    RecoveryConfig,
    RecoveryController,
    RecoveryError,
    Rules,
    StandbyView,
)
from .. import effects as fx
from .. import events as ev
from ..host import ControllerLink, ControllerQueries, EffectError, FailedEffects, Link
from ..journal import JsonlJournal

log = logging.getLogger(__name__)


class RecoveryControllerActor:
    """A controller in its own Ray actor (use ``RecoveryControllerActor.launch``)."""

    def __init__(
        self,
        config: RecoveryConfig,
        initial_version: int,
        journal: str | None,
        rules: type[Rules] = Rules,
    ) -> None:
        self._journal_path = journal
        self._journal = JsonlJournal(journal) if journal else None
        self._controller = RecoveryController(
            config, initial_version=initial_version, journal=self._journal, rules=rules
        )
        # Stamp, handle and queue in one critical section: the outbox's order is the
        # controller's order.
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._last = float("-inf")
        self._outbox: collections.deque[tuple[int, fx.Effect]] = collections.deque()
        self._numbered = 0

    @staticmethod
    def launch(
        name: str,
        config: RecoveryConfig | None = None,
        *,
        initial_version: int = 0,
        journal: str | None = None,
        namespace: str | None = None,
        rules: type[Rules] = Rules,
    ) -> Any:
        """Start the named actor (threaded: reporters and the runtime call it at once)."""
        cls: Any = ray.remote(RecoveryControllerActor)
        return cls.options(name=name, namespace=namespace, max_concurrency=8, num_cpus=0).remote(
            config or RecoveryConfig(), initial_version, journal, rules
        )

    def send(self, cls: type[ev.Event], **fields: Any) -> tuple[fx.Effect, ...]:
        """Stamp the time, handle the event, queue its effects for the runtime. Refusals
        raise to the caller (as a RayTaskError wrapping the typed error)."""
        with self._lock:
            now = max(time.monotonic(), self._last)
            self._last = now
            effects = self._controller.handle(ev.build(cls, fields, now))
            for effect in effects:
                self._numbered += 1
                self._outbox.append((self._numbered, effect))
            if effects:
                self._ready.notify_all()
        return effects

    def take_effects(self, acked: int, max_wait_s: float = 1.0) -> list[tuple[int, fx.Effect]]:
        """Drop the effects numbered up to ``acked`` (executed), then return the rest, in
        order, waiting up to ``max_wait_s`` for one."""
        with self._ready:
            while self._outbox and self._outbox[0][0] <= acked:
                self._outbox.popleft()
            self._ready.wait_for(lambda: bool(self._outbox), max_wait_s)
            return list(self._outbox)

    def pending_after(self, acked: int) -> int:
        """How many effects numbered after ``acked`` wait in the outbox."""
        with self._lock:
            return sum(1 for n, _ in self._outbox if n > acked)

    def query(self, name: str, *args: Any) -> Any:
        """One of the controller's queries (``up_groups``, ``group``, ``checkpoints``...)."""
        if name not in _QUERIES:
            raise AttributeError(f"{name!r} is not a controller query; one of {_QUERIES}")
        value = getattr(self._controller, name)
        return value(*args) if callable(value) else value

    def journal_path(self) -> str | None:
        """Where this controller's journal is (to rebuild from after fail-stop)."""
        return self._journal_path

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()


_QUERIES = (
    "up_groups", "group", "groups", "incarnation", "group_state", "recovery_state",
    "checkpoint_state", "checkpoints", "outstanding", "drained", "closed", "version", "epoch",
    "standbys", "up_standbys", "pool_state", "check_invariants", "snapshot",
)  # fmt: skip


class RemoteController:
    """The queries the runtime reads, answered by the named actor."""

    def __init__(self, actor: Any, timeout_s: float = 30.0) -> None:
        self.actor = actor
        self._timeout = timeout_s

    def _q(self, name: str, *args: Any) -> Any:
        return ray.get(self.actor.query.remote(name, *args), timeout=self._timeout)

    def journal_path(self) -> str | None:
        path = ray.get(self.actor.journal_path.remote(), timeout=self._timeout)
        return None if path is None else str(path)

    @property
    def version(self) -> int:
        return int(self._q("version"))

    def up_groups(self) -> dict[str, int]:
        return dict(self._q("up_groups"))

    def group(self, name: str) -> GroupView:
        return self._q("group", name)  # type: ignore[no-any-return]

    def groups(self) -> dict[str, GroupView]:
        return dict(self._q("groups"))

    def incarnation(self, group: str) -> int:
        return int(self._q("incarnation", group))

    def group_state(self, group: str) -> str:
        return str(self._q("group_state", group))

    def recovery_state(self, group: str) -> str:
        return str(self._q("recovery_state", group))

    def checkpoint_state(self, version: int) -> str:
        return str(self._q("checkpoint_state", version))

    def checkpoints(self) -> dict[int, CheckpointView]:
        return dict(self._q("checkpoints"))

    def outstanding(self) -> list[str]:
        return list(self._q("outstanding"))

    def standbys(self) -> dict[str, StandbyView]:
        return dict(self._q("standbys"))

    def up_standbys(self) -> list[str]:
        return list(self._q("up_standbys"))

    @property
    def pool_state(self) -> str:
        return str(self._q("pool_state"))

    @property
    def drained(self) -> bool:
        return bool(self._q("drained"))

    @property
    def epoch(self) -> int:
        return int(self._q("epoch"))

    @property
    def closed(self) -> bool:
        return bool(self._q("closed"))


class RemoteLink:
    """``send`` to the named actor, and a thread that drains its outbox into ``execute``,
    one effect at a time, in order, as ``ControllerLink`` runs them. Every call to the actor
    has a timeout; after ``close`` the effects of a late ``send`` run on the caller's thread
    (as ``ControllerLink`` does). An effect whose ``execute`` raised is kept in ``errors``
    (retry with ``retry_failed``), as every executor does: the outbox number acknowledges
    that it was delivered, never that it was done."""

    def __init__(
        self, actor: Any, execute: Callable[[fx.Effect], None], timeout_s: float = 30.0
    ) -> None:
        self.actor = actor
        self._execute = execute
        self._timeout = timeout_s
        self._acked = 0  # the number of the last effect delivered to execute
        self.failed = FailedEffects()
        self._pump = threading.RLock()  # one executor of the outbox at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="recovery-fsm-remote", daemon=True)
        self._thread.start()

    def send(self, cls: type[ev.Event], **fields: Any) -> tuple[fx.Effect, ...]:
        try:
            effects = tuple(ray.get(self.actor.send.remote(cls, **fields), timeout=self._timeout))
        except ray.exceptions.RayTaskError as err:
            # The controller's typed refusal (or ControllerBroken), raised here as itself.
            if isinstance(err.cause, RecoveryError):
                raise err.cause from None
            raise
        if self._stop.is_set():
            self._take_and_run(0.0)
        return effects

    def _take_and_run(self, max_wait_s: float) -> int:
        # The wait for a batch holds no lock: held across it, the reader thread took the
        # pump back at once after each empty wait, and ``join``/``close`` starved for
        # minutes behind it. Two takers may then get the same batch: the numbers, checked
        # under the pump, run each effect once.
        batch = ray.get(
            self.actor.take_effects.remote(self._acked, max_wait_s),
            timeout=self._timeout + max_wait_s,
        )
        with self._pump:
            for number, effect in batch:
                if number <= self._acked:
                    continue
                try:
                    self._execute(effect)
                except BaseException as err:
                    log.exception("executing %r raised; kept in link.errors", effect)
                    self.failed.add(effect, err)
                self._acked = number
            return len(batch)

    @property
    def errors(self) -> tuple[EffectError, ...]:
        return self.failed.kept

    def retry_failed(self) -> int:
        """Execute the kept failures again, in their order, on the caller's thread; returns
        how many (those that raise again are kept again)."""
        failed = self.failed.take()
        with self._pump:  # not beside the outbox's executor
            for f in failed:
                try:
                    self._execute(f.effect)
                except BaseException as err:
                    log.exception("executing %r raised again", f.effect)
                    self.failed.add(f.effect, err)
        return len(failed)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                self._take_and_run(0.5)
            except Exception:
                # A timeout loses nothing: the batch stays in the outbox until acknowledged.
                log.exception("taking effects from the controller actor failed")
                self._stop.wait(0.5)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every effect queued so far has been executed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._pump:
                acked = self._acked
            pending = ray.get(self.actor.pending_after.remote(acked), timeout=self._timeout)
            if not pending:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def close(self, timeout: float | None = None) -> bool:
        """Run what the outbox holds (False if not in ``timeout``, or if the actor did not
        answer), then stop the reader thread in any case."""
        try:
            done = self.join(timeout)
        except Exception:
            log.exception("the controller actor did not answer while closing")
            done = False
        finally:
            self._stop.set()
        self._thread.join(timeout)
        return done and not self._thread.is_alive()


def host_controller(
    rebuilt: RecoveryController | None,
    actor: Any,
    new: Callable[[], RecoveryController],
    *,
    journal: Callable[[dict[str, Any]], None],
    after_step: int,
    execute: Callable[[Any], None],
    report_timeout_s: float,
) -> tuple[ControllerQueries, Link, str | None]:
    """Where a runtime's controller lives, and the link its reports take: a controller
    rebuilt by a resume (it goes on writing its journal after ``after_step``), one hosted by
    a ``RecoveryControllerActor`` (which keeps its own journal, whose path is returned), or a
    ``new`` one in this process."""
    if rebuilt is not None:
        rebuilt.continue_journal(journal, after_step)
        return rebuilt, ControllerLink(rebuilt, execute=execute), None
    if actor is None:
        local = new()
        return local, ControllerLink(local, execute=execute), None
    remote = RemoteController(actor)
    link = RemoteLink(actor, execute=execute, timeout_s=report_timeout_s)
    return remote, link, remote.journal_path()
