"""Exporter and recovery-load cost beside their limits, on the same model in one run (ratios).

    .venv/bin/python benchmarks/bench_export.py [--sizes small,large] [--repeat 6] [--dir DIR]

Write side, every candidate once per repeat in a rotated order: the long-lived exporter (as in
training: xxh3-128, writeback by ``sync_file_range``), the same with sha256, with writeback by
``POSIX_FADV_DONTNEED`` and with none before the fsync; a fresh exporter's first export;
``save_pretrained`` with and without an fsync of its files; a raw sequential write + fsync of
the same bytes (the disk's limit), plain and with writeback started per tensor. The trainer's
stall per export is printed beside a plain clone of every tensor (the stall's limit).

Load side: right after each exporter variant commits, a verified ``load_model`` of that
checkpoint into a fresh model (what a restart on this host pays: the writeback modes differ
in what they leave in the page cache). Then, from the page cache (the files just read): an
unverified ``safetensors.torch.load_file`` of the same files next to the verified
``load_checkpoint`` (xxh3-128 and sha256 checkpoints), and an unverified ``from_pretrained``
next to ``load_model``. Last, each hash's throughput on one thread over the same tensors.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from recovery_fsm.export import AsyncHFExporter, load_checkpoint, load_model
from recovery_fsm.export.safetensors_io import HASHES, raw_bytes, tensor_digest
from recovery_fsm.export.store import fsync_dir

MODELS = {
    # ~97M parameters, ~390 MB in fp32
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, vocab_size=16000),
    # ~290M parameters, ~1.16 GB in fp32
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, vocab_size=32000),
}


def _release_freed_memory() -> None:
    """Hand the memory freed so far back to the system (glibc's ``malloc_trim``), so that every
    load writes into pages it has to fault in, as a restarted engine does: otherwise a load
    that allocates tensor by tensor reuses the last load's heap and looks cheaper than one
    that allocates a whole shard at once."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


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
                      architectures=["LlamaForCausalLM"], **MODELS[name])  # fmt: skip
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
    cpu: list[float] = field(default_factory=list)  # process CPU seconds per wall second
    # Untimed by run_rotated: measured in ``after`` (e.g. loading what the run wrote).
    loads: list[float] = field(default_factory=list)


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
            os.sync()  # so that the sync inside _timed, outside the clock, finds little to do
            cpu = time.process_time()
            c.times.append(_timed(c.run))
            # CPU seconds of this process (all its threads) per second of the run: near the
            # number of cores, the run is CPU-bound; far below, it waits for the disk.
            c.cpu.append((time.process_time() - cpu) / c.times[-1])
            c.after()


