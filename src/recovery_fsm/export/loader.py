"""The restart side: load a committed checkpoint, checking every byte as it is read, and prove
which weights a loaded model holds.

There is no unverified recovery load: a group that boots from a checkpoint must serve the
exported weights or fail its restart with CorruptCheckpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import CorruptCheckpoint
from . import hf_layout
from .safetensors_io import DEFAULT_HASH, DTYPE_NAMES, tensor_digest, weights_digest
from .store import CheckpointStore, checkpoint_version, verify_contents


@attrs.frozen
class LoadedCheckpoint:
    version: int
    path: Path
    state_dict: dict[str, torch.Tensor] = attrs.field(repr=False)
    manifest: dict[str, Any] = attrs.field(repr=False)
    digest: str


def digest_of(
    state_dict: dict[str, torch.Tensor],
    aliases: dict[str, str] | None = None,
    *,
    hash_name: str = DEFAULT_HASH,
) -> str:
    """The weights digest of tensors in memory (aliases of tied weights are left out, as the
    exporter wrote them once). ``hash_name`` is the manifest's ``hash``."""
    entries = []
    skip = set(aliases or {})
    for name, t in state_dict.items():
        if name in skip:
            continue
        digest = tensor_digest(t.detach().contiguous().cpu(), hash_name)
        entries.append((name, DTYPE_NAMES[t.dtype], list(t.shape), digest))
    return weights_digest(entries)


def model_digest(model: Any, *, hash_name: str = DEFAULT_HASH) -> str:
    """The weights digest of a transformers model as ``export_model`` would write it (hub
    names, tied weights once): what a restarted engine reports to prove its version."""
    return digest_of(hf_layout.hub_state_dict(model), hash_name=hash_name)


def load_checkpoint(path: str | os.PathLike[str], *, device: str = "cpu") -> LoadedCheckpoint:
    """Read every file once into memory, checking each byte against the manifest as it
    arrives; tied aliases are restored. Raises CorruptCheckpoint on any difference."""
    p = Path(path)
    named = checkpoint_version(p.name)
    if p.name.startswith("step-") and named is None:
        # scan() ignores it too: "step-007" or "step-\u0667" is no name the store writes, and
        # taking it for version 7 would let a stray copy pass for the real one.
        raise CorruptCheckpoint(
            f"{p}: not a name the store writes (step-<version>, plain decimal digits)"
        )
    if not p.is_dir():  # before CheckpointStore(p.parent), which would create the parent
        raise CorruptCheckpoint(f"{p} is not a directory: not a committed checkpoint")
    manifest = CheckpointStore(p.parent).verify(p)  # presence and sizes first: cheap
    try:
        state = verify_contents(p, manifest, keep=True)
        entries = [
            (name, meta["dtype"], meta["shape"], meta["digest"])
            for name, meta in manifest["tensors"].items()
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptCheckpoint(f"{p}: the manifest is malformed ({err!r})") from err
    # Every tensor matched its digest as it was read: the weights digest follows from them.
    digest = weights_digest(entries)
    if digest != manifest["weights_digest"]:
        raise CorruptCheckpoint(f"{p}: weights digest {digest[:12]} != manifest's")
    if device != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    try:
        for alias, target in manifest["aliases"].items():
            state[alias] = state[target]
        version = int(manifest["version"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptCheckpoint(f"{p}: the manifest is malformed ({err!r})") from err
    if named is not None and named != version:
        # As scan() does: a renamed or copied directory is not the version its name says.
        raise CorruptCheckpoint(f"{p}: the manifest names version {version}")
    return LoadedCheckpoint(version, p, state, manifest, digest)


def load_model(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """A transformers model built from a committed checkpoint, every byte checked as it was
    read (``load_checkpoint``) into memory the model then takes as its weights (it keeps no
    mapping of the checkpoint's files).
    ``kwargs`` go to ``from_pretrained`` (e.g. ``device_map``); the model class is the
    config's first architecture."""
    import transformers

    p = Path(path)
    loaded = load_checkpoint(p)
    if "config.json" not in loaded.manifest["files"]:
        raise CorruptCheckpoint(
            f"{p} has no config.json (exported without a config): use load_checkpoint"
        )
    config = transformers.AutoConfig.from_pretrained(str(p))
    cls = _model_class(config)
    model = None if kwargs else _assigned(cls, config, loaded.state_dict)
    if model is None:  # placement or dtype asked for, or hub names the model converts
        model = cls.from_pretrained(None, config=config, state_dict=loaded.state_dict, **kwargs)
    if (p / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(p))
    return model


def _assigned(cls: Any, config: Any, state: dict[str, torch.Tensor]) -> Any:
    """The model built without initialising its weights, then holding the verified tensors
    as its own: ``from_pretrained`` with a state dict initialises every weight and then
    copies each one in. The tensors are in process memory (``load_checkpoint`` reads them
    there), so the model keeps no file of the checkpoint open. None where the checkpoint's
    names or shapes are not the model's own (transformers converts some hub layouts as it
    loads them, e.g. fused experts)."""
    import importlib

    try:  # transformers 5 moved the switch that skips weight initialisation
        no_init = importlib.import_module("transformers.initialization").no_init_weights
    except (ImportError, AttributeError):
        no_init = importlib.import_module("transformers.modeling_utils").no_init_weights
    with no_init():
        model = cls(config)
    own = model.state_dict()
    if own.keys() != state.keys() or any(
        own[k].shape != t.shape or own[k].dtype != t.dtype for k, t in state.items()
    ):
        return None
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]
