"""The Ray runtime: detect, execute, verify, report.

The controller decides; this module only carries its decisions out on Ray actors and
reports what happened, one event per outcome, for the incarnation it concerns:

- ``EffectRunner`` executes effects. Starts run on a small thread pool, one lane per group
  (a group's effects run in order, different groups at once); kills and routing run at once
  on the link's thread, so a ``StopGroup`` is never queued behind the hung load it ends. A
  restart boots the group's actors and passes the **digest gate**: every actor must report
  the manifest's weights digest, or the restart failed (never a retry loop).
- ``HealthMonitor`` notices death two ways at once: each up actor has a ``watch()`` call
  outstanding that fails the moment the process dies (reported within a second), and every
  ``probe_interval_s`` all up groups are pinged concurrently under one ``probe_timeout_s``
  (a hang). A new process gets ``grace_s`` before its first probe. It also sends ``Tick``.
- ``RecoveryRuntime`` owns every lifetime: controller, journal, link, runner, monitor,
  exporter and the actors it made. ``with RecoveryRuntime(...) as rt:`` closes them in order
  in a ``finally``, also when the trainer raises.

Ray must be initialised by the caller (``ray.init``); nothing here addresses another host.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import ray
import torch

from .. import ExporterClosed, RecoveryConfig, RecoveryController, RecoveryError
from .. import effects as fx
from .. import events as ev
from ..export import AsyncHFExporter, CheckpointStore, ExportHandle, model_digest
from ..journal import JsonlJournal
from ..ledger import PATHS, Ledger
from ..link import ControllerLink
from ..machines import LOADING, UP
from .engine import ReferenceEngine, WeightsHeld
from .hosting import RemoteController, RemoteLink

log = logging.getLogger(__name__)

Router = Callable[[fx.RouteTraffic | fx.WithdrawTraffic], None]


@attrs.frozen
class Statistics:
    """What the runtime saw, for a trainer's metrics (a snapshot; plain values)."""

    failures_seen: int  # deaths and hangs the monitor reported
    recoveries: Mapping[str, int]  # per path: "immediate", "waited", "cold" (see ledger)
    latency_s: Mapping[str, tuple[float, ...]]  # from the failure to admitted, per path
    effects_in_flight: int
    refused_reports: int  # outcomes the controller refused (a stale incarnation)
    lost_reports: int  # outcomes that could not be reported (logged): should stay 0
    failed_deletes: int  # deletes that failed every attempt (runner.failed, retry_failed)
    loads_from_deleted: int  # deletes of a directory a start was loading from (must be 0)


class SharedRootError(RecoveryError):
    """The checkpoint root is not the same directory on every node a group may restart on."""


def check_shared_root(root: Path, actor_options: Mapping[str, Any], timeout_s: float = 60.0) -> int:
    """Refuse to run unless every alive node a group may be placed on (those with the
    custom ``resources`` the actors ask for) reads the same marker file under ``root``:
    a restart on a node that cannot see the checkpoint would fail at the worst moment.
    Returns how many nodes were checked."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = dict(actor_options.get("resources") or {})
    nodes = [
        n
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in wanted.items())
    ]
    if not nodes:
        raise SharedRootError(f"no alive node offers the resources the groups ask for: {wanted}")
    token = uuid.uuid4().hex
    marker = root / f".recovery-fsm-shared-{token}"
    marker.write_text(token)
    try:
        read = ray.remote(num_cpus=0)(_read_marker)
        refs = [
            read.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(marker))
            for n in nodes
        ]
        seen = ray.get(refs, timeout=timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    pairs = zip(nodes, seen, strict=True)
    blind = [n.get("NodeManagerAddress", n["NodeID"]) for n, s in pairs if s != token]
    if blind:
        raise SharedRootError(
            f"{root} is not shared: nodes {blind} do not see it. Put the checkpoint root on a "
            "filesystem every node mounts at the same path, or restrict the groups to nodes "
            "that do (actor_options resources)"
        )
    return len(nodes)


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


class _Actors:
    """The actor handles of each group's current process, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: dict[str, tuple[int, list[Any]]] = {}
        self.started_at: dict[tuple[str, int], float] = {}
        # Incarnations told to stop, possibly before their actors existed: a boot that
        # comes later must not leave them running.
        self.stopped: set[tuple[str, int]] = set()
        self.closed = False  # the runtime closed: any boot that comes later is killed

    def of(self, group: str, incarnation: int) -> list[Any]:
        with self.lock:
            inc, actors = self.current.get(group, (-1, []))
            return list(actors) if inc == incarnation else []

    def replace(self, group: str, incarnation: int, actors: list[Any]) -> list[Any]:
        """Make ``actors`` the group's current ones; returns the ones to kill: those they
        replace, or ``actors`` themselves if this incarnation was already told to stop."""
        with self.lock:
            if self.closed or (group, incarnation) in self.stopped:
                return actors
            _, old = self.current.get(group, (-1, []))
            self.current[group] = (incarnation, actors)
            self.started_at[(group, incarnation)] = time.monotonic()
            return old

    def renumber(self, group: str, previous: int, incarnation: int) -> None:
        """The group's process ``previous`` goes on as ``incarnation`` (a load in place);
        nothing happens if it was replaced or stopped meanwhile."""
        with self.lock:
            inc, actors = self.current.get(group, (-1, []))
            if inc == previous and actors:
                self.current[group] = (incarnation, actors)
                self.started_at[(group, incarnation)] = self.started_at.get((group, inc), 0.0)

    def take(self, group: str, incarnation: int | None = None) -> list[Any]:
        """Remove (to kill) the group's current actors, or only those of ``incarnation``."""
        with self.lock:
            inc, actors = self.current.get(group, (-1, []))
            if incarnation is not None:
                self.stopped.add((group, incarnation))
                if inc != incarnation:
                    return []
            self.current[group] = (inc, [])
            return actors


