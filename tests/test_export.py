"""The exporter against real files, real tensors and a tiny Llama built from a config."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

from recovery_fsm import (
    BadExportInput,
    CorruptCheckpoint,
    ExportCancelledError,
    RecoveryController,
)
from recovery_fsm import events as ev
from recovery_fsm.effects import RestartFromCheckpoint
from recovery_fsm.export import (
    MANIFEST,
    AsyncHFExporter,
    CheckpointStore,
    FailedReport,
    digest_of,
    load_checkpoint,
    load_model,
)
from recovery_fsm.host import ControllerLink


def tiny_config(**overrides: Any) -> LlamaConfig:
    base: dict[str, Any] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    base.update(overrides)
    return LlamaConfig(**base)


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config()).eval()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, cls: type, **fields: Any) -> None:
        with self.lock:
            self.events.append((cls.__name__, fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def test_sharded_round_trip_is_bit_identical(model: Any, tmp_path: Path) -> None:
    rec = Recorder()
    with AsyncHFExporter(tmp_path, report=rec, max_shard_size="60KB") as ex:
        path = ex.export(3, model.state_dict(), config=model.config,
                         generation_config=model.generation_config).result(60)  # fmt: skip
    assert path == tmp_path / "step-3"
    assert rec.kinds() == ["ExportStarted", "ExportCommitted"]
    assert rec.events[1][1] == {"version": 3, "path": str(path)}

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd) - {"lm_head.weight"}  # tied: saved once
    on_disk: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            on_disk.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in on_disk.values())  # fmt: skip
    for name, tensor in on_disk.items():
        assert torch.equal(tensor, sd[name]), name

    loaded = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for name, tensor in sd.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (path / "generation_config.json").exists()
    assert _leftovers(tmp_path) == []


def test_caller_may_change_weights_right_after_export(model: Any, tmp_path: Path) -> None:
    m = AutoModelForCausalLM.from_config(tiny_config()).eval()
    m.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with AsyncHFExporter(tmp_path, max_shard_size="40KB") as ex:
        handle = ex.export(1, m.state_dict(), config=m.config)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(-3.0).add_(1.0)
        loaded = load_checkpoint(handle.result(60))
    for name, tensor in before.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert not torch.equal(m.state_dict()["model.norm.weight"], before["model.norm.weight"])


def test_staging_buffers_are_reused_across_exports(model: Any, tmp_path: Path) -> None:
    sd = model.state_dict()
    with AsyncHFExporter(tmp_path) as ex:
        ex.export(1, sd).result(60)
        pool = ex._free_buffers[-1]
        first = {k: v.data_ptr() for k, v in pool.items()}
        ex.export(2, sd).result(60)
        assert {k: v.data_ptr() for k, v in ex._free_buffers[-1].items()} == first


def test_reserve_allocates_the_buffers_the_first_export_uses(model: Any, tmp_path: Path) -> None:
    sd = model.state_dict()
    ex = AsyncHFExporter(tmp_path)
    for bad in ({"w": "not a tensor"}, {}, 5):
        with pytest.raises(BadExportInput):
            ex.reserve(bad)  # type: ignore[arg-type]
    assert ex._free_buffers == [{}]  # the one free set is still empty: nothing allocated
    ex.reserve(sd)
    reserved = {k: v.data_ptr() for k, v in ex._free_buffers[-1].items()}
    assert set(reserved) == set(sd) - {"lm_head.weight"}  # tied to the embedding
    # A bad item after good ones keeps the reserved set as it was.
    with pytest.raises(BadExportInput):
        ex.reserve([*sd.items(), ("extra", "not a tensor")])
    assert {k: v.data_ptr() for k, v in ex._free_buffers[-1].items()} == reserved
    assert list(tmp_path.iterdir()) == []  # nothing written
    ex.export(1, sd).result(60)
    assert {k: v.data_ptr() for k, v in ex._free_buffers[-1].items()} == reserved
    ex.close()
    with pytest.raises(BadExportInput, match="closed"):
        ex.reserve(sd)


def test_close_during_staging_flushes_that_export(model: Any, tmp_path: Path) -> None:
    """close() from another thread waits until the export being staged is submitted."""
    rec = Recorder()
    ex = AsyncHFExporter(tmp_path, report=rec)
    closer = threading.Thread(target=ex.close)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(model.state_dict().items()):
            if i == 1:
                closer.start()
                time.sleep(0.2)  # close() is now waiting for this export
            yield item

    handle = ex.export(1, weights())
    closer.join(60)
    assert not closer.is_alive()
    assert handle.result(0) == tmp_path / "step-1"  # close() flushed it
    assert rec.kinds() == ["ExportStarted", "ExportCommitted"]
    with pytest.raises(BadExportInput, match="closed"):
        ex.export(2, model.state_dict())


def test_a_report_refusing_started_keeps_the_export_from_running(
    model: Any, tmp_path: Path
) -> None:
    """The refused export never runs, and the one in flight goes on as if it had not come."""

    class Refuses(RuntimeError):
        pass

    refuse = {2}

    def report(cls: type, **fields: Any) -> None:
        if cls is ev.ExportStarted and fields["version"] in refuse:
            raise Refuses("the controller refused ExportStarted")

    ex = AsyncHFExporter(tmp_path, report=report, max_shard_size="20KB", write_threads=1,
                         opener=lambda p: SlowFile(p, 0.02))  # fmt: skip
    first = ex.export(1, model.state_dict())
    with pytest.raises(Refuses):
        ex.export(2, model.state_dict())
    assert first.result(60) == tmp_path / "step-1"  # not cancelled by the refused one
    refuse.clear()
    assert ex.export(2, model.state_dict()).result(60) == tmp_path / "step-2"
    ex.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_bf16_export_and_digest(model: Any, tmp_path: Path) -> None:
    with AsyncHFExporter(tmp_path, dtype=torch.bfloat16) as ex:
        path = ex.export(1, model.state_dict(), config=model.config).result(60)
    loaded = load_checkpoint(path)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for name, tensor in expected.items():
        assert loaded.state_dict[name].dtype == torch.bfloat16
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.digest == digest_of(expected, {"lm_head.weight": "model.embed_tokens.weight"})
    assert loaded.state_dict["lm_head.weight"] is loaded.state_dict["model.embed_tokens.weight"]


def test_load_model_refuses_a_flipped_bit(model: Any, tmp_path: Path) -> None:
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, model).result(60)
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="does not match its digest"):
        load_model(path)


def test_iterator_of_pairs_and_tokenizer(model: Any, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>")  # fmt: skip

    def pairs() -> Iterator[tuple[str, torch.Tensor]]:
        yield from model.state_dict().items()

    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export(1, pairs(), config=model.config, tokenizer=tok).result(60)
    manifest = json.loads((path / MANIFEST).read_text())
    assert "tokenizer.json" in manifest["files"]
    assert CheckpointStore(tmp_path).verify(path, full=True)["version"] == 1
    assert load_model(path).config.hidden_size == 64


def test_every_file_a_full_export_writes_is_in_its_manifest(model: Any, tmp_path: Path) -> None:
    """verify() refuses unlisted files: everything the exporter itself writes must be listed."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>")  # fmt: skip
    with AsyncHFExporter(tmp_path, max_shard_size="100KB") as ex:
        path = ex.export_model(
            1, model, tokenizer=tok, generation_config=GenerationConfig(top_k=3)
        ).result(60)
    manifest = CheckpointStore(tmp_path).verify(path, full=True)
    listed = set(manifest["files"]) | set(manifest["shards"])
    assert set(os.listdir(path)) == listed | {MANIFEST}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json"} <= listed  # fmt: skip
    assert len(manifest["shards"]) > 2
    assert load_model(path).generation_config.top_k == 3


