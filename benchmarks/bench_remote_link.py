"""How long ``RemoteLink.join`` and ``close`` take once the controller actor's outbox is
empty: a link's reader thread waits for effects in a loop, and a caller that needs its lock
must get it between two waits.

Until the fix, the reader held the lock across each wait, took it back at once after an
empty one, and a join waited tens of seconds, a close over a minute, on a quiet machine.

    .venv/bin/python benchmarks/bench_remote_link.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray

from recovery_fsm import events as ev
from recovery_fsm.ray import RecoveryControllerActor, RemoteLink


def one(k: int) -> tuple[float, float]:
    actor = RecoveryControllerActor.launch(f"bench-link-{os.getpid()}-{k}")
    try:
        link = RemoteLink(actor, execute=lambda _effect: None)
        link.send(ev.GroupRegistered, group="g0", version=0)
        link.send(ev.GroupFailed, group="g0", incarnation=1)
        began = time.monotonic()
        assert link.join(120)
        joined = time.monotonic() - began
        began = time.monotonic()
        assert link.close(120)
        return joined, time.monotonic() - began
    finally:
        ray.kill(actor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = [one(k) for k in range(args.repeats)]
    finally:
        ray.shutdown()
    joins, closes = zip(*rows, strict=True)
    print(f"{'':8} {'median s':>9} {'max s':>7}  ({args.repeats} links)")
    for name, xs in (("join", joins), ("close", closes)):
        print(f"{name:8} {statistics.median(xs):9.3f} {max(xs):7.3f}")


if __name__ == "__main__":
    main()
