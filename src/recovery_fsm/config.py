"""The knobs of recovery, validated when built (a bad one raises ``MalformedEvent``)."""

from __future__ import annotations

import attrs

from . import validators as valid


@attrs.frozen
class RecoveryConfig:
    """Knobs. Defaults follow what xtuner and NeMo-RL ship (3 probes, 5 restarts). The
    deadlines assume a ``Tick`` about every second (see ``Tick``)."""

    immediate_recovery: bool = attrs.field(default=True, validator=valid.flag)
    clean_syncs_to_reenable: int = attrs.field(default=3, validator=valid.positive_int)
    suspect_threshold: int = attrs.field(default=3, validator=valid.positive_int)
    restart_budget: int = attrs.field(default=5, validator=valid.positive_int)
    # Restarts (and claims) counted against the budget: those of the last this many seconds,
    # so a run of days keeps recovering; None counts every restart of the run.
    restart_window_s: float | None = attrs.field(default=None, validator=valid.optional_seconds)
    # A failed group waits this long for the current version's export before going cold.
    await_checkpoint_timeout_s: float = attrs.field(default=300.0, validator=valid.seconds)
    # A start from a checkpoint, or a cold start, past this long is killed and has failed.
    load_timeout_s: float = attrs.field(default=600.0, validator=valid.seconds)
    relaunch_timeout_s: float = attrs.field(default=600.0, validator=valid.seconds)
    # The trainer exports after every sync: a group failing between the sync and the
    # export's start waits for it instead of going cold.
    export_every_sync: bool = attrs.field(default=True, validator=valid.flag)
    # Warm standby engines kept booted for failed groups (0: none), and how many in a row
    # may be lost before they ever held the fleet's weights before the pool stops refilling.
    standby: int = attrs.field(default=0, validator=valid.count)
    standby_boot_budget: int = attrs.field(default=3, validator=valid.positive_int)

    def deadline(self, wait: str) -> float:
        """Seconds a wait of kind ``wait`` (one of ``DEADLINES``) may run: the one deadline
        table of the rules, the world model and the simulator."""
        return float(getattr(self, DEADLINES[wait]))


# Each kind of wait, and the knob that bounds it.
DEADLINES = {
    "checkpoint": "await_checkpoint_timeout_s",  # a failed group waits for C(v)'s export
    "load": "load_timeout_s",  # a start from a checkpoint, a load in place, a claim
    "relaunch": "relaunch_timeout_s",  # a cold start; a standby's boot
}
