"""Exports compared with a real ``save_pretrained`` of the same model: file names, tensor names,
dtypes and ``config.json`` keys, for a dense untied model (Llama), a tied one (Qwen2) and an
MoE (Mixtral, whose experts transformers 5 fuses in memory). Tiny models built from configs."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
)

from recovery_fsm import BadExportInput
from recovery_fsm.export import (
    MANIFEST,
    AsyncHFExporter,
    hub_state_dict,
    load_checkpoint,
    load_model,
    model_digest,
)

SMALL = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
CONFIGS = {
    "llama-untied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "mixtral-moe": lambda: MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}
TIED = {
    "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "qwen2-tied": CONFIGS["qwen2-tied"],
    # An MoE whose other tensors transformers renames and splits on the way to the hub.
    "mixtral-tied": lambda: MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True
    ),
}


def build(kind: str) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config({**CONFIGS, **TIED}[kind]()).eval()


def on_disk(path: Path) -> dict[str, Any]:
    """What an engine sees in a checkpoint directory: files, tensors and their dtypes, the
    config keys, architectures and dtype, and the shard index."""
    files = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    tensors: dict[str, str] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = str(f.get_slice(name).get_dtype())
    config = json.loads((path / "config.json").read_text())
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    return {
        "files": files,
        "tensors": tensors,
        "config_keys": sorted(config),
        "architectures": config.get("architectures"),
        "dtype": config.get("dtype"),
        "weight_map": index and index["weight_map"],
        "generation": json.loads((path / "generation_config.json").read_text()),
    }


def hf_save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-is", "bf16"])
def test_export_model_writes_what_save_pretrained_writes(
    kind: str, dtype: torch.dtype | None, tmp_path: Path
) -> None:
    model = build(kind)
    with AsyncHFExporter(tmp_path / "ours") as ex:
        ours = ex.export_model(1, model, dtype=dtype).result(60)
    assert model.config.architectures is None  # our export leaves the model's config alone
    reference = model if dtype is None else build(kind).to(dtype)
    theirs = on_disk(hf_save(reference, tmp_path / "hf"))
    mine = on_disk(ours)
    assert mine == theirs
    assert mine["architectures"] == [type(model).__name__]
    assert mine["dtype"] == ("float32" if dtype is None else "bfloat16")
    # The weights are the model's, under the hub names, bit for bit.
    loaded = load_checkpoint(ours)
    for name, t in hub_state_dict(reference).items():
        assert torch.equal(loaded.state_dict[name], t), name


def test_the_moe_is_written_in_the_hub_layout(tmp_path: Path) -> None:
    model = build("mixtral-moe")
    fused = [k for k in model.state_dict() if "gate_up_proj" in k]
    assert fused, "transformers no longer fuses Mixtral's experts: this test needs a new model"
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, model).result(60)
    names = set(on_disk(path)["tensors"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    # Loaded back, it converts to the model's in-memory layout again, equal to the original.
    again = load_model(path)
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    assert model_digest(again) == load_checkpoint(path).digest


def test_sharded_export_matches_save_pretrained_weight_map(tmp_path: Path) -> None:
    model = build("llama-untied")
    with AsyncHFExporter(tmp_path / "ours", max_shard_size="20KB") as ex:
        ours = on_disk(ex.export_model(1, model).result(60))
    theirs = on_disk(hf_save(model, tmp_path / "hf", max_shard_size="20KB"))
    assert len((ours["weight_map"] and set(ours["weight_map"].values())) or ()) > 2
    assert ours == theirs


def test_a_tied_tensor_keeps_its_canonical_name_whatever_the_order(tmp_path: Path) -> None:
    model = build("qwen2-tied")
    own = model.state_dict
    # The state dict listed lm_head first: the canonical name must still win.
    model.state_dict = lambda: OrderedDict(reversed(list(own().items())))  # type: ignore[method-assign]
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, model).result(60)
    names = set(on_disk(path)["tensors"])
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    aliases = load_checkpoint(path).manifest["aliases"]
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_state_dict_path_takes_architectures_and_dtype_from_the_config(tmp_path: Path) -> None:
    model = build("qwen2-tied")
    config = model.config.to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    with AsyncHFExporter(tmp_path, dtype=torch.bfloat16) as ex:
        path = ex.export(1, model.state_dict(), config=config).result(60)
    written = json.loads((path / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM"]
    assert written["dtype"] == "bfloat16"  # the shards' dtype, not the config's float32
    assert load_model(path).dtype == torch.bfloat16


def test_state_dict_path_refuses_a_config_without_architectures(tmp_path: Path) -> None:
    model = build("llama-untied")
    with AsyncHFExporter(tmp_path) as ex:
        with pytest.raises(BadExportInput, match="architectures"):
            ex.export(1, model.state_dict(), config=model.config)
        # Nothing started: the same version can still be exported, with the fix.
        model.config.architectures = ["LlamaForCausalLM"]
        try:
            ex.export(1, model.state_dict(), config=model.config).result(60)
        finally:
            model.config.architectures = None
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"]


def test_export_model_takes_the_generation_config_given(tmp_path: Path) -> None:
    model = build("llama-untied")
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, model, generation_config=GenerationConfig(top_k=7)).result(60)
    assert json.loads((path / "generation_config.json").read_text())["top_k"] == 7
    assert load_model(path).generation_config.top_k == 7


def test_per_export_options_override_the_exporter(tmp_path: Path) -> None:
    model = build("llama-untied")
    with AsyncHFExporter(tmp_path, dtype=torch.bfloat16, max_shard_size="5GB") as ex:
        a = ex.export_model(1, model, dtype=None, max_shard_size="20KB").result(60)
        b = ex.export_model(2, model).result(60)
        for bad in ({"dtype": torch.int8}, {"dtype": "bf16"}, {"max_shard_size": "lots"}):
            with pytest.raises(BadExportInput):
                ex.export_model(3, model, **bad)
        c = ex.export_model(3, model).result(60)  # the refusals changed nothing
    assert on_disk(a)["dtype"] == "float32" and len(list(a.glob("*.safetensors"))) > 2
    assert on_disk(b)["dtype"] == "bfloat16" and [p.name for p in b.glob("*.safetensors")] == [
        "model.safetensors"
    ]
    assert on_disk(c) == on_disk(b)


def test_a_config_that_is_not_json_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    model = build("llama-untied")
    config = {"architectures": ["LlamaForCausalLM"], "dtype": torch.float32}
    with AsyncHFExporter(tmp_path) as ex:
        with pytest.raises(BadExportInput, match="JSON"):
            ex.export(1, model.state_dict(), config=config)
        assert ex.export(1, model.state_dict()).result(60) == tmp_path / "step-1"


@pytest.mark.parametrize("kind", sorted(TIED))
def test_load_checkpoint_of_export_model_restores_the_tied_names(kind: str, tmp_path: Path) -> None:
    model = build(kind)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config = model.config.to_dict() | {"architectures": [type(model).__name__]}
    with AsyncHFExporter(tmp_path) as ex:
        ours = ex.export_model(1, model).result(60)
        plain = ex.export(2, hub_state_dict(model) | {"lm_head.weight": model.lm_head.weight},
                          config=config).result(60)  # fmt: skip
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    loaded = load_checkpoint(ours)
    # As the state-dict path records it, and as the docstring promises.
    assert loaded.manifest["aliases"] == load_checkpoint(plain).manifest["aliases"] == tied
    assert "lm_head.weight" not in on_disk(ours)["tensors"]  # still written once
    state = loaded.state_dict
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert set(state) == set(hub_state_dict(model)) | {"lm_head.weight"}
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight)
    assert loaded.digest == model_digest(model)
    again = load_model(ours)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert model_digest(again) == loaded.digest


@pytest.mark.parametrize("kind", ["llama-untied", "mixtral-moe"])
def test_an_untied_model_records_no_aliases(kind: str, tmp_path: Path) -> None:
    with AsyncHFExporter(tmp_path) as ex:
        path = ex.export_model(1, build(kind)).result(60)
    assert load_checkpoint(path).manifest["aliases"] == {}