def _kill(actors: Iterable[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            log.debug("ray.kill of an actor that is already gone", exc_info=True)


class EffectRunner:
    """Executes the controller's effects on Ray actors and reports their outcomes."""

    def __init__(self, rt: RecoveryRuntime, *, max_parallel: int = 4) -> None:
        self._rt = rt
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="recovery-fsm-run")
        self._lock = threading.Lock()
        self._lanes: dict[str, collections.deque[fx.Effect]] = {}
        self._busy: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._stopped = False
        self._failed: list[fx.Effect] = []  # deletes that failed every attempt
        # Loads in place asked for, per process: a push that overlaps one cannot vouch for
        # what that process holds afterwards (the load may land after the push).
        self.loads_in_place: collections.Counter[tuple[str, int]] = collections.Counter()

    @property
    def failed(self) -> tuple[fx.Effect, ...]:
        """Deletes that failed every attempt; the checkpoint stays on disk until retried."""
        with self._lock:
            return tuple(self._failed)

    def retry_failed(self) -> int:
        """Queue the failed deletes again; returns how many."""
        with self._lock:
            failed, self._failed = self._failed, []
        for effect in failed:
            self.execute(effect)
        return len(failed)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def stop(self, timeout: float | None = None) -> bool:
        """Stop starting work: the starts and deletes running now finish (True if within
        ``timeout``), the others wait in their lanes, in order, until ``start()``. Kills,
        routing and cancels still run at once: a stop must never hold the kill that ends a
        hung load, nor keep traffic on a dead group."""
        with self._lock:
            self._stopped = True
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def start(self) -> None:
        """Run what waits in the lanes, each effect once, in the order it came."""
        with self._lock:
            self._stopped = False
            for lane, queue in self._lanes.items():
                if queue and lane not in self._busy:
                    self._busy.add(lane)
                    self._pool.submit(self._drain, lane)

    def execute(self, effect: fx.Effect) -> None:
        """Called by the link, one effect at a time: must not block."""
        match effect:
            case fx.RouteTraffic() | fx.WithdrawTraffic():
                self._rt._route(effect)
            case fx.StopGroup(group=g, incarnation=inc):
                _kill(self._rt._actors.take(g, inc))
            case fx.RetireGroup(group=g):
                _kill(self._rt._actors.take(g))
            case fx.CancelExport(version=v):
                self._rt.exporter.cancel(v)
            case fx.LoadCheckpoint(group=g, incarnation=inc, previous=previous):
                with self._lock:
                    self.loads_in_place[(g, previous)] += 1
                self._rt._actors.renumber(g, previous, inc)  # the same actors, a new number
                self._queue(f"group:{g}", effect)
            case fx.RestartFromCheckpoint(group=g) | fx.RestartCold(group=g):
                self._queue(f"group:{g}", effect)
            case fx.DeleteCheckpoint(version=v):
                self._queue(f"checkpoint:{v}", effect)
            case _:
                raise TypeError(f"no executor for {effect!r}")

    def _queue(self, lane: str, effect: fx.Effect) -> None:
        with self._lock:
            self._lanes.setdefault(lane, collections.deque()).append(effect)
            self._in_flight += 1
            if lane not in self._busy and not self._stopped:
                self._busy.add(lane)
                self._pool.submit(self._drain, lane)

    def _drain(self, lane: str) -> None:
        while True:
            with self._lock:
                queue = self._lanes[lane]
                if not queue or self._stopped:
                    self._busy.discard(lane)
                    self._idle.notify_all()
                    return
                effect = queue.popleft()
            try:
                self._run(effect)
            except BaseException:
                log.exception("executing %r raised", effect)
            finally:
                with self._lock:
                    self._in_flight -= 1

    def _run(self, effect: fx.Effect) -> None:
        """Run one effect; a start's outcome is reported whatever raises on the way."""
        match effect:
            case (
                fx.RestartFromCheckpoint(group=g, incarnation=inc)
                | fx.LoadCheckpoint(group=g, incarnation=inc)
                | fx.RestartCold(group=g, incarnation=inc)
            ):
                try:
                    self._start(effect)
                except Exception as err:
                    log.exception("starting %r raised", effect)
                    _kill(self._rt._actors.take(g, inc))
                    failed = (
                        ev.RelaunchFailed
                        if isinstance(effect, fx.RestartCold)
                        else ev.RestartLoadFailed
                    )
                    self._rt._report(failed, group=g, incarnation=inc,
                                     error=f"{type(err).__name__}: {err}"[:500])  # fmt: skip
            case _:
                self._start(effect)

    def _start(self, effect: fx.Effect) -> None:
        rt = self._rt
        match effect:
            case (
                fx.RestartFromCheckpoint(group=g, incarnation=inc, path=path)
                | fx.LoadCheckpoint(group=g, incarnation=inc, path=path)
            ):
                # A restart boots new actors; a load in place uses the running ones.
                start = rt._boot if isinstance(effect, fx.RestartFromCheckpoint) else rt._call_all
                with rt._stats_lock:
                    rt._loading[path] += 1
                    if path in rt._deleted_paths:
                        rt.loads_from_deleted += 1  # the leases failed: say so, loudly
                        log.error("a start loads %s, which was deleted", path)
                try:
                    outcome = start(g, inc, lambda a: a.boot_from_checkpoint.remote(path))
                finally:
                    with rt._stats_lock:
                        rt._loading[path] -= 1
                if isinstance(outcome, str):
                    error: str | None = outcome
                else:
                    expected = rt.store.read_manifest(path)
                    error = _digest_gate(outcome, expected["weights_digest"])
                if error is None:
                    rt._report(ev.RestartLoaded, group=g, incarnation=inc)
                else:
                    _kill(rt._actors.take(g, inc))
                    rt._report(ev.RestartLoadFailed, group=g, incarnation=inc, error=error)
            case fx.RestartCold(group=g, incarnation=inc):
                outcome = rt._boot(g, inc, lambda a: a.boot_empty.remote())
                if isinstance(outcome, str):
                    _kill(rt._actors.take(g, inc))
                    rt._report(ev.RelaunchFailed, group=g, incarnation=inc, error=outcome)
                else:
                    rt._report(ev.Relaunched, group=g, incarnation=inc)
            case fx.DeleteCheckpoint(version=v, path=path):
                with rt._stats_lock:
                    if rt._loading[path]:
                        rt.loads_from_deleted += 1  # the leases failed: say so, loudly
                        log.error("deleting %s while a start loads from it", path)
                for attempt in range(rt.delete_attempts):
                    try:
                        rt.store.delete(path)
                    except FileNotFoundError:
                        pass  # already gone: that is the outcome asked for
                    except Exception:
                        log.warning("delete of %s failed (attempt %d)", path, attempt + 1,
                                    exc_info=True)  # fmt: skip
                        time.sleep(min(2.0, 0.1 * 2**attempt))
                        continue
                    with rt._stats_lock:
                        rt._deleted_paths.add(path)
                    rt._report(ev.CheckpointDeleted, version=v)
                    return
                # The core has no event for it: kept (statistics, retry_failed) and logged.
                with self._lock:
                    self._failed.append(effect)
                log.error("could not delete %s in %d attempts; kept for retry_failed()",
                          path, rt.delete_attempts)  # fmt: skip

    def close(self, timeout: float | None = None) -> bool:
        """Wait for every queued effect to finish; True if they did in time."""
        with self._lock:
            done = self._idle.wait_for(lambda: not self._busy, timeout)
        self._pool.shutdown(wait=done)
        return done


def _digest_gate(held: list[WeightsHeld], expected: str) -> str | None:
    """None if every actor holds exactly the expected weights, else why not."""
    wrong = [h.digest for h in held if h.digest != expected]
    if wrong:
        return f"digest gate: {len(wrong)} of {len(held)} actors hold other weights"
    return None


class HealthMonitor:
    """Detects death (watch calls) and hangs (concurrent probes) of up groups; sends Tick."""

    def __init__(
        self,
        rt: RecoveryRuntime,
        *,
        tick_s: float,
        probe_interval_s: float,
        probe_timeout_s: float,
        grace_s: float,
    ) -> None:
        self._rt = rt
        self.tick_s = tick_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._watches: dict[Any, tuple[str, int]] = {}  # ObjectRef -> (group, incarnation)
        # (group, incarnation, actor index) watched once: a watch call stays outstanding
        # while that process lives, also through a load in place.
        self._watched: set[tuple[str, int, int]] = set()  # (group, incarnation, actor index)
        self._thread = threading.Thread(target=self._loop, name="recovery-fsm-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        """No probes while paused (engines offloaded during training); death is still seen."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        next_probe = time.monotonic() + self.probe_interval_s
        while not self._stop.is_set():
            try:
                self._rt._report(ev.Tick)
                up = self._rt.controller.up_groups()
                self._arm_watches(up)
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.probe_interval_s
                    if not self._paused.is_set():
                        self._probe(up)
                self._wait_for_death(min(self.tick_s, max(0.0, next_probe - time.monotonic())))
            except Exception:
                log.exception("health monitor round failed; going on")
                self._stop.wait(self.tick_s)

    def _arm_watches(self, up: Mapping[str, int]) -> None:
        for g, inc in up.items():
            for i, actor in enumerate(self._rt._actors.of(g, inc)):
                if (g, inc, i) not in self._watched:
                    self._watched.add((g, inc, i))
                    self._watches[actor.watch.remote()] = (g, inc)

    def _wait_for_death(self, timeout: float) -> None:
        if not self._watches:
            self._stop.wait(timeout)
            return
        ready, _ = ray.wait(list(self._watches), num_returns=1, timeout=timeout)
        for ref in ready:
            g, inc = self._watches.pop(ref)
            now = self._rt.controller.group(g)
            # Up, or loading a checkpoint in place: the same process, still the group's.
            if now.incarnation == inc and now.state in UP | LOADING:
                self._rt._report(ev.GroupFailed, group=g, incarnation=inc, reason="actor died")
                self._rt._saw_failure(g)
        # Watches of replaced processes are dropped (their actors are gone or going).
        current = {n: v.incarnation for n, v in self._rt.controller.groups().items()}
        for ref, (g, inc) in list(self._watches.items()):
            if current.get(g) != inc:
                del self._watches[ref]

    def _probe(self, up: Mapping[str, int]) -> None:
        now = time.monotonic()
        pings: dict[tuple[str, int], list[Any]] = {}
        serving = {n: v.state for n, v in self._rt.controller.groups().items()}
        for g, inc in up.items():
            if serving.get(g) not in ("active", "suspect"):
                continue  # a group waiting for weights takes no probe verdicts
            started = self._rt._actors.started_at.get((g, inc), 0.0)
            actors = self._rt._actors.of(g, inc)
            if actors and now - started >= self.grace_s:
                pings[(g, inc)] = [a.ping.remote() for a in actors]
        refs = [r for rs in pings.values() for r in rs]
        if not refs:
            return
        # One round costs one timeout, however many groups there are.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_timeout_s)
        done = set(ready)
        for (g, inc), rs in pings.items():
            ok = all(r in done for r in rs) and all(_answered(r) for r in rs)
            if ok:
                self._rt._report(ev.ProbeOk, group=g, incarnation=inc)
            else:
                self._rt._report(ev.ProbeFailed, group=g, incarnation=inc)
                if self._rt.controller.up_groups().get(g) != inc:
                    self._rt._saw_failure(g)  # that miss was the one too many


def _answered(ref: Any) -> bool:
    try:
        return bool(ray.get(ref, timeout=0))
    except Exception:
        return False


class RecoveryRuntime:
    """Everything between the controller and the Ray actors, with one owner of every lifetime.

    ``groups`` names the worker groups; each is ``actors_per_group`` actors of ``engine``
    (the reference engine by default) built from ``model_config`` (a config as a dict) and
    restarted together. ``router`` receives every ``RouteTraffic``/``WithdrawTraffic``.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        groups: Iterable[str],
        model_config: Mapping[str, Any],
        config: RecoveryConfig | None = None,
        engine: type = ReferenceEngine,
        actors_per_group: int = 1,
        actor_options: Mapping[str, Any] | None = None,
        journal: str | Path | None = None,
        router: Router | None = None,
        tick_s: float = 1.0,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 2.0,
        grace_s: float = 5.0,
        call_timeout_s: float = 120.0,
        max_parallel: int | None = None,
        delete_attempts: int = 5,
        initial_version: int = 0,
        exporter_options: Mapping[str, Any] | None = None,
        controller_actor: Any = None,
    ) -> None:
        self.groups = list(groups)
        self.model_config = dict(model_config)
        self.config = config or RecoveryConfig()
        self.actors_per_group = actors_per_group
        self.actor_options = {"num_cpus": 0.1, **(actor_options or {})}
        self.call_timeout_s = call_timeout_s
        self.delete_attempts = delete_attempts
        self.routes: dict[str, tuple[int, int] | None] = {}  # group -> (incarnation, version)
        self.failures_seen = 0
        self.loads_from_deleted = 0  # loads of a deleted path, or deletes under a load (0!)
        self._deleted_paths: set[str] = set()
        self._loading: collections.Counter[str] = collections.Counter()  # path -> starts
        self._refused = 0
        self._lost_reports = 0
        self._stats_lock = threading.Lock()
        self._router = router
        # Probes and watches get their own threads, so they answer beside a load.
        self._engine: Any = ray.remote(concurrency_groups={"health": 1, "watch": 1})(  # type: ignore[call-overload]
            engine
        )
        self._actors = _Actors()
        self._journal = JsonlJournal(journal) if journal is not None else None
        self._journal_path = journal
        # Every record the controller journals, folded (metrics, reports, timelines).
        self.ledger = Ledger()
        self.store = CheckpointStore(root)
        # One lane per group and one for deletes: a hung load never holds another group's.
        self.runner = EffectRunner(self, max_parallel=max_parallel or len(self.groups) + 1)
        self.exporter = AsyncHFExporter(
            self.store, report=self._report_export, **(exporter_options or {})
        )
        self.controller: RecoveryController | RemoteController
        self.link: ControllerLink | RemoteLink
        if controller_actor is None:
            self.controller = RecoveryController(
                self.config, initial_version=initial_version, journal=self._record
            )
            self.link = ControllerLink(self.controller, execute=self.runner_execute)
        else:  # hosted by a RecoveryControllerActor, which keeps its own journal
            self.controller = RemoteController(controller_actor)
            self.link = RemoteLink(controller_actor, execute=self.runner_execute)
        self.initial_version = initial_version
        self.monitor = HealthMonitor(
            self, tick_s=tick_s, probe_interval_s=probe_interval_s,
            probe_timeout_s=probe_timeout_s, grace_s=grace_s,
        )  # fmt: skip
        self._closed = False

    # -- the trainer's side ------------------------------------------------------------------

    def runner_execute(self, effect: fx.Effect) -> None:
        self.runner.execute(effect)

    def start(self, model: Any) -> None:
        """Boot every group with ``model``'s weights (``initial_version``), then watch."""
        version = self.initial_version
        check_shared_root(self.store.root, self.actor_options)
        weights = ray.put(_cpu_state(model))
        digest = model_digest(model)
        # A registered group's first process is incarnation 1 (the controller's count). The
        # groups boot at once; they register one by one, in order.
        with ThreadPoolExecutor(len(self.groups) or 1) as pool:
            booted = list(pool.map(lambda g: self._boot(g, 1, lambda a: a.boot_empty.remote()),
                                   self.groups))  # fmt: skip
        for g, held in zip(self.groups, booted, strict=True):
            if isinstance(held, str):
                raise RuntimeError(f"group {g} did not boot: {held}")
            pushed = self._call_all(g, 1, lambda a: a.update_weights.remote(version, weights))
            if isinstance(pushed, str) or _digest_gate(pushed, digest):
                raise RuntimeError(f"group {g} did not take the initial weights: {pushed}")
            self._report(ev.GroupRegistered, group=g, version=version)
            if self.controller.incarnation(g) != 1:
                raise RuntimeError(f"the controller numbered {g}'s first process otherwise")
        self.monitor.start()

    def sync(self, model: Any, version: int) -> dict[str, int]:
        """A weight sync to ``version``: ``push``, then ``synced`` (report and export).
        Returns the incarnations that took ``version``."""
        if self.exporter.closed:  # before anything is pushed or reported
            raise ExporterClosed(f"sync({version}) after the runtime's exporter was closed")
        got = self.push(model, version)
        self.synced(version, got, model)
        return got

    def push(self, model: Any, version: int) -> dict[str, int]:
        """Push ``model``'s weights to every up group through the object store (one
        ``ray.put`` shared by all) and return the incarnations whose digest matches the
        trainer's. Reports nothing: a trainer with its own push skips this."""
        weights = ray.put(_cpu_state(model))
        digest = model_digest(model)
        with self.runner._lock:  # before the snapshot of who is up (see below)
            loads_before = dict(self.runner.loads_in_place)
        up = self.controller.up_groups()
        calls = {
            (g, inc): [a.update_weights.remote(version, weights) for a in self._actors.of(g, inc)]
            for g, inc in up.items()
        }
        every = [r for refs in calls.values() for r in refs]
        # One timeout for the whole push, however many groups: a hung one costs no more.
        done, _ = ray.wait(every, num_returns=len(every), timeout=self.call_timeout_s)
        finished = set(done)
        got: dict[str, int] = {}
        for (g, inc), refs in calls.items():
            try:
                if not refs or not all(r in finished for r in refs):
                    raise TimeoutError(f"no answer in {self.call_timeout_s} s")
                held = ray.get(refs, timeout=0)
            except Exception as err:
                log.warning("weight push to %s#%d failed: %s", g, inc, err)
                continue
            with self.runner._lock:
                overlapped = self.runner.loads_in_place[(g, inc)] != loads_before.get((g, inc), 0)
            if overlapped:  # a load in place may have replaced these weights since
                log.info("push of %d to %s#%d overlapped a load in place: not reported", version,
                         g, inc)  # fmt: skip
            elif _digest_gate(held, digest) is None:
                got[g] = inc
        return got

    def synced(
        self,
        version: int,
        groups: Mapping[str, int],
        model: Any,
        *,
        pinned: bool = False,
        config: Any = None,
        tokenizer: Any = None,
    ) -> ExportHandle:
        """Report that ``groups`` (name -> incarnation) took ``version``, then export it as
        its recovery checkpoint (``pinned``: never deleted; ``tokenizer``: saved beside it).
        ``model`` is a transformers model, or full weights in the hub layout (gathered from
        FSDP or Megatron shards) with their ``config``."""
        if self.exporter.closed:
            raise ExporterClosed(f"synced({version}) after the runtime's exporter was closed")
        # Sent directly: a refusal (an unknown group, a version not above the fleet's) is
        # the trainer's mistake and reaches it, before anything is exported.
        self.link.send(ev.WeightsSynced, version=version, groups=dict(groups))
        if isinstance(model, Mapping):
            return self.exporter.export(
                version, model, config=config, pinned=pinned, tokenizer=tokenizer
            )
        return self.exporter.export_model(version, model, pinned=pinned, tokenizer=tokenizer)

    def generate(self, group: str, prompt: list[int], max_new_tokens: int = 8) -> Any:
        """Generate on the group's first actor (its current process)."""
        actors = self._actors.of(group, self.controller.incarnation(group))
        if not actors:
            raise RuntimeError(f"group {group} has no process up")
        return ray.get(actors[0].generate.remote(prompt, max_new_tokens),
                       timeout=self.call_timeout_s)  # fmt: skip

    def kill(self, group: str) -> int:
        """Chaos: kill the group's current process through Ray (as a crash would); returns
        the incarnation killed."""
        inc = self.controller.incarnation(group)
        _kill(self._actors.of(group, inc))
        return inc

    def actors(self, group: str, incarnation: int | None = None) -> list[Any]:
        """The actor handles of a group's process (default: its current incarnation); empty
        once that process was stopped."""
        inc = self.controller.incarnation(group) if incarnation is None else incarnation
        return self._actors.of(group, inc)

    def statistics(self) -> Statistics:
        latency = {p: tuple(self.ledger.latencies(p)) for p in PATHS}
        return Statistics(
            self.failures_seen,
            {p: len(v) for p, v in latency.items() if v},
            {p: v for p, v in latency.items() if v},
            self.runner.in_flight,
            self._refused,
            self._lost_reports,
            len(self.runner.failed),
            self.loads_from_deleted,
        )

    def close(self, *, drain_timeout_s: float = 60.0) -> bool:
        """Stop in order: monitor, exporter (flush), Shutdown, drain, runner, actors,
        journal. Returns whether the controller drained in time."""
        if self._closed:
            return True
        self._closed = True
        drained = False
        try:
            self.monitor.stop()
            self.runner.start()  # a stopped runner runs what it holds: the drain needs it
            self.exporter.close(cancel=True)  # an export in flight now would be stale at once
            if not self.controller.closed:
                self._report(ev.Shutdown)
            # Shutdown stops every process; what is owed (a load's outcome, a delete)
            # arrives from the runner meanwhile.
            deadline = time.monotonic() + drain_timeout_s
            while not self.controller.drained and time.monotonic() < deadline:
                self.link.join(0.5)
                time.sleep(0.05)
            drained = self.controller.drained
            self.link.close(timeout=drain_timeout_s)
            self.runner.close(timeout=drain_timeout_s)
        finally:
            with self._actors.lock:
                self._actors.closed = True
            for g in list(self._actors.current):
                _kill(self._actors.take(g))
            if self._journal is not None:
                self._journal.close()
        return drained

    def __enter__(self) -> RecoveryRuntime:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the adapters' side ------------------------------------------------------------------

    def _report(self, cls: type[ev.Event], **fields: Any) -> None:
        """Send an outcome; a refusal (a stale incarnation, a closed controller) is logged."""
        for attempt in range(3):
            try:
                self.link.send(cls, **fields)
                return
            except RecoveryError as err:
                with self._stats_lock:
                    self._refused += 1
                log.info("the controller refused %s%s: %s", cls.__name__, fields, err)
                return
            except Exception:  # the controller actor did not answer in time: try again
                log.warning("reporting %s%s failed (attempt %d)", cls.__name__, fields,
                            attempt + 1, exc_info=True)  # fmt: skip
                time.sleep(0.5 * 2**attempt)
        with self._stats_lock:
            self._lost_reports += 1
        log.error("reporting %s%s failed for good", cls.__name__, fields)

    def _report_export(self, cls: type[ev.Event], **fields: Any) -> None:
        self.link.send(cls, **fields)

    def _saw_failure(self, _group: str) -> None:
        with self._stats_lock:
            self.failures_seen += 1

    def _record(self, record: dict[str, Any]) -> None:
        """The controller's journal sink: the ledger first (it cannot fail), then the file."""
        self.ledger.add(record)
        if self._journal is not None:
            self._journal(record)

    def _route(self, effect: fx.RouteTraffic | fx.WithdrawTraffic) -> None:
        if isinstance(effect, fx.RouteTraffic):
            self.routes[effect.group] = (effect.incarnation, effect.version)
        else:
            self.routes[effect.group] = None
        if self._router is not None:
            self._router(effect)

    def _boot(self, group: str, incarnation: int, call: Callable[[Any], Any]) -> Any:
        """Start the group's actors for ``incarnation`` (killing any older ones) and run
        ``call`` on each; the results, or why it failed."""
        actors = [
            self._engine.options(**self.actor_options).remote(self.model_config, group, incarnation)
            for _ in range(self.actors_per_group)
        ]
        _kill(self._actors.replace(group, incarnation, actors))
        return self._call_all(group, incarnation, call)

    def _call_all(self, group: str, incarnation: int, call: Callable[[Any], Any]) -> Any:
        actors = self._actors.of(group, incarnation)
        if not actors:
            return "stopped before it started"
        try:
            return ray.get([call(a) for a in actors], timeout=self.call_timeout_s)
        except Exception as err:
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _cpu_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
