"""The demo's report stays readable whatever the width: in a file or a CI log (no width of
its own; rich alone would wrap every cell at 80 columns) and in a narrow terminal.

The reports are made up: nothing here starts Ray or runs the demo.
"""

from __future__ import annotations

import io
import math
import re

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("rich")

from rich.console import Console

from recovery_fsm.demo.report import Report, print_report, rows

LABELS = ("immediate + standbys (2)", "immediate recovery", "cold path", "no failures")


def report(label: str, **changes: object) -> Report:
    fields: dict[str, object] = dict(
        label=label, failures_injected=9,
        injected_by_kind={"idle": 3, "export": 2, "loading": 2, "double": 1, "repeat": 1},
        incidents_skipped=1, failures_seen=11,
        recoveries={"standby": 6, "immediate": 3, "waited": 1, "cold": 0},
        p50_s={"standby": 0.41, "immediate": 1.23, "waited": 3.4, "cold": math.nan},
        p95_s={"standby": 0.88, "immediate": 2.05, "waited": 3.4, "cold": math.nan},
        unrecovered=0, idle_group_s=12.3, cooldown_entries=1, tokens=123456, requests=2048,
        samples=8192, reissued=12, lost=0, wall_s=95.0,
        safety={"stale admissions": 0, "stale answers served": 0, "loads from deleted paths": 0,
                "leaked checkpoint dirs": 0, "lost effects": 0},
        replay_ok=True, replay_summary="replayed 1234 events through Controller",
        tokens_per_s=1000.0, samples_per_s=80.0, goodput=0.9,
    )  # fmt: skip
    fields.update(changes)
    return Report(**fields)  # type: ignore[arg-type]


REPORTS = [report(label) for label in LABELS]


def in_a_file(reports: list[Report]) -> list[str]:
    out = io.StringIO()
    print_report(Console(file=out), reports)
    return out.getvalue().splitlines()


def in_a_terminal(reports: list[Report], width: int, colour: bool = False) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True,
                      color_system="standard" if colour else None)  # fmt: skip
    print_report(console, reports)
    return out.getvalue().splitlines()


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split("[│┃]", line)[1:-1]]


@pytest.fixture(autouse=True)
def no_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)


def test_in_a_file_every_row_is_one_line_with_every_run_side_by_side() -> None:
    """Where rich would assume 80 columns, the table takes the width of its content: one
    line per row, each cell whole, the runs in one table."""
    lines = in_a_file(REPORTS)
    table = rows(REPORTS)
    assert cells(next(ln for ln in lines if "┃" in ln)) == list(table[0])
    body = [cells(ln) for ln in lines if ln.startswith("│")]
    assert body == [[c.strip() for c in r] for r in table[1:]]
    assert sum("report" in ln for ln in lines) == 1


def test_a_file_keeps_to_columns_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``COLUMNS`` set for a log is a width asked for: the report keeps to it."""
    monkeypatch.setenv("COLUMNS", "100")
    lines = in_a_file(REPORTS)
    assert max(map(len, lines)) <= 100
    assert all(any(label in ln for ln in lines) for label in LABELS)


@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_a_narrow_terminal_gets_whole_labels_and_figures_and_no_longer_lines(
    width: int,
) -> None:
    """Fewer runs side by side (one per table at worst) rather than every cell folded: each
    run's label, each row's name where it fits and each short figure stays on one line."""
    lines = in_a_terminal(REPORTS, width)
    assert max(map(len, lines)) <= width
    for label in LABELS:
        assert any(label in ln for ln in lines), (label, "\n".join(lines))
    for name, *values in rows(REPORTS)[1:]:
        start = "│ " + name[: len(name) - len(name.lstrip())] + name.split()[0]
        row = [cells(ln) for ln in lines if ln.startswith(start)]
        if len(name) <= 26:  # fits the names' column at 60
            row = [r for r in row if r[0] == name.strip()]
        assert row, (name, "\n".join(lines))
        for v in values:
            if len(v) <= 20:
                assert any(v in r[1:] for r in row), (name, v, "\n".join(lines))


def test_a_wide_terminal_gets_one_table() -> None:
    lines = in_a_terminal(REPORTS, 200)
    assert sum("┃" in ln and LABELS[0] in ln and LABELS[-1] in ln for ln in lines) == 1
    assert max(map(len, lines)) <= 200


@pytest.mark.parametrize("width", [60, 200])
def test_only_a_safety_counter_not_0_is_red(width: int) -> None:
    """A clean replay after the safety rows is not one of them."""
    bad = [REPORTS[0], report(LABELS[1], safety={**REPORTS[0].safety, "lost effects": 2})]
    red = "\x1b[1;31m"
    lines = in_a_terminal(bad, width, colour=True)
    assert [ln for ln in lines if "lost effects" in ln and red in ln]
    assert not [ln for ln in lines if red in ln and "lost effects" not in ln]


def test_the_demo_display_prints_the_report_so() -> None:
    """What ``recovery-fsm demo`` prints at the end, to a log: one line per row."""
    from recovery_fsm.demo.live import Display

    out = io.StringIO()
    Display(Console(file=out), live=False).report(REPORTS)
    lines = out.getvalue().splitlines()
    assert [cells(ln) for ln in lines if ln.startswith("│")] == [
        [c.strip() for c in r] for r in rows(REPORTS)[1:]
    ]
