"""Asynchronous Hugging Face export and verified loading of recovery checkpoints (extra
``[torch]``)."""

from . import canary
from .canary import Canary, CanaryError
from .exporter import UNSET, AsyncHFExporter, ExportHandle, FailedReport, parse_size
from .hf_layout import hub_state_dict
from .loader import LoadedCheckpoint, digest_of, load_checkpoint, load_model, model_digest
from .store import MANIFEST, CheckpointStore, ScanReport

__all__ = [
    "MANIFEST",
    "UNSET",
    "AsyncHFExporter",
    "Canary",
    "CanaryError",
    "CheckpointStore",
    "ExportHandle",
    "FailedReport",
    "LoadedCheckpoint",
    "ScanReport",
    "canary",
    "digest_of",
    "hub_state_dict",
    "load_checkpoint",
    "load_model",
    "model_digest",
    "parse_size",
]
