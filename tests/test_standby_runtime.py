"""Warm standbys on a real local Ray cluster with the reference engine: kept current by the push
or by loading each checkpoint in place, claimed by a killed group without a boot, checked at
admission, replaced when they die, stopped at shutdown. Each journal replays clean."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA, process_gone, serving, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from test_ray_runtime import assert_replays_clean, journal_events, runtime, step, trainer  # noqa: E402

from recovery_fsm.ray import ReferenceEngine  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("ray_cluster")
assert TINY_LLAMA


def dead(actor: Any) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def standby_state(rt: Any, name: str) -> str | None:
    view = rt.controller.standbys().get(name)
    return None if view is None else view.state


def test_a_pushed_standby_replaces_a_killed_group_without_a_boot(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path, standby=1) as rt:
        rt.start(model)
        wait_for(lambda: standby_state(rt, "standby-1") == "stale", what="standby-1 booted")
        step(model)
        got = rt.sync(model, 1)
        assert got == {"g0": 1, "g1": 1, "standby-1": 1}  # the push reached the standby
        assert standby_state(rt, "standby-1") == "ready"
        [spare] = rt.actors_table.of("standby-1", 1)
        before = rt.generate("g0", [1, 2, 3])

        rt.kill("g0")
        wait_for(lambda: rt.controller.incarnation("g0") == 2 and serving(rt, "g0"),
                 what="g0 back on the standby")  # fmt: skip
        assert rt.actors("g0", 2) == [spare]  # the standby's own process, not a new one
        after = rt.generate("g0", [1, 2, 3])
        assert (after.tokens, after.version, after.group, after.incarnation) == (
            before.tokens, 1, "g0", 2,
        )  # fmt: skip
        assert rt.statistics().recoveries == {"standby": 1}
        # The pool refills with a new engine, which loads the ready C(1) in place.
        wait_for(lambda: standby_state(rt, "standby-2") == "ready", what="standby-2 current")
        # The claimed standby's name leaves no stop floor behind (one per claim, over days).
        assert (rt.bookkeeping()["actors.stopped"], rt.bookkeeping()["actors.booting"]) == (0, 0)
        step(model)
        assert "standby-2" in rt.sync(model, 2)
    claims = journal_events(tmp_path, "ClaimStandby")
    assert claims == []  # effects are not events: the claim shows as the group's transition
    assert_replays_clean(tmp_path)


def test_in_load_mode_a_standby_loads_each_checkpoint_and_is_claimed_as_it_is(
    tmp_path: Path,
) -> None:
    model = trainer()
    with runtime(tmp_path, standby=1, standby_push=False) as rt:
        rt.start(model)
        wait_for(lambda: standby_state(rt, "standby-1") == "stale", what="standby-1 booted")
        step(model)
        assert "standby-1" not in rt.sync(model, 1)
        wait_for(lambda: standby_state(rt, "standby-1") == "ready", what="C(1) loaded in place")
        rt.kill("g1")
        wait_for(lambda: rt.controller.incarnation("g1") == 2 and serving(rt, "g1"),
                 what="g1 back on the standby")  # fmt: skip
        assert rt.generate("g1", [4, 5]).version == 1
        assert rt.statistics().recoveries == {"standby": 1}
        assert rt.statistics().safety.loads_from_deleted == 0
    loaded = journal_events(tmp_path, "StandbyLoaded")
    assert [(e["standby"], e["version"]) for e in loaded] == [("standby-1", 1)]
    assert_replays_clean(tmp_path)


class CorruptingEngine(ReferenceEngine):
    """Loses its weights when it is handed to a group: admission must refuse it."""

    def assume(self, group: str, incarnation: int) -> Any:
        held = super().assume(group, incarnation)
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(-1.0)
        return held


def test_a_standby_that_fails_admission_is_not_routed_and_the_group_restarts(
    tmp_path: Path,
) -> None:
    model = trainer()
    with runtime(tmp_path, standby=1, engine=CorruptingEngine) as rt:
        rt.start(model)
        wait_for(lambda: standby_state(rt, "standby-1") == "stale", what="standby-1 booted")
        step(model)
        rt.sync(model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        rt.kill("g0")
        # The claim fails its check (digest and canary); C(1) is ready: an immediate restart.
        wait_for(lambda: rt.controller.incarnation("g0") == 3 and serving(rt, "g0"),
                 what="g0 restarted from C(1)", timeout=120)  # fmt: skip
        assert rt.statistics().recoveries == {"immediate": 1}
        assert rt.generate("g0", [1, 2]).incarnation == 3
        assert rt.statistics().admissions_refused == {"canary": 1}  # the claim's check
    [failed] = journal_events(tmp_path, "RestartLoadFailed")
    assert (failed["group"], failed["incarnation"]) == ("g0", 2)
    assert "digest gate" in failed["error"] or "canary" in failed["error"]
    assert_replays_clean(tmp_path)


def test_a_dead_standby_is_replaced_and_shutdown_stops_the_pool(tmp_path: Path) -> None:
    model = trainer()
    rt = runtime(tmp_path, standby=1)
    with rt:
        rt.start(model)
        wait_for(lambda: standby_state(rt, "standby-1") == "stale", what="standby-1 booted")
        [first] = rt.actors_table.of("standby-1", 1)
        ray.kill(first, no_restart=True)
        wait_for(lambda: standby_state(rt, "standby-2") == "stale", what="standby-2 booted")
        assert "standby-1" not in rt.controller.standbys()
        [second] = rt.actors_table.of("standby-2", 1)
        # The dead standby left the table, and its name leaves no stop floor behind.
        sizes = rt.bookkeeping()
        assert (sizes["actors.current"], sizes["actors.stopped"]) == (3, 0)
    assert rt.controller.drained
    wait_for(lambda: dead(second), what="standby-2 killed at shutdown")
    [died] = journal_events(tmp_path, "StandbyFailed")
    assert (died["standby"], died["reason"]) == ("standby-1", "actor died")
    assert_replays_clean(tmp_path)


class PushWaitsForAFlagOnG1(ReferenceEngine):
    """g1 takes the push of 2 only once ``FLAG`` exists: the sync stays in flight."""

    FLAG = ""

    def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
        if self.group == "g1" and version == 2:
            while not os.path.exists(self.FLAG):
                time.sleep(0.05)
        return super().update_weights(version, weights)


def test_a_standby_the_push_in_flight_reached_is_claimed_and_serves_when_that_sync_lands(
    tmp_path: Path,
) -> None:
    """g0 dies while the push of 2 is in flight, after it reached the standby: the claim
    finds 2 where it asked 1, is checked against the push's own record and waits, not
    routed, for the sync of 2, which admits it. No kill, no boot, no slow path."""
    flag = tmp_path / "push-may-finish"
    engine = type("PushWaits", (PushWaitsForAFlagOnG1,), {"FLAG": str(flag)})
    model = trainer()
    with runtime(tmp_path, standby=1, engine=engine) as rt:
        rt.start(model)
        wait_for(lambda: standby_state(rt, "standby-1") == "stale", what="standby-1 booted")
        step(model)
        rt.sync(model, 1)
        assert standby_state(rt, "standby-1") == "ready"
        [spare] = rt.actors_table.of("standby-1", 1)
        boots = rt.launcher.boots
        step(model)
        synced: dict[str, Any] = {}
        pushing = threading.Thread(target=lambda: synced.update(rt.sync(model, 2)))
        pushing.start()
        wait_for(lambda: ray.get(spare.weights.remote(), timeout=30).version == 2,
                 what="the push reached the standby")  # fmt: skip
        rt.kill("g0")

        def found_ahead() -> bool:
            view = rt.controller.group("g0")
            return (view.incarnation, view.state, view.version) == (2, "pending_weights", 2)

        wait_for(found_ahead, what="g0 claimed the standby, found holding 2")
        assert rt.routes["g0"] is None  # not before the sync of 2
        flag.touch()
        pushing.join(timeout=120)
        assert synced["g1"] == 1 and synced.get("g0") in (None, 1)  # its dead process, if any
        wait_for(lambda: serving(rt, "g0"), what="g0 admitted by the sync of 2")
        assert rt.actors("g0", 2) == [spare]  # the standby's process, never killed
        assert rt.generate("g0", [1, 2, 3]).version == 2
        assert rt.statistics().recoveries == {"standby": 1}
        assert rt.launcher.boots == boots + 1  # the pool's refill only
    assert_replays_clean(tmp_path)


def held_standbys(flags: str) -> type[ReferenceEngine]:
    """Standbys whose boot waits while the file ``<flags>/hold`` exists."""

    class HeldStandbyEngine(ReferenceEngine):
        def boot_empty(self) -> Any:
            while self.group.startswith("standby") and os.path.exists(f"{flags}/hold"):
                time.sleep(0.05)
            return super().boot_empty()

    return HeldStandbyEngine


def test_start_routes_wait_ready_waits_for_standbys_processes_and_recoveries_say_who(
    tmp_path: Path,
) -> None:
    hold = tmp_path / "hold"
    hold.write_text("")
    seen: list[Any] = []

    def slow_router(effect: Any) -> None:  # each routing effect queues the next behind it
        time.sleep(0.5)
        seen.append(effect)

    model = trainer()
    engine = held_standbys(str(tmp_path))
    with runtime(tmp_path, standby=1, engine=engine, router=slow_router) as rt:
        rt.start(model)
        assert rt.routes == {"g0": (1, 0), "g1": (1, 0)}  # as sync: routed when it returns
        assert rt.wait_ready(timeout_s=1.0) is False  # the standby still boots
        assert standby_state(rt, "standby-1") == "booting"
        hold.unlink()
        assert rt.wait_ready(timeout_s=60.0) is True
        assert standby_state(rt, "standby-1") == "stale"  # booted: the next sync reaches it
        step(model)
        assert rt.sync(model, 1) == {"g0": 1, "g1": 1, "standby-1": 1}
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        before = rt.processes()
        assert sorted(before) == ["g0", "g1", "standby-1"]
        [spare] = before["standby-1"]
        assert spare.pid is not None and not process_gone(spare.pid)
        assert spare.node_id == ray.get_runtime_context().get_node_id() and spare.node_ip
        assert len({p.pid for ps in before.values() for p in ps}) == 3
        rt.kill("g0")
        wait_for(lambda: rt.controller.incarnation("g0") == 2 and serving(rt, "g0"),
                 what="g0 back on the standby")  # fmt: skip
        [now] = rt.processes()["g0"]
        assert (now.incarnation, now.pid) == (2, spare.pid)  # the standby's own process
        # The ledger says which failure that recovery answered, its path and its idle time.
        [r] = rt.ledger.recoveries
        assert (r.group, r.incarnation, r.reason, r.path) == ("g0", 1, "actor died", "standby")
        assert 0 < r.latency_s < 60
    assert_replays_clean(tmp_path)
