"""The runtime's own safety accounting, under one lock, read as one frozen snapshot.

The controller's leases promise that no checkpoint is deleted while a start loads it; these
counters check that promise at the real files (a load of a deleted path, a delete under a
load), and keep the facts the push needs (loads in place asked for, per group) and the
reporter's tallies. Every structure is bounded: per group, per path in use, and the last
``remember`` deleted paths.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping

import attrs

log = logging.getLogger(__name__)


@attrs.frozen
class SafetySnapshot:
    """Plain values, consistent with each other (read under one lock)."""

    loads_from_deleted: int  # loads of a deleted path, or deletes under a load: must be 0
    loads_in_place: int  # LoadCheckpoint effects executed
    paths_in_use: Mapping[str, int]  # path -> starts loading it now
    refused_reports: int  # outcomes the controller refused (a stale incarnation)
    duplicate_reports: int  # a retry after a timed-out send that had landed
    lost_reports: int  # outcomes that could not be delivered (logged): should stay 0
    # Started processes admission refused, per kind (``RefusalKind`` values): each is a
    # failed start in the journal, with the refusal's words as its reason.
    admissions_refused: Mapping[str, int] = attrs.field(factory=dict)


class SafetyCounters:
    """Lock order: leaf (calls nothing while holding its lock)."""

    def __init__(self, remember: int = 256) -> None:
        self._lock = threading.Lock()
        self._loading: collections.Counter[str] = collections.Counter()
        self._deleted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        self._loads_from_deleted = 0
        self._loads_in_place: collections.Counter[str] = collections.Counter()  # per group
        self._refused = 0
        self._duplicates = 0
        self._lost = 0
        self._admissions_refused: collections.Counter[str] = collections.Counter()

    def load_begins(self, path: str) -> None:
        with self._lock:
            self._loading[path] += 1
            if path in self._deleted:
                self._loads_from_deleted += 1
                log.error("a start loads %s, which was deleted", path)

    def load_ends(self, path: str) -> None:
        with self._lock:
            self._loading[path] -= 1
            if self._loading[path] <= 0:
                del self._loading[path]

    def delete_begins(self, path: str) -> None:
        with self._lock:
            if self._loading.get(path):
                self._loads_from_deleted += 1
                log.error("deleting %s while a start loads from it", path)

    def deleted(self, path: str) -> None:
        with self._lock:
            self._deleted[path] = None
            while len(self._deleted) > self._remember:
                self._deleted.popitem(last=False)

    def load_in_place(self, group: str) -> None:
        with self._lock:
            self._loads_in_place[group] += 1

    def loads_in_place_by_group(self) -> dict[str, int]:
        """How many loads in place each group was asked for so far: a push compares the
        figure before and after, and vouches for no process that loaded in between."""
        with self._lock:
            return dict(self._loads_in_place)

    def refused(self) -> None:
        with self._lock:
            self._refused += 1

    def admission_refused(self, kind: str) -> None:
        with self._lock:
            self._admissions_refused[str(kind)] += 1

    def duplicate(self) -> None:
        with self._lock:
            self._duplicates += 1

    def lost(self) -> None:
        with self._lock:
            self._lost += 1

    def snapshot(self) -> SafetySnapshot:
        with self._lock:
            return SafetySnapshot(
                self._loads_from_deleted,
                sum(self._loads_in_place.values()),
                dict(self._loading),
                self._refused,
                self._duplicates,
                self._lost,
                dict(self._admissions_refused),
            )

    def sizes(self) -> Mapping[str, int]:
        with self._lock:
            return {
                "loading": len(self._loading),
                "deleted": len(self._deleted),
                "loads_in_place": len(self._loads_in_place),
            }
