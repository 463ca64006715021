"""What happened, read off journal records: the one account behind metrics, reports and
timelines.

A ``Ledger`` folds the controller's journal records (live, as a tee of the journal sink, or
read back from a ``JsonlJournal`` file) into plain facts: each group's states over time,
weight syncs, export intervals, crashes, admissions, and each outage with the path that ended
it. Because the journal is its only input, a production journal gives the same figures and
the same picture as the demo. It decides nothing and touches no file.

Recovery paths: ``immediate`` booted from the checkpoint that was ready when the group
failed (and, if a sync landed during that load, loaded the next one in place), ``waited``
waited for the export being written (or came up cold) and then loaded it, ``cold`` started
without weights and was admitted by a later sync, ``standby`` took over a warm standby engine
(admitted as it was, or after it loaded C(v) in place). An outage runs from the group's
first failure to its admission, across any restarts that failed in between; the path is the
one of the start that was admitted.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ..machines import (
    SERVING,
    SYNC_VERDICTS,
    GroupEvent,
    GroupState,
    Label,
    PoolState,
    StandbyState,
    SwitchState,
    sync_verdict,
)
from .jsonl import mixed_journal, read_journal

PATHS = ("standby", "immediate", "waited", "cold")


@attrs.frozen
class Span:
    """A group in one state from ``start`` to ``end`` (None: still in it)."""

    group: str
    state: str
    start: float
    end: float | None


@attrs.frozen
class ExportSpan:
    version: int
    start: float
    end: float | None
    outcome: str  # "committed", "failed", "cancelled" or "running"


@attrs.frozen
class Recovery:
    """One outage of a group: the failure it answers (``incarnation``, ``reason``, when),
    the path that brought the group back, and when it served again. Failed restarts on
    the way belong to the same outage (``attempts`` starts made in all)."""

    group: str
    failed_at: float
    admitted_at: float
    path: str  # one of PATHS
    incarnation: int = 0  # the process that failed
    reason: str = ""  # why it failed, as the journal says
    attempts: int = 1  # starts made until one served (a failed restart adds one)

    @property
    def latency_s(self) -> float:
        return self.admitted_at - self.failed_at


@attrs.frozen
class Mark:
    """A point on a group's row: a failure (why) or an admission (the version it serves)."""

    at: float
    group: str
    incarnation: int
    detail: str


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(xs)))
    return xs[rank - 1]


@attrs.define
class _Outage:
    failed_at: float
    incarnation: int
    reason: str
    waited: bool = False
    path: str | None = None
    attempts: int = 1


