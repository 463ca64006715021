"""CheckpointStore: scan, verify, safe delete; and SIGKILL during export never tears one."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from recovery_fsm import CorruptCheckpoint, UnsafePath
from recovery_fsm.export import MANIFEST, AsyncHFExporter, CheckpointStore, load_checkpoint


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    with AsyncHFExporter(tmp_path, max_shard_size="40KB") as ex:
        ex.export(1, _weights()).result(60)
        ex.export(2, _weights(1)).result(60)
    return CheckpointStore(tmp_path)


def test_scan_adopts_committed_and_removes_temporaries(store: CheckpointStore) -> None:
    root = store.root
    orphan = root / ".tmp-step-3-00ff00ff00ff"
    orphan.mkdir()
    (orphan / "model-00001-of-00002.safetensors").write_bytes(b"half")
    (root / "step-9").mkdir()  # renamed by hand, no manifest
    (root / "notes.txt").write_text("user file")
    (root / "step-7").symlink_to(root / "step-1")
    report = store.scan()
    assert report.committed == {1: root / "step-1", 2: root / "step-2"}
    assert report.removed_temp == [orphan] and not orphan.exists()
    assert [(p.name, "no recovery_manifest.json" in why) for p, why in report.invalid] == [
        ("step-9", True)
    ]
    assert sorted(p.name for p in report.ignored) == ["notes.txt", "step-7"]
    assert (root / "step-9").exists() and (root / "notes.txt").exists()


def test_verify_sizes_and_full_hash(store: CheckpointStore) -> None:
    path = store.path_for(1)
    shard = next(path.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    shard.write_bytes(bytes(data))
    store.verify(path)  # sizes still match
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        store.verify(path, full=True)
    with pytest.raises(CorruptCheckpoint, match="digest"):
        load_checkpoint(path, verify="sizes")
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptCheckpoint, match="bytes, manifest says"):
        store.verify(path)
    (path / MANIFEST).unlink()
    with pytest.raises(CorruptCheckpoint, match="not a committed checkpoint"):
        store.verify(path)


def test_delete_removes_a_checkpoint(store: CheckpointStore) -> None:
    store.delete(store.path_for(1))
    assert not store.path_for(1).exists()
    store.delete("step-2")  # relative to the root
    assert sorted(p.name for p in store.root.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda root: root.parent / "step-1", "direct children"),
        (lambda root: root / "step-1" / "model.safetensors", "direct children"),
        (lambda root: root / ".." / root.name / "step-1", "'..'"),
        (lambda root: "../step-1", "'..'"),
        (lambda root: root / "notes", "name must be"),
        (lambda root: root / "step-1x", "name must be"),
        (lambda root: "/etc", "direct children"),
        (lambda root: root / "step-5", "symlink"),
    ],
)
def test_unsafe_deletes_are_refused_and_change_nothing(
    store: CheckpointStore, make: object, words: str
) -> None:
    root = store.root
    (root / "notes").mkdir()
    (root / "step-5").symlink_to(root / "step-1")
    before = sorted(p.name for p in root.rglob("*"))
    with pytest.raises(UnsafePath, match=words):
        store.delete(make(root))  # type: ignore[operator]
    assert sorted(p.name for p in root.rglob("*")) == before


def test_symlink_pointing_outside_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (store.root / "step-8").symlink_to(outside)
    with pytest.raises(UnsafePath, match="symlink"):
        store.delete(store.root / "step-8")
    assert (outside / "precious").read_text() == "keep"


def test_delete_of_a_missing_checkpoint_says_so(store: CheckpointStore) -> None:
    with pytest.raises(FileNotFoundError):
        store.delete("step-42")


CHILD = textwrap.dedent(
    """
    import sys, torch
    from recovery_fsm.export import AsyncHFExporter
    root, start = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(start)
    weights = {f"w.{i}": torch.randn(256, 256, generator=g) for i in range(24)}
    print("ready", flush=True)
    with AsyncHFExporter(root, max_shard_size="600KB", write_threads=2) as ex:
        for v in range(start, start + 1000):
            ex.export(v, weights).result()
            print(v, flush=True)
    """
)


def test_sigkill_mid_export_never_leaves_a_torn_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "root"
    start = 0
    torn = trials = 0
    # Kill until enough kills landed mid-write (how many do depends on the machine's load).
    while torn < 4 and trials < 40:
        trials += 1
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"  # imports done, exports begin
        time.sleep(rng.uniform(0.05, 0.8))  # a random point in the stream of exports
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        reported = [int(v) for v in out.split()]
        report = CheckpointStore(root).scan()
        torn += len(report.removed_temp)
        assert report.invalid == []
        assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
        # Every checkpoint the child saw committed is on disk, complete and loadable.
        assert set(reported) <= set(report.committed)
        for version, path in report.committed.items():
            assert load_checkpoint(path, verify="full").version == version
        start = max([start, *report.committed]) + 1
    # The kills did land mid-write: the scans found and removed half-written exports.
    assert torn >= 4, f"only {torn} of {trials} kills landed mid-write"
