"""A trainer's crash and resume, for real: a trainer process (``tests/procs/resume_trainer.py``)
runs a named run on a local Ray cluster, SIGKILLs itself at each point (mid-sync, mid-export,
mid-recovery, and after a recovery), and a new process resumes at its pinned version, from
the journal or, the journal deleted, from the checkpoint store. Prints, per point and
source, the resume's wall time and engine boots beside the fresh start's (what restarting
the fleet would cost: every engine booted again). With ``--standby N`` the run keeps N warm
standbys (a kill mid-recovery then lands mid-claim); a standby that survived is kept from
the journal and booted again from the store.

    .venv/bin/python benchmarks/bench_resume.py [--trials 2] [--standby 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray

TRAINER = Path(__file__).resolve().parents[1] / "tests" / "procs" / "resume_trainer.py"
POINTS = ("sync", "export", "recovery", "recovered")
SOURCES = ("journal", "store")


def run(mode: str, work: Path, run_name: str, at: str = "", standby: int = 0) -> dict[str, Any]:
    cmd = [
        sys.executable, str(TRAINER), mode, "--address", ray.get_runtime_context().gcs_address,
        "--root", str(work / "ckpt"), "--journal", str(work / "journal.jsonl"),
        "--run", run_name, "--at", at, "--standby", str(standby),
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise SystemExit(f"{mode} at {at!r} printed nothing:\n{done.stderr[-3000:]}")
    return lines[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--standby", type=int, default=0, help="warm standbys in the run")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {
        (at, src): [] for at in POINTS for src in SOURCES
    }
    try:
        for trial in range(args.trials):
            for at, src in rows:  # alternating, so every cell shares the hour's load
                with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
                    work, name = Path(tmp), f"bench-{trial}-{at}-{src}"
                    crashed = run("crash", work, name, at, args.standby)
                    if src == "store":
                        (work / "journal.jsonl").unlink()
                    resumed = run("resume", work, name, standby=args.standby)
                    rows[at, src].append({**resumed, "start_s": crashed["start_s"]})
    finally:
        ray.shutdown()
    print(f"{'killed at':<10} {'from':<8} {'resume s':>9} {'start s':>8} {'boots':>6} "
          f"{'fresh boots':>12} {'adopted':>8} {'reloaded':>9} {'restarted':>10} "
          f"{'standbys kept':>14} {'replay':>7}")  # fmt: skip
    for (at, src), got in rows.items():
        found = [g["resumption"] for g in got]
        print(
            f"{at:<10} {src:<8} {statistics.median(g['resume_s'] for g in got):>9.2f} "
            f"{statistics.median(g['start_s'] for g in got):>8.2f} "
            f"{max(g['boots_at_resume'] for g in got):>6} {2 + args.standby:>12} "
            f"{sum(len(f['adopted']) for f in found):>8} "
            f"{sum(len(f['reloaded']) for f in found):>9} "
            f"{sum(len(f['restarted']) for f in found):>10} "
            f"{sum(len(f['standbys']) for f in found):>14} "
            f"{'clean' if all(g['replay_ok'] for g in got) else 'DIRTY':>7}"
        )
    print(f"({args.trials} trials per point; medians; adopted/reloaded/restarted summed over "
          "trials; 'fresh boots': engines a restart of the whole fleet would boot)")  # fmt: skip


if __name__ == "__main__":
    main()
