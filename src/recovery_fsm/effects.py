"""Outputs of the controller: what an adapter must do, then report back as an event."""

from __future__ import annotations

import attrs


@attrs.frozen
class Effect:
    @property
    def kind(self) -> str:
        return type(self).__name__


@attrs.frozen
class RestartFromCheckpoint(Effect):
    """Boot ``group`` from ``path`` (weights of ``version``); report RestartLoaded/LoadFailed
    with ``lease``. The checkpoint is not deleted while the lease is live."""

    group: str
    version: int
    path: str
    lease: str


@attrs.frozen
class RestartCold(Effect):
    """Relaunch ``group`` without weights; report Relaunched or RelaunchFailed."""

    group: str


@attrs.frozen
class ReadmitGroup(Effect):
    """Route traffic to ``group`` again: it serves the current ``version``."""

    group: str
    version: int


@attrs.frozen
class RetireGroup(Effect):
    """``group`` spent its restart budget: tear it down for good."""

    group: str


@attrs.frozen
class StopGroup(Effect):
    """Shutdown: stop ``group``."""

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
