"""Where groups may run: the checkpoint root must be the same directory on every node."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from .. import RecoveryError


class SharedRootError(RecoveryError):
    """The checkpoint root is not the same directory on every node a group may restart on."""


def check_shared_root(root: Path, actor_options: Mapping[str, Any], timeout_s: float = 60.0) -> int:
    """Refuse to run unless every alive node a group may be placed on (those with the
    custom ``resources`` the actors ask for) reads the same marker file under ``root``:
    a restart on a node that cannot see the checkpoint would fail at the worst moment.
    Returns how many nodes were checked."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = dict(actor_options.get("resources") or {})
    nodes = [
        n
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in wanted.items())
    ]
    if not nodes:
        raise SharedRootError(f"no alive node offers the resources the groups ask for: {wanted}")
    token = uuid.uuid4().hex
    marker = root / f".recovery-fsm-shared-{token}"
    marker.write_text(token)
    try:
        read = ray.remote(num_cpus=0)(_read_marker)
        refs = [
            read.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(marker))
            for n in nodes
        ]
        seen = ray.get(refs, timeout=timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    pairs = zip(nodes, seen, strict=True)
    blind = [n.get("NodeManagerAddress", n["NodeID"]) for n, s in pairs if s != token]
    if blind:
        raise SharedRootError(
            f"{root} is not shared: nodes {blind} do not see it. Put the checkpoint root on a "
            "filesystem every node mounts at the same path, or restrict the groups to nodes "
            "that do (actor_options resources)"
        )
    return len(nodes)


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None
