from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from recovery_fsm import RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.effects import Effect


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

    def sync(self, version: int, groups: Iterable[str] | None = None) -> tuple[Effect, ...]:
        names = groups if groups is not None else self.c.snapshot()["groups"].keys()
        return self.send(ev.WeightsSynced, version, frozenset(names))

    def export(self, version: int, path: str | None = None) -> tuple[Effect, ...]:
        self.send(ev.ExportStarted, version)
        return self.send(ev.ExportCommitted, version, path or f"/ckpt/step-{version}")

    def step(self, version: int) -> tuple[Effect, ...]:
        """Sync to ``version`` and finish every delete it asks for, then export it."""
        for effect in self.sync(version):
            if effect.kind == "DeleteCheckpoint":
                self.send(ev.CheckpointDeleted, effect.version)  # type: ignore[attr-defined]
        return self.export(version)


@pytest.fixture
def driver() -> Driver:
    d = Driver(RecoveryConfig(clean_syncs_to_reenable=2, restart_budget=3), ["g1", "g2"])
    d.step(1)
    return d
