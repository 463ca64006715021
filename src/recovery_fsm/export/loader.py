"""The restart side: load a committed checkpoint, verify it, and prove which weights it holds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from safetensors.torch import load_file

from ..errors import CorruptCheckpoint
from .safetensors_io import DTYPE_NAMES, tensor_sha256, weights_digest
from .store import CheckpointStore

Verify = Literal["none", "sizes", "full"]


@attrs.frozen
class LoadedCheckpoint:
    version: int
    path: Path
    state_dict: dict[str, torch.Tensor] = attrs.field(repr=False)
    manifest: dict[str, Any] = attrs.field(repr=False)
    digest: str


def digest_of(state_dict: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str:
    """The weights digest of tensors in memory (aliases of tied weights are left out, as the
    exporter wrote them once)."""
    entries = []
    skip = set(aliases or {})
    for name, t in state_dict.items():
        if name in skip:
            continue
        digest = tensor_sha256(t.detach().contiguous().cpu())
        entries.append((name, DTYPE_NAMES[t.dtype], list(t.shape), digest))
    return weights_digest(entries)


def load_checkpoint(
    path: str | os.PathLike[str], *, verify: Verify = "sizes", device: str = "cpu"
) -> LoadedCheckpoint:
    """Read every shard into one state dict (tied aliases restored) and check its digest."""
    p = Path(path)
    store = CheckpointStore(p.parent)
    manifest = (
        store.verify(p, full=verify == "full") if verify != "none" else (store.read_manifest(p))
    )
    state: dict[str, torch.Tensor] = {}
    for name in sorted({m["file"] for m in manifest["tensors"].values()}):
        state.update(load_file(str(p / name), device=device))
    if set(state) != set(manifest["tensors"]):
        raise CorruptCheckpoint(f"{p}: tensors on disk differ from the manifest")
    digest = digest_of(state)
    if digest != manifest["weights_digest"]:
        raise CorruptCheckpoint(f"{p}: weights digest {digest[:12]} != manifest's")
    for alias, target in manifest.get("aliases", {}).items():
        state[alias] = state[target]
    return LoadedCheckpoint(int(manifest["version"]), p, state, manifest, digest)


def load_model(path: str | os.PathLike[str], *, verify: Verify = "sizes", **kwargs: Any) -> Any:
    """A transformers model from a committed checkpoint (verified first)."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if verify != "none":
        CheckpointStore(p.parent).verify(p, full=verify == "full")
    return AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
