"""Drives ``soak_trainer.py`` on a multi-node test cluster: a run to ``crash_at`` whose trainer
SIGKILLs itself, then a trainer that resumes it to ``steps``; the driver removes one worker
node when the resumed run's samples pass ``node_loss_at`` and adds one back at ``node_back_at``.
Returns every JSON line the trainers printed, and what the driver did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TRAINER = Path(__file__).with_name("soak_trainer.py")
WORKER = {"num_cpus": 2, "resources": {"rollout": 8}}


def soak(
    cluster: Any,
    work: Path,
    *,
    steps: int,
    crash_at: int,
    node_loss_at: int,
    node_back_at: int,
    **flags: Any,
) -> dict[str, Any]:
    base = [
        sys.executable, str(TRAINER), "--address", cluster.address,
        "--root", str(work / "ckpt"), "--journal", str(work / "journal.jsonl"),
        "--run", f"soak-{work.name}", "--steps", str(steps), "--crash-at", str(crash_at),
        "--placed", *[x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))],
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    out: dict[str, Any] = {"before": [], "after": [], "node": []}
    first = subprocess.run([*base[:2], "start", *base[2:]], capture_output=True, text=True,
                           env=env, timeout=3600, check=False)  # fmt: skip
    out["crash_code"] = first.returncode
    out["before"] = [json.loads(x) for x in first.stdout.splitlines() if x.startswith("{")]
    if first.returncode != -9:
        out["stderr"] = first.stderr[-4000:]
        return out
    with subprocess.Popen([*base[:2], "resume", *base[2:]], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as child:  # fmt: skip
        assert child.stdout is not None
        removed = None
        for line in child.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            out["after"].append(record)
            at = record.get("step", 0)
            if removed is None and at >= node_loss_at:
                removed = cluster.list_all_nodes()[-1]
                cluster.remove_node(removed)
                out["node"].append(("removed", at))
            elif removed is not None and at >= node_back_at and len(out["node"]) == 1:
                cluster.add_node(**WORKER)
                out["node"].append(("added", at))
        out["resume_code"] = child.wait(timeout=600)
        out["stderr"] = child.stderr.read()[-4000:] if child.stderr else ""
    return out
