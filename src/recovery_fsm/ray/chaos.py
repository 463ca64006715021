"""Engines that misbehave on request, for chaos tests, benchmarks and demos."""

from __future__ import annotations

import os
import time

import ray

from .engine import ReferenceEngine


def hangable(flags: str) -> type[ReferenceEngine]:
    """A reference engine whose probe hangs while the file ``<flags>/<group>`` exists.

    Made inside a function so that Ray ships the class by value, ``flags`` included."""

    class HangableEngine(ReferenceEngine):
        @ray.method(concurrency_group="health")
        def ping(self, stall_s: float | None = None) -> int | None:
            while os.path.exists(os.path.join(flags, self.group)):
                time.sleep(0.05)
            return self.held.version

    return HangableEngine
