"""Losing a node: Ray's multi-node test cluster (``ray.cluster_utils.Cluster``, a head and
two worker raylets on this one machine). The groups and a standby spread over the two
workers (``actor_options``: a custom ``rollout`` resource only workers offer, and Ray's
``SPREAD``); the worker holding the most groups is removed in the middle of the run. Every
group on it fails at once and serves again from the surviving node (a current standby
there first), within the restart budget; the node's return is capacity again. The journal
replays clean."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import serving, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402
from test_ray_runtime import assert_replays_clean, runtime, step, trainer  # noqa: E402

from recovery_fsm import RecoveryConfig  # noqa: E402
from recovery_fsm.ray.placement import check_shared_root  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORKER = {"num_cpus": 2, "resources": {"rollout": 8}}
PLACED = {"resources": {"rollout": 1}, "scheduling_strategy": "SPREAD"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(**WORKER)
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def node_of(actor: Any) -> str:
    """The node an actor runs on, as the GCS records it."""
    from ray._private import state

    return str(state.actors(actor._actor_id.hex())["Address"]["NodeID"])


def nodes_of(rt: Any, name: str) -> set[str]:
    view = rt.controller.group(name) if name.startswith("g") else None
    inc = view.incarnation if view is not None else 1
    return {node_of(a) for a in rt.actors_table.of(name, inc)}


def test_a_node_lost_mid_run_takes_its_groups_which_come_back_on_the_others(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = trainer()
    groups = ["g0", "g1", "g2"]
    config = RecoveryConfig(restart_budget=3)
    with runtime(tmp_path, groups=groups, standby=1, actor_options=PLACED, config=config) as rt:
        # Only the two workers offer "rollout": both must see the checkpoint root.
        assert check_shared_root(rt.store.root, rt.launcher.actor_options) == 2
        rt.start(model)
        wait_for(lambda: "standby-1" in rt.controller.up_standbys(), what="standby-1 booted")
        step(model)
        rt.sync(model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        placed = {g: nodes_of(rt, g) for g in groups}
        workers = [n for n in cluster.worker_nodes]
        by_node = {w.node_id: [g for g, ns in placed.items() if w.node_id in ns] for w in workers}
        assert all(by_node.values()), f"the groups did not spread: {placed}"  # SPREAD did
        victim = max(workers, key=lambda w: len(by_node[w.node_id]))
        lost = by_node[victim.node_id]
        spare_there = victim.node_id in nodes_of(rt, "standby-1")
        before = {g: rt.controller.incarnation(g) for g in groups}

        cluster.remove_node(victim)
        for g in lost:
            wait_for(lambda g=g: rt.controller.incarnation(g) > before[g] and serving(rt, g),
                     timeout=180, what=f"{g} back after its node was lost")  # fmt: skip
        survivor = next(w.node_id for w in workers if w is not victim)
        for g in groups:
            assert nodes_of(rt, g) == {survivor}, g
            view = rt.controller.group(g)
            assert view.state == "active" and view.version == 1 and view.restarts <= 1
        paths = rt.statistics().recoveries
        print(f"lost {lost} with the node (standby there: {spare_there}); recovered by {paths}")
        assert sum(paths.values()) == len(lost)
        if not spare_there:  # a current standby on the surviving node took the first group
            assert paths.get("standby") == 1, paths

        # The node comes back: capacity again, where the next recovery may land.
        cluster.add_node(**WORKER)
        cluster.wait_for_nodes()
        assert check_shared_root(rt.store.root, rt.launcher.actor_options) == 2
        step(model)
        assert set(rt.sync(model, 2)) >= set(groups)
    assert_replays_clean(tmp_path)


def test_a_short_soak_through_a_trainer_crash_and_a_node_loss(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The long soak's short version (``benchmarks/soak_resume.py`` runs 500 steps): a trainer
    process killed at step 15 with its export in flight, resumed at its checkpoint of 10 by
    a new one that runs to 30, keeping its last two checkpoints; a worker node removed at 20
    and one added at 25; a group killed every 5 steps throughout."""
    sys.path.insert(0, str(Path(__file__).parent / "procs"))
    from soak import soak

    out = soak(cluster, tmp_path, steps=30, crash_at=15, node_loss_at=20, node_back_at=25,
               pin=10, chaos_every=5, sample_every=5, step_s=0.5)  # fmt: skip
    assert out["crash_code"] == -9 and out.get("resume_code") == 0, out.get("stderr")
    assert [what for what, _ in out["node"]] == ["removed", "added"]
    resumed = next(r for r in out["after"] if "resumed" in r)["resumed"]
    assert resumed["settled"] and resumed["version"] == 10
    final = next(r for r in out["after"] if r.get("final"))
    assert set(final["states"].values()) <= {"active", "retired"}, final["states"]
    assert final["loads_from_deleted"] == final["lost_reports"] == 0
    assert final["drained"] and final["replay_ok"], final["replay"]
    # Left on disk after the run: the trainer's last two checkpoints only (the abandoned 11-15
    # went at the resume, step-10 when the trainer unpinned it at 30).
    assert final["dirs"] == ["step-20", "step-30"]
    for sample in [r for r in out["before"] + out["after"] if "step" in r]:
        assert sample["finished"] <= 16 and sample["starts"] <= 7, sample