class SlowFile:
    """A real file whose writes take a while, so a cancel lands mid-export."""

    def __init__(self, path: Any, delay: float) -> None:
        self._f = open(path, "xb")  # noqa: SIM115
        self._delay = delay
        self.writes = 0

    def write(self, data: Any) -> int:
        self.writes += 1
        time.sleep(self._delay)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> SlowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def test_newer_export_cancels_the_one_in_flight(model: Any, tmp_path: Path) -> None:
    rec = Recorder()
    ex = AsyncHFExporter(tmp_path, report=rec, max_shard_size="20KB", write_threads=1,
                         opener=lambda p: SlowFile(p, 0.02))  # fmt: skip
    first = ex.export(1, model.state_dict())
    time.sleep(0.1)
    second = ex.export(2, model.state_dict())
    with pytest.raises(ExportCancelledError):
        first.result(60)
    assert second.result(60) == tmp_path / "step-2"
    ex.close()
    assert not (tmp_path / "step-1").exists()
    assert _leftovers(tmp_path) == []
    kinds = rec.kinds()
    assert kinds.index("ExportCancelled") > kinds.index("ExportStarted")
    assert [k for k, f in rec.events if f["version"] == 1] == ["ExportStarted", "ExportCancelled"]
    assert [k for k, f in rec.events if f["version"] == 2] == ["ExportStarted", "ExportCommitted"]


