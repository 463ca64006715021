"""The Ray runtime (extra ``[ray]``): engines as Ray actors, the effect runner, the health
monitor and the runtime that owns them."""

from .engine import Generation, ReferenceEngine, RolloutEngine, WeightsHeld
from .hosting import RecoveryControllerActor, RemoteController, RemoteLink
from .runtime import EffectRunner, HealthMonitor, RecoveryRuntime, Statistics

__all__ = [
    "EffectRunner",
    "Generation",
    "HealthMonitor",
    "RecoveryControllerActor",
    "RecoveryRuntime",
    "ReferenceEngine",
    "RemoteController",
    "RemoteLink",
    "RolloutEngine",
    "Statistics",
    "WeightsHeld",
]
