"""What a runtime saw, as one snapshot of plain values for a trainer's metrics."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .rollouts import RolloutCounters
from .safety import SafetySnapshot


@attrs.frozen
class Statistics:
    """What the runtime saw, for a trainer's metrics (a snapshot; plain values). Failures,
    recoveries and latencies are the ledger's (the same numbers as ``hooks.metrics()``)."""

    failures: int  # failures in the journal (deaths, hangs, deadlines, failed starts)
    recoveries: Mapping[str, int]  # per path: "immediate", "waited", "cold" (see ledger)
    latency_s: Mapping[str, tuple[float, ...]]  # from the failure to admitted, per path
    effects_in_flight: int  # starts and deletes queued or running
    failed_effects: int  # executions that raised or failed for good, kept for retry_failed
    safety: SafetySnapshot
    rollouts: RolloutCounters = attrs.field(factory=RolloutCounters)

    @property
    def refused_reports(self) -> int:
        return self.safety.refused_reports

    @property
    def admissions_refused(self) -> Mapping[str, int]:
        """Started processes that admission refused, per ``RefusalKind`` value."""
        return self.safety.admissions_refused

    @property
    def lost_reports(self) -> int:
        return self.safety.lost_reports

    @property
    def loads_from_deleted(self) -> int:
        return self.safety.loads_from_deleted
