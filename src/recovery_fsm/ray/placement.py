"""Where groups may run: the checkpoint root must be the same directory on every node."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from .. import RecoveryError
from ..export.store import is_shared_marker, shared_marker_name

log = logging.getLogger(__name__)


class SharedRootError(RecoveryError):
    """The checkpoint root is not the same directory on every node a group may restart on."""


def check_shared_root(root: Path, actor_options: Mapping[str, Any], timeout_s: float = 60.0) -> int:
    """Refuse to run unless every alive node a group may be placed on (those with the
    custom ``resources`` the actors ask for) reads the same marker file under ``root``:
    a restart on a node that cannot see the checkpoint would fail at the worst moment.
    Returns how many nodes were checked.

    Markers that earlier checks left (a process killed mid-check never ran its ``finally``)
    are removed first: every start and resume checks, so none stays for good. The root is
    one run's: a check running at the same time from another process would lose its marker
    and refuse, never pass wrongly."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = dict(actor_options.get("resources") or {})
    nodes = [
        n
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in wanted.items())
    ]
    if not nodes:
        raise SharedRootError(f"no alive node offers the resources the groups ask for: {wanted}")
    remove_stale_markers(root)
    token = uuid.uuid4().hex
    marker = root / shared_marker_name(token)
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


def remove_stale_markers(root: Path) -> list[Path]:
    """Remove the markers killed checks left in ``root``: regular files named exactly as
    ``check_shared_root`` names them, nothing else (not a symlink, not a directory, never a
    checkpoint). Returns those removed."""
    removed = []
    for child in Path(root).iterdir():
        if is_shared_marker(child.name) and not child.is_symlink() and child.is_file():
            child.unlink(missing_ok=True)
            removed.append(child)
    if removed:
        log.warning("removed %d shared-root marker(s) a killed check left in %s: %s",
                    len(removed), root, sorted(p.name for p in removed))  # fmt: skip
    return removed


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None
