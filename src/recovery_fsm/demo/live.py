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

from .. import Label
from ..journal import palette
from .report import Report, print_report


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
        print_report(self.console, reports)

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
        t.add_row(name, _state(Label.GROUP, g.state), str(g.version), str(g.incarnation),
                  _state(Label.RECOVERY, g.recovery), str(g.restarts))  # fmt: skip
    t.caption = _legend(Label.GROUP, {g.state for g in groups.values()})
    return t


def _checkpoints_table(checkpoints: dict[int, Any]) -> Table:
    t = Table(title="recovery checkpoints", expand=False)
    for col in ("version", "state", "leases", "pinned"):
        t.add_column(col)
    for v, c in checkpoints.items():
        t.add_row(str(v), _state(Label.CHECKPOINT, c.state), str(c.leases),
                  "yes" if c.pinned else "")  # fmt: skip
    t.caption = _legend(Label.CHECKPOINT, {c.state for c in checkpoints.values()})
    return t


def _state(label: str, state: str) -> str:
    return f"[{palette.swatch(label, state).style}]{state}[/]"


def _legend(label: str, shown: set[str]) -> str:
    """The legend of the states on screen, in the timeline's order and words."""
    return "  ".join(f"[{s.style}]■ {s.legend}[/]" for state, s in palette.of(label).items()
                     if state in shown)  # fmt: skip
