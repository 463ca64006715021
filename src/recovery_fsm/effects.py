"""Outputs of the controller: what an adapter must do, then report back as an event.

Process effects name the ``incarnation`` they concern; a restart effect carries the new
incarnation, which every later report about that process must quote. Routing effects
(``RouteTraffic``, ``WithdrawTraffic``) are emitted exactly when a group enters or leaves the
set that may serve traffic, so a router driven by them alone never sends a request to a
process that does not hold the fleet's current weights.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Effect:
    @property
    def kind(self) -> str:
        return type(self).__name__


@attrs.frozen
class RestartFromCheckpoint(Effect):
    """Start incarnation ``incarnation`` of ``group`` from ``path`` (weights of ``version``);
    report RestartLoaded or RestartLoadFailed for it. The checkpoint is not deleted before
    that report (or a GroupFailed for that incarnation) arrives."""

    group: str
    incarnation: int
    version: int
    path: str


@attrs.frozen
class LoadCheckpoint(Effect):
    """The running process ``previous`` of ``group`` holds older weights (its restart
    finished after a sync, or it came up cold): load ``path`` (weights of ``version``) into
    it, without a new process. From now on that process is ``incarnation``: a new number, so
    that no report about what it held before (a late or repeated one) can be taken for the
    outcome of this load. Report RestartLoaded or RestartLoadFailed for ``incarnation``; the
    checkpoint is leased until then, as for a restart."""

    group: str
    incarnation: int
    version: int
    path: str
    previous: int


@attrs.frozen
class RestartCold(Effect):
    """Start incarnation ``incarnation`` of ``group`` without weights; report Relaunched or
    RelaunchFailed for it."""

    group: str
    incarnation: int


@attrs.frozen
class RouteTraffic(Effect):
    """``group``'s incarnation ``incarnation`` serves the fleet's ``version``: route to it."""

    group: str
    incarnation: int
    version: int


@attrs.frozen
class WithdrawTraffic(Effect):
    """Stop routing to ``group``'s incarnation ``incarnation``: it no longer serves."""

    group: str
    incarnation: int


@attrs.frozen
class StopGroup(Effect):
    """Kill incarnation ``incarnation`` of ``group`` (``reason``: shutdown or a missed
    deadline). If a start of it was in flight, report that start's outcome or GroupFailed
    for it once it is dead."""

    group: str
    incarnation: int
    reason: str


@attrs.frozen
class StopFound(Effect):
    """Kill a process a resume found (``name``, ``incarnation``: what it answered, or its
    name in the run's namespace) that the rules keep as nobody's: a group's old incarnation,
    a lost standby, a name the controller does not know, or one that did not answer."""

    name: str
    incarnation: int
    reason: str


@attrs.frozen
class RetireGroup(Effect):
    """``group`` spent its restart budget: tear it down for good."""

    group: str


@attrs.frozen
class CancelExport(Effect):
    """Stop writing checkpoint ``version``; report ExportCancelled (or its commit/failure)."""

    version: int


@attrs.frozen
class DeleteCheckpoint(Effect):
    """Remove checkpoint ``version`` at ``path``; report CheckpointDeleted."""

    version: int
    path: str


@attrs.frozen
class VerifyGroup(Effect):
    """After a resume: ask the process running incarnation ``incarnation`` of ``group`` (found
    by its name) which incarnation and weights it holds, and check its canary against that
    version's record. Report GroupVerified, or GroupFailed if it is gone, answers for another
    incarnation or fails the check (kill what was found first). A load it was running when
    the trainer died finishes first: the answer is what it holds after."""

    group: str
    incarnation: int


@attrs.frozen
class StartStandby(Effect):
    """Boot a standby engine named ``standby``, without weights and never routed; report
    StandbyBooted or StandbyFailed."""

    standby: str


@attrs.frozen
class LoadStandby(Effect):
    """Load ``path`` (weights of ``version``) into standby ``standby`` in place; report
    StandbyLoaded or StandbyFailed. The checkpoint is leased until then."""

    standby: str
    version: int
    path: str


@attrs.frozen
class StopStandby(Effect):
    """Kill standby ``standby`` (``reason``: shutdown or a missed deadline). If its boot or
    load was in flight, report that outcome or StandbyFailed once it is dead."""

    standby: str
    reason: str


@attrs.frozen
class VerifyStandby(Effect):
    """After a resume: ask standby ``standby`` (found by its name) which weights it holds,
    and check its canary against that version's record. Report StandbyVerified, or
    StandbyFailed if it is gone or fails the check (kill it first). A boot or load it was
    running when the trainer died finishes first: the answer is what it holds after."""

    standby: str


@attrs.frozen
class ClaimStandby(Effect):
    """Standby ``standby``'s process becomes incarnation ``incarnation`` of ``group``. With a
    ``path`` it first loads that checkpoint (weights of ``version``, leased as a restart's);
    without, it already holds ``version``. Either way it must pass the admission check before
    it serves; report RestartLoaded or RestartLoadFailed for ``incarnation``."""

    group: str
    incarnation: int
    standby: str
    version: int
    path: str | None
