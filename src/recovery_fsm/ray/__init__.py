"""The Ray runtime (extra ``[ray]``): engines as Ray actors, and the parts that carry out
the controller's decisions on them (see ``runtime.py`` for how they fit)."""

from .actors import ActorTable, Booted, BootFailed, Launcher
from .admission import Refusal, RefusalKind
from .causes import cause_of
from .cluster import start_local_cluster
from .engine import Generation, ReferenceEngine, RolloutEngine, WeightsHeld
from .errors import AlreadyStarted, BadRuntimeInput, StartFailed, VersionNotAbove
from .hosting import RecoveryControllerActor, RemoteController, RemoteLink
from .monitor import HealthMonitor
from .placement import SharedRootError, check_shared_root
from .reporter import FailStop, Reporter
from .resume import Resumption
from .rollouts import (
    Certificate,
    Policy,
    PromptSamples,
    RolloutCounters,
    RolloutFailed,
    RolloutInLoop,
    Sample,
)
from .router import NoServingGroup, NotServing, TrafficRouter
from .runner import EffectRunner
from .runtime import RecoveryRuntime
from .safety import SafetyCounters, SafetySnapshot
from .sampling import BadSampling, Batch, EngineSample, EngineWedged, Sampling
from .statistics import Statistics
from .views import EngineProcess
from .vllm_engine import VLLMEngine

__all__ = [
    "ActorTable",
    "AlreadyStarted",
    "BadRuntimeInput",
    "BadSampling",
    "Batch",
    "BootFailed",
    "Booted",
    "Certificate",
    "EffectRunner",
    "EngineProcess",
    "EngineSample",
    "EngineWedged",
    "FailStop",
    "Generation",
    "HealthMonitor",
    "Launcher",
    "NoServingGroup",
    "NotServing",
    "Policy",
    "PromptSamples",
    "RecoveryControllerActor",
    "RecoveryRuntime",
    "ReferenceEngine",
    "Refusal",
    "RefusalKind",
    "RemoteController",
    "RemoteLink",
    "Reporter",
    "Resumption",
    "RolloutCounters",
    "RolloutEngine",
    "RolloutFailed",
    "RolloutInLoop",
    "SafetyCounters",
    "SafetySnapshot",
    "Sample",
    "Sampling",
    "SharedRootError",
    "StartFailed",
    "Statistics",
    "TrafficRouter",
    "VLLMEngine",
    "VersionNotAbove",
    "WeightsHeld",
    "cause_of",
    "check_shared_root",
    "start_local_cluster",
]
