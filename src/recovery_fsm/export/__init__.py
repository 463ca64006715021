"""Asynchronous Hugging Face export and loading of recovery checkpoints (extra ``[torch]``)."""

from .exporter import AsyncHFExporter, ExportHandle, FailedReport, parse_size
from .loader import LoadedCheckpoint, digest_of, load_checkpoint, load_model
from .store import MANIFEST, CheckpointStore, ScanReport

__all__ = [
    "MANIFEST",
    "AsyncHFExporter",
    "CheckpointStore",
    "ExportHandle",
    "FailedReport",
    "LoadedCheckpoint",
    "ScanReport",
    "digest_of",
    "load_checkpoint",
    "load_model",
    "parse_size",
]
