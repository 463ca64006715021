from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.effects import DeleteCheckpoint, Effect
from recovery_fsm.machines import LOADING, RELAUNCHING, STANDBY_FINAL, UP, GroupState

# A tiny Llama for the engines on Ray (the reference engine's tests).
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.05)


def process_gone(pid: int) -> bool:
    """What the operating system says: no such process, or one that exited and awaits its
    parent's reaping (a zombie holds no file open and runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, someone else's
    ps = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    state = ps.stdout.strip()
    return state == "" or state.startswith("Z")


def serving(rt: Any, group: str) -> bool:
    """``group`` is active and routed: the routing effect runs just after the transition, so
    a test that waits for the state alone can send a request before the router knows."""
    return rt.routes.get(group) is not None and rt.controller.group_state(group) == "active"


def short_run(path: Path) -> None:
    """One short real run, its journal appended to ``path``: a failure and a recovery."""
    from recovery_fsm.journal import JsonlJournal

    with JsonlJournal(path) as journal:
        c = RecoveryController(RecoveryConfig(), journal=journal)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        c.handle(ev.ExportStarted(0, at=2.0))
        c.handle(ev.ExportCommitted(0, "/ckpt/step-0", at=3.0))
        c.handle(ev.GroupFailed("g1", 1, at=4.0))


class Driver:
    """A controller plus a clock; checks the invariants after every accepted event."""

    def __init__(self, config: RecoveryConfig | None = None, groups: Iterable[str] = ()) -> None:
        self.c = RecoveryController(config)
        self._clock = itertools.count(1)
        for name in groups:
            self.send(ev.GroupRegistered, name, self.c.version)

    def now(self) -> float:
        return float(next(self._clock))

    def send(self, cls: type[ev.Event], *args: object, **kwargs: object) -> tuple[Effect, ...]:
        effects = self.c.handle(cls(*args, at=self.now(), **kwargs))  # type: ignore[call-arg]
        assert self.c.check_invariants() == []
        return effects

    def processes(self) -> list[str]:
        """Every process a resume would find alive: each group's current one while it has
        one, and each live standby (``<name>#<incarnation>``)."""
        has_process = UP | LOADING | RELAUNCHING | {GroupState.RESUMING}
        out = [f"{n}#{g.incarnation}" for n, g in self.c.groups().items() if g.state in has_process]
        return out + [
            f"{n}#1" for n, s in self.c.standbys().items() if s.state not in STANDBY_FINAL
        ]

    def resume(
        self,
        version: int,
        *,
        gone: Iterable[str] = (),
        silent: Iterable[str] = (),
        strays: Iterable[str] = (),
        epoch: int | None = None,
    ) -> tuple[Effect, ...]:
        """A resume at ``version`` that finds every live process but those ``gone`` (none
        left) or ``silent`` (listed, mute), and ``strays`` beside them."""
        missing = {*gone, *silent}
        found = [p for p in self.processes() if p not in missing] + list(strays)
        return self.send(ev.Resumed, version, epoch=self.c.epoch + 1 if epoch is None else epoch,
                         found=found, silent=list(silent))  # fmt: skip

    def inc(self, group: str) -> int:
        """The group's current incarnation."""
        return self.c.incarnation(group)

    def about(self, cls: type[ev.Event], group: str, **kwargs: object) -> tuple[Effect, ...]:
        """Send an event about ``group``'s current incarnation."""
        return self.send(cls, group, self.inc(group), **kwargs)

    def sync(self, version: int, groups: Iterable[str] | None = None) -> tuple[Effect, ...]:
        """Push ``version`` to every up group (or to those named), at their incarnations."""
        up = self.c.up_groups()
        names = up if groups is None else {g: self.inc(g) for g in groups}
        return self.send(ev.WeightsSynced, version, names)

    def export(self, version: int, path: str | None = None) -> tuple[Effect, ...]:
        self.send(ev.ExportStarted, version)
        return self.send(ev.ExportCommitted, version, path or f"/ckpt/step-{version}")

    def step(self, version: int) -> tuple[Effect, ...]:
        """Sync to ``version`` and finish every delete it asks for, then export it."""
        for effect in self.sync(version):
            if isinstance(effect, DeleteCheckpoint):
                self.send(ev.CheckpointDeleted, effect.version)
        return self.export(version)


@pytest.fixture
def driver() -> Driver:
    d = Driver(RecoveryConfig(clean_syncs_to_reenable=2, restart_budget=3), ["g1", "g2"])
    d.step(1)
    return d


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A private local Ray cluster for one test module: two CPUs, no dashboard, this machine
    only, never a cluster another process started here (``address="local"``). A module asks
    for it with ``pytestmark = pytest.mark.usefixtures("ray_cluster")``."""
    ray = pytest.importorskip("ray")
    from recovery_fsm.ray import start_local_cluster

    start_local_cluster(num_cpus=2, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A Ray head started as a user would (``ray start --head``), recorded on this machine
    as its current cluster (the record there before is put back after); yields its
    address. Stopped by its own process (``--block`` ends what it started on SIGTERM),
    never by ``ray stop``, which would stop every cluster here."""
    import signal
    import socket
    import sys

    pytest.importorskip("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    # Where Ray records the machine's current cluster (a private helper: no public one).
    from ray._common.utils import get_ray_address_file

    record = Path(get_ray_address_file(None))
    previous = record.read_text() if record.exists() else None  # a developer's own head

    def recorded() -> bool:  # what a plain ray.init() would join: written once it is up
        with contextlib.suppress(OSError):
            return record.read_text().strip().endswith(f":{port}")
        return False

    try:
        deadline = time.monotonic() + 60
        while not recorded():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not come up (exit {head.poll()})")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # its own session: only what it started
            head.wait()
        if recorded():  # the record of the head as this machine's cluster goes with it
            if previous is None:
                record.unlink()
            else:
                record.write_text(previous)


def same_port(a: str, b: str) -> bool:
    """Two Ray addresses of one cluster here (a head may name itself by another address)."""
    return a.rpartition(":")[2] == b.rpartition(":")[2]
