"""The chaos demo (extras ``[torch,ray,demo]``): immediate recovery on a local Ray cluster,
and with ``baseline`` the same seeded scenario on the cold path, side by side."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import attrs

from .live import Display
from .report import Report, render_plain, summarize
from .run import (
    KINDS,
    MODELS,
    RUNS,
    DemoOptions,
    Incident,
    OutputInUse,
    RunResult,
    plan,
    replace_previous_run,
    run,
)

__all__ = [
    "KINDS",
    "MODELS",
    "DemoOptions",
    "Display",
    "Incident",
    "OutputInUse",
    "Report",
    "RunResult",
    "main",
    "plan",
    "render_plain",
    "replace_previous_run",
    "run",
    "summarize",
]


@attrs.frozen
class Outcome:
    reports: tuple[Report, ...]
    results: tuple[RunResult, ...]
    timelines: tuple[Path, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)


def main(options: DemoOptions, *, baseline: bool = False, display: Display | None = None,
         timeline: bool = True) -> Outcome:  # fmt: skip
    """Run the demo (starting a local Ray cluster if none is up) and print the report.

    Each run's files are its own: the previous run's under ``options.out`` are replaced
    (``OutputInUse`` if it holds anything else), before Ray starts."""
    import ray

    display = display or Display()
    replaced = replace_previous_run(options.out)
    if replaced:
        display.note(f"replaced the previous run's files in {options.out} "
                     f"({', '.join(p.name for p in replaced)})")  # fmt: skip
    started_ray = not ray.is_initialized()
    if started_ray:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)  # fmt: skip
    results: list[RunResult] = []
    pictures: list[Path] = []
    try:
        for immediate in (True, False) if baseline else (True,):
            label = "immediate recovery" if immediate else "cold path (baseline)"
            out = options.out / RUNS[0 if immediate else 1]
            display.begin(f"{label}: {options.groups} groups, {options.steps} steps of "
                          f"{options.step_s:g} s, model {options.model}, seed {options.seed}",
                          options.steps)  # fmt: skip
            try:
                result = run(options, immediate=immediate, out=out,
                             on_status=display.status, note=display.note)  # fmt: skip
            finally:
                display.end()
            results.append(result)
            if timeline:
                from ..journal.timeline import draw

                info = draw(result.ledger, out / "timeline.png", title=label)
                pictures.append(info.path)
                display.note(f"timeline: {info.path}")
    finally:
        if started_ray:
            ray.shutdown()
    reports = tuple(summarize(r) for r in results)
    display.report(reports)
    for r, res in zip(reports, results, strict=True):
        display.note(f"{r.label}: journal {res.journal}")
        if not r.replay_ok:
            display.note(r.replay_summary)
    return Outcome(reports, tuple(results), tuple(pictures))
