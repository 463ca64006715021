"""Carry out the controller's effects on Ray actors and report each outcome.

Starts run on a small thread pool, one lane per group (a group's effects run in order,
different groups at once), deletes in one lane per checkpoint; kills, routing and cancels
run at once on the link's thread, so a ``StopGroup`` is never queued behind the hung load
it ends. A start from a checkpoint passes admission (``admission.py``: the digest gate where
the engine computes digests, and the canary the manifest records), or the start failed (never
a retry loop). The runner decides nothing: it reports.

Standbys are processes under their own names in the actor table (incarnation 1), with a lane
each. A claim moves the standby's actors to the group's new incarnation at once, on the
link's thread (so a kill or a watch after it finds them under the group), then runs on the
group's lane: each actor ``assume``s the group's name, loads C(v) in place if the claim says
so, and passes admission against the checkpoint's record or, for a standby that took the
trainer's push, against the push's (``expected``: version -> its digest and canary).

Lifecycle: ``pause`` holds new starts and deletes in their lanes (kills and routing still
run), ``resume`` runs them in order, ``halt`` (fail-stop) runs nothing more, ``close``
waits for what runs. An effect whose execution raised is kept in ``failed`` (counted,
retryable with ``retry_failed``), as every executor does.

Lock order: the runner's lock is a leaf: effects run, and outcomes are reported, outside it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import effects as fx
from .. import events as ev
from ..export import CheckpointStore
from ..export.canary import Canary
from ..host import EffectError, FailedEffects
from . import admission
from .actors import ActorTable, Booted, BootFailed, Launcher, kill
from .admission import Refusal, RefusalKind
from .reporter import Reporter
from .router import TrafficRouter
from .safety import SafetyCounters

log = logging.getLogger(__name__)


class EffectRunner:
    def __init__(
        self,
        *,
        launcher: Launcher,
        reporter: Reporter,
        counters: SafetyCounters,
        router: TrafficRouter,
        store: CheckpointStore,
        cancel_export: Callable[[int], Any],
        max_parallel: int,
        delete_attempts: int = 5,
        expected: Callable[[int], tuple[str | None, Canary | None] | None] = lambda _v: None,
    ) -> None:
        self._launcher = launcher
        self._table: ActorTable = launcher.table
        self._reporter = reporter
        self._counters = counters
        self._router = router
        self._store = store
        self._cancel_export = cancel_export
        self.delete_attempts = delete_attempts
        self._expected = expected
        # (group, incarnation) -> what its admission held it to, until its outcome is reported
        # (each process is run by one lane at a time).
        self._evidence: dict[tuple[str, int], str] = {}
        # Claims whose standby a push in flight had brought to a newer version: that version.
        self._ahead: dict[tuple[str, int], int] = {}
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="recovery-fsm-run")
        self._lock = threading.Lock()
        self._lanes: dict[str, collections.deque[fx.Effect]] = {}
        self._busy: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._paused = False
        self._halted = False
        self.failed = FailedEffects()

    # -- lifecycle -------------------------------------------------------------------------

    def pause(self, timeout: float | None = None) -> bool:
        """Hold new starts and deletes in their lanes; True once those running finished
        (within ``timeout``). Kills, routing and cancels still run at once: a pause must
        never hold the kill that ends a hung load, nor keep traffic on a dead group."""
        with self._lock:
            self._paused = True
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def resume(self) -> None:
        """Run what waits in the lanes, each effect once, in the order it came."""
        with self._lock:
            self._paused = False
            if not self._halted:
                for lane, queue in self._lanes.items():
                    if queue and lane not in self._busy:
                        self._busy.add(lane)
                        self._pool.submit(self._drain, lane)

    def halt(self) -> None:
        """Fail-stop: nothing more runs, whatever is queued or arrives later."""
        with self._lock:
            self._halted = True

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the lanes running now; True if they finished in time."""
        with self._lock:
            done = self._idle.wait_for(lambda: not self._busy, timeout)
        self._pool.shutdown(wait=done)
        return done

    @property
    def in_flight(self) -> int:
        """Starts and deletes queued or running."""
        with self._lock:
            return self._in_flight

    @property
    def errors(self) -> tuple[EffectError, ...]:
        return self.failed.kept

    def retry_failed(self) -> int:
        """Queue the effects that failed again, in their order; returns how many (0 after
        fail-stop: they stay kept). A routing effect that a newer one replaced is dropped."""
        with self._lock:
            if self._halted:
                return 0
        failed = self.failed.take()
        for f in failed:
            if isinstance(f.effect, fx.RouteTraffic | fx.WithdrawTraffic):
                self._route(f.effect, retry=True)
            else:
                self.execute(f.effect)
        return len(failed)

    def _route(self, effect: fx.RouteTraffic | fx.WithdrawTraffic, *, retry: bool) -> None:
        try:
            self._router.apply(effect, retry=retry)
        except Exception as err:  # the user's router: kept, as every executor keeps it
            log.exception("routing %r raised; kept in runner.failed", effect)
            self.failed.add(effect, err)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"lanes": len(self._lanes)}

    # -- executing ---------------------------------------------------------------------------

    def execute(self, effect: fx.Effect) -> None:
        """Called by the link, one effect at a time: must not block."""
        with self._lock:
            if self._halted:
                log.warning("not executed after fail-stop: %r", effect)
                return
        match effect:
            case fx.RouteTraffic() | fx.WithdrawTraffic():
                self._route(effect, retry=False)
            case fx.StopGroup(group=g, incarnation=inc):
                kill(self._table.take(g, inc))
            case fx.RetireGroup(group=g):
                kill(self._table.take(g))
            case fx.CancelExport(version=v):
                self._cancel_export(v)
            case fx.LoadCheckpoint(group=g, incarnation=inc, previous=previous):
                self._counters.load_in_place(g)
                self._table.renumber(g, previous, inc)  # the same actors, a new number
                self._queue(f"group:{g}", effect)
            case fx.VerifyGroup(group=g, incarnation=inc):
                kill(self._table.adopt(g, inc))  # found at a resume: the rules keep it
                self._queue(f"group:{g}", effect)
            case fx.StopFound(name=name, incarnation=inc):
                kill(self._table.take_found(name, inc))
            case fx.RestartFromCheckpoint(group=g) | fx.RestartCold(group=g):
                self._queue(f"group:{g}", effect)
            case fx.StopStandby(standby=s):
                kill(self._table.take_standby(s))
            case (
                fx.StartStandby(standby=s) | fx.LoadStandby(standby=s) | fx.VerifyStandby(standby=s)
            ):
                if isinstance(effect, fx.VerifyStandby):
                    kill(self._table.adopt(s, 1))  # found at a resume: the rules keep it
                if isinstance(effect, fx.StartStandby):
                    self._table.standby_boot_queued(s)
                self._queue(f"standby:{s}", effect)
            case fx.ClaimStandby(group=g, incarnation=inc, standby=s):
                # The standby's actors are the group's from now on (an own load of theirs
                # still running finds them gone from the standby and reports it failed).
                kill(self._table.replace(g, inc, self._table.take_standby(s)))
                self._queue(f"group:{g}", effect)
            case fx.DeleteCheckpoint(version=v):
                self._queue(f"checkpoint:{v}", effect)
            case _:
                raise TypeError(f"no executor for {effect!r}")

    def _queue(self, lane: str, effect: fx.Effect) -> None:
        with self._lock:
            self._lanes.setdefault(lane, collections.deque()).append(effect)
            self._in_flight += 1
            if lane not in self._busy and not self._paused and not self._halted:
                self._busy.add(lane)
                self._pool.submit(self._drain, lane)

    def _drain(self, lane: str) -> None:
        while True:
            with self._lock:
                queue = self._lanes[lane]
                if not queue or self._paused or self._halted:
                    self._busy.discard(lane)
                    if not queue:
                        del self._lanes[lane]  # a lane per checkpoint must not pile up
                    self._idle.notify_all()
                    return
                effect = queue.popleft()
            try:
                self._run(effect)
            except BaseException as err:
                log.exception("executing %r raised; kept in runner.failed", effect)
                self.failed.add(effect, err)
            finally:
                with self._lock:
                    self._in_flight -= 1

    def _run(self, effect: fx.Effect) -> None:
        """Run one queued effect; a start's outcome is reported whatever raises on the way."""
        error: Refusal | str | None  # a refusal, a failed start's cause, or None: it started
        match effect:
            case (
                fx.RestartFromCheckpoint(group=g, incarnation=inc)
                | fx.LoadCheckpoint(group=g, incarnation=inc)
                | fx.RestartCold(group=g, incarnation=inc)
            ):
                cold = isinstance(effect, fx.RestartCold)
                try:
                    if isinstance(effect, fx.RestartCold):
                        error = self._start_cold(g, inc)
                    else:
                        error = self._load(effect)
                except Exception as err:
                    log.exception("starting %r raised", effect)
                    error = f"{type(err).__name__}: {err}"[:500]
                evidence = self._evidence.pop((g, inc), "")
                if error is None and cold:
                    self._reporter.report(ev.Relaunched, group=g, incarnation=inc)
                elif error is None:
                    self._reporter.report(ev.RestartLoaded, group=g, incarnation=inc,
                                          evidence=evidence)  # fmt: skip
                else:
                    kill(self._table.take(g, inc))
                    self._table.wait_exited(g, inc)  # what it read is let go only then
                    self._reporter.report(ev.RelaunchFailed if cold else ev.RestartLoadFailed,
                                          group=g, incarnation=inc,
                                          error=self._why(error))  # fmt: skip
            case fx.ClaimStandby(group=g, incarnation=inc):
                try:
                    error = self._claim(effect)
                except Exception as err:
                    log.exception("claiming %r raised", effect)
                    error = f"{type(err).__name__}: {err}"[:500]
                evidence = self._evidence.pop((g, inc), "")
                ahead = self._ahead.pop((g, inc), None)  # found holding a pushed version
                if error is None:
                    self._reporter.report(ev.RestartLoaded, group=g, incarnation=inc,
                                          evidence=evidence, version=ahead)  # fmt: skip
                else:
                    kill(self._table.take(g, inc))
                    self._table.wait_exited(g, inc)
                    self._reporter.report(ev.RestartLoadFailed, group=g, incarnation=inc,
                                          error=self._why(error))  # fmt: skip
            case fx.VerifyGroup(group=g, incarnation=inc):
                try:
                    held, error = self._verify(g, inc)
                except Exception as err:
                    log.exception("verifying %r raised", effect)
                    held, error = None, f"{type(err).__name__}: {err}"[:500]
                evidence = self._evidence.pop((g, inc), "")
                if error is None:
                    self._reporter.report(ev.GroupVerified, group=g, incarnation=inc,
                                          version=held, evidence=evidence)  # fmt: skip
                else:
                    kill(self._table.take(g, inc))
                    self._table.wait_exited(g, inc)
                    self._reporter.report(ev.GroupFailed, group=g, incarnation=inc,
                                          reason=f"not verified: {self._why(error)}")  # fmt: skip
            case fx.VerifyStandby(standby=s):
                try:
                    held, error = self._verify(s, 1)
                except Exception as err:
                    log.exception("verifying %r raised", effect)
                    held, error = None, f"{type(err).__name__}: {err}"[:500]
                if error is None:
                    self._reporter.report(ev.StandbyVerified, standby=s, version=held)
                else:
                    kill(self._table.take_standby(s))
                    self._reporter.report(ev.StandbyFailed, standby=s,
                                          reason=f"not verified: {self._why(error)}")  # fmt: skip
            case fx.StartStandby(standby=s) | fx.LoadStandby(standby=s):
                try:
                    error = self._standby(effect)
                except Exception as err:
                    log.exception("running %r raised", effect)
                    error = f"{type(err).__name__}: {err}"[:500]
                if error is None and isinstance(effect, fx.StartStandby):
                    self._reporter.report(ev.StandbyBooted, standby=s)
                elif error is None and isinstance(effect, fx.LoadStandby):
                    self._reporter.report(ev.StandbyLoaded, standby=s, version=effect.version)
                else:
                    kill(self._table.take_standby(s))
                    self._table.wait_exited(s, 1)
                    self._reporter.report(ev.StandbyFailed, standby=s, reason=self._why(error))
            case fx.DeleteCheckpoint(version=v, path=path):
                self._delete(v, path, effect)
            case _:
                raise TypeError(f"no lane runs {effect!r}")

    def _why(self, error: Refusal | str | None) -> str:
        """A failed start's reason for its report; a refusal is counted by its kind."""
        if isinstance(error, Refusal):
            self._counters.admission_refused(error.kind)
        return str(error)

    def _load(
        self, effect: fx.RestartFromCheckpoint | fx.LoadCheckpoint
    ) -> Refusal | str | None:
        """Boot from (or load in place) the checkpoint; why it failed, or None."""
        g, inc, path = effect.group, effect.incarnation, effect.path
        self._counters.load_begins(path)
        try:
            if isinstance(effect, fx.RestartFromCheckpoint):
                outcome = self._launcher.boot(
                    g,
                    inc,
                    lambda a: a.boot_from_checkpoint.remote(path, epoch=self._launcher.epoch),
                )
            else:  # a load in place: the running actors, under their new number
                outcome = self._launcher.call_all(
                    g,
                    inc,
                    lambda a: a.load_checkpoint.remote(path, inc, epoch=self._launcher.epoch),
                )
        finally:
            self._counters.load_ends(path)
        if isinstance(outcome, BootFailed):
            return outcome.reason
        manifest = self._store.read_manifest(path)
        digest, canary = manifest["weights_digest"], admission.manifest_canary(manifest)
        return self._admit(g, inc, outcome, digest, canary)

    def _admit(
        self, g: str, inc: int, outcome: Booted, digest: str | None, canary: Canary | None
    ) -> Refusal | str | None:
        """Admission of a group's process; what it was held to is kept for its report."""
        why = admission.refusal(self._launcher, g, inc, outcome, digest=digest, canary=canary)
        if why is None:
            self._evidence[(g, inc)] = admission.evidence(self._launcher, digest, canary)
        return why

    def _standby(self, effect: fx.StartStandby | fx.LoadStandby) -> Refusal | str | None:
        """Boot a standby empty, or load C(v) into it in place and admit what it holds;
        why it failed, or None."""
        s = effect.standby
        if isinstance(effect, fx.StartStandby):
            try:
                outcome = self._launcher.boot(
                    s, 1, lambda a: a.boot_empty.remote(epoch=self._launcher.epoch)
                )
            finally:
                self._table.standby_boot_ends(s)
            return outcome.reason if isinstance(outcome, BootFailed) else None
        self._counters.load_begins(effect.path)
        try:
            outcome = self._launcher.call_all(
                s, 1, lambda a: a.load_checkpoint.remote(effect.path, 1, epoch=self._launcher.epoch)
            )
        finally:
            self._counters.load_ends(effect.path)
        if isinstance(outcome, BootFailed):
            return outcome.reason
        manifest = self._store.read_manifest(effect.path)
        return admission.refusal(
            self._launcher, s, 1, outcome,
            digest=manifest["weights_digest"], canary=admission.manifest_canary(manifest),
        )  # fmt: skip

    def _claim(self, effect: fx.ClaimStandby) -> Refusal | str | None:
        """The standby's actors take the group's name; with a path they load C(v) first.
        Either way they pass admission before the group serves: why not, or None."""
        g, inc, path = effect.group, effect.incarnation, effect.path
        if path is None:
            record = self._expected(effect.version)
            if record is None:
                return Refusal(
                    RefusalKind.NO_RECORD,
                    f"no record of what version {effect.version} holds (no push or "
                    "checkpoint of it): the standby cannot be admitted",
                )
            digest, canary = record
            if canary is not None:  # one round: each actor's canary right behind its assume
                return self._claim_as_it_is(g, inc, effect.version, digest, canary)
        outcome = self._launcher.call_all(
            g, inc, lambda a: a.assume.remote(g, inc, epoch=self._launcher.epoch)
        )
        if isinstance(outcome, BootFailed):
            return outcome.reason
        if path is not None:
            self._counters.load_begins(path)
            try:
                outcome = self._launcher.call_all(
                    g,
                    inc,
                    lambda a: a.load_checkpoint.remote(path, inc, epoch=self._launcher.epoch),
                )
            finally:
                self._counters.load_ends(path)
            if isinstance(outcome, BootFailed):
                return outcome.reason
            manifest = self._store.read_manifest(path)
            digest, canary = manifest["weights_digest"], admission.manifest_canary(manifest)
        if any(h.version != effect.version for h in outcome.held):
            held = sorted({str(h.version) for h in outcome.held})
            return Refusal(
                RefusalKind.WRONG_VERSION,
                f"the standby holds version {', '.join(held)}, not {effect.version}",
            )
        return self._admit(g, inc, outcome, digest, canary)

    def _claim_as_it_is(
        self, g: str, inc: int, version: int, digest: str | None, canary: Canary
    ) -> Refusal | str | None:
        """A current standby's check in one round trip: every actor takes the group's name
        and answers the canary (an actor runs its calls in order)."""
        prompt, n = list(canary.prompt), len(canary.answer.tokens)
        answers = self._launcher.ask(
            g,
            inc,
            lambda a: (
                a.assume.remote(g, inc, epoch=self._launcher.epoch),
                a.canary.remote(prompt, n),
            ),
        )
        if isinstance(answers, BootFailed):
            return answers.reason
        held = {getattr(h, "version", None) for h in answers[0::2]}
        if held != {version}:
            (found,) = held if len(held) == 1 else (None,)
            # A push in flight may have reached it first: checked against that push's own
            # record, and reported as found (the rules decide what it may do).
            newer = found if type(found) is int and found > version else None
            record = None if newer is None else self._expected(newer)
            if newer is None or record is None or record[1] is None:
                shown = sorted(str(v) for v in held)
                return Refusal(
                    RefusalKind.WRONG_VERSION,
                    f"the standby holds version {', '.join(shown)}, not {version}",
                )
            digest, canary = record[0], record[1]
            self._ahead[(g, inc)] = newer
        gate = digest if self._launcher.computes_digest else None
        why = admission.push_refusal(canary, gate, answers)
        if why is None:
            self._evidence[(g, inc)] = admission.evidence(self._launcher, gate, canary)
        else:
            self._ahead.pop((g, inc), None)
        return why

    def _verify(self, g: str, inc: int) -> tuple[int | None, Refusal | str | None]:
        """What a process (a standby: incarnation 1) that outlived the trainer holds, checked
        against that version's record (the push's or its checkpoint's manifest): (version,
        None), or (None, why it cannot be trusted). Asked behind any load it still runs.
        Weights no record vouches for count as none: the controller then loads C(v) into it
        or waits for a push."""
        answers = self._launcher.ask(g, inc, lambda a: (a.booted.remote(), a.weights.remote()))
        if isinstance(answers, BootFailed):
            return None, answers.reason
        if not all(answers[0::2]):
            return None, Refusal(
                RefusalKind.INCOMPLETE,
                "never booted: its boot died with the trainer that asked for it",
            )
        outcome = Booted(tuple(answers[1::2]))
        if len(outcome.held) != self._launcher.actors_per_group:
            return None, Refusal(
                RefusalKind.INCOMPLETE,
                f"{len(outcome.held)} of {self._launcher.actors_per_group} actors survived",
            )
        versions = {h.version for h in outcome.held}
        if len(versions) != 1:
            return None, Refusal(
                RefusalKind.MIXED,
                f"its actors hold different versions {sorted(map(str, versions))}",
            )
        version = versions.pop()
        record = None if version is None else self._expected(version)
        if version is None or record is None:
            return None, None
        digest, canary = record
        return version, self._admit(g, inc, outcome, digest, canary)

    def _start_cold(self, g: str, inc: int) -> str | None:
        outcome = self._launcher.boot(
            g, inc, lambda a: a.boot_empty.remote(epoch=self._launcher.epoch)
        )
        return outcome.reason if isinstance(outcome, BootFailed) else None

    def _delete(self, version: int, path: str, effect: fx.Effect) -> None:
        self._counters.delete_begins(path)
        for attempt in range(self.delete_attempts):
            try:
                self._store.delete(path)
            except FileNotFoundError:
                pass  # already gone: that is the outcome asked for
            except Exception as err:
                log.warning("delete of %s failed (attempt %d)", path, attempt + 1, exc_info=True)
                if attempt + 1 == self.delete_attempts:
                    # The core has no event for it: kept (retry_failed) and logged.
                    self.failed.add(effect, err)
                    log.error("could not delete %s in %d attempts; kept for retry_failed()",
                              path, self.delete_attempts)  # fmt: skip
                    return
                time.sleep(min(2.0, 0.1 * 2**attempt))
                continue
            self._counters.deleted(path)
            self._reporter.report(ev.CheckpointDeleted, version=version)
            return
