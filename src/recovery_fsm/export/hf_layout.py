"""What ``save_pretrained`` would write for a model: its tensors under hub names, and its
configs as they would appear on disk.

A serving engine (vLLM, SGLang) loads a directory by the hub checkpoint's layout: the model
class named in ``config.json``'s ``architectures``, the dtype in ``dtype``, and tensor names
as published. A model in memory can differ from that: transformers 5 fuses some weights at
load time (a Mixtral's experts become one ``gate_up_proj``) and tied weights appear under
every name. The helpers here do what ``save_pretrained`` does, using transformers' own
functions for it, and work on a copy: the model and its config are left untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import BadExportInput


def hub_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` would write for ``model``, by the names it would use:
    keys it ignores on save dropped, each tied group kept once under the model's canonical
    name, and transformers' load-time conversions reverted (no copy where it can view)."""
    return hub_weights(model)[0]


def hub_weights(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``hub_state_dict(model)`` and its tied aliases: each tied name left out (e.g.
    ``lm_head.weight``), mapped to the name its tensor is written under. The manifest
    records them so that ``load_checkpoint`` gives back every name, as it does for
    ``export`` of a state dict, whose aliases ``_stage`` finds by shared storage."""
    state = dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    before = dict(state)  # remove_tied_weights_from_state_dict edits the dict it is given
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: tied targets are listed by name
        state = _drop_tied_targets(model, state)
    else:
        state = remove_tied_weights_from_state_dict(state, model)
    revert: Callable[[Any, dict[str, torch.Tensor]], Any] | None
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:  # transformers 4 keeps the hub layout in memory
        revert = None
    hub = state if revert is None else dict(revert(model, state))
    written = {storage_key(t): name for name, t in hub.items() if _aliasable(t)}
    aliases: dict[str, str] = {}
    for name, t in before.items():
        if name in state or not _aliasable(t):
            continue
        target = written.get(storage_key(t))
        if target is None:
            continue
        alias = name if revert is None else _hub_name(revert, model, name, t)
        if alias is not None and alias not in hub:
            aliases[alias] = target
    return hub, aliases


def _hub_name(
    revert: Callable[[Any, dict[str, torch.Tensor]], Any], model: Any, name: str, t: torch.Tensor
) -> str | None:
    """A tied name under the model's conversion, alone: a rename gives back one tensor, the
    same one. Anything else (a split, a merge that wants its other parts) has no single hub
    name to alias, and the export goes on without that alias."""
    try:
        out = list(revert(model, {name: t}).items())
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return None
    if len(out) == 1 and storage_key(out[0][1]) == storage_key(t):
        return str(out[0][0])
    return None


def _aliasable(t: Any) -> bool:
    """A tensor whose memory can be compared; anything else is left to ``_stage`` to
    refuse with a clear error, or (empty tensors) to write under every name."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and t.numel() > 0
    )


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they are the same view of the same memory (a tied
    pair): what the exporter writes once and records the other name of as an alias."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()), t.dtype)  # fmt: skip


def _drop_tied_targets(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    names = list(tied) if not isinstance(tied, Mapping) else list(tied.keys())
    for name in names:
        t = state.get(name)
        if t is None:
            continue
        ptr = t.untyped_storage().data_ptr()
        if any(k != name and v.untyped_storage().data_ptr() == ptr for k, v in state.items()):
            del state[name]
    return state


def architecture_of(model: Any) -> str:
    # An FSDP2-wrapped class is named FSDP<Model>; save_pretrained writes the model's name.
    return str(type(model).__name__).removeprefix("FSDP")


def model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def config_json(config: Any, *, dtype: torch.dtype | None, architectures: list[str] | None) -> str:
    """``config.json`` as ``save_pretrained`` writes it (the difference from the defaults),
    with ``dtype`` naming the dtype on disk and ``architectures`` set when given.

    ``config`` is a transformers config or a plain dict. A config that ends up without
    ``architectures`` is refused: vLLM and SGLang pick the model class from it and would
    refuse the checkpoint at the restart, which is too late to find out."""
    if isinstance(config, Mapping):
        try:
            data = json.loads(json.dumps(dict(config)))  # a deep copy that must be JSON anyway
        except (TypeError, ValueError) as err:
            raise BadExportInput(f"config must hold only JSON values: {err}") from None
    elif callable(getattr(config, "to_json_string", None)):
        data = json.loads(config.to_json_string(use_diff=True))
    else:
        raise BadExportInput(
            f"config must be a transformers config or a dict, got {type(config).__name__}"
        )
    if dtype is not None:
        data["dtype"] = _dtype_name(dtype)
        if "torch_dtype" in data:  # transformers 4 wrote the dtype under this key
            data["torch_dtype"] = _dtype_name(dtype)
    if architectures is not None:
        data["architectures"] = list(architectures)
    arch = data.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) for a in arch)):
        raise BadExportInput(
            "config has no 'architectures' (e.g. ['LlamaForCausalLM']): serving engines pick "
            "the model class from it. Set config.architectures, or use export_model(), which "
            "takes it from the model"
        )
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def generation_config_json(model: Any, given: Any = None) -> str | None:
    """``generation_config.json`` as ``save_pretrained`` writes it: the one given, else the
    model's own when the model can generate (``model`` may be None: the given one only).
    Serialized at call time, so later changes to it cannot leak into the export."""
    source = given
    if source is None:
        can_generate = getattr(model, "can_generate", None)
        if callable(can_generate) and can_generate():
            source = getattr(model, "generation_config", None)
    if source is None:
        return None
    if isinstance(source, Mapping):
        return json.dumps(dict(source), indent=2, sort_keys=True) + "\n"
    if callable(getattr(source, "to_json_string", None)):
        return str(source.to_json_string(use_diff=True))
    raise BadExportInput(
        f"generation_config must be a GenerationConfig or a dict, got {type(source).__name__}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_floating_dtype(tensors: list[tuple[str, torch.Tensor]]) -> torch.dtype | None:
    return next((t.dtype for _, t in tensors if t.is_floating_point()), None)
