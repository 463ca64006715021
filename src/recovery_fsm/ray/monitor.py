"""Notice death and hangs of the processes that are up, and pass time to the controller.

Two ways at once: each up actor has a ``watch()`` call outstanding that fails the moment its
process dies (reported within a tick), and every ``probe_interval_s`` the serving groups are
pinged concurrently under one ``probe_timeout_s`` (a hang); each answers the weight version it
holds, and one that holds an older version than the controller believes, or none, has failed
(a newer one is a push not yet reported). A new process gets ``grace_s`` before its first
probe. Every ``tick_s`` it sends ``Tick``. It decides nothing: it reports.

Its bookkeeping is one watch per actor of the groups' current processes, keyed by the actor:
a load in place keeps it (the same process goes on under a new number, and the watch, when
it fires, is reported for the number the process has then), and an actor that leaves the
table (replaced, stopped) is dropped. An actor's watch is armed once: the engine's "watch"
concurrency group runs one call at a time, so a second would queue behind the first.

Standbys are watched the same way (a death is ``StandbyFailed``) and pinged in the same round
once booted: ``standby_probe_failures`` rounds in a row without an answer, or a current one
answering an older version, and the standby is stopped and reported lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray

from .. import STANDBY_PREFIX, StandbyState, StandbyView
from .. import events as ev
from ..host import ControllerQueries
from .actors import ActorTable, kill
from .reporter import Reporter

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        *,
        reporter: Reporter,
        controller: ControllerQueries,
        table: ActorTable,
        tick_s: float,
        probe_interval_s: float,
        probe_timeout_s: float,
        grace_s: float,
        check_versions: bool = True,
        watch_standbys: bool = False,
        standby_probe_failures: int = 3,
    ) -> None:
        self._reporter = reporter
        self._controller = controller
        self._table = table
        self.tick_s = tick_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.grace_s = grace_s
        self.check_versions = check_versions
        self.watch_standbys = watch_standbys  # the runtime has a standby pool
        self.standby_probe_failures = standby_probe_failures
        self._standby_misses: dict[str, int] = {}  # standby -> probes unanswered in a row
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._watches: dict[Any, Any] = {}  # ObjectRef -> the actor it watches
        # Actor -> its outstanding watch, or None once that fired (never armed twice).
        self._armed: dict[Any, Any] = {}
        self._thread = threading.Thread(target=self._loop, name="recovery-fsm-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        """No probes while paused (engines offloaded during training); death is still seen."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (also from fail-stop, on any thread but its own)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def sizes(self) -> Mapping[str, int]:
        return {"watches": len(self._watches), "armed": len(self._armed)}

    def _loop(self) -> None:
        next_probe = time.monotonic() + self.probe_interval_s
        while not self._stop.is_set():
            try:
                self._reporter.report(ev.Tick)
                if self._stop.is_set():
                    return
                up = self._controller.up_groups()
                standbys = self._controller.standbys() if self.watch_standbys else {}
                self._arm_watches({**up, **dict.fromkeys(standbys, 1)})
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.probe_interval_s
                    if not self._paused.is_set():
                        self._probe(up)
                        if standbys:
                            self._probe_standbys(standbys)
                self._wait_for_death(min(self.tick_s, max(0.0, next_probe - time.monotonic())))
            except Exception:
                log.exception("health monitor round failed; going on")
                self._stop.wait(self.tick_s)

    def _arm_watches(self, up: Mapping[str, int]) -> None:
        for g, inc in up.items():
            for actor in self._table.of(g, inc):
                if actor not in self._armed:
                    ref = actor.watch.remote()
                    self._armed[actor] = ref
                    self._watches[ref] = actor

    def _wait_for_death(self, timeout: float) -> None:
        if not self._watches:
            self._stop.wait(timeout)
        else:
            ready, _ = ray.wait(list(self._watches), num_returns=1, timeout=timeout)
            for ref in ready:
                actor = self._watches[ref]
                owner = self._table.owner(actor)  # the process it belongs to now
                if owner is not None and owner[0] in self._controller.standbys():
                    # Out of the table: a standby's name never comes back to replace it.
                    kill(self._table.take_standby(owner[0]))
                    self._table.wait_exited(owner[0], 1)  # a load of its may read C(v)
                    self._reporter.report_once(ev.StandbyFailed, standby=owner[0],
                                               reason="actor died")  # fmt: skip
                elif owner is not None and not owner[0].startswith(STANDBY_PREFIX):
                    g, inc = owner
                    now = self._controller.group(g)  # if this raises, the watch stays
                    # Up, or loading a checkpoint in place: the same process, still the
                    # group's, under the number it has now.
                    if now.incarnation == inc and (now.up or now.loading):
                        self._table.wait_exited(g, inc, [actor])  # a load's lease ends next
                        self._reporter.report(ev.GroupFailed, group=g, incarnation=inc,
                                              reason="actor died")  # fmt: skip
                del self._watches[ref]
                self._armed[actor] = None
        # Actors that left the table (replaced, stopped) are dropped with their watches.
        for actor in [a for a in self._armed if self._table.owner(a) is None]:
            ref = self._armed.pop(actor)
            self._watches.pop(ref, None)

    def _probe(self, up: Mapping[str, int]) -> None:
        now = time.monotonic()
        pings: dict[tuple[str, int], list[Any]] = {}
        views = self._controller.groups()
        for g, inc in up.items():
            if g not in views or not views[g].serving:
                continue  # a group waiting for weights takes no probe verdicts
            started = self._table.started_at(g, inc)
            actors = self._table.of(g, inc)
            if actors and started is not None and now - started >= self.grace_s:
                # Through the engine's loop: a wedged generation loop fails the probe.
                pings[(g, inc)] = [a.ping.remote(self.probe_timeout_s) for a in actors]
        refs = [r for rs in pings.values() for r in rs]
        if not refs:
            return
        # One round costs one timeout, however many groups there are.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_timeout_s)
        done = set(ready)
        for (g, inc), rs in pings.items():
            answers = [_answer(r) if r in done else _NO_ANSWER for r in rs]
            believed = views[g].version
            wrong = [
                a for a in answers
                if self.check_versions and a is not _NO_ANSWER and not _holds(a, believed)
            ]  # fmt: skip
            if wrong:
                # Like a start that failed its check: the process is stopped, then reported.
                kill(self._table.take(g, inc))
                self._reporter.report_once(
                    ev.GroupFailed, group=g, incarnation=inc,
                    reason=f"holds version {wrong[0]}, not {believed}",
                )  # fmt: skip
                continue
            ok = _NO_ANSWER not in answers
            # Once: a retry of a result that had landed would count as a second probe.
            self._reporter.report_once(
                ev.ProbeOk if ok else ev.ProbeFailed, group=g, incarnation=inc
            )


    def _probe_standbys(self, standbys: Mapping[str, StandbyView]) -> None:
        """Ping every booted standby under one timeout; stop and report the silent (for
        ``standby_probe_failures`` rounds in a row) and the current ones holding less."""
        now = time.monotonic()
        pings: dict[str, list[Any]] = {}
        for s, view in standbys.items():
            started = self._table.started_at(s, 1)
            actors = self._table.of(s, 1)
            # A resuming one answers its verification, under that deadline, instead.
            waiting = view.state in {StandbyState.BOOTING, StandbyState.RESUMING}
            booted = not waiting and actors and started is not None
            if booted and now - started >= self.grace_s:  # type: ignore[operator]
                pings[s] = [a.ping.remote() for a in actors]
        for s in [s for s in self._standby_misses if s not in standbys]:
            del self._standby_misses[s]
        refs = [r for rs in pings.values() for r in rs]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_timeout_s)
        done = set(ready)
        for s, rs in pings.items():
            answers = [_answer(r) if r in done else _NO_ANSWER for r in rs]
            believed = standbys[s].version if standbys[s].ready else None
            wrong = [a for a in answers if a is not _NO_ANSWER and not _holds(a, believed)]
            misses = self._standby_misses.get(s, 0) + 1 if _NO_ANSWER in answers else 0
            self._standby_misses[s] = misses
            why = (
                f"holds version {wrong[0]}, not {believed}"
                if wrong and self.check_versions
                else f"{misses} probes unanswered"
                if misses >= self.standby_probe_failures
                else None
            )
            if why is not None:
                kill(self._table.take_standby(s))
                self._standby_misses.pop(s, None)
                self._reporter.report_once(ev.StandbyFailed, standby=s, reason=why)


_NO_ANSWER = object()


def _answer(ref: Any) -> object:
    try:
        return ray.get(ref, timeout=0)
    except Exception:
        return _NO_ANSWER


def _holds(answer: object, believed: int | None) -> bool:
    """The version an engine answers agrees with the controller's belief: the same, or
    newer (a push the trainer has not reported yet)."""
    if type(answer) is not int:
        return answer is None and believed is None
    return believed is None or answer >= believed
