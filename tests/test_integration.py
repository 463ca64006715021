"""Done when: a trainer, a health manager, a real exporter and an adapter, each on its own
thread, drive one controller through a ControllerLink while the journal sink, the adapter's
execute and the exporter's report callback fail at random, and the run still shuts down
drained: no lease, no broken invariant, no unpinned checkpoint left on disk.

Nothing here is mocked: the controller, the link's dispatcher and the AsyncHFExporter writing
safetensors to ``tmp_path`` are the real ones; only the worker processes are simulated (a
restart "loads" after a short random delay and sometimes fails).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

torch = pytest.importorskip("torch")

from recovery_fsm import (  # noqa: E402  (after the torch check)
    CancelExport,
    DeleteCheckpoint,
    Effect,
    EventNotAllowed,
    LoadCheckpoint,
    RecoveryConfig,
    RecoveryController,
    RecoveryError,
    RestartCold,
    RestartFromCheckpoint,
    RetireGroup,
    RouteTraffic,
    StopGroup,
    WithdrawTraffic,
    WrongIncarnation,
)
from recovery_fsm import events as ev  # noqa: E402
from recovery_fsm.export import AsyncHFExporter, CheckpointStore  # noqa: E402
from recovery_fsm.host import ControllerLink  # noqa: E402
from recovery_fsm.rules import FINISHED_KEPT  # noqa: E402

SEED = 7
STEPS = 60
GROUPS = ("g1", "g2", "g3", "g4")
FAULT_RATE = 0.15
DRAIN_TIMEOUT = 15.0
SERVING = {"active", "suspect"}


class InjectedFault(RuntimeError):
    """Raised on purpose by the test; anything else that raises is a real failure."""


class Faults:
    """Seeded coin flips, one stream per site (so one site's calls do not shift another's),
    counted so the test can check that every kind of fault really fired."""

    def __init__(self, seed: int, rate: float) -> None:
        self._seed = seed
        self._rate = rate
        self._rngs: dict[str, random.Random] = {}
        self._lock = threading.Lock()
        self.fired: collections.Counter[str] = collections.Counter()
        self.enabled = True

    def maybe(self, site: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            rng = self._rngs.setdefault(site, random.Random(f"{self._seed}:{site}"))
            hit = rng.random() < self._rate
            if hit:
                self.fired[site] += 1
        if hit:
            raise InjectedFault(f"injected fault at {site}")


class FlakyJournal:
    """A journal sink that loses records at random (never the header, so the step numbers
    of what it keeps can be checked against the ``lost`` markers)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.records: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        if "header" not in record:
            self.faults.maybe("journal")
        self.records.append(record)


