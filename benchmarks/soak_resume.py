"""A long run through a trainer's crash and a node's loss: three groups and a standby on Ray's
multi-node test cluster (a head and two worker raylets on this machine), a sync and export per
step, a group killed every ``--chaos-every`` steps, the trainer's checkpoint pinned every
``--pin`` (the last ``--keep`` kept, older ones unpinned). The trainer process SIGKILLs itself
at ``--crash-at`` (its export in flight); a new one resumes at the last pinned version and
runs to ``--steps``; one worker node is removed at ``--node-loss-at`` and one added at
``--node-back-at`` (at the first sample past each). Prints the samples as a table (driver
RSS, the controller's tables, the runtime's bookkeeping, journal bytes per step) and the end.

    .venv/bin/python benchmarks/soak_resume.py [--steps 500] [--crash-at 255] [--pin 20]
        [--keep 2] [--chaos-every 20] [--node-loss-at 375] [--node-back-at 425]
        [--step-s 0.5] [--sample-every 25]

The CI runs a short version (``tests/test_node_loss.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "procs"))
from soak import WORKER, soak

COLUMNS = ("step", "rss_mb", "checkpoints", "finished", "starts", "standbys", "runtime",
           "remembered", "failures")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--crash-at", type=int, default=255)
    p.add_argument("--pin", type=int, default=20)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--node-loss-at", type=int, default=375)
    p.add_argument("--node-back-at", type=int, default=425)
    p.add_argument("--chaos-every", type=int, default=20)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--step-s", type=float, default=0.5)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    head = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        cluster.add_node(**WORKER)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    cluster.wait_for_nodes()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {a.steps} "
          f"steps, crash at {a.crash_at}, node lost at {a.node_loss_at}, back at "
          f"{a.node_back_at}")  # fmt: skip
    start = time.monotonic()
    try:
        out = soak(
            cluster, Path(tempfile.mkdtemp(prefix="recovery-fsm-soak-resume-")),
            steps=a.steps, crash_at=a.crash_at, node_loss_at=a.node_loss_at,
            node_back_at=a.node_back_at, pin=a.pin, keep=a.keep, chaos_every=a.chaos_every,
            sample_every=a.sample_every, step_s=a.step_s,
        )  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    samples = [r for r in out["before"] + out["after"] if "step" in r]
    print("| " + " | ".join(COLUMNS) + " | active | journal bytes/step |")
    print("|" + "---|" * (len(COLUMNS) + 2))
    last_step, last_bytes = 0, 0
    for r in samples:
        per = (r["journal_bytes"] - last_bytes) / max(1, r["step"] - last_step)
        if r["step"] <= last_step:  # the resumed run re-runs steps after its version
            per = float("nan")
        active = sum(state == "active" for state in r["states"].values())
        print("| " + " | ".join(str(r[c]) for c in COLUMNS) + f" | {active} | {per:.0f} |")
        last_step, last_bytes = r["step"], r["journal_bytes"]
    resumed = next((r for r in out["after"] if "resumed" in r), None)
    final = next((r for r in out["after"] if r.get("final")), None)
    print(f"{time.monotonic() - start:.0f} s; crash exit {out.get('crash_code')}, resume exit "
          f"{out.get('resume_code')}; node {out['node']}")  # fmt: skip
    print(f"resume: {resumed}")
    print(f"end: {final}")
    if final is None:
        print(out.get("stderr", ""))


if __name__ == "__main__":
    main()
