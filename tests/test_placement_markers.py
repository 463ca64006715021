"""A shared-root check killed mid-way leaves its marker under the checkpoint root; the next
check (every start and resume runs one) removes it, and nothing else. The store never takes
a marker for a checkpoint or a temporary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from recovery_fsm.export import AsyncHFExporter, CheckpointStore
from recovery_fsm.export.store import is_shared_marker, shared_marker_name

# The check as a trainer's process runs it, joined to this test's cluster, its node reader
# stuck: killed (SIGKILL) there, its `finally` never runs.
KILLED_CHECK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import ray
    from recovery_fsm.ray import placement

    def stuck(path):
        time.sleep(120)

    placement._read_marker = stuck
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
    placement.check_shared_root(Path(sys.argv[2]), {})
""")


def committed(root: Path) -> Path:
    """A real checkpoint, written by the exporter."""
    g = torch.Generator().manual_seed(0)
    with AsyncHFExporter(root) as ex:
        ex.export(1, {"w": torch.randn(8, 8, generator=g)}).result(60)
    return root / "step-1"


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def markers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if is_shared_marker(p.name))


@pytest.mark.usefixtures("ray_cluster")
def test_the_next_check_removes_the_marker_a_killed_check_left(tmp_path: Path) -> None:
    import ray

    from recovery_fsm.ray.placement import check_shared_root

    root = tmp_path / "ckpt"
    checkpoint = committed(root)
    before = snapshot(checkpoint)
    # Beside it, what is not a marker though named like one: all left alone.
    lookalike_dir = root / shared_marker_name("0" * 32)
    lookalike_dir.mkdir()
    (root / ".recovery-fsm-shared-notes.txt").write_text("a user's file")
    (root / shared_marker_name("1" * 32)).symlink_to(checkpoint / "recovery_manifest.json")

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CHECK, address, str(root)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is not None or any(
            p.is_file() and not p.is_symlink() for p in root.iterdir() if is_shared_marker(p.name)
        ), timeout=120, what="the check's marker")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    [left] = [p for p in root.iterdir()
              if is_shared_marker(p.name) and p.is_file() and not p.is_symlink()]  # fmt: skip
    assert left.read_text() == left.name.rsplit("-", 1)[1]  # the killed check's own marker

    scan = CheckpointStore(root).scan()  # as a resume's scan finds it first
    assert scan.committed == {1: checkpoint} and left in scan.ignored
    assert not scan.removed_temp and not scan.invalid

    assert check_shared_root(root, {}) == 1
    assert not left.exists()
    assert markers(root) == sorted([lookalike_dir.name, shared_marker_name("1" * 32)])
    assert lookalike_dir.is_dir() and (root / ".recovery-fsm-shared-notes.txt").is_file()
    assert snapshot(checkpoint) == before
    assert CheckpointStore(root).scan().committed == {1: checkpoint}


def test_scan_takes_a_marker_for_neither_a_checkpoint_nor_a_temporary(tmp_path: Path) -> None:
    """Not even one that is a directory: it is left where it is, ignored."""
    checkpoint = committed(tmp_path)
    file_marker = tmp_path / shared_marker_name("a" * 32)
    file_marker.write_text("a" * 32)
    dir_marker = tmp_path / shared_marker_name("b" * 32)
    dir_marker.mkdir()
    report = CheckpointStore(tmp_path).scan()
    assert report.committed == {1: checkpoint}
    assert not report.removed_temp and not report.invalid
    assert sorted(report.ignored) == sorted([file_marker, dir_marker])
    assert file_marker.is_file() and dir_marker.is_dir()
