"""The Ray runtime (extra ``[ray]``): engines as Ray actors, the effect runner, the health
monitor and the runtime that owns them."""

from .engine import Generation, ReferenceEngine, RolloutEngine, WeightsHeld
from .runtime import EffectRunner, HealthMonitor, RecoveryRuntime, Statistics

__all__ = [
    "EffectRunner",
    "Generation",
    "HealthMonitor",
    "RecoveryRuntime",
    "ReferenceEngine",
    "RolloutEngine",
    "Statistics",
    "WeightsHeld",
]
