"""A private Ray cluster on this machine, for the demo, ``recovery-fsm serve`` and tests.

``ray.init(num_cpus=...)`` without an address joins a cluster another process started on
the machine (``ray start --head`` records it in the temporary folder) and then refuses
``num_cpus``; ``address="local"`` always starts a cluster of the caller's own, which ends
with the caller's process. To run on a cluster that is already up, call ``ray.init`` with
its address instead (``"auto"`` for the one recorded here).
"""

from __future__ import annotations

import os
from typing import Any

import ray


def start_local_cluster(num_cpus: int | None = None, **options: Any) -> None:
    """Start a Ray cluster of this process's own: no dashboard, no usage statistics, no
    worker logs on this process's terminal (``options`` go to ``ray.init``)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        **{"include_dashboard": False, "log_to_driver": False, **options},
    )
