"""Exporter cost beside its limits, on the same model in one run (read the ratios).

    .venv/bin/python benchmarks/bench_export.py [--sizes small,large] [--repeat 6] [--dir DIR]
    .venv/bin/python benchmarks/bench_export.py --hash-niceness 0   # the A/B of the niceness

For each model: the trainer's stall per export next to a plain in-memory copy of the state
dict (``clone`` of every tensor, the stall's limit); the write of a long-lived exporter (as in
training) next to a fresh exporter's first export, ``save_pretrained(safe_serialization=True)``
to the same disk with and without an fsync of its files, and a raw sequential write plus fsync
of the same bytes (the disk's limit), plain and with writeback started after each tensor.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

import recovery_fsm.export.exporter as exporter_module
from recovery_fsm.export import AsyncHFExporter
from recovery_fsm.export.safetensors_io import raw_bytes, tensor_sha256
from recovery_fsm.export.store import fsync_dir

MODELS = {
    # ~97M parameters, ~390 MB in fp32
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, vocab_size=16000),
    # ~290M parameters, ~1.16 GB in fp32
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, vocab_size=32000),
}


def _timed(fn: Callable[[], Any]) -> float:
    # Start every measurement with no dirty pages: on ext4 an fsync may also have to write
    # out data that an earlier measurement left in the page cache.
    os.sync()
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    del result  # freeing what fn built (a cloned state dict) is not part of its cost
    return elapsed


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def _raw_write(path: Path, tensors: list[torch.Tensor], early_writeback: bool = False) -> None:
    with path.open("wb") as f:
        offset = 0
        for t in tensors:
            data = raw_bytes(t.contiguous())
            f.write(data)
            if early_writeback:  # the exporter's kernel hint, given per tensor here
                f.flush()
                os.posix_fadvise(f.fileno(), offset, len(data), os.POSIX_FADV_DONTNEED)
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())


def _model(name: str) -> tuple[Any, LlamaConfig, dict[str, torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                      **MODELS[name])  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    sd = model.state_dict()
    unique = list({t.data_ptr(): t for t in sd.values()}.values())
    return model, cfg, sd, unique


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()  # the deletes (and the discards they send) finish outside every measurement


@dataclass
class Candidate:
    label: str
    run: Callable[[], Any]  # the timed part
    before: Callable[[], None] = lambda: None  # untimed set-up
    after: Callable[[], None] = lambda: None  # untimed clean-up
    times: list[float] = field(default_factory=list)
    clones: list[float] = field(default_factory=list)  # a clone timed just before each run


def ratio(num: list[float], den: list[float]) -> str:
    """Per repeat, then the median (and the range): the disk's speed drifts."""
    rs = sorted(n / d for n, d in zip(num, den, strict=True))
    return f"{statistics.median(rs):.2f}x ({rs[0]:.2f}-{rs[-1]:.2f})"


def export_until_committed(
    ex: AsyncHFExporter, version: int, sd: Any, cfg: Any, stalls: list[float]
) -> None:
    """One export, waited for until it commits; its stall (the call alone) goes to ``stalls``."""
    t0 = time.perf_counter()
    handle = ex.export(version, sd, config=cfg)
    stalls.append(time.perf_counter() - t0)
    handle.result()


def run_rotated(candidates: list[Candidate], repeat: int, clone: Callable[[], Any]) -> None:
    """Each repeat runs every candidate once, in an order rotated by one per repeat, each
    after the same steps (a timed clone, then its set-up), so the disk's drift and the
    position in the sequence hit all candidates alike (evenly when ``repeat`` is a multiple
    of the number of candidates)."""
    for r in range(repeat):
        shift = r % len(candidates)
        for c in candidates[shift:] + candidates[:shift]:
            gc.collect()
            c.clones.append(_timed(clone))
            gc.collect()
            c.before()
            c.times.append(_timed(c.run))
            c.after()