def test_a_pool_refusing_work_fails_the_export_after_its_writers_stop(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writers already started are told to stop, and the directory is removed (and the
    buffers handed back) only once none of them still runs."""
    import recovery_fsm.export.exporter as xm

    busy: list[int] = [0]
    files: list[SlowFile] = []

    def opener(path: Any) -> SlowFile:
        with lock:
            files.append(SlowFile(path, 0.02))
            return files[-1]

    lock = threading.Lock()

    def counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            busy[0] += 1
        try:
            return write_file(*args, **kwargs)
        finally:
            with lock:
                busy[0] -= 1

    write_file = xm.write_file
    monkeypatch.setattr(xm, "write_file", counted)
    rec = Recorder()
    ex = AsyncHFExporter(tmp_path, report=rec, max_shard_size="20KB", opener=opener)
    submit = ex._writers.submit
    submitted = [0]

    def refuse_after_two(*args: Any, **kwargs: Any) -> Any:
        if submitted[0] == 2:  # as a pool does during interpreter exit
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        submitted[0] += 1
        return submit(*args, **kwargs)

    monkeypatch.setattr(ex._writers, "submit", refuse_after_two)
    handle = ex.export(1, model.state_dict())
    assert isinstance(handle.exception(60), RuntimeError)
    with lock:
        assert busy[0] == 0
        # Two shards were submitted; told to stop, their writers wrote only a few tensors
        # (each file's first write is its header).
        assert sum(f.writes - 1 for f in files) < len(model.state_dict()) // 2
    assert rec.kinds() == ["ExportStarted", "ExportFailed"]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "step-1").exists()
    ex.close()


def test_cancel_lands_inside_one_large_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single tensor of many chunks stops at the next chunk, not at its end."""
    import recovery_fsm.export.safetensors_io as sio

    monkeypatch.setattr(sio, "CHUNK", 64 << 10)
    big = {"w": torch.arange(64 * (64 << 10) // 4, dtype=torch.float32)}  # 64 chunks
    files: list[SlowFile] = []

    def opener(path: Any) -> SlowFile:
        files.append(SlowFile(path, 0.05))
        return files[-1]

    rec = Recorder()
    ex = AsyncHFExporter(tmp_path, report=rec, write_threads=1, opener=opener)
    handle = ex.export(1, big)
    deadline = time.monotonic() + 30
    while not files and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)  # a few chunks in
    assert ex.cancel(1)
    with pytest.raises(ExportCancelledError):
        handle.result(60)
    ex.close()
    assert files[0].writes < 40  # the header and a few chunks, far from all 1 + 64 writes
    assert rec.kinds() == ["ExportStarted", "ExportCancelled"]
    assert _leftovers(tmp_path) == []


class FailingOpener:
    def __init__(self, fail_on: int, error: OSError) -> None:
        self.calls = 0
        self.fail_on = fail_on
        self.error = error

    def __call__(self, path: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_on:
            raise self.error
        return open(path, "xb")


@pytest.mark.parametrize(
    "error", [PermissionError(13, "Permission denied"), OSError(28, "No space left on device")]
)
def test_writer_fault_ends_failed_and_keeps_the_committed_one(
    model: Any, tmp_path: Path, error: OSError
) -> None:
    rec = Recorder()
    with AsyncHFExporter(tmp_path, report=rec, max_shard_size="40KB") as ex:
        good = ex.export(1, model.state_dict()).result(60)
        ex._opener = FailingOpener(3, error)
        bad = ex.export(2, model.state_dict())
        assert isinstance(bad.exception(60), OSError)
    assert rec.events[-1][0] == "ExportFailed" and rec.events[-1][1]["version"] == 2
    assert str(error.strerror) in rec.events[-1][1]["error"]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "step-2").exists()
    assert load_checkpoint(good).version == 1


class ReportRaises(Recorder):
    """Records every event, then raises on the chosen (event name, version) pairs."""

    def __init__(self, *on: tuple[str, int]) -> None:
        super().__init__()
        self.on = set(on)
        self.raised: list[BaseException] = []

    def __call__(self, cls: type, **fields: Any) -> None:
        super().__call__(cls, **fields)
        if (cls.__name__, fields["version"]) in self.on:
            self.raised.append(RuntimeError(f"adapter lost {cls.__name__}"))
            raise self.raised[-1]


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, BaseException | None]]:
    return [
        (r.getMessage(), r.exc_info[1] if r.exc_info else None)
        for r in caplog.records
        if r.name == "recovery_fsm.export.exporter" and r.levelno == logging.ERROR
    ]


