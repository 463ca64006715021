"""Exporter cost beside its limits, on the same model in one run (read the ratios).

    .venv/bin/python benchmarks/bench_export.py [--sizes small,large] [--dir DIR]
    .venv/bin/python benchmarks/bench_export.py --sizes large --pairs 8

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


def bench(name: str, work: Path, repeat: int) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                      **MODELS[name])  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    sd = model.state_dict()
    unique = {t.data_ptr(): t for t in sd.values()}.values()
    total = sum(t.numel() * t.element_size() for t in unique)
    print(f"\n== {name}: {sum(t.numel() for t in unique) / 1e6:.0f}M parameters, "
          f"{total / 1e6:.0f} MB (fp32), median of {repeat}")  # fmt: skip

    clone_s, stall_cold, stall_warm, ours_s, hf_s, hf_sync_s, raw_s, rawwb_s = (
        [] for _ in range(8)
    )
    for r in range(repeat):
        gc.collect()
        clone_s.append(_timed(lambda: {k: v.clone() for k, v in sd.items()}))
        gc.collect()
        root = work / f"ours-{r}"
        with AsyncHFExporter(root, max_shard_size="2GB", write_threads=2) as ex:
            os.sync()
            t0 = time.perf_counter()
            h = ex.export(1, sd, config=cfg)
            stall_cold.append(time.perf_counter() - t0)
            h.result()
            os.sync()
            t0 = time.perf_counter()
            h = ex.export(2, sd, config=cfg)
            stall_warm.append(time.perf_counter() - t0)
            h.result()
            ours_s.append(time.perf_counter() - t0)  # stall plus background write, v2
        shutil.rmtree(root)

        hf_dir = work / f"hf-{r}"
        hf_s.append(_timed(lambda d=hf_dir: model.save_pretrained(d, safe_serialization=True)))
        shutil.rmtree(hf_dir)
        hf_sync_s.append(_timed(lambda d=hf_dir: (model.save_pretrained(d, safe_serialization=True),
                                                  _fsync_tree(d))))  # fmt: skip
        shutil.rmtree(hf_dir)

        raw = work / f"raw-{r}.bin"
        raw_s.append(_timed(lambda p=raw: _raw_write(p, list(unique))))
        raw.unlink()
        rawwb_s.append(_timed(lambda p=raw: _raw_write(p, list(unique), early_writeback=True)))
        raw.unlink()

    med = statistics.median
    clone, cold, warm = med(clone_s), med(stall_cold), med(stall_warm)
    ours, hf, hf_sync, raw_t = med(ours_s), med(hf_s), med(hf_sync_s), med(raw_s)
    rawwb = med(rawwb_s)

    def rate(seconds: float) -> str:
        return f"{total / seconds / 1e6:7.0f} MB/s"

    def ratio(num: list[float], den: list[float]) -> float:
        # Per repeat, then the median: the disk's speed drifts between repeats.
        return med(n / d for n, d in zip(num, den, strict=True))

    print(f"  stall  clone of the state dict (limit)     {clone:7.3f} s   1.00x")
    print(f"         export(), first (buffers allocated) {cold:7.3f} s   "
          f"{ratio(stall_cold, clone_s):.2f}x clone")  # fmt: skip
    print(f"         export(), reused staging buffers    {warm:7.3f} s   "
          f"{ratio(stall_warm, clone_s):.2f}x clone")  # fmt: skip
    print(f"  write  exporter, staged to committed+fsync {ours:7.3f} s  {rate(ours)}")
    print(f"         save_pretrained (no fsync)          {hf:7.3f} s  {rate(hf)}"
          f"   exporter takes {ratio(ours_s, hf_s):.2f}x this")  # fmt: skip
    print(f"         save_pretrained + fsync             {hf_sync:7.3f} s  {rate(hf_sync)}"
          f"   exporter takes {ratio(ours_s, hf_sync_s):.2f}x this")  # fmt: skip
    print(f"         raw sequential write + fsync        {raw_t:7.3f} s  {rate(raw_t)}"
          f"   exporter takes {ratio(ours_s, raw_s):.2f}x this")  # fmt: skip
    print(f"         raw, writeback started per tensor   {rawwb:7.3f} s  {rate(rawwb)}"
          f"   exporter takes {ratio(ours_s, rawwb_s):.2f}x this")  # fmt: skip
    print("  (ratios: median over repeats of the ratio within one repeat)")


def pairs(name: str, work: Path, n: int) -> None:
    """One exporter kept open, its write and the raw write alternating: the disk's drift
    hits both sides of each pair alike."""
    torch.manual_seed(0)
    cfg = LlamaConfig(num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                      **MODELS[name])  # fmt: skip
    sd = AutoModelForCausalLM.from_config(cfg).eval().state_dict()
    unique = list({t.data_ptr(): t for t in sd.values()}.values())
    print(f"\n== {name}: exporter write vs raw write + fsync, alternating, {n} pairs")
    ratios = []
    with AsyncHFExporter(work / "pairs", max_shard_size="2GB") as ex:
        for v in range(n):
            ours = _timed(lambda v=v: ex.export(v, sd, config=cfg).result())
            shutil.rmtree(work / "pairs" / f"step-{v}")
            raw = _timed(lambda: _raw_write(work / "raw.bin", unique))
            (work / "raw.bin").unlink()
            ratios.append(ours / raw)
            print(f"  pair {v + 1}: exporter {ours:6.3f} s   raw {raw:6.3f} s   {ours / raw:.2f}x")
    print(f"  median {statistics.median(ratios):.2f}x, "
          f"after the first {statistics.median(ratios[1:] or ratios):.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--pairs", type=int, default=0, help="only the alternating comparison")
    a = parser.parse_args()
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"writing under {work}; torch threads: {torch.get_num_threads()}")
    try:
        for name in a.sizes.split(","):
            if a.pairs:
                pairs(name, work, a.pairs)
            else:
                bench(name, work, a.repeat)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
