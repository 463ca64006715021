"""CheckpointStore: scan, verify, safe delete; and SIGKILL during export never tears one."""

from __future__ import annotations

import json
import random
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # one bit: the size stays the same
    path.write_bytes(bytes(data))


def _data_offsets(shard: Path) -> tuple[int, int]:
    """Where the tensor data of a safetensors file begins, and its size."""
    n = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    return 8 + n, shard.stat().st_size


def _targets(store: CheckpointStore) -> list[tuple[str, int, int]]:
    """Every shard of step-1, with a byte in its header, its first, a middle and its last
    data byte: a bit flipped at any of them must be refused."""
    out = []
    for i, shard in enumerate(sorted(store.path_for(1).glob("model-*.safetensors"))):
        begin, end = _data_offsets(shard)
        for where in (20, begin, (begin + end) // 2, end - 1):
            out.append((shard.name, i, where))
    return out


def test_a_bit_flip_anywhere_is_refused_by_every_recovery_load(store: CheckpointStore) -> None:
    path = store.path_for(1)
    targets = _targets(store)
    assert len({name for name, _, _ in targets}) > 1  # more than one shard
    for name, _, offset in targets:
        original = (path / name).read_bytes()
        _flip(path / name, offset)
        try:
            store.verify(path)  # sizes alone: the flip is not seen (documented)
            for load in (load_checkpoint, lambda p: store.verify(p, full=True)):
                with pytest.raises(CorruptCheckpoint, match="digest"):
                    load(path)
            report = store.scan(full=True)
            assert [p for p, _ in report.invalid] == [path], (name, offset)
            assert set(report.committed) == {2}
            # scan()'s default adopts on sizes; the load that boots a group refuses it.
            assert 1 in store.scan().committed
        finally:
            (path / name).write_bytes(original)
    assert load_checkpoint(path).version == 1


def test_a_bit_flip_in_a_config_file_is_refused(tmp_path: Path) -> None:
    with AsyncHFExporter(tmp_path) as ex:
        ex.export(1, _weights(), config={"architectures": ["X"], "model_type": "llama"})
        ex.close()
    path = tmp_path / "step-1"
    _flip(path / "config.json", 5)
    with pytest.raises(CorruptCheckpoint, match=r"config\.json does not match"):
        load_checkpoint(path)


def test_size_and_manifest_checks(store: CheckpointStore) -> None:
    path = store.path_for(1)
    shard = next(path.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpoint, match="bytes, manifest says"):
        store.verify(path)
    with pytest.raises(CorruptCheckpoint, match="bytes, manifest says"):
        load_checkpoint(path)
    other = store.path_for(2)
    manifest = json.loads((other / MANIFEST).read_text())
    del manifest["shards"][shard.name]["header_digest"]
    (other / MANIFEST).write_text(json.dumps(manifest))
    store.verify(other)  # the sizes still hold
    for check in (lambda p: store.verify(p, full=True), load_checkpoint):
        with pytest.raises(CorruptCheckpoint, match="malformed"):
            check(other)
    (path / MANIFEST).unlink()
    with pytest.raises(CorruptCheckpoint, match="not a committed checkpoint"):
        store.verify(path)


def test_a_name_with_a_trailing_newline_is_not_a_checkpoint(store: CheckpointStore) -> None:
    root = store.root
    (root / "step-1").rename(root / "step-1\n")
    report = store.scan()
    assert report.committed == {2: root / "step-2"}
    assert root / "step-1\n" in report.ignored
    with pytest.raises(UnsafePath, match="name must be"):
        store.delete(root / "step-1\n")
    assert (root / "step-1\n").is_dir()


def test_delete_through_a_symlinked_root(store: CheckpointStore, tmp_path: Path) -> None:
    link = tmp_path.parent / f"{tmp_path.name}-link"
    link.symlink_to(store.root)
    via_link = CheckpointStore(link)
    assert via_link.root == store.root
    via_link.delete(link / "step-1")
    assert not store.path_for(1).exists() and store.path_for(2).is_dir()
    link.unlink()


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
            assert load_checkpoint(path).version == version
        start = max([start, *report.committed]) + 1
    # The kills did land mid-write: the scans found and removed half-written exports.
    assert torn >= 4, f"only {torn} of {trials} kills landed mid-write"


def test_load_model_of_a_checkpoint_without_config_says_why(store: CheckpointStore) -> None:
    from recovery_fsm.export import load_model

    with pytest.raises(CorruptCheckpoint, match=r"no config\.json"):
        load_model(store.path_for(1))


def test_a_checkpoint_under_another_versions_name_is_refused(store: CheckpointStore) -> None:
    import shutil

    shutil.copytree(store.path_for(2), store.root / "step-5")
    with pytest.raises(CorruptCheckpoint, match="names version 2"):
        load_checkpoint(store.root / "step-5")
    assert 5 not in store.scan().committed


# Spellings int() reads as 2 that the store never writes: leading zeros, other scripts'
# digits (Arabic-Indic, fullwidth), and a superscript that isdigit() accepts but int() does not.
NOT_OURS = ["step-02", "step-002", "step-\u0662", "step-\uff12", "step-\u00b2"]


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_only_the_canonical_name_is_adopted_and_none_hides_the_real_one(
    store: CheckpointStore,
) -> None:
    import shutil

    root = store.root
    for name in NOT_OURS:
        shutil.copytree(store.path_for(2), root / name)  # manifests that name version 2
    report = store.scan()
    assert report.committed == {1: root / "step-1", 2: root / "step-2"}
    assert sorted(p.name for p in report.ignored) == sorted(NOT_OURS)
    assert report.invalid == []
    assert all((root / name).is_dir() for name in NOT_OURS)
    # Without the real one, no look-alike stands in for it.
    shutil.rmtree(store.path_for(2))
    assert store.scan().committed == {1: root / "step-1"}


@pytest.mark.parametrize("name", NOT_OURS)
def test_a_look_alike_name_is_neither_deleted_nor_loaded(store: CheckpointStore, name: str) -> None:
    import shutil

    root = store.root
    shutil.copytree(store.path_for(2), root / name)
    before = _tree(root)
    for given in (root / name, name):
        with pytest.raises(UnsafePath, match="name must be"):
            store.delete(given)
    with pytest.raises(CorruptCheckpoint, match="not a name the store writes"):
        load_checkpoint(root / name)
    assert _tree(root) == before


@pytest.mark.parametrize("name", [".tmp-step-02-00ff00ff00ff", ".tmp-step-\u0662-00ff00ff00ff",
                                  ".tmp-step-2-00ff", ".tmp-step-2-00ff00ff00ff00"])  # fmt: skip
def test_a_look_alike_temporary_is_not_removed(store: CheckpointStore, name: str) -> None:
    root = store.root
    (root / name).mkdir()
    (root / name / "keep").write_text("not the store's")
    report = store.scan()
    assert report.removed_temp == [] and report.ignored == [root / name]
    with pytest.raises(UnsafePath, match="name must be"):
        store.delete(root / name)
    assert (root / name / "keep").read_text() == "not the store's"


@pytest.mark.parametrize("version", [-1, "2", True, 2.0, None])
def test_a_path_for_a_version_that_is_not_one_is_refused(
    store: CheckpointStore, version: object
) -> None:
    before = _tree(store.root)
    for make in (store.path_for, store.temp_path):
        with pytest.raises(UnsafePath, match="version"):
            make(version)  # type: ignore[arg-type]
    assert _tree(store.root) == before


@pytest.mark.parametrize("version", [7.0, "2", "002", True, -2])
def test_a_manifest_version_that_is_not_an_int_is_refused(
    store: CheckpointStore, version: object
) -> None:
    path = store.path_for(2)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(manifest | {"version": version}))
    for check in (store.verify, load_checkpoint):
        with pytest.raises(CorruptCheckpoint, match="not an int"):
            check(path)
    assert set(store.scan().committed) == {1}


