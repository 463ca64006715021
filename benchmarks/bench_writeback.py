"""How the exporter starts writeback, and what that leaves for a restart on the same host.

    .venv/bin/python benchmarks/bench_writeback.py [--size large] [--repeat 10]

For each mode (``sync_file_range``, ``dontneed``, ``off``), in an order rotated per repeat:
the export to committed (fsync included), the share of the committed shard's pages still in
the page cache right after the commit (``fincore`` from util-linux, when installed), and a
verified ``load_model`` of that checkpoint into a fresh model. Ratios are taken within one
repeat against ``sync_file_range``, then the median and the range.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_export import _clear, _model, ratio
from transformers.utils import logging as hf_logging

from recovery_fsm.export import AsyncHFExporter, load_model

MODES = ("sync_file_range", "dontneed", "off")


def resident(path: Path) -> float | None:
    """The share of the file's bytes in the page cache, or None without ``fincore``."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]) / max(1, int(out[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="large", choices=["small", "large"])
    parser.add_argument("--repeat", type=int, default=10)
    a = parser.parse_args()
    hf_logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    _, cfg, sd, unique = _model(a.size)
    total = sum(t.numel() * t.element_size() for t in unique)
    exporters = {m: AsyncHFExporter(work / m, max_shard_size="5GB", writeback=m) for m in MODES}
    writes: dict[str, list[float]] = {m: [] for m in MODES}
    loads: dict[str, list[float]] = {m: [] for m in MODES}
    cached: dict[str, list[float]] = {m: [] for m in MODES}
    version = 0
    try:
        for ex in exporters.values():  # past their first exports, as in training
            for _ in range(2):
                version += 1
                ex.export(version, sd, config=cfg).result()
                _clear(ex.store.root)
        for r in range(a.repeat):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                version += 1
                os.sync()
                t0 = time.perf_counter()
                path = exporters[mode].export(version, sd, config=cfg).result()
                writes[mode].append(time.perf_counter() - t0)
                share = resident(path / "model.safetensors")
                if share is not None:
                    cached[mode].append(share)
                t0 = time.perf_counter()
                model = load_model(path)
                loads[mode].append(time.perf_counter() - t0)
                del model
                _clear(exporters[mode].store.root)
    finally:
        for ex in exporters.values():
            ex.close()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(f"{a.size}: {total / 1e6:.0f} MB, {a.repeat} repeats, {os.cpu_count()} cores")
    print(f"  {'writeback':<16} {'export':>9} {'vs sfr':>18} {'cached':>7} "
          f"{'load_model':>11} {'vs sfr':>18}")  # fmt: skip
    base = "sync_file_range"
    for m in MODES:
        share = f"{med(cached[m]) * 100:6.1f}%" if cached[m] else "    n/a"
        print(f"  {m:<16} {med(writes[m]):7.3f} s {ratio(writes[m], writes[base]):>18} "
              f"{share} {med(loads[m]):9.3f} s {ratio(loads[m], loads[base]):>18}")  # fmt: skip
    print("  export MB/s (median): " + ", ".join(
        f"{m} {total / med(writes[m]) / 1e6:.0f}" for m in MODES))  # fmt: skip


if __name__ == "__main__":
    main()