class Adapter:
    """Executes effects on the link's dispatcher thread. It raises (at random) before doing
    any work, so a retry does the whole job once; a slow start reports from its own thread,
    as a real process would."""

    def __init__(self, store: CheckpointStore, faults: Faults, seed: int) -> None:
        self.store = store
        self.faults = faults
        self.rng = random.Random(seed)
        self.link: ControllerLink | None = None
        self.exporter: AsyncHFExporter | None = None
        self.lock = threading.Lock()
        self.routes: dict[str, int] = {}  # the router: group -> incarnation it sends to
        self.retired: set[str] = set()
        self.deleted: list[int] = []
        self.stale: list[RecoveryError] = []  # refused reports of starts already superseded
        self.crashes: list[BaseException] = []  # anything unexpected on a reporter thread
        self.reporters: list[threading.Thread] = []
        self.done: collections.Counter[str] = collections.Counter()  # effects executed
        # Cleared to hold every simulated process's report (to stop groups mid-start).
        self.reports_open = threading.Event()
        self.reports_open.set()

    def execute(self, effect: Effect) -> None:
        assert self.link is not None and self.exporter is not None
        self.faults.maybe("execute")
        c = self.link.controller
        if isinstance(effect, (RestartFromCheckpoint, LoadCheckpoint)):
            self._report_later(effect.group, effect.incarnation, ev.RestartLoaded,
                               ev.RestartLoadFailed)  # fmt: skip
        elif isinstance(effect, RestartCold):
            self._report_later(effect.group, effect.incarnation, ev.Relaunched, ev.RelaunchFailed)
        elif isinstance(effect, DeleteCheckpoint):
            self.store.delete(effect.path)
            self.link.send(ev.CheckpointDeleted, version=effect.version)
            with self.lock:
                self.deleted.append(effect.version)
        elif isinstance(effect, CancelExport):
            # False when that export is no longer the one writing: it already ended (its
            # outcome is reported) or a newer export cancelled it (it reports ExportCancelled).
            self.exporter.cancel(effect.version)
        elif isinstance(effect, RouteTraffic):
            # A retried RouteTraffic runs after effects queued later (retry_failed queues it
            # at the back): route only if that process still serves, or a stale retry would
            # route to a dead process.
            view = c.group(effect.group)
            with self.lock:
                if view.incarnation == effect.incarnation and view.state in SERVING:
                    self.routes[effect.group] = effect.incarnation
        elif isinstance(effect, WithdrawTraffic):
            with self.lock:
                if self.routes.get(effect.group) == effect.incarnation:
                    del self.routes[effect.group]
        elif isinstance(effect, RetireGroup):
            with self.lock:
                self.retired.add(effect.group)
        elif isinstance(effect, StopGroup):
            pass  # the simulated process reports its start's outcome (if any) on its own
        else:  # pragma: no cover - a new effect kind this adapter does not know
            raise AssertionError(f"unexpected effect {effect!r}")
        with self.lock:
            self.done[effect.kind] += 1

    def _report_later(
        self,
        group: str,
        incarnation: int,
        ok: type[ev.Event],
        failed: type[ev.Event],
    ) -> None:
        with self.lock:
            delay = self.rng.uniform(0.001, 0.02)
            outcome = failed if self.rng.random() < 0.1 else ok

        def report() -> None:
            assert self.link is not None
            time.sleep(delay)  # the simulated load; nothing is asserted on its timing
            self.reports_open.wait(DRAIN_TIMEOUT)
            try:
                self.link.send(outcome, group=group, incarnation=incarnation)
            except (WrongIncarnation, EventNotAllowed) as err:
                # That start was ended before it reported (the health manager killed it):
                # a real process would be gone; this one still says something, and is refused.
                with self.lock:
                    self.stale.append(err)
            except BaseException as err:
                with self.lock:
                    self.crashes.append(err)

        t = threading.Thread(target=report, name=f"start-{group}#{incarnation}", daemon=True)
        with self.lock:
            self.reporters.append(t)
        t.start()

    def join_reporters(self) -> None:
        while True:
            with self.lock:
                alive = [t for t in self.reporters if t.is_alive()]
            if not alive:
                return
            for t in alive:
                t.join(5.0)


class Reporter:
    """The exporter's ``report``, with a callback that fails at random.

    Where the fault lands decides what it means, so it is placed where a real failure is
    survivable:

    * ExportStarted (on the trainer's thread) fails BEFORE link.send: ``export()`` raises and
      the export never runs, and the controller never heard of it. Consistent both ways.
      (Failing after the send would leave the controller waiting for an export that
      ``export()`` dropped: nobody would ever report its outcome.)
    * The outcomes (on the writer thread) fail AFTER link.send succeeded: the callback's own
      post-processing failed, the controller has the event, and the exporter keeps the error
      in ``report_errors``. A failure BEFORE the send would lose the outcome for good (the
      writer thread does not retry), so the controller would wait forever for an export that
      already committed: at-least-once delivery is the report callback's job, not something
      this test could assert around honestly.
    """

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.link: ControllerLink | None = None
        self.lock = threading.Lock()
        self.delivered_then_failed: list[tuple[str, int]] = []
        self.delivered: collections.Counter[str] = collections.Counter()

    def __call__(self, cls: type[ev.Event], **fields: Any) -> None:
        assert self.link is not None
        if cls is ev.ExportStarted:
            self.faults.maybe("report:start")
            self.link.send(cls, **fields)
            return
        self.link.send(cls, **fields)
        with self.lock:
            self.delivered[cls.__name__] += 1
        try:
            self.faults.maybe("report:outcome")
        except InjectedFault:
            with self.lock:
                self.delivered_then_failed.append((cls.__name__, fields["version"]))
            raise


