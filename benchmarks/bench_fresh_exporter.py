"""Why a fresh exporter's first export is slower: is it the exporter or its new buffers?

    .venv/bin/python benchmarks/bench_fresh_exporter.py [--size large] [--repeat 5]

Five candidates, rotated per repeat and each after the same clean-up: a raw write + fsync
of the same bytes; a long-lived exporter; and a fresh exporter's first export, allocating
its staging buffers, after ``reserve()`` allocated them at "start-up" (untimed), or handed
the long-lived one's buffers. Ratios are to the raw write within one repeat (median, range).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench_export import _clear, _model, _raw_write, _remove, _timed

from recovery_fsm.export import AsyncHFExporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="large", choices=["small", "large"])
    parser.add_argument("--repeat", type=int, default=5)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recovery-fsm-bench-"))
    _, cfg, sd, unique = _model(a.size)
    kept = AsyncHFExporter(work / "kept", max_shard_size="2GB")
    versions = iter(range(10**6))
    for _ in range(2):  # past its first exports
        kept.export(next(versions), sd, config=cfg).result()
        _clear(work / "kept")
    times: dict[str, list[float]] = {}

    def raw() -> None:
        times.setdefault("raw write + fsync", []).append(
            _timed(lambda: _raw_write(work / "raw.bin", unique))
        )
        _remove(work / "raw.bin")

    def long_lived() -> None:
        times.setdefault("long-lived exporter", []).append(
            _timed(lambda: kept.export(next(versions), sd, config=cfg).result())
        )
        _clear(work / "kept")

    def fresh(buffers: str) -> Callable[[], None]:
        label = {
            "own": "fresh exporter, its own new buffers",
            "reserved": "fresh exporter after reserve()",
            "borrowed": "fresh exporter, borrowed buffers",
        }[buffers]
        borrow = buffers == "borrowed"

        def run() -> None:
            ex = AsyncHFExporter(work / "fresh", max_shard_size="2GB")
            if borrow:
                ex._free_buffers.append(kept._free_buffers.pop())
            if buffers == "reserved":
                ex.reserve(sd)  # untimed, as at start-up
            times.setdefault(label, []).append(
                _timed(lambda: ex.export(1, sd, config=cfg).result())
            )
            if borrow:
                kept._free_buffers.append(ex._free_buffers.pop())
            ex.close()
            _remove(work / "fresh")
            gc.collect()

        return run

    candidates = [raw, long_lived, fresh("own"), fresh("reserved"), fresh("borrowed")]
    try:
        for r in range(a.repeat):
            shift = r % len(candidates)
            for run in candidates[shift:] + candidates[:shift]:
                run()
    finally:
        kept.close()
        shutil.rmtree(work, ignore_errors=True)
    base = times["raw write + fsync"]
    print(f"{a.size} model, {a.repeat} repeats")
    for label, ts in times.items():
        rs = sorted(t / b for t, b in zip(ts, base, strict=True))
        print(f"  {label:<38} {statistics.median(ts):7.3f} s   "
              f"{statistics.median(rs):.2f}x ({rs[0]:.2f}-{rs[-1]:.2f}) raw")  # fmt: skip


if __name__ == "__main__":
    main()
