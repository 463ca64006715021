"""One colour and one legend entry for every state of every machine.

The timeline (matplotlib, hex colours) and the demo's live table (rich styles) both read this
table, so a state cannot be coloured in one and forgotten in the other; ``tests/test_palette.py``
fails when a machine gains a state this table lacks. Plain strings only: no drawing library is
imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from .. import CheckpointState, GroupState, Label, PoolState, StandbyState, SwitchState


@attrs.frozen
class Swatch:
    """How one state is drawn in the picture and on the terminal, and what it is called there."""

    hex: str  # matplotlib
    style: str  # rich
    legend: str


# Per machine label, in legend order: (hex, rich style, legend). Serving or current in greens,
# waiting in blues, starting in oranges, failed red, the end in greys.
_TABLE: dict[str, dict[str, tuple[str, str, str]]] = {
    Label.GROUP: {
        GroupState.ACTIVE: ("#2ca02c", "green", "active"),
        GroupState.SUSPECT: ("#a6d96a", "yellow", "suspect"),
        GroupState.PENDING_WEIGHTS: ("#9ecae1", "bright_black", "pending weights"),
        GroupState.AWAITING_CHECKPOINT: ("#3182bd", "magenta", "awaiting checkpoint"),
        GroupState.RESUMING: ("#6baed6", "bright_magenta", "resuming"),
        GroupState.LOADING: ("#fdae6b", "cyan", "loading"),
        GroupState.CLAIMING: ("#a63603", "bright_cyan", "claiming a standby"),
        GroupState.RELAUNCHING: ("#e6550d", "blue", "relaunching"),
        GroupState.FAILED: ("#d62728", "bold red", "failed"),
        GroupState.RETIRED: ("#636363", "red", "retired"),
        GroupState.STOPPED: ("#cccccc", "bright_black", "stopped"),
    },
    Label.CHECKPOINT: {
        CheckpointState.EXPORTING: ("#bcbddc", "cyan", "exporting"),
        CheckpointState.READY: ("#6a51a3", "green", "ready"),
        CheckpointState.SUPERSEDED: ("#9e9ac8", "bright_black", "superseded"),
        CheckpointState.ABANDONED: ("#fdae6b", "yellow", "abandoned (a future not followed)"),
        CheckpointState.DELETABLE: ("#d9d9d9", "bright_black", "deletable"),
        CheckpointState.DELETED: ("#f0f0f0", "dim", "deleted"),
        CheckpointState.FAILED: ("#d62728", "bold red", "export failed"),
        CheckpointState.DISCARDED: ("#969696", "red", "discarded"),
    },
    Label.STANDBY: {
        StandbyState.BOOTING: ("#fdd0a2", "cyan", "booting"),
        StandbyState.STALE: ("#9ecae1", "bright_black", "stale"),
        StandbyState.LOADING: ("#fdae6b", "cyan", "loading"),
        StandbyState.READY: ("#2ca02c", "green", "ready"),
        StandbyState.RESUMING: ("#6baed6", "bright_magenta", "resuming"),
        StandbyState.CLAIMED: ("#a63603", "bright_cyan", "claimed by a group"),
        StandbyState.LOST: ("#d62728", "bold red", "lost"),
        StandbyState.STOPPED: ("#cccccc", "bright_black", "stopped"),
    },
    Label.POOL: {
        PoolState.FILLING: ("#2ca02c", "green", "filling"),
        PoolState.EXHAUSTED: ("#d62728", "bold red", "exhausted (boots keep failing)"),
        PoolState.CLOSED: ("#cccccc", "bright_black", "closed"),
    },
    Label.RECOVERY: {
        SwitchState.ENABLED: ("#2ca02c", "green", "immediate recovery on"),
        SwitchState.COOLDOWN: ("#fdae6b", "yellow", "cooling down"),
        SwitchState.DISABLED: ("#969696", "bright_black", "immediate recovery off"),
    },
}

# Keyed by (machine label, state).
PALETTE: Final[Mapping[tuple[str, str], Swatch]] = MappingProxyType(
    {(label, state): Swatch(*s) for label, states in _TABLE.items() for state, s in states.items()}
)

# Used for a state the table lacks (a journal written by another version, say).
UNKNOWN: Final = Swatch("#ffffff", "white", "unknown")


def swatch(label: str, state: str) -> Swatch:
    """The swatch of ``state`` of a ``label`` machine (``UNKNOWN`` when not in the table)."""
    return PALETTE.get((label, state), UNKNOWN)


def of(label: str) -> dict[str, Swatch]:
    """One machine's states and swatches, in legend order."""
    return {state: s for (lb, state), s in PALETTE.items() if lb == label}
