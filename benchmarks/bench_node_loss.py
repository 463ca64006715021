"""A node lost in the middle of a run, timed beside the loss of one engine.

    .venv/bin/python benchmarks/bench_node_loss.py [--trials 2]

Ray's multi-node test cluster (``ray.cluster_utils.Cluster``: a head and two worker raylets
on this machine). Three groups of one tiny-Llama reference engine spread over the workers
(a custom ``rollout`` resource only workers offer, and ``SPREAD``), with and without one
standby. Each trial first kills one engine through Ray (the baseline: one group's outage),
then removes the worker holding the most groups. Timed from the kill or the removal:
*detected*, until the first of those groups stops serving; *back*, until every one of them
serves again from the surviving node. A worker is added back after each trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from recovery_fsm import RecoveryConfig
from recovery_fsm.ray import RecoveryRuntime

CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip
WORKER = {"num_cpus": 2, "resources": {"rollout": 8}}
PLACED = {"resources": {"rollout": 1}, "scheduling_strategy": "SPREAD"}
GROUPS = ["g0", "g1", "g2"]


def wait(cond: Any, timeout: float = 300.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("the runtime did not get there in time")
        time.sleep(0.01)
    return time.monotonic()


def serving(rt: RecoveryRuntime, g: str) -> bool:
    return rt.routes.get(g) is not None and rt.controller.group_state(g) == "active"


def node_of(actor: Any) -> str:
    from ray._private import state

    return str(state.actors(actor._actor_id.hex())["Address"]["NodeID"])


def nodes(rt: RecoveryRuntime, g: str, incarnation: int = 0) -> set[str]:
    inc = incarnation or rt.controller.incarnation(g)
    return {node_of(a) for a in rt.actors_table.of(g, inc)}


def outage(rt: RecoveryRuntime, lost: list[str], act: Any) -> tuple[float, float, float]:
    """(detected, first back, all back) in seconds after ``act()``, for the groups in
    ``lost``."""
    before = {g: rt.controller.incarnation(g) for g in lost}
    t0 = time.monotonic()
    act()
    detected = wait(lambda: not all(serving(rt, g) for g in lost)) - t0
    back = lambda: [rt.controller.incarnation(g) > before[g] and serving(rt, g) for g in lost]  # noqa: E731
    first = wait(lambda: any(back())) - t0
    return detected, first, wait(lambda: all(back())) - t0


def trial(cluster: Cluster, root: Path, standby: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    rt = RecoveryRuntime(
        root, groups=GROUPS, model_config=LlamaConfig(**CONFIG), standby=standby,
        actor_options=PLACED, config=RecoveryConfig(restart_budget=5), tick_s=0.1,
        probe_interval_s=0.5,
        probe_timeout_s=2.0, grace_s=1.0, call_timeout_s=60.0,
    )  # fmt: skip
    try:
        rt.start(model)
        rt.sync(model, 1)
        wait(lambda: rt.controller.checkpoint_state(1) == "ready")
        pool = lambda: len(rt.controller.up_standbys()) == standby  # noqa: E731
        wait(pool)
        one = GROUPS[0]
        single = outage(rt, [one], lambda: rt.kill(one))
        wait(pool)
        workers = list(cluster.worker_nodes)
        placed = {g: nodes(rt, g) for g in GROUPS}
        victim = max(workers, key=lambda w: sum(w.node_id in ns for ns in placed.values()))
        lost = [g for g, ns in placed.items() if victim.node_id in ns]
        spare_there = any(
            victim.node_id in nodes(rt, s, 1) for s in rt.controller.up_standbys()
        )  # fmt: skip
        recovered = dict(rt.statistics().recoveries)
        node = outage(rt, lost, lambda: cluster.remove_node(victim))
        after = rt.statistics().recoveries
        paths = {p: after[p] - recovered.get(p, 0) for p in after if after[p] > recovered.get(p, 0)}
        return {"single": single, "node": node, "lost": len(lost), "paths": paths,
                "spare_there": spare_there, "failures": rt.statistics().failures}  # fmt: skip
    finally:
        rt.close()
        cluster.add_node(**WORKER)
        cluster.wait_for_nodes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=2)
    args = p.parse_args()
    hf_logging.set_verbosity_error()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    head = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        cluster.add_node(**WORKER)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    cluster.wait_for_nodes()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    rows: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    try:
        for _ in range(args.trials):
            for standby in rows:  # alternating, so both share the hour's load
                with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as tmp:
                    r = trial(cluster, Path(tmp), standby)
                    rows[standby].append(r)
                    print(f"  standby {standby}: one {r['single'][2]:.2f} s; node: lost "
                          f"{r['lost']}, first back {r['node'][1]:.2f} s, all {r['node'][2]:.2f}"
                          f" s, {r['paths']}, standby on the lost node: {r['spare_there']}",
                          flush=True)  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"{'standby':>7} {'lost':>5} {'one: detected s':>16} {'one: back s':>12} "
          f"{'node: detected s':>17} {'first back s':>13} {'all back s':>11}  paths (node)")
    for standby, got in rows.items():
        med = [[statistics.median(r[k][i] for r in got) for i in range(3)]
               for k in ("single", "node")]  # fmt: skip
        paths: dict[str, int] = {}
        for r in got:
            for k, n in r["paths"].items():
                paths[k] = paths.get(k, 0) + n
        print(f"{standby:>7} {sum(r['lost'] for r in got):>5} {med[0][0]:>16.2f} "
              f"{med[0][2]:>12.2f} {med[1][0]:>17.2f} {med[1][1]:>13.2f} {med[1][2]:>11.2f}  "
              f"{paths}" + ("  (a standby was on the lost node)"
                            if any(r["spare_there"] for r in got) else ""))  # fmt: skip
    print(f"({args.trials} trials; medians; 'lost' and paths summed over trials)")


if __name__ == "__main__":
    main()
