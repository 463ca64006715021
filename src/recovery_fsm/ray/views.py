"""What a trainer reads of a running fleet (routes, actors, failed effects, statistics,
bookkeeping), and the chaos it may cause: the read side of ``RecoveryRuntime``, apart from
the parts it composes and the calls that change the fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import ray

from .. import CheckpointState, GroupState, PoolState, RecoveryConfig, StandbyState
from ..errors import Fenced
from ..host import ControllerQueries, EffectError, Link
from ..journal.ledger import PATHS, Ledger
from .actors import ActorTable, kill
from .monitor import HealthMonitor
from .reporter import FailStop, Reporter
from .rollouts import RolloutClient
from .router import TrafficRouter
from .runner import EffectRunner
from .safety import SafetyCounters
from .statistics import Statistics


@attrs.frozen
class EngineProcess:
    """Where one actor of a group or standby runs: what ``ps`` on its node shows."""

    name: str  # the group or standby
    incarnation: int
    pid: int | None  # None: the actor is still being made
    node_id: str | None
    node_ip: str | None


class RuntimeViews:
    """Reads the parts a ``RecoveryRuntime`` composes; holds none of its own."""

    controller: ControllerQueries
    link: Link
    runner: EffectRunner
    router: TrafficRouter
    actors_table: ActorTable
    ledger: Ledger
    counters: SafetyCounters
    rollouts: RolloutClient
    monitor: HealthMonitor
    reporter: Reporter
    failstop: FailStop
    groups: list[str]
    config: RecoveryConfig

    @property
    def fenced(self) -> bool:
        """Whether a resume replaced this runtime: it acts no more, and kills nothing."""
        stopped = self.failstop.error
        return stopped is not None and isinstance(stopped.first, Fenced)

    def raise_if_stopped(self) -> None:
        """Raise ``ControllerStopped`` once the controller broke (for the trainer hooks)."""
        self.failstop.check()

    @property
    def routes(self) -> dict[str, tuple[int, int] | None]:
        """Group -> (incarnation, version) it serves, or None while it does not."""
        return self.router.routes

    def kill(self, group: str) -> int:
        """Chaos: kill the group's current process through Ray (as a crash would); returns
        the incarnation killed."""
        inc = self.controller.incarnation(group)
        kill(self.actors_table.of(group, inc))
        return inc

    def actors(self, group: str, incarnation: int | None = None) -> list[Any]:
        """The actor handles of a group's process (default: its current incarnation); empty
        once that process was stopped."""
        inc = self.controller.incarnation(group) if incarnation is None else incarnation
        return self.actors_table.of(group, inc)

    @property
    def errors(self) -> tuple[EffectError, ...]:
        """Effects whose execution failed, from every executor (the link's dispatcher and
        the runner's lanes), kept until ``retry_failed``."""
        return self.link.errors + self.runner.errors

    def retry_failed(self) -> int:
        """Execute every kept failed effect again; returns how many. After fail-stop it
        raises ``ControllerStopped``: nothing runs any more, and the effects stay kept."""
        self.failstop.check()
        return self.link.retry_failed() + self.runner.retry_failed()

    def statistics(self) -> Statistics:
        latency = {p: tuple(self.ledger.latencies(p)) for p in PATHS}
        return Statistics(
            self.ledger.failures,
            {p: n for p, n in self.ledger.recovered.items() if n},
            {p: v for p, v in latency.items() if v},
            self.runner.in_flight,
            len(self.errors),
            self.counters.snapshot(),
            self.rollouts.snapshot(),
        )

    def bookkeeping(self) -> dict[str, int]:
        """The size of every structure the runtime keeps per group, path or process (they
        stay bounded over a long run)."""
        return {
            **{f"actors.{k}": v for k, v in self.actors_table.sizes().items()},
            **{f"safety.{k}": v for k, v in self.counters.sizes().items()},
            **{f"monitor.{k}": v for k, v in self.monitor.sizes().items()},
            **{f"runner.{k}": v for k, v in self.runner.sizes().items()},
            **{f"router.{k}": v for k, v in self.router.sizes().items()},
        }

    def pinned_checkpoints(self) -> dict[int, Path]:
        """The run's pinned checkpoints that committed, whichever of its trainer processes
        exported them (one a resume replaced included): on disk until ``unpin``."""
        committed = {CheckpointState.READY, CheckpointState.SUPERSEDED}
        return {
            v: Path(c.path)
            for v, c in self.controller.checkpoints().items()
            if c.pinned and c.path is not None and c.state in committed
        }

    def processes(self, timeout_s: float = 10.0) -> dict[str, list[EngineProcess]]:
        """The operating-system process of each actor of every group and standby now: its
        pid and Ray node (a claimed standby's process serves its group, same pid)."""
        current = self.actors_table.current()
        refs = [r for _, rs in current.values() for r in rs]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
        ips = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}  # type: ignore[no-untyped-call]
        out: dict[str, list[EngineProcess]] = {}
        for name, (inc, rs) in sorted(current.items()):
            for r in rs:
                try:
                    pid, node = ray.get(r, timeout=0) if r in done else (None, None)
                except Exception:  # died meanwhile: the monitor reports it
                    pid, node = None, None
                out.setdefault(name, []).append(
                    EngineProcess(name, inc, pid, node, ips.get(node) if node else None)
                )
        return out

    def wait_ready(self, timeout_s: float = 300.0) -> bool:
        """Wait until every group serves (or was retired) and the standbys have booted
        (each claimable), or the pool gave up filling; False on timeout. Until then a kill
        takes the reboot path: ``start`` returns as soon as the groups serve, while the
        standbys still boot."""
        gone = {GroupState.RETIRED, GroupState.STOPPED}

        def ready() -> bool:
            routes, views = self.router.routes, self.controller.groups()
            if any(routes.get(g) is None and (g not in views or views[g].state not in gone)
                   for g in self.groups):  # fmt: skip
                return False
            if self.controller.pool_state != PoolState.FILLING:
                return True
            up = [s for s in self.controller.standbys().values()
                  if s.state != StandbyState.BOOTING]  # fmt: skip
            return len(up) >= self.config.standby

        return self.reporter.wait(ready, timeout_s)

    def wait_drained(self, timeout: float) -> bool:
        """Wait until the controller has nothing outstanding (after ``Shutdown``)."""
        return self.reporter.wait(lambda: self.controller.drained, timeout)