TINY = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3)}


def test_a_report_raising_on_committed_is_logged_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rep = ReportRaises(("ExportCommitted", 1))
    ex = AsyncHFExporter(tmp_path, report=rep)
    assert ex.export(1, TINY).result(60) == tmp_path / "step-1"
    ex.close()  # the report follows the future: close() waits for it
    (err,) = rep.raised
    assert ex.report_errors == (FailedReport("ExportCommitted", 1, err),)
    [(message, logged)] = _logged(caplog)
    assert logged is err and "ExportCommitted" in message and "version=1" in message
    assert load_checkpoint(tmp_path / "step-1").version == 1
    assert CheckpointStore(tmp_path).scan().committed == {1: tmp_path / "step-1"}


def test_a_report_raising_on_failed_keeps_the_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rep = ReportRaises(("ExportFailed", 2))
    ex = AsyncHFExporter(tmp_path, report=rep)
    ex.export(1, TINY).result(60)
    ex._opener = FailingOpener(1, OSError(28, "No space left on device"))
    bad = ex.export(2, TINY)
    failure = bad.exception(60)
    assert isinstance(failure, OSError) and failure.errno == 28  # not the report's error
    ex.close()
    (err,) = rep.raised
    assert ex.report_errors == (FailedReport("ExportFailed", 2, err),)
    assert [logged for _, logged in _logged(caplog)] == [err]
    assert rep.kinds() == ["ExportStarted", "ExportCommitted", "ExportStarted", "ExportFailed"]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "step-2").exists()
    assert CheckpointStore(tmp_path).scan().committed == {1: tmp_path / "step-1"}


def test_a_report_raising_on_cancelled_keeps_the_cancellation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()

    def opener(path: Any) -> Any:
        gate.wait(30)  # the writer waits here until the cancel is in
        return open(path, "xb")

    rep = ReportRaises(("ExportCancelled", 1))
    ex = AsyncHFExporter(tmp_path, report=rep, opener=opener)
    first = ex.export(1, TINY)
    assert ex.cancel(1)
    gate.set()
    with pytest.raises(ExportCancelledError):
        first.result(60)
    ex.close()
    (err,) = rep.raised
    assert ex.report_errors == (FailedReport("ExportCancelled", 1, err),)
    assert [logged for _, logged in _logged(caplog)] == [err]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "step-1").exists()


