"""What the demo shows while it runs: a live table on a terminal, plain lines otherwise."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from .report import SAFETY, Report, rows

COLOURS = {
    "active": "green", "suspect": "yellow", "failed": "bold red", "awaiting_checkpoint": "magenta",
    "loading": "cyan", "relaunching": "blue", "pending_weights": "bright_black",
    "retired": "red", "stopped": "bright_black", "resuming": "bright_magenta",
}  # fmt: skip


class Display:
    """``status`` is called often from the trainer's thread; ``note`` from any thread."""

    def __init__(self, console: Console | None = None, *, live: bool | None = None) -> None:
        self.console = console or Console()
        self.live_mode = self.console.is_terminal if live is None else live
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_line = 0.0
        self._last_version = -1

    def begin(self, title: str, steps: int) -> None:
        self.console.rule(title)
        if not self.live_mode:
            return
        self._progress = Progress(
            TextColumn("weight syncs"), BarColumn(), MofNCompleteColumn(), console=self.console
        )
        self._task = self._progress.add_task("steps", total=steps)
        self._live = Live(console=self.console, refresh_per_second=4, transient=True)
        self._live.start()

    def end(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def note(self, text: str) -> None:
        with self._lock:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    def status(self, rt: Any, version: int, steps: int) -> None:
        groups = rt.controller.groups()
        checkpoints = rt.controller.checkpoints()
        if self._live is not None and self._progress is not None:
            self._progress.update(self._task, completed=min(version, steps))
            self._live.update(Group(self._progress, _groups_table(groups, rt.controller.version),
                                    _checkpoints_table(checkpoints)))  # fmt: skip
            return
        now = time.monotonic()
        if version == self._last_version and now - self._last_line < 2.0:
            return  # plain output: a line per sync, and every 2 s while something changes
        self._last_line, self._last_version = now, version
        g = " ".join(f"{n}:{v.state}#{v.incarnation}@{v.version}" for n, v in groups.items())
        c = " ".join(f"C{v}:{x.state}({x.leases})" for v, x in checkpoints.items())
        self.note(f"sync {version}/{steps} | {g} | {c}")

    def report(self, reports: Sequence[Report]) -> None:
        table = Table(title="report", show_lines=False)
        header, *body = rows(reports)
        for i, cell in enumerate(header):
            table.add_column(cell or "", justify="left" if i == 0 else "right")
        safety = False
        for r in body:
            safety = safety or r[0] == SAFETY
            bad = safety and r[0] != SAFETY and any(x != "0" for x in r[1:])
            table.add_row(*r, style="bold red" if bad else None)
        self.console.print(table)

    def __enter__(self) -> Display:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.end()


def _groups_table(groups: dict[str, Any], version: int) -> Table:
    t = Table(title=f"worker groups (fleet at version {version})", expand=False)
    for col in ("group", "state", "version", "incarnation", "immediate recovery", "restarts"):
        t.add_column(col)
    for name, g in groups.items():
        colour = COLOURS.get(g.state, "white")
        t.add_row(name, f"[{colour}]{g.state}[/]", str(g.version), str(g.incarnation),
                  g.recovery, str(g.restarts))  # fmt: skip
    return t


def _checkpoints_table(checkpoints: dict[int, Any]) -> Table:
    t = Table(title="recovery checkpoints", expand=False)
    for col in ("version", "state", "leases", "pinned"):
        t.add_column(col)
    for v, c in checkpoints.items():
        t.add_row(str(v), c.state, str(c.leases), "yes" if c.pinned else "")
    return t
