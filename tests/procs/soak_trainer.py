"""A long run's trainer in its own process (``tests/procs/soak.py`` drives it): three groups
and a standby on the driver's Ray cluster, a weight sync and export per step, a group killed
every few steps, the trainer's checkpoint (a pinned recovery checkpoint) every ``pin`` steps,
of which it keeps the last ``keep`` (an older one is unpinned, and deleted).
``start`` runs to ``--crash-at`` and SIGKILLs itself with that step's export in flight;
``resume`` takes the run over at the last pinned version and runs to ``--steps``. Each prints
a JSON line per sample and one at the end."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import ray
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from recovery_fsm import RecoveryConfig
from recovery_fsm.ray import RecoveryRuntime
from recovery_fsm.search.replay import replay

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TINY_LLAMA

GROUPS = ["g0", "g1", "g2"]
PLACED = {"resources": {"rollout": 1}, "scheduling_strategy": "SPREAD"}


def model(version: int) -> Any:
    torch.manual_seed(5000 + version)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()


def options(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        groups=GROUPS,
        model_config=LlamaConfig(**TINY_LLAMA).to_dict(),
        config=RecoveryConfig(restart_budget=5, restart_window_s=a.window_s),
        standby=1,
        actor_options=PLACED if a.placed else None,
        tick_s=0.2,
        probe_interval_s=1.0,
        probe_timeout_s=3.0,
        grace_s=2.0,
        call_timeout_s=60.0,
    )


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def sample(rt: RecoveryRuntime, a: argparse.Namespace, v: int) -> None:
    snap = rt.controller.snapshot()
    kept = rt.bookkeeping()
    remembered = kept.pop("safety.deleted")  # the last 256 deleted paths, by design
    emit(step=v, rss_mb=round(rss_mb()), checkpoints=len(snap["checkpoints"]),
         finished=len(snap["finished"]), starts=len(snap["starts"]),
         standbys=len(snap["standbys"]), runtime=sum(kept.values()), remembered=remembered,
         journal_bytes=Path(a.journal).stat().st_size, failures=rt.ledger.failures,
         states={g: s.state for g, s in rt.controller.groups().items()})  # fmt: skip


def steps(rt: RecoveryRuntime, a: argparse.Namespace, first: int, last: int) -> None:
    for v in range(first, last + 1):
        m = model(v)
        got = rt.push(m, v)
        handle = rt.synced(v, got, m, pinned=v % a.pin == 0)
        if v == a.crash_at and a.mode == "start":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # its export in flight
        handle.result(timeout=120)
        old = v - a.keep * a.pin  # the trainer rotates its checkpoints: keep the last few
        if v % a.pin == 0 and old > 0:
            rt.unpin(old)
        if v % a.chaos_every == 0:
            serving = [g for g, s in rt.controller.groups().items() if s.serving]
            if serving:
                rt.kill(random.Random(v).choice(serving))
        if v % a.sample_every == 0:
            sample(rt, a, v)
        time.sleep(a.step_s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["start", "resume"])
    for name in ("--address", "--root", "--journal", "--run"):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--crash-at", type=int, default=250)
    p.add_argument("--pin", type=int, default=20)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--chaos-every", type=int, default=10)
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--placed", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    ray.init(address=a.address, log_to_driver=False, logging_level="ERROR")
    if a.mode == "start":
        rt = RecoveryRuntime(a.root, run=a.run, journal=a.journal, **options(a))
        rt.start(model(0))
        steps(rt, a, 1, a.crash_at)
        raise SystemExit("the trainer was to crash")
    resumed_at = a.crash_at // a.pin * a.pin
    t0 = time.perf_counter()
    rt, found = RecoveryRuntime.resume(
        a.root, run=a.run, version=resumed_at, journal=a.journal, **options(a)
    )
    emit(resumed=attrs.asdict(found), resume_s=round(time.perf_counter() - t0, 2),
         boots=rt.launcher.boots)  # fmt: skip
    steps(rt, a, resumed_at + 1, a.steps)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        s.state in {"active", "retired"} for s in rt.controller.groups().values()
    ):
        time.sleep(0.2)
    states = {g: s.state for g, s in rt.controller.groups().items()}
    stats = rt.statistics()
    drained = rt.close()
    report = replay(a.journal)
    emit(final=True, states=states, failures=stats.failures, recoveries=dict(stats.recoveries),
         loads_from_deleted=stats.loads_from_deleted, lost_reports=stats.lost_reports,
         drained=drained, dirs=sorted(os.listdir(a.root)), replay_ok=report.ok,
         replay=report.render()[-2000:], boots=rt.launcher.boots)  # fmt: skip


if __name__ == "__main__":
    main()
