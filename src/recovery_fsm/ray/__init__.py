"""The Ray runtime (extra ``[ray]``): engines as Ray actors, and the parts that carry out
the controller's decisions on them (see ``runtime.py`` for how they fit)."""

from .actors import ActorTable, Booted, BootFailed, Launcher
from .engine import Generation, ReferenceEngine, RolloutEngine, WeightsHeld
from .hosting import RecoveryControllerActor, RemoteController, RemoteLink
from .monitor import HealthMonitor
from .placement import SharedRootError, check_shared_root
from .reporter import FailStop, Reporter
from .router import NoServingGroup, NotServing, TrafficRouter
from .runner import EffectRunner
from .runtime import (
    AlreadyStarted,
    BadRuntimeInput,
    RecoveryRuntime,
    Resumption,
    Statistics,
    VersionNotAbove,
)
from .safety import SafetyCounters, SafetySnapshot

__all__ = [
    "ActorTable",
    "AlreadyStarted",
    "BadRuntimeInput",
    "BootFailed",
    "Booted",
    "EffectRunner",
    "FailStop",
    "Generation",
    "HealthMonitor",
    "Launcher",
    "NoServingGroup",
    "NotServing",
    "RecoveryControllerActor",
    "RecoveryRuntime",
    "ReferenceEngine",
    "RemoteController",
    "RemoteLink",
    "Reporter",
    "Resumption",
    "RolloutEngine",
    "SafetyCounters",
    "SafetySnapshot",
    "SharedRootError",
    "Statistics",
    "TrafficRouter",
    "VersionNotAbove",
    "WeightsHeld",
    "check_shared_root",
]
