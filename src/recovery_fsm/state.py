"""What the rules hold: leases, starts in flight, and each checkpoint's and group's records
with their machines (built lazily from the records, so a copy copies plain data)."""

from __future__ import annotations

import copy
import enum

import attrs
from statemachine import StateMachine

from .machines import (
    CheckpointMachine,
    CheckpointRecord,
    GroupRecord,
    ImmediateRecoveryMachine,
    PoolRecord,
    RecoveryRecord,
    StandbyMachine,
    StandbyPoolMachine,
    StandbyRecord,
    WorkerGroupMachine,
)


@attrs.frozen
class Lease:
    """Incarnation ``incarnation`` of ``group`` reads checkpoint ``version``."""

    group: str
    incarnation: int
    version: int
    # The fleet version when the lease was granted; equals ``version`` by rule.
    granted_at_version: int

    @property
    def id(self) -> str:
        return f"{self.group}#{self.incarnation}"


class StartKind(str, enum.Enum):
    """What a start in flight is: only the reports of its kind end it (and a death). A
    group's are load, claim, relaunch and verify; a standby's boot, load and verify."""

    LOAD = "load"
    CLAIM = "claim"
    RELAUNCH = "relaunch"
    VERIFY = "verify"
    BOOT = "boot"

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Start:
    """A start of a group's (or a standby's) process whose outcome has not been reported."""

    kind: StartKind = attrs.field(converter=StartKind)
    lease: Lease | None  # a load's lease on its checkpoint
    # A claim without a load: the version the standby held when it was claimed.
    version: int | None = None


class CheckpointSlot:
    """A checkpoint's record and its machine. The machine is built from the record when
    first needed, so a copy (``fork``) copies plain records only."""

    __slots__ = ("_machine", "record")

    def __init__(self, record: CheckpointRecord, *, build: bool = False) -> None:
        self.record = record
        self._machine: CheckpointMachine | None = None
        if build:
            self._machine = self.machine

    @property
    def machine(self) -> CheckpointMachine:
        if self._machine is None:
            self._machine = CheckpointMachine(model=self.record, start_value=self.record.state)
        return self._machine

    def __deepcopy__(self, memo: dict[int, object]) -> CheckpointSlot:
        return CheckpointSlot(copy.deepcopy(self.record, memo))


class GroupSlot:
    """A group's records and machines, built lazily like ``CheckpointSlot``'s."""

    __slots__ = ("_machine", "_recovery_machine", "record", "recovery")

    def __init__(self, record: GroupRecord, recovery: RecoveryRecord, *, build: bool = False):
        self.record = record
        self.recovery = recovery
        self._machine: WorkerGroupMachine | None = None
        self._recovery_machine: ImmediateRecoveryMachine | None = None
        if build:  # pay for the machines here rather than inside a fleet-wide sync
            self._machine, self._recovery_machine = self.machine, self.recovery_machine

    @property
    def machine(self) -> WorkerGroupMachine:
        if self._machine is None:
            self._machine = WorkerGroupMachine(model=self.record, start_value=self.record.state)
        return self._machine

    @property
    def recovery_machine(self) -> ImmediateRecoveryMachine:
        if self._recovery_machine is None:
            self._recovery_machine = ImmediateRecoveryMachine(
                model=self.recovery, start_value=self.recovery.state
            )
        return self._recovery_machine

    @property
    def built(self) -> StateMachine | None:
        return self._machine

    def __deepcopy__(self, memo: dict[int, object]) -> GroupSlot:
        return GroupSlot(copy.deepcopy(self.record, memo), copy.deepcopy(self.recovery, memo))


class StandbySlot:
    """A standby's record and machine, built lazily like ``CheckpointSlot``'s."""

    __slots__ = ("_machine", "record")

    def __init__(self, record: StandbyRecord, *, build: bool = False) -> None:
        self.record = record
        self._machine: StandbyMachine | None = None
        if build:
            self._machine = self.machine

    @property
    def machine(self) -> StandbyMachine:
        if self._machine is None:
            self._machine = StandbyMachine(model=self.record, start_value=self.record.state)
        return self._machine

    def __deepcopy__(self, memo: dict[int, object]) -> StandbySlot:
        return StandbySlot(copy.deepcopy(self.record, memo))


class PoolSlot:
    """The standby pool's record and machine."""

    __slots__ = ("_machine", "record")

    def __init__(self, record: PoolRecord) -> None:
        self.record = record
        self._machine: StandbyPoolMachine | None = None

    @property
    def machine(self) -> StandbyPoolMachine:
        if self._machine is None:
            self._machine = StandbyPoolMachine(model=self.record, start_value=self.record.state)
        return self._machine

    def __deepcopy__(self, memo: dict[int, object]) -> PoolSlot:
        return PoolSlot(copy.deepcopy(self.record, memo))