class Ledger:
    """Folds journal records, in step order, into what happened; safe to read from any thread."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = (), *, keep: int = 10_000) -> None:
        """``keep``: how many of each kind of fact (spans, syncs, exports, failures,
        admissions, recoveries) are kept for reading; older ones are folded into running
        totals, so the counts and idle seconds stay exact over a run of any length."""
        self._lock = threading.Lock()
        self._keep = keep
        self.header: Mapping[str, Any] | None = None
        self.version = 0  # the fleet's version after the last record
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.shutdown_at: float | None = None
        self._open: dict[str, Span] = {}  # group -> its current state, end None
        self._closed: list[Span] = []
        self._syncs: list[tuple[float, int]] = []
        self._exports: dict[int, ExportSpan] = {}
        self._crashes: list[Mark] = []
        self._admissions: list[Mark] = []
        self._recoveries: list[Recovery] = []
        # Totals over everything, dropped facts included.
        self.failures = 0
        self._recovered: dict[str, int] = dict.fromkeys(PATHS, 0)
        self._committed = 0
        self._dropped_idle_s = 0.0
        self._dropped_groups: set[str] = set()
        self.cooldowns = 0  # entries of an immediate-recovery switch into cooldown
        self.standbys_started = 0
        self.standbys_lost = 0  # died, failed a boot, a load or a check, or missed a deadline
        self.pool_exhausted_at: float | None = None  # the pool gave up refilling
        # Per sync, how the previous version's export had fared (the rules' verdict).
        self.sync_verdicts: dict[str, int] = dict.fromkeys(SYNC_VERDICTS, 0)
        self.refused = 0  # records of refused events
        self._taken = 0  # records folded so far: a header after the first is a second run
        self._outages: dict[str, _Outage] = {}
        for record in records:
            self.add(record)

    @classmethod
    def read(cls, path: str | Path) -> Ledger:
        """The ledger of a journal file (one holding two runs raises ``MixedJournal``)."""
        return cls(read_journal(path))

    # -- folding -----------------------------------------------------------------------------

    def add(self, record: Mapping[str, Any]) -> None:
        """Take one journal record (the header, an event, or a refusal). A header after the
        first record raises ``MixedJournal`` and changes nothing: two runs' facts would
        fold into figures of neither."""
        with self._lock:
            self._add(record)

    def __call__(self, record: Mapping[str, Any]) -> None:  # a journal sink
        self.add(record)

    def _add(self, record: Mapping[str, Any]) -> None:
        if "header" in record and self._taken:
            raise mixed_journal(None, self._taken + 1, record.get("step"))
        self._taken += 1
        if "header" in record:
            self.header = record["header"]
            self.version = int(record["header"].get("initial_version", 0))
            return
        if "error" in record or "event" not in record:
            self.refused += 1
            return
        event = record["event"]
        at = float(event["at"])
        self.first_at = at if self.first_at is None else self.first_at
        self.last_at = at
        kind = event["kind"]
        if kind == "WeightsSynced":
            left = self._exports.get(self.version)
            verdict = sync_verdict(None if left is None else left.outcome == "committed")
            self.sync_verdicts[verdict] += 1
            self.version = int(event["version"])
            self._keep_last(self._syncs, (at, self.version))
        elif kind == "ExportStarted":
            v = int(event["version"])
            self._exports[v] = ExportSpan(v, at, None, "running")
            while len(self._exports) > self._keep:
                del self._exports[min(self._exports)]
        elif kind in ("ExportCommitted", "ExportFailed", "ExportCancelled"):
            v = int(event["version"])
            started = self._exports.get(v)
            outcome = kind.removeprefix("Export").lower()
            self._exports[v] = ExportSpan(v, started.start if started else at, at, outcome)
            self._committed += outcome == "committed"
        elif kind == "Shutdown":
            self.shutdown_at = at
        effects = record.get("effects", ())
        # A deadline's failure names its process and reason only in the StopGroup it emits.
        stops = {e["group"]: e for e in effects if e["kind"] == "StopGroup"}
        for label, name, _source, target in record.get("transitions", ()):
            self._transition(at, label, name, target, event, stops)
        for effect in effects:
            if effect["kind"] == "RouteTraffic":
                self._keep_last(
                    self._admissions,
                    Mark(at, effect["group"], int(effect["incarnation"]), str(effect["version"])),
                )

    def _transition(
        self,
        at: float,
        label: str,
        name: str,
        target: str,
        event: Mapping[str, Any],
        stops: Mapping[str, Mapping[str, Any]],
    ) -> None:
        kind, _, who = label.partition(":")
        if kind == Label.RECOVERY:
            if target == SwitchState.COOLDOWN:
                self.cooldowns += 1
            return
        if kind == Label.STANDBY:
            if name == Label.CREATE:
                self.standbys_started += 1
            elif target == StandbyState.LOST:
                self.standbys_lost += 1
            return
        if kind == Label.POOL:
            if target == PoolState.EXHAUSTED:
                self.pool_exhausted_at = at
            return
        if kind != Label.GROUP:
            return
        span = self._open.pop(who, None)
        if span is not None:
            self._keep_last(self._closed, attrs.evolve(span, end=at))
        self._open[who] = Span(who, target, at, None)
        outage = self._outages.get(who)
        if name == GroupEvent.FAIL:
            stop = stops.get(who, {})
            why = event.get("reason") or event.get("error") or stop.get("reason") or event["kind"]
            inc = event.get("incarnation", stop.get("incarnation", 0))
            self._keep_last(self._crashes, Mark(at, who, int(inc), str(why)))
            self.failures += 1
            if outage is None:
                self._outages[who] = _Outage(at, int(inc), str(why))
            else:  # a restart failed: the path is decided again from here
                outage.waited, outage.path = False, None
                outage.attempts += 1
        elif outage is None:
            return
        elif name == GroupEvent.AWAIT_CHECKPOINT:
            outage.waited = True
        elif name == GroupEvent.LOAD:
            outage.path = "waited" if outage.waited else "immediate"
        elif name == GroupEvent.CLAIM:
            outage.path = "standby"
        elif name == GroupEvent.RELOAD and outage.path in (None, "cold"):
            outage.path = "waited"  # came up cold, then loaded C(v) once it was ready
        elif name == GroupEvent.RELAUNCH:
            outage.path = "cold"
        elif target == GroupState.ACTIVE:  # admitted: after a failure, only by a load or a sync
            del self._outages[who]
            path = outage.path or "cold"
            self._keep_last(self._recoveries, Recovery(
                who, outage.failed_at, at, path, outage.incarnation, outage.reason,
                outage.attempts))  # fmt: skip
            self._recovered[path] += 1
        elif target in (GroupState.RETIRED, GroupState.STOPPED):
            del self._outages[who]

    def _keep_last(self, facts: list[Any], fact: Any) -> None:
        """Append, dropping the oldest beyond ``keep`` (a dropped span's idle time is kept)."""
        facts.append(fact)
        if len(facts) > self._keep:
            old = facts.pop(0)
            if isinstance(old, Span):
                self._dropped_groups.add(old.group)
                if _idle(old.state) and old.end is not None:
                    self._dropped_idle_s += old.end - old.start

    # -- reading -----------------------------------------------------------------------------

    @property
    def exports(self) -> list[ExportSpan]:
        with self._lock:
            return [self._exports[v] for v in sorted(self._exports)]

    @property
    def syncs(self) -> list[tuple[float, int]]:
        """(at, version) of every weight sync."""
        with self._lock:
            return list(self._syncs)

    @property
    def crashes(self) -> list[Mark]:
        """Every failure of a group's process (a death, a failed start, a deadline)."""
        with self._lock:
            return list(self._crashes)

    @property
    def admissions(self) -> list[Mark]:
        """Every route to a group (its registration too), with the version it serves."""
        with self._lock:
            return list(self._admissions)

    @property
    def recoveries(self) -> list[Recovery]:
        with self._lock:
            return list(self._recoveries)

    def spans(self, until: float | None = None) -> list[Span]:
        """Every group's states in time order; open spans end at ``until`` (or stay open)."""
        with self._lock:
            out = list(self._closed)
            for s in self._open.values():
                out.append(s if until is None else attrs.evolve(s, end=until))
        return sorted(out, key=lambda s: (s.group, s.start))

    def groups(self) -> list[str]:
        with self._lock:
            return sorted({s.group for s in self._closed} | set(self._open) | self._dropped_groups)

    def idle_group_seconds(self, until: float | None = None) -> float:
        """Seconds each group spent not serving, summed, from its registration to ``until``
        (default: the shutdown, else the last record). A stopped group is not idle."""
        end = until if until is not None else (self.shutdown_at or self.last_at or 0.0)
        with self._lock:
            total = self._dropped_idle_s  # spans dropped had ended before any kept one
        for s in self.spans(until=end):
            if not _idle(s.state) or s.start >= end:
                continue
            total += min(s.end if s.end is not None else end, end) - s.start
        return total

    @property
    def recovered(self) -> dict[str, int]:
        """Recoveries per path over the whole run (``latencies`` holds the kept ones)."""
        with self._lock:
            return dict(self._recovered)

    def latencies(self, path: str) -> list[float]:
        with self._lock:
            return [r.latency_s for r in self._recoveries if r.path == path]

    def metrics(self, until: float | None = None) -> dict[str, float]:
        """Plain numbers for a trainer's logger, under ``recovery/``."""
        out: dict[str, float] = {
            "recovery/failures": float(self.failures),
            "recovery/idle_group_s": self.idle_group_seconds(until),
            "recovery/cooldown_entries": float(self.cooldowns),
            "recovery/standbys_started": float(self.standbys_started),
            "recovery/standbys_lost": float(self.standbys_lost),
        }
        with self._lock:
            for verdict, n in self.sync_verdicts.items():
                out[f"recovery/syncs_{verdict}"] = float(n)
        for path in PATHS:
            lat = self.latencies(path)
            with self._lock:
                out[f"recovery/{path}_count"] = float(self._recovered[path])
            if lat:
                out[f"recovery/{path}_latency_p50_s"] = percentile(lat, 50)
                out[f"recovery/{path}_latency_p95_s"] = percentile(lat, 95)
        done = [e for e in self.exports if e.outcome == "committed" and e.end is not None]
        with self._lock:
            out["recovery/exports_committed"] = float(self._committed)
        if done:
            out["recovery/export_duration_s"] = done[-1].end - done[-1].start  # type: ignore[operator]
        return out


def _idle(state: str) -> bool:
    """A group in ``state`` is idle: not serving, and not stopped for good."""
    return state not in SERVING and state != GroupState.STOPPED
