"""The demo's report: what was injected, how each outage ended, what it cost, and the safety
counters that must all be zero. Everything comes from a ``RunResult``; nothing is re-measured.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Sequence

import attrs
from rich.console import Console
from rich.table import Table

from ..journal.ledger import PATHS, percentile
from ..search.replay import replay
from .run import RunResult


@attrs.frozen
class Report:
    label: str
    failures_injected: int
    injected_by_kind: dict[str, int]
    incidents_skipped: int  # planned, but no group was serving at the time
    failures_seen: int  # fail transitions in the journal (a death while loading is one more)
    recoveries: dict[str, int]
    p50_s: dict[str, float]
    p95_s: dict[str, float]
    unrecovered: int  # outages still open at shutdown (retired or stopped)
    idle_group_s: float
    cooldown_entries: int
    tokens: int
    requests: int
    samples: int
    reissued: int
    lost: int
    wall_s: float
    safety: dict[str, int]
    replay_ok: bool
    replay_summary: str
    tokens_per_s: float  # rollout tokens per second while the rollouts ran
    samples_per_s: float  # accepted samples per second while the rollouts ran
    goodput: float | None = None  # samples_per_s over the failure-free run's (None: no such run)

    @property
    def ok(self) -> bool:
        return self.replay_ok and not any(self.safety.values())

    @property
    def idle_per_failure_s(self) -> float:
        return self.idle_group_s / self.failures_injected if self.failures_injected else 0.0


def summarize(result: RunResult) -> Report:
    ledger = result.ledger
    stats = result.statistics
    kinds = collections.Counter(kind for _, _, kind in result.counters.killed)
    lat = {p: ledger.latencies(p) for p in PATHS}
    check = replay(result.journal)
    safety = {
        "stale admissions": result.counters.stale_admissions,
        "stale answers served": result.counters.stale_serves,
        "loads from deleted paths": stats.loads_from_deleted,
        "leaked checkpoint dirs": len(result.leaked),
        "lost effects": (
            len(result.outstanding) + stats.lost_reports + stats.failed_effects
            + result.link_errors + (0 if result.drained else 1)
        ),
    }  # fmt: skip
    return Report(
        label=result.label,
        failures_injected=len(result.counters.killed),
        injected_by_kind=dict(kinds),
        incidents_skipped=len(result.counters.skipped),
        failures_seen=len(ledger.crashes),
        recoveries={p: len(v) for p, v in lat.items()},
        p50_s={p: percentile(v, 50) for p, v in lat.items()},
        p95_s={p: percentile(v, 95) for p, v in lat.items()},
        unrecovered=_outages_left(result),
        idle_group_s=ledger.idle_group_seconds(),
        cooldown_entries=ledger.cooldowns,
        tokens=result.counters.tokens,
        requests=result.counters.requests,
        samples=result.counters.samples,
        reissued=result.counters.reissued,
        lost=result.counters.lost,
        wall_s=result.wall_s,
        safety=safety,
        replay_ok=check.ok,
        replay_summary=check.render(),
        tokens_per_s=result.counters.tokens / result.rollout_s if result.rollout_s else 0.0,
        samples_per_s=result.counters.samples / result.rollout_s if result.rollout_s else 0.0,
    )


def with_goodput(reports: Sequence[Report], results: Sequence[RunResult]) -> list[Report]:
    """Each report's goodput: accepted samples per second against the failure-free run's,
    if one was made."""
    free = [r for r, res in zip(reports, results, strict=True) if res.mode == "free"]
    if not free or not free[0].samples_per_s:
        return list(reports)
    base = free[0].samples_per_s
    return [attrs.evolve(r, goodput=r.samples_per_s / base) for r in reports]


def _outages_left(result: RunResult) -> int:
    """Groups that failed and were never admitted again before the shutdown."""
    last_fail: dict[str, float] = {}
    for m in result.ledger.crashes:
        last_fail[m.group] = m.at
    last_admit: dict[str, float] = {}
    for m in result.ledger.admissions:
        last_admit[m.group] = m.at
    return sum(1 for g, at in last_fail.items() if last_admit.get(g, -math.inf) < at)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f} s"


SAFETY = "safety (each must be 0)"


def rows(reports: Sequence[Report]) -> list[tuple[str, ...]]:
    """The report as (what, value per run) rows, for a table or plain text."""
    out: list[tuple[str, ...]] = [("", *(r.label for r in reports))]

    def row(name: str, values: Sequence[str]) -> None:
        out.append((name, *values))

    row("wall time", [f"{r.wall_s:.0f} s" for r in reports])
    row("failures injected", [str(r.failures_injected) for r in reports])
    for kind in sorted({k for r in reports for k in r.injected_by_kind}):
        row(f"  {kind}", [str(r.injected_by_kind.get(kind, 0)) for r in reports])
    row("  skipped (no group serving)", [str(r.incidents_skipped) for r in reports])
    row("failures seen (all causes)", [str(r.failures_seen) for r in reports])
    for p in PATHS:
        row(f"recovered: {p}", [str(r.recoveries[p]) for r in reports])
        row("  latency p50 / p95",
            [f"{_fmt(r.p50_s[p])} / {_fmt(r.p95_s[p])}" for r in reports])  # fmt: skip
    row("not recovered at shutdown", [str(r.unrecovered) for r in reports])
    row("idle group-seconds", [f"{r.idle_group_s:.1f}" for r in reports])
    row("  per failure injected", [f"{r.idle_per_failure_s:.1f}" for r in reports])
    row("cooldown entries", [str(r.cooldown_entries) for r in reports])
    row("samples accepted (n=4, t=1)",
        [f"{r.samples} in {r.requests} calls, {r.tokens} tokens" for r in reports])  # fmt: skip
    row("  prompts issued again / lost", [f"{r.reissued} / {r.lost}" for r in reports])
    row("  accepted samples per second", [f"{r.samples_per_s:.1f}" for r in reports])
    row("  goodput (of the run without failures)",
        ["-" if r.goodput is None else f"{100 * r.goodput:.0f}%" for r in reports])  # fmt: skip
    row(SAFETY, ["" for _ in reports])
    for name in reports[0].safety:
        row(f"  {name}", [str(r.safety[name]) for r in reports])
    row("journal replayed (world model)",
        [("clean, " if r.replay_ok else "FAILED, ")
         + r.replay_summary.splitlines()[0].split(" through")[0].removeprefix("replayed ")
         for r in reports])  # fmt: skip
    return out


def render_plain(reports: Sequence[Report]) -> str:
    table = rows(reports)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table
    )


def print_report(console: Console, reports: Sequence[Report]) -> None:
    """The report as a table of the runs side by side.

    A file or a CI log has no width of its own (rich would assume 80 columns and wrap every
    cell), so there the table takes the width its content needs. A terminal (or ``COLUMNS``)
    gets as many runs side by side as fit; with less room, one run per table."""
    table = rows(reports)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        whole = _table(table, title="report")
        whole.width = _natural_width(console, whole)
        console.print(whole, crop=False)
        return
    runs = len(table[0]) - 1
    per = next((n for n in range(runs, 1, -1) if _fits(console, _pieces(table, n))), 1)
    for t in _pieces(table, per):
        console.print(t)


def _pieces(table: Sequence[tuple[str, ...]], per: int) -> list[Table]:
    """The table cut into tables of ``per`` runs each, every one with the rows' names."""
    return [_table([(r[0], *r[i : i + per]) for r in table], title="report" if i == 1 else None)
            for i in range(1, len(table[0]), per)]  # fmt: skip


def _table(table: Sequence[tuple[str, ...]], title: str | None) -> Table:
    header, *body = table
    out = Table(title=title)
    for i, cell in enumerate(header):
        out.add_column(cell, justify="left" if i == 0 else "right")
    safety = False
    for r in body:
        # The safety section is the indented rows under its heading; any of them not 0 is red.
        safety = r[0] == SAFETY or (safety and r[0].startswith(" "))
        bad = safety and r[0] != SAFETY and any(x != "0" for x in r[1:])
        out.add_row(*r, style="bold red" if bad else None)
    return out


def _fits(console: Console, tables: Sequence[Table]) -> bool:
    return all(_natural_width(console, t) <= console.width for t in tables)


def _natural_width(console: Console, table: Table) -> int:
    """The width a table takes when no cell wraps."""
    return console.measure(table, options=console.options.update_width(1 << 16)).maximum