def bench(name: str, work: Path, repeat: int) -> None:
    model, cfg, sd, unique = _model(name)
    total = sum(t.numel() * t.element_size() for t in unique)
    print(f"\n== {name}: {sum(t.numel() for t in unique) / 1e6:.0f}M parameters, "
          f"{total / 1e6:.0f} MB (fp32), {repeat} repeats")  # fmt: skip

    stalls: dict[str, list[float]] = {"warm": [], "cold": []}

    def clone() -> list[torch.Tensor]:
        return [t.clone() for t in unique]  # each stored tensor once, as the exporter stages

    # The long-lived exporter, as in training, past its first exports.
    ours = AsyncHFExporter(work / "ours", max_shard_size="2GB", write_threads=2)
    versions = iter(range(1, 10**6))
    for _ in range(2):
        ours.export(next(versions), sd, config=cfg).result()
        _clear(work / "ours")
    fresh: list[AsyncHFExporter] = []

    def fresh_before() -> None:
        fresh.append(AsyncHFExporter(work / "fresh", max_shard_size="2GB", write_threads=2))

    def fresh_after() -> None:
        fresh.pop().close()
        _remove(work / "fresh")

    def hf_save(fsync: bool) -> None:
        model.save_pretrained(work / "hf", safe_serialization=True)
        if fsync:
            _fsync_tree(work / "hf")

    exporter = Candidate(
        "exporter, export() to committed + fsync",
        lambda: export_until_committed(ours, next(versions), sd, cfg, stalls["warm"]),
        after=lambda: _clear(work / "ours"),
    )
    candidates = [
        exporter,
        Candidate(
            "a fresh exporter's first export",
            lambda: export_until_committed(fresh[-1], 1, sd, cfg, stalls["cold"]),
            before=fresh_before,
            after=fresh_after,
        ),
        Candidate(
            "save_pretrained (no fsync)",
            lambda: hf_save(fsync=False),
            after=lambda: _remove(work / "hf"),
        ),
        Candidate(
            "save_pretrained + fsync",
            lambda: hf_save(fsync=True),
            after=lambda: _remove(work / "hf"),
        ),
        Candidate(
            "raw sequential write + fsync",
            lambda: _raw_write(work / "raw.bin", unique),
            after=lambda: _remove(work / "raw.bin"),
        ),
        Candidate(
            "raw, writeback started per tensor",
            lambda: _raw_write(work / "raw.bin", unique, early_writeback=True),
            after=lambda: _remove(work / "raw.bin"),
        ),
    ]
    try:
        run_rotated(candidates, repeat, clone)
    finally:
        ours.close()
    fresh_first = candidates[1]
    raw = next(c for c in candidates if c.label.startswith("raw sequential"))
    med = statistics.median
    clones = [t for c in candidates for t in c.clones]
    hash_s = _timed(lambda: [tensor_sha256(t) for t in unique])

    print(f"  stall  {'clone of the state dict (limit)':<40} {med(clones):7.3f} s")
    print(f"         {'export(), reused staging buffers':<40} {med(stalls['warm']):7.3f} s   "
          f"{ratio(stalls['warm'], exporter.clones)} clone")  # fmt: skip
    print(f"         {'export(), fresh exporter (allocates)':<40} {med(stalls['cold']):7.3f} s   "
          f"{ratio(stalls['cold'], fresh_first.clones)} clone")  # fmt: skip
    print(f"  write  {exporter.label:<40} {med(exporter.times):7.3f} s "
          f"{total / med(exporter.times) / 1e6:6.0f} MB/s")  # fmt: skip
    for c in candidates[1:]:
        print(f"         {c.label:<40} {med(c.times):7.3f} s "
              f"{total / med(c.times) / 1e6:6.0f} MB/s   "
              f"exporter takes {ratio(exporter.times, c.times)} this")  # fmt: skip
    print("  (ratios: median and range over repeats of the ratio within one repeat)")
    for c in (fresh_first, candidates[3]):
        print(f"  {c.label} takes {ratio(c.times, raw.times)} the raw write")
    print(f"  sha256 on one thread: {total / hash_s / 1e6:.0f} MB/s (the exporter hashes each "
          f"byte twice, on separate threads)")  # fmt: skip


def _clear(root: Path) -> None:
    for child in list(root.iterdir()):
        _remove(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--hash-niceness",
        type=int,
        default=None,
        help="niceness added to the tensor-hash threads (the exporter's default: "
        f"{exporter_module.HASH_NICENESS}); 0 for the A/B comparison",
    )
    a = parser.parse_args()
    if a.hash_niceness is not None:
        exporter_module.HASH_NICENESS = a.hash_niceness
    hf_logging.disable_progress_bar()
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"writing under {work}; torch threads: {torch.get_num_threads()}; "
          f"tensor-hash niceness +{exporter_module.HASH_NICENESS}")  # fmt: skip
    try:
        for name in a.sizes.split(","):
            bench(name, work, a.repeat)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