def test_exports_after_a_raising_report_still_work(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rep = ReportRaises(("ExportCommitted", 1))
    with AsyncHFExporter(tmp_path, report=rep) as ex:
        ex.export(1, TINY).result(60)
        second = ex.export(2, {k: v * 2 for k, v in TINY.items()})
        assert second.result(60) == tmp_path / "step-2"
    assert rep.kinds() == ["ExportStarted", "ExportCommitted"] * 2
    assert [(e.event, e.version) for e in ex.report_errors] == [("ExportCommitted", 1)]
    assert len(_logged(caplog)) == 1
    loaded = load_checkpoint(tmp_path / "step-2")
    assert torch.equal(loaded.state_dict["w"], TINY["w"] * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_unserializable_tensor_is_refused_before_anything_starts(tmp_path: Path) -> None:
    rec = Recorder()
    with AsyncHFExporter(tmp_path, report=rec) as ex:
        for weights, words in [
            ({"a": torch.zeros(2, dtype=torch.complex64)}, "cannot hold"),
            ({"a": [1, 2]}, "expected a torch.Tensor"),
            ([("a", torch.zeros(1)), ("a", torch.zeros(1))], "appears twice"),
            ({"a": torch.zeros(2, device="meta")}, "cannot export"),
        ]:
            with pytest.raises(BadExportInput, match=words):
                ex.export(1, weights)  # type: ignore[arg-type]
        ex.export(5, {"a": torch.zeros(2)}).result(60)
        with pytest.raises(BadExportInput, match="versions must increase"):
            ex.export(5, {"a": torch.zeros(2)})
    assert rec.kinds() == ["ExportStarted", "ExportCommitted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and os.system(f"mount -t tmpfs -o {options} tmpfs {path}") == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_real_enospc_on_a_small_tmpfs(model: Any, tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    assert _mount_tmpfs(mnt, "size=200k")
    try:
        rec = Recorder()
        with AsyncHFExporter(mnt, report=rec) as ex:
            err = ex.export(1, model.state_dict()).exception(60)
        assert isinstance(err, OSError) and err.errno == 28
        assert rec.kinds() == ["ExportStarted", "ExportFailed"]
        assert list(mnt.iterdir()) == []
    finally:
        os.system(f"umount {mnt}")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_read_only_root_fails_cleanly(model: Any, tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    assert _mount_tmpfs(mnt, "size=1m")
    try:
        os.system(f"mount -o remount,ro {mnt}")
        rec = Recorder()
        with AsyncHFExporter(mnt, report=rec) as ex:
            err = ex.export(1, model.state_dict()).exception(60)
        assert isinstance(err, OSError) and err.errno == 30  # EROFS
        assert rec.kinds() == ["ExportStarted", "ExportFailed"]
    finally:
        os.system(f"umount {mnt}")


def test_exporter_drives_the_controller(model: Any, tmp_path: Path) -> None:
    c = RecoveryController()
    link = ControllerLink(c)
    link.send(ev.GroupRegistered, group="g1", version=0)
    link.send(ev.WeightsSynced, version=1, groups=c.up_groups())
    with AsyncHFExporter(tmp_path, report=link.send) as ex:
        path = ex.export(1, model.state_dict(), config=model.config).result(60)
    assert c.checkpoint_state(1) == "ready"
    _, restart = link.send(ev.GroupFailed, group="g1", incarnation=1)
    assert isinstance(restart, RestartFromCheckpoint) and restart.path == str(path)
    assert restart.incarnation == 2
    assert load_checkpoint(restart.path).version == 1


def test_a_closed_exporter_says_so(model: Any, tmp_path: Path) -> None:
    from recovery_fsm import ExporterClosed

    ex = AsyncHFExporter(tmp_path)
    ex.close()
    assert ex.closed
    with pytest.raises(ExporterClosed, match="closed"):
        ex.export_model(1, model)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tied", [False, True])
def test_load_model_takes_the_verified_weights_without_a_second_copy_and_answers_as_before(
    tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verified weights are read once into the process's own memory and the model takes
    them: no initialisation, no from_pretrained, no mapping of the checkpoint's files kept
    (by the model or by load_checkpoint's tensors); tied weights stay one tensor; the
    answers are from_pretrained's."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=tied)).eval()
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, source).result(60)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # from_pretrained maps the files: let it go before looking
        expected = AutoModelForCausalLM.from_pretrained(str(path)).eval()(ids).logits

    def second_pass(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("load_model copied the weights again through from_pretrained")

    def mapped_shards() -> list[Path]:
        gc.collect()
        maps = Path("/proc/self/maps").read_text()
        return [f for f in path.glob("*.safetensors") if str(f) in maps]

    if sys.platform == "linux":  # an engine holding these must not keep the files alive
        held = load_checkpoint(path)
        assert mapped_shards() == [] and held.state_dict
        del held
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", second_pass)
    loaded = load_model(path)
    assert not loaded.training
    embed, head = loaded.model.embed_tokens.weight, loaded.lm_head.weight
    assert (embed is head) is tied and (embed.data_ptr() == head.data_ptr()) is tied
    # The weights are the buffer the verified read filled, not copies of it (one shard here).
    storages = {p.untyped_storage().data_ptr() for p in loaded.parameters()}
    assert len(storages) == 1, len(storages)
    if sys.platform == "linux":  # the model keeps no mapping of the checkpoint's files
        assert mapped_shards() == []
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
        assert torch.equal(loaded(ids).logits, source(ids).logits)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="the hook point is Linux's")
def test_a_shard_cut_short_while_it_is_read_is_corrupt(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that shrinks after its size was checked ends the read with CorruptCheckpoint
    (a read at the end of a file returns nothing: waiting for more would never end)."""
    import recovery_fsm.export.safetensors_io as io

    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, model).result(60)
    shard = next(path.glob("*.safetensors"))
    advise = os.posix_fadvise

    def cut_then_advise(fd: int, offset: int, length: int, advice: int) -> None:
        os.truncate(shard, shard.stat().st_size // 2)  # after the size check, before the data
        advise(fd, offset, length, advice)

    monkeypatch.setattr(io.os, "posix_fadvise", cut_then_advise)
    raised: list[BaseException] = []

    def load() -> None:
        try:
            load_checkpoint(path)
        except BaseException as err:
            raised.append(err)

    reader = threading.Thread(target=load, daemon=True)  # a read that waits forever: fail
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the read waits for bytes that will never come"
    assert len(raised) == 1 and isinstance(raised[0], CorruptCheckpoint), raised
    assert "ended early" in str(raised[0])