def bench(name: str, work: Path, repeat: int) -> None:
    model, cfg, sd, unique = _model(name)
    total = sum(t.numel() * t.element_size() for t in unique)
    print(f"\n== {name}: {sum(t.numel() for t in unique) / 1e6:.0f}M parameters, "
          f"{total / 1e6:.0f} MB (fp32), {repeat} repeats")  # fmt: skip

    stalls: dict[str, list[float]] = {"warm": [], "cold": []}

    def clone() -> list[torch.Tensor]:
        return [t.clone() for t in unique]  # each stored tensor once, as the exporter stages

    versions = iter(range(1, 10**6))
    kept: dict[str, AsyncHFExporter] = {}

    def long_lived(label: str, **options: Any) -> Candidate:
        """An exporter past its first exports, as in training; after each commit, the
        verified load of that checkpoint into a fresh model is timed (not in the write)."""
        root = work / label.replace(" ", "-")
        ex = kept[label] = AsyncHFExporter(root, max_shard_size="2GB", **options)
        for _ in range(2):
            ex.export(next(versions), sd, config=cfg).result()
            _clear(root)
        c = Candidate(label, lambda: export_until_committed(ex, next(versions), sd, cfg,
                                                            stalls["warm"] if not options
                                                            else []))  # fmt: skip

        def after() -> None:
            (committed,) = root.iterdir()
            c.loads.append(_timed(lambda: load_model(committed)))
            _clear(root)

        c.after = after
        return c

    fresh: list[AsyncHFExporter] = []

    def fresh_before() -> None:
        fresh.append(AsyncHFExporter(work / "fresh", max_shard_size="2GB"))

    def fresh_after() -> None:
        fresh.pop().close()
        _remove(work / "fresh")

    def hf_save(fsync: bool) -> None:
        model.save_pretrained(work / "hf", safe_serialization=True)
        if fsync:
            _fsync_tree(work / "hf")

    exporter = long_lived("exporter")
    by_hash = long_lived("exporter, sha256", hash_name="sha256")
    dontneed = long_lived("exporter, writeback dontneed", writeback="dontneed")
    no_early = long_lived("exporter, no early writeback", writeback="off")
    candidates = [
        exporter,
        by_hash,
        dontneed,
        no_early,
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
        page_cache = load_from_page_cache(kept, sd, cfg, repeat, versions)
    finally:
        for ex in kept.values():
            ex.close()
    fresh_first = candidates[4]
    raw = next(c for c in candidates if c.label.startswith("raw sequential"))
    hf_fsync = next(c for c in candidates if c.label == "save_pretrained + fsync")
    med = statistics.median
    clones = [t for c in candidates for t in c.clones]

    print(f"  stall  {'clone of the state dict (limit)':<40} {med(clones):7.3f} s")
    print(f"         {'export(), reused staging buffers':<40} {med(stalls['warm']):7.3f} s   "
          f"{ratio(stalls['warm'], exporter.clones)} clone")  # fmt: skip
    print(f"         {'export(), fresh exporter (allocates)':<40} {med(stalls['cold']):7.3f} s   "
          f"{ratio(stalls['cold'], fresh_first.clones)} clone")  # fmt: skip
    print(f"  write  {'':<40} {'median':>9} {'MB/s':>6} {'CPU':>5}   "
          f"raw+fsync         save_pretrained+fsync")  # fmt: skip
    for c in candidates:
        print(f"         {c.label:<40} {med(c.times):7.3f} s "
              f"{total / med(c.times) / 1e6:6.0f} {med(c.cpu):5.2f}   "
              f"{ratio(c.times, raw.times):<17} {ratio(c.times, hf_fsync.times)}")  # fmt: skip
    print("  (CPU: this process's CPU seconds per second of the run, all threads; "
          f"{os.cpu_count()} cores)")  # fmt: skip
    print("  load of the just-committed checkpoint into a fresh model (load_model, verified)")
    for c in (exporter, by_hash, dontneed, no_early):
        print(f"         after {c.label:<34} {med(c.loads):7.3f} s   "
              f"{ratio(c.loads, exporter.loads)} the default's")  # fmt: skip
    print("  load from the page cache (the same files, read just before)")
    base = page_cache["safetensors load_file (unverified)"]
    for label, times in page_cache.items():
        print(f"         {label:<40} {med(times):7.3f} s   {ratio(times, base)} load_file")
    fp = page_cache["from_pretrained (unverified)"]
    print(f"         load_model takes {ratio(page_cache['load_model (verified)'], fp)} "
          f"from_pretrained")  # fmt: skip
    # from_pretrained maps the files and reads a byte only when a weight is used; a verified
    # load reads every byte once. The aim: at most 1.3x from_pretrained plus that one pass.
    copied = page_cache["load_file, then each tensor copied"]
    one_pass = [c - b for c, b in zip(copied, base, strict=True)]
    limit = [f + o for f, o in zip(fp, one_pass, strict=True)]
    print(f"         load_model takes {ratio(page_cache['load_model (verified)'], limit)} "
          f"from_pretrained + one copy of every weight (aim: 1.3x at most)")  # fmt: skip
    print("  (ratios: median and range over repeats of the ratio within one repeat)")
    for algo in HASHES:
        tensor_digest(unique[0], algo)
        hash_s = _timed(lambda a=algo: [tensor_digest(t, a) for t in unique])  # type: ignore[misc]
        print(f"  hash {algo:<10} one thread: {total / hash_s / 1e6:7.0f} MB/s")


def load_from_page_cache(
    kept: dict[str, AsyncHFExporter],
    sd: dict[str, torch.Tensor],
    cfg: Any,
    repeat: int,
    versions: Any,
) -> dict[str, list[float]]:
    """Verified and unverified loads of the same committed files, all from the page cache
    (each file is read once first), rotated per repeat like the writes."""
    paths = {}
    for label in ("exporter", "exporter, sha256"):
        paths[label] = kept[label].export(next(versions), sd, config=cfg).result()
    xxh, sha = paths["exporter"], paths["exporter, sha256"]
    shards = sorted(xxh.glob("*.safetensors"))

    def read_all() -> None:
        for p in (xxh, sha):
            for f in p.iterdir():
                f.read_bytes()

    loads: dict[str, Callable[[], Any]] = {
        # Maps the files: no byte is read until a tensor is used.
        "safetensors load_file (unverified)": lambda: [load_file(str(f)) for f in shards],
        # ...and every byte copied into process memory, as an engine does moving weights.
        "load_file, then each tensor copied": lambda: [
            {k: v.clone() for k, v in load_file(str(f)).items()} for f in shards
        ],
        "load_checkpoint (verified, xxh3-128)": lambda: load_checkpoint(xxh),
        "load_checkpoint (verified, sha256)": lambda: load_checkpoint(sha),
        "from_pretrained (unverified)": lambda: AutoModelForCausalLM.from_pretrained(str(xxh)),
        "load_model (verified)": lambda: load_model(xxh),
    }
    times: dict[str, list[float]] = {label: [] for label in loads}
    order = list(loads)
    for r in range(repeat):
        for label in order[r % len(order) :] + order[: r % len(order)]:
            read_all()
            gc.collect()
            _release_freed_memory()
            t0 = time.perf_counter()
            result = loads[label]()
            times[label].append(time.perf_counter() - t0)
            del result
    return times


def _clear(root: Path) -> None:
    for child in list(root.iterdir()):
        _remove(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"writing under {work}; torch threads: {torch.get_num_threads()}; "
          f"cores: {os.cpu_count()}")  # fmt: skip
    try:
        for name in a.sizes.split(","):
            bench(name, work, a.repeat)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