def _run_thread(
    name: str, body: Callable[[], None], errors: list[BaseException]
) -> threading.Thread:
    def target() -> None:
        try:
            body()
        except BaseException as err:  # reported by the test
            errors.append(err)

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t


class SlowDisk:
    """The exporter's file opener: a disk that stalls now and then (so a newer export or a
    CancelExport lands mid-write) and fails now and then (so exports fail too)."""

    def __init__(self, faults: Faults, seed: int) -> None:
        self.faults = faults
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def __call__(self, path: str | os.PathLike[str]) -> BinaryIO:
        self.faults.maybe("disk")
        with self.lock:
            delay = self.rng.uniform(0.02, 0.05) if self.rng.random() < 0.05 else 0.0
        time.sleep(delay)  # latency only; nothing is asserted on it
        return open(path, "xb")


def test_threads_faults_and_a_real_exporter_still_drain(tmp_path: Path) -> None:
    root = tmp_path / "recovery"
    faults = Faults(SEED, FAULT_RATE)
    journal = FlakyJournal(faults)
    controller = RecoveryController(
        RecoveryConfig(restart_budget=8, clean_syncs_to_reenable=1, await_checkpoint_timeout_s=0.2),
        journal=journal,
    )
    adapter = Adapter(CheckpointStore(root), faults, SEED)
    link = ControllerLink(controller, execute=adapter.execute)
    adapter.link = link
    reporter = Reporter(faults)
    reporter.link = link
    exporter = AsyncHFExporter(
        root,
        report=reporter,
        fsync=False,
        write_threads=2,
        max_shard_size=600,  # a few shards, so a cancel can land between two files
        opener=SlowDisk(Faults(SEED, 0.05), SEED + 3),
    )
    adapter.exporter = exporter
    thread_errors: list[BaseException] = []
    skipped_exports: list[int] = []
    demotions: list[int] = []  # syncs that left a serving group out
    stop_health = threading.Event()

    for g in GROUPS:
        link.send(ev.GroupRegistered, group=g, version=0)

    def trainer() -> None:
        rng = random.Random(SEED + 1)
        weights = {
            "embed.weight": torch.zeros(16, 8),
            "layers.0.weight": torch.zeros(8, 8),
            "layers.0.bias": torch.zeros(8),
        }
        for step in range(1, STEPS + 1):
            for t in weights.values():
                t.fill_(float(step))
            effects = link.send(ev.WeightsSynced, version=step, groups=controller.up_groups())
            # up_groups() named every process that serves, so none is demoted, except one
            # that came up between that read and the send (a window of microseconds).
            if any(isinstance(e, WithdrawTraffic) for e in effects):
                demotions.append(step)
            try:
                exporter.export(step, weights, pinned=step % 10 == 5)
            except InjectedFault:
                skipped_exports.append(step)  # the controller never heard of it either
            time.sleep(rng.uniform(0.005, 0.03))  # pacing only

    def health() -> None:
        rng = random.Random(SEED + 2)
        while not stop_health.wait(rng.uniform(0.03, 0.08)):
            # g4 is killed most often: it spends its restart budget and is retired.
            (g,) = rng.choices(GROUPS, weights=(1, 1, 1, 4))
            # Refused when it is not up to be killed (already down, restarting, or retired).
            with contextlib.suppress(WrongIncarnation, EventNotAllowed):
                link.send(ev.GroupFailed, group=g, incarnation=controller.incarnation(g),
                          reason="killed")  # fmt: skip

    started = time.monotonic()
    trainer_thread = _run_thread("trainer", trainer, thread_errors)
    health_thread = _run_thread("health", health, thread_errors)

    # The supervisor: retry what failed, and let time pass (deadlines fire on Tick).
    while trainer_thread.is_alive():
        link.retry_failed()
        link.send(ev.Tick)
        trainer_thread.join(0.01)
    stop_health.set()
    health_thread.join(5.0)
    assert not health_thread.is_alive()
    assert thread_errors == []

    # Shut down with starts in flight: kill every group that serves, and hold the new
    # processes' reports until after Shutdown, so their outcomes arrive for stopped groups.
    adapter.reports_open.clear()
    for g, incarnation in controller.up_groups().items():
        link.send(ev.GroupFailed, group=g, incarnation=incarnation, reason="last kill")
    in_flight = [s for s in controller.outstanding() if "has not reported" in s]
    assert in_flight, controller.outstanding()
    link.send(ev.Shutdown)
    adapter.reports_open.set()

    deadline = time.monotonic() + DRAIN_TIMEOUT
    while not controller.drained and time.monotonic() < deadline:
        link.retry_failed()
        link.send(ev.Tick)
        link.join(0.02)
    assert controller.drained, controller.outstanding()

    # Drained means nothing is owed by the world; effects that failed may still wait for a
    # retry (a withdraw, a stop, the start of a process that was killed meanwhile).
    for _ in range(100):
        adapter.join_reporters()
        assert link.join(5.0)
        if not link.retry_failed():
            adapter.join_reporters()
            if link.join(5.0) and not link.errors and link.pending == 0:
                break
    assert link.errors == ()
    assert link.close(5.0)
    exporter.close()

    # The controller ended clean.
    assert controller.broken is None
    assert controller.drained
    assert controller.leases == {}
    assert controller.check_invariants() == []
    assert adapter.crashes == []
    assert controller.version == STEPS
    assert all(v.state in {"stopped", "retired"} for v in controller.groups().values())
    assert adapter.routes == {}, "the router still sends traffic to a stopped process"
    assert adapter.retired == {g for g, v in controller.groups().items() if v.state == "retired"}
    assert len(demotions) <= 2, f"syncs to up_groups() left serving groups out: {demotions}"
    # And they reach the processes that came up cold: those are admitted by a sync.
    admitted_by_sync = [
        r["step"]
        for r in journal.records
        if r.get("event", {}).get("kind") == "WeightsSynced"
        and any(t[1] == "sync" and t[3] == "active" for t in r.get("transitions", []))
    ]
    assert admitted_by_sync, "no sync ever admitted a relaunched process"
    # What is left is what the user keeps: pinned, no longer a recovery source.
    remaining = controller.checkpoints().values()
    assert all(v.pinned and v.state == "superseded" for v in remaining), remaining

    # On disk: exactly those, each intact; no temporaries.
    kept = {Path(v.path).name for v in remaining if v.path is not None}
    on_disk = {p.name for p in root.iterdir()}
    assert on_disk == kept
    for name in kept:
        CheckpointStore(root).verify(root / name, full=True)

    # The exporter's failed reports are exactly the injected ones, and each of those events
    # reached the controller before the callback failed.
    errors = exporter.report_errors
    assert all(isinstance(e.error, InjectedFault) for e in errors), errors
    assert sorted((e.event, e.version) for e in errors) == sorted(reporter.delivered_then_failed)
    for _event, version in reporter.delivered_then_failed:
        if version not in controller.rules.finished and version not in controller.checkpoints():
            # Only final states are forgotten, the oldest first: a bounded memory.
            assert len(controller.rules.finished) == FINISHED_KEPT
            assert version < min(controller.rules.finished)
            continue
        assert controller.checkpoint_state(version) in {"deleted", "discarded", "superseded",
                                                        "failed"}  # fmt: skip

    # The journal: every lost record is accounted for by the next record's "lost" marker.
    faults.enabled = False
    link.send(ev.Tick)  # one more record, written, so it carries any trailing loss
    assert controller.journal_failures == faults.fired["journal"]
    assert journal.records[0]["step"] == 0
    for prev, record in itertools.pairwise(journal.records):
        assert record["step"] - prev["step"] - 1 == record.get("lost", 0), record
    assert sum(r.get("lost", 0) for r in journal.records) == controller.journal_failures

    # Every kind of fault really fired, so the run above proves something.
    for site in ("journal", "execute", "report:start", "report:outcome"):
        assert faults.fired[site] > 0, f"no fault fired at {site}: {faults.fired}"
    assert skipped_exports  # report:start faults cost those exports
    # And the run went through the paths that matter: restarts both ways, real deletes,
    # every outcome of an export.
    for kind in ("RestartFromCheckpoint", "RestartCold", "DeleteCheckpoint", "RetireGroup"):
        assert adapter.done[kind] > 0, adapter.done
    for outcome in ("ExportCommitted", "ExportCancelled", "ExportFailed"):
        assert reporter.delivered[outcome] > 0, reporter.delivered
    assert time.monotonic() - started < 20.0
