"""Eight threads sending events at one controller as fast as they can, through a link
(in-process ``ControllerLink`` or the actor's ``RemoteLink``): one trainer thread syncing
and exporting, seven health threads each hurting and healing its own group, and the link's
executor reporting every delete back. Used by ``test_hammer.py`` and
``benchmarks/bench_hammer.py``.

Every send is either handled or refused with a typed ``RecoveryError`` (a thread reads its
group's state, then another thread moves it first); both are journaled, so "processed
exactly once" is checked against the journal: one record per send, steps without gaps, and
per group as many records as its thread sent."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from recovery_fsm import RecoveryConfig, RecoveryController, RecoveryError
from recovery_fsm import effects as fx
from recovery_fsm import events as ev
from recovery_fsm.host import ControllerLink
from recovery_fsm.journal import JsonlJournal

GROUPS = tuple(f"g{n}" for n in range(1, 8))  # one health thread each; the trainer is the 8th
# A budget no hammered group spends, so every group keeps taking events to the end.
CONFIG = RecoveryConfig(restart_budget=10**9)


@attrs.define
class Tally:
    """What the senders did and saw."""

    sent: Counter[str] = attrs.Factory(Counter)  # per group, or "trainer", "deletes", "ticks"
    refused: int = 0
    violations: list[str] = attrs.Factory(list)
    errors: list[BaseException] = attrs.Factory(list)  # anything but a typed refusal
    lock: threading.Lock = attrs.Factory(threading.Lock)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


class Hammer:
    """``send(cls, **fields)`` is the link's; ``query(name, *args)`` reads the controller
    (``check_invariants`` included)."""

    def __init__(
        self,
        send: Callable[..., tuple[fx.Effect, ...]],
        query: Callable[..., Any],
        events: int,
    ) -> None:
        self.send, self.query = send, query
        self.per_thread = events // 8
        self.tally = Tally()
        self.stop = threading.Event()

    def execute(self, effect: fx.Effect) -> None:
        """The link's executor: a delete is done at once and reported (from its thread)."""
        if isinstance(effect, fx.DeleteCheckpoint):
            self._send("deletes", ev.CheckpointDeleted, version=effect.version)

    def register(self) -> None:
        for g in GROUPS:
            self._send(g, ev.GroupRegistered, group=g, version=0)

    def run(self, timeout_s: float) -> tuple[float, list[str]]:
        """Run every thread to its count; returns the seconds taken and the names of threads
        still running at ``timeout_s`` (a deadlock, or a starved thread)."""
        threads = [threading.Thread(target=self._guard, args=(self._trainer,), name="trainer")]
        threads += [
            threading.Thread(target=self._guard, args=(self._health, g), name=g) for g in GROUPS
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.stop.set()
        return time.perf_counter() - start, [t.name for t in threads if t.is_alive()]

    def _guard(self, body: Callable[..., None], *args: str) -> None:
        try:
            body(*args)
        except BaseException as err:  # a crashed thread is a finding, not a hang
            with self.tally.lock:
                self.tally.errors.append(err)

    def _send(self, who: str, cls: type[ev.Event], **fields: Any) -> None:
        with self.tally.lock:
            self.tally.sent[who] += 1
        try:
            self.send(cls, **fields)
        except RecoveryError:
            with self.tally.lock:
                self.tally.refused += 1
        found = self.query("check_invariants")
        if found:
            with self.tally.lock:
                self.tally.violations.extend(found)

    def _trainer(self) -> None:
        version = 0
        for n in range(self.per_thread):
            if self.stop.is_set():
                return
            if n % 3 == 0:
                version += 1
                self._send("trainer", ev.WeightsSynced, version=version,
                           groups=self.query("up_groups"))  # fmt: skip
            elif n % 3 == 1:
                self._send("trainer", ev.ExportStarted, version=version)
            else:
                self._send("trainer", ev.ExportCommitted, version=version,
                           path=f"/ckpt/step-{version}")  # fmt: skip

    def _health(self, g: str) -> None:
        for n in range(self.per_thread):
            if self.stop.is_set():
                return
            view = self.query("group", g)
            inc = view.incarnation
            if view.state == "active":
                kind: type[ev.Event] = ev.GroupFailed if n % 5 == 0 else ev.ProbeFailed
                self._send(g, kind, group=g, incarnation=inc)
            elif view.state == "suspect":
                self._send(g, ev.ProbeOk, group=g, incarnation=inc)
            elif view.state == "loading":
                self._send(g, ev.RestartLoaded, group=g, incarnation=inc)
            elif view.state == "relaunching":
                self._send(g, ev.Relaunched, group=g, incarnation=inc)
            elif view.state == "pending_weights" and n % 5 == 0:
                self._send(g, ev.GroupFailed, group=g, incarnation=inc)
            else:  # waiting for weights or a checkpoint: time passes
                self._send("ticks", ev.Tick)


def journal_counts(path: Path) -> tuple[list[int], Counter[str]]:
    """The steps of a journal's event records, and how many are about each group (or the
    trainer's and the deletes' kinds)."""
    steps: list[int] = []
    about: Counter[str] = Counter()
    trainer = {"WeightsSynced", "ExportStarted", "ExportCommitted"}
    with path.open() as f:
        for line in f:
            record = json.loads(line)
            if "event" not in record:
                continue
            steps.append(record["step"])
            e = record["event"]
            if e["kind"] in trainer:
                about["trainer"] += 1
            elif e["kind"] == "CheckpointDeleted":
                about["deletes"] += 1
            elif e["kind"] == "Tick":
                about["ticks"] += 1
            else:
                about[e["group"]] += 1
    return steps, about


def in_process(events: int, journal: Path) -> tuple[Hammer, float, list[str], ControllerLink]:
    """Hammer a controller through ``ControllerLink``; returns the hammer, the seconds, the
    threads stuck and the (closed) link."""
    with JsonlJournal(journal) as sink:
        controller = RecoveryController(CONFIG, journal=sink)
        h: Hammer
        link = ControllerLink(controller, execute=lambda e: h.execute(e))

        def query(name: str, *args: Any) -> Any:
            value = getattr(controller, name)
            return value(*args) if callable(value) else value

        h = Hammer(link.send, query, events)
        h.register()
        seconds, stuck = h.run(timeout_s=3600)
        link.close(60)
    return h, seconds, stuck, link


def through_actor(events: int, journal: Path, name: str) -> tuple[Hammer, float, list[str], Any]:
    """The same through a ``RecoveryControllerActor`` named ``name`` and ``RemoteLink`` (on
    a Ray cluster already up); the actor is closed and killed before this returns."""
    import ray

    from recovery_fsm.ray import RecoveryControllerActor, RemoteLink

    actor = RecoveryControllerActor.launch(name, CONFIG, journal=str(journal))
    h: Hammer
    link = RemoteLink(actor, execute=lambda e: h.execute(e))
    try:

        def query(q: str, *args: Any) -> Any:
            return ray.get(actor.query.remote(q, *args), timeout=60)

        h = Hammer(link.send, query, events)
        h.register()
        seconds, stuck = h.run(timeout_s=3600)
        link.close(60)
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)
    return h, seconds, stuck, link
