"""Why a fresh exporter's first export is slower: is it the exporter or its new buffers?

    .venv/bin/python benchmarks/bench_fresh_exporter.py [--size large] [--repeat 5]

Five candidates, rotated per repeat as in ``bench_export.py``: a raw write + fsync of the
same bytes; a long-lived exporter; and a fresh exporter's first export, allocating its
staging buffers, after ``reserve()`` allocated them at "start-up" (untimed), or handed the
long-lived one's buffers. Each exporter's time runs from the ``export()`` call to the commit;
its stall (the ``export()`` call alone) is printed beside it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from bench_export import (
    Candidate,
    _clear,
    _model,
    _raw_write,
    _remove,
    export_until_committed,
    ratio,
    run_rotated,
)

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
    stalls: dict[str, list[float]] = {}
    fresh: list[AsyncHFExporter] = []

    def export(ex: AsyncHFExporter, version: int, label: str) -> None:
        export_until_committed(ex, version, sd, cfg, stalls.setdefault(label, []))

    def fresh_candidate(buffers: str, label: str) -> Candidate:
        def before() -> None:
            ex = AsyncHFExporter(work / "fresh", max_shard_size="2GB")
            if buffers == "borrowed":
                ex._free_buffers.append(kept._free_buffers.pop())
            elif buffers == "reserved":
                ex.reserve(sd)  # as at start-up
            fresh.append(ex)

        def after() -> None:
            ex = fresh.pop()
            if buffers == "borrowed":
                kept._free_buffers.append(ex._free_buffers.pop())
            ex.close()
            _remove(work / "fresh")

        return Candidate(label, lambda: export(fresh[-1], 1, label), before=before, after=after)

    raw = Candidate(
        "raw write + fsync",
        lambda: _raw_write(work / "raw.bin", unique),
        after=lambda: _remove(work / "raw.bin"),
    )
    candidates = [
        raw,
        Candidate(
            "long-lived exporter",
            lambda: export(kept, next(versions), "long-lived exporter"),
            after=lambda: _clear(work / "kept"),
        ),
        fresh_candidate("own", "fresh exporter, its own new buffers"),
        fresh_candidate("reserved", "fresh exporter after reserve()"),
        fresh_candidate("borrowed", "fresh exporter, borrowed buffers"),
    ]
    try:
        run_rotated(candidates, a.repeat, lambda: [t.clone() for t in unique])
    finally:
        kept.close()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(f"{a.size} model, {a.repeat} repeats; torch threads: {torch.get_num_threads()}")
    for c in candidates:
        line = f"  {c.label:<38} {med(c.times):7.3f} s   {ratio(c.times, raw.times)} raw"
        if c.label in stalls:
            line += f"   stall {ratio(stalls[c.label], c.clones)} clone"
        print(line)


if __name__ == "__main__":
    main()