def test_loading_a_missing_path_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpoint, match="not a directory"):
        load_checkpoint(tmp_path / "absent" / "step-1")
    assert list(tmp_path.iterdir()) == []


def _stray_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"layer.0.weight": torch.zeros(64, 64)}, str(path))


@pytest.mark.parametrize(
    ("name", "make"),
    [
        # What vLLM would load beside the listed shards: it globs *.safetensors.
        ("model-00004-of-00004.safetensors", _stray_safetensors),
        ("notes.txt", lambda p: p.write_text("dropped in by hand")),
        (".hidden", lambda p: p.write_bytes(b"")),
        ("sub", lambda p: p.mkdir()),
    ],
)
def test_a_file_the_manifest_does_not_list_is_refused(
    store: CheckpointStore, name: str, make: Any
) -> None:
    path = store.path_for(1)
    make(path / name)
    before = _tree(store.root)
    for check in (store.verify, lambda p: store.verify(p, full=True), load_checkpoint):
        with pytest.raises(CorruptCheckpoint, match=f"{re.escape(name)} is not listed"):
            check(path)
    for full in (False, True):
        report = store.scan(full=full)
        assert set(report.committed) == {2}
        assert [(p, name in why) for p, why in report.invalid] == [(path, True)]
    assert _tree(store.root) == before  # refused, not cleaned up: it is not the store's file


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(
    store: CheckpointStore,
) -> None:
    from recovery_fsm.export.store import file_digest

    path, other = store.path_for(1), store.path_for(2)
    manifest = json.loads((path / MANIFEST).read_text())
    outside = next(other.glob("*.safetensors"))
    name = f"../{other.name}/{outside.name}"
    manifest["files"][name] = {
        "size": outside.stat().st_size,
        "digest": file_digest(outside, manifest["hash"]),
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    for check in (store.verify, lambda p: store.verify(p, full=True), load_checkpoint):
        with pytest.raises(CorruptCheckpoint, match=f"{re.escape(name)} listed .* is missing"):
            check(path)


def test_a_listed_file_that_is_a_symlink_is_refused(store: CheckpointStore) -> None:
    import shutil

    path = store.path_for(1)
    shard = next(path.glob("*.safetensors"))
    kept = store.root.parent / f"{store.root.name}-{shard.name}"
    shutil.move(shard, kept)  # the same bytes, now outside the checkpoint
    shard.symlink_to(kept)
    for check in (store.verify, lambda p: store.verify(p, full=True), load_checkpoint):
        with pytest.raises(CorruptCheckpoint, match=f"{shard.name} listed .* is missing"):
            check(path)
