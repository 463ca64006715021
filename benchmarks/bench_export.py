"""Exporter cost beside its limits, on the same model in one run (read the ratios).

    .venv/bin/python benchmarks/bench_export.py [--sizes small,large] [--repeat 5] [--dir DIR]

For each model: the trainer's stall per export next to a plain in-memory copy of the state
dict (``clone`` of every tensor, the stall's limit); the background write next to
``save_pretrained(safe_serialization=True)`` to the same disk, with and without an fsync of
its files, and next to a raw sequential write plus fsync of the same bytes (the disk's limit),
plain and with writeback started after each tensor (the kernel hint the exporter gives).
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
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from recovery_fsm.export import AsyncHFExporter
from recovery_fsm.export.safetensors_io import raw_bytes

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
    fn()
    return time.perf_counter() - t0


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _raw_write(path: Path, tensors: list[torch.Tensor], early_writeback: bool = False) -> None:
    with path.open("wb") as f:
        offset = 0
        for t in tensors:
            data = raw_bytes(t.contiguous())
            f.write(data)
            if early_writeback:  # the same hint the exporter gives the kernel
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
    else:
        path.unlink()
    os.sync()  # the deletes (and the discards they send) finish outside every measurement


def bench(name: str, work: Path, repeat: int) -> None:
    """One exporter for the whole run, as in training. Each repeat runs every candidate in
    a rotated order, each after the same clean-up, so the disk's drift and the position in
    the sequence hit all candidates alike."""
    model, cfg, sd, unique = _model(name)
    total = sum(t.numel() * t.element_size() for t in unique)
    print(f"\n== {name}: {sum(t.numel() for t in unique) / 1e6:.0f}M parameters, "
          f"{total / 1e6:.0f} MB (fp32), median of {repeat}")  # fmt: skip

    times: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {"clone": [], "cold": [], "warm": []}
    for _ in range(repeat):
        # The first export of a fresh exporter allocates its staging buffers.
        gc.collect()
        stalls["clone"].append(_timed(lambda: {k: v.clone() for k, v in sd.items()}))
        gc.collect()
        cold = AsyncHFExporter(work / "cold", max_shard_size="2GB")
        t0 = time.perf_counter()
        cold.export(0, sd, config=cfg)
        stalls["cold"].append(time.perf_counter() - t0)
        cold.close(cancel=True)
        _remove(work / "cold")
    ex = AsyncHFExporter(work / "ours", max_shard_size="2GB", write_threads=2)
    versions = iter(range(1, 10**6))
    ex.export(next(versions), sd, config=cfg).result()  # allocate the staging buffers
    _remove(work / "ours" / "step-1")

    def ours() -> None:
        t0 = time.perf_counter()
        handle = ex.export(next(versions), sd, config=cfg)
        stalls["warm"].append(time.perf_counter() - t0)
        handle.result()

    def hf_save(fsync: bool) -> None:
        model.save_pretrained(work / "hf", safe_serialization=True)
        if fsync:
            _fsync_tree(work / "hf")

    candidates: dict[str, tuple[Callable[[], Any], Path]] = {
        "exporter": (ours, work / "ours"),
        "save_pretrained": (lambda: hf_save(fsync=False), work / "hf"),
        "save_pretrained+fsync": (lambda: hf_save(fsync=True), work / "hf"),
        "raw": (lambda: _raw_write(work / "raw.bin", unique), work / "raw.bin"),
        "raw+writeback": (
            lambda: _raw_write(work / "raw.bin", unique, early_writeback=True),
            work / "raw.bin",
        ),
    }
    names = list(candidates)
    for r in range(repeat):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            fn, out = candidates[k]
            times.setdefault(k, []).append(_timed(fn))
            for leftover in [out] if k != "exporter" else list(out.iterdir()):
                _remove(leftover)
    ex.close()

    med = statistics.median

    def ratio(num: list[float], den: list[float]) -> str:
        # Per repeat, then the median (and the range): the disk's speed drifts.
        rs = sorted(n / d for n, d in zip(num, den, strict=True))
        return f"{med(rs):.2f}x ({rs[0]:.2f}-{rs[-1]:.2f})"

    def rate(k: str) -> str:
        return f"{total / med(times[k]) / 1e6:7.0f} MB/s"

    clone = stalls["clone"]
    print(f"  stall  clone of the state dict (limit)     {med(clone):7.3f} s   1.00x")
    print(f"         export(), first (buffers allocated) {med(stalls['cold']):7.3f} s   "
          f"{ratio(stalls['cold'], clone)} clone")  # fmt: skip
    print(f"         export(), reused staging buffers    {med(stalls['warm']):7.3f} s   "
          f"{ratio(stalls['warm'], stalls['clone'])} clone")  # fmt: skip
    ours_s = times["exporter"]
    print(f"  write  exporter, staged to committed+fsync {med(ours_s):7.3f} s  {rate('exporter')}")
    for k, label in (
        ("save_pretrained", "save_pretrained (no fsync)         "),
        ("save_pretrained+fsync", "save_pretrained + fsync            "),
        ("raw", "raw sequential write + fsync       "),
        ("raw+writeback", "raw, writeback started per tensor  "),
    ):
        print(f"         {label} {med(times[k]):7.3f} s  {rate(k)}"
              f"   exporter takes {ratio(ours_s, times[k])} this")  # fmt: skip
    print("  (ratios: median and range over repeats of the ratio within one repeat)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"writing under {work}; torch threads: {torch.get_num_threads()}")
    try:
        for name in a.sizes.split(","):
            bench(name, work, a.repeat)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
