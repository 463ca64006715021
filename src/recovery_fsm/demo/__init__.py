"""The chaos demo (extras ``[torch,ray,demo]``): one seeded scenario on a local Ray cluster,
run with warm standbys, with immediate recovery alone, on the cold path, and without failures
(the goodput's yardstick), reported side by side."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import attrs

from .live import Display
from .report import Report, render_plain, summarize, with_goodput
from .run import (
    KINDS,
    LABELS,
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


def default_runs(options: DemoOptions) -> tuple[str, ...]:
    """Every run, in the report's order; the standby run only with standbys."""
    return tuple(r for r in RUNS if r != "standby" or options.standby > 0)


def main(options: DemoOptions, *, runs: Sequence[str] | None = None,
         display: Display | None = None, timeline: bool = True) -> Outcome:  # fmt: skip
    """Run the demo (starting a private Ray cluster if none is up) and print the report.

    Each run's files are its own: the previous run's under ``options.out`` are replaced
    (``OutputInUse`` if it holds anything else), before Ray starts."""
    import ray

    from ..ray import start_local_cluster

    display = display or Display()
    modes = tuple(runs) if runs is not None else default_runs(options)
    unknown = [m for m in modes if m not in RUNS]
    if unknown or not modes:
        raise ValueError(f"demo runs must be some of {', '.join(RUNS)}; got {list(modes)}")
    replaced = replace_previous_run(options.out)
    if replaced:
        display.note(f"replaced the previous run's files in {options.out} "
                     f"({', '.join(p.name for p in replaced)})")  # fmt: skip
    started_ray = not ray.is_initialized()
    if started_ray:
        start_local_cluster(num_cpus=2, logging_level=logging.ERROR)
    results: list[RunResult] = []
    pictures: list[Path] = []
    try:
        for mode in modes:
            label = LABELS[mode]
            if mode == "standby":
                label += f" ({options.standby})"
            out = options.out / mode
            display.begin(f"{label}: {options.groups} groups, {options.steps} steps of "
                          f"{options.step_s:g} s, model {options.model}, seed {options.seed}",
                          options.steps)  # fmt: skip
            try:
                result = run(options, mode=mode, out=out,
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
    reports = tuple(with_goodput([summarize(r) for r in results], results))
    display.report(reports)
    for r, res in zip(reports, results, strict=True):
        display.note(f"{r.label}: journal {res.journal}")
        if not r.replay_ok:
            display.note(r.replay_summary)
    return Outcome(reports, tuple(results), tuple(pictures))
