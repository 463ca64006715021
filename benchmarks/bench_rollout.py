"""The rollout path's cost, side by side in one run, on one engine (one group):

- ``inside``: the engine's own seconds for the batch (``Batch.elapsed_s``, lock held);
- ``direct``: the same batch sent to the engine's actor with one Ray call, no runtime;
- ``runtime``: ``rt.rollout`` (split, asyncio, certify, keep), the same batch;
- ``one-by-one``: today's single-request path, ``rt.generate`` per prompt (greedy only,
  so only the greedy rows have it).

The arms alternate within each repeat; medians over ``--repeats``. Then, with two groups,
kill to the first answer issued again: a rollout in flight on both, g0 killed, the time
from the kill to the call's return (its g0 prompts answered by g1).

    .venv/bin/python benchmarks/bench_rollout.py [--engine reference|vllm] [--repeats 5]
        [--prompts 32 128] [--kills 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers.utils import logging as hf_logging

from recovery_fsm.demo.run import DemoOptions, SyntheticTrainer, engine_class, model_config
from recovery_fsm.ray import RecoveryRuntime, Sampling

SAMPLINGS = {
    "greedy n=1": Sampling(max_new_tokens=32),
    "GRPO n=4 t=1": Sampling(max_new_tokens=32, temperature=1.0, n=4, logprobs=1),
}


def runtime(work: Path, engine: str, groups: list[str], config: dict[str, Any]) -> Any:
    return RecoveryRuntime(
        work / "ckpt", groups=groups, model_config=config, engine=engine_class(engine),
        tick_s=0.2, probe_interval_s=1.0, probe_timeout_s=5.0, grace_s=2.0,
        call_timeout_s=300.0,
    )  # fmt: skip


def prompts_of(k: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + j) % (vocab - 1) + 1 for j in range(8)] for i in range(k)]


def compare(
    rt: Any, prompts: list[list[int]], sampling: Sampling, repeats: int
) -> dict[str, float]:
    [actor] = rt.actors("g0")
    got: dict[str, list[float]] = {"inside": [], "direct": [], "runtime": [], "one-by-one": []}
    for _ in range(repeats):
        began = time.perf_counter()
        batch = ray.get(actor.rollout.remote(prompts, sampling))
        got["direct"].append(time.perf_counter() - began)
        got["inside"].append(batch.elapsed_s)
        began = time.perf_counter()
        rt.rollout(prompts, sampling)
        got["runtime"].append(time.perf_counter() - began)
        if sampling.temperature == 0:
            began = time.perf_counter()
            for p in prompts:
                rt.generate("g0", p, sampling.max_new_tokens)
            got["one-by-one"].append(time.perf_counter() - began)
    return {k: statistics.median(v) for k, v in got.items() if v}


def kill_to_answer(rt: Any, vocab: int, kills: int) -> list[float]:
    out = []
    sampling = Sampling(max_new_tokens=16, temperature=1.0, n=2)
    for _ in range(kills):
        while any(r is None for r in rt.routes.values()):
            time.sleep(0.05)  # both groups serving before each trial
        t = threading.Thread(target=rt.rollout, args=(prompts_of(16, vocab), sampling))
        t.start()
        while rt.rollouts.gate.in_flight() == 0:
            time.sleep(0.001)
        killed_at = time.perf_counter()
        rt.kill("g0")
        t.join(300)
        out.append(time.perf_counter() - killed_at)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--kills", type=int, default=3)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-rollout-"))
    config = model_config(DemoOptions(model="small"))
    vocab = int(config["vocab_size"])
    trainer = SyntheticTrainer(config, seed=0)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"engine {a.engine}, model small, {a.repeats} repeats (medians)")  # fmt: skip
    print(f"{'batch':>24} {'inside s':>9} {'direct s':>9} {'runtime s':>10} "
          f"{'runtime/direct':>15} {'runtime/inside':>15} {'one-by-one/runtime':>19}")
    with runtime(work / "one", a.engine, ["g0"], config) as rt:
        rt.start(trainer.model)
        for k in a.prompts:
            for name, sampling in SAMPLINGS.items():
                m = compare(rt, prompts_of(k, vocab), sampling, a.repeats)
                single = (f"{m['one-by-one'] / m['runtime']:.1f}x" if "one-by-one" in m
                          else "-")  # fmt: skip
                print(f"{f'{k} prompts, {name}':>24} {m['inside']:9.3f} {m['direct']:9.3f} "
                      f"{m['runtime']:10.3f} {m['runtime'] / m['direct']:14.2f}x "
                      f"{m['runtime'] / m['inside']:14.2f}x {single:>19}")
    if a.kills:
        with runtime(work / "two", a.engine, ["g0", "g1"], config) as rt:
            rt.start(trainer.model)
            trainer.step()
            rt.sync(trainer.model, 1)  # a killed group boots from C(1)
            while rt.controller.checkpoint_state(1) != "ready":
                time.sleep(0.05)
            took = kill_to_answer(rt, vocab, a.kills)
            stats = rt.statistics().rollouts
            print(f"kill to the call's return (16 prompts x 2, g0's issued again on g1): "
                  f"{', '.join(f'{x:.2f}' for x in took)} s; median {statistics.median(took):.2f}"
                  f" s; prompts issued again {stats.reissued}, duplicates {stats.duplicates}")
    ray.shutdown()


if __name__ == "__main__":
    main()
