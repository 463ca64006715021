"""The reference engine answers as the model itself would: the rollouts check versions by
its answers, so an engine that changed them (say, by masking real tokens as padding) would
serve something no trainer's model produces. Built in-process, without Ray actors."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm.ray.engine import ReferenceEngine  # noqa: E402

CONFIG: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


def greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """The model's own greedy answer, by hand: every prompt token attended, the argmax of
    the last position appended, stopping at the model's end-of-sequence token."""
    eos = model.config.eos_token_id
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize(
    "prompt", [[0, 5, 7, 9], [5, 0, 0, 9], [0], [2, 0, 4]], ids=["first", "middle", "only", "eos"]
)
def test_a_prompt_with_token_0_gets_the_models_own_greedy_answer(prompt: list[int]) -> None:
    """Token 0 is an ordinary token here: the config names no pad token."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    assert model.config.pad_token_id is None
    engine = ReferenceEngine(LlamaConfig(**CONFIG).to_dict(), "g0", 1)
    engine.boot_empty()
    engine.update_weights(1, model.state_dict())
    answer = engine.generate(prompt, 12)
    expected = greedy(model, prompt, 12)
    assert answer.tokens == expected
    assert answer.version == 1
    # transformers' own greedy decoding of the same weights agrees with the hand loop.
    ids = torch.tensor([prompt])
    with torch.no_grad():
        own = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=model.config.eos_token_id)  # fmt: skip
    assert own[0, len(prompt) :].tolist() == expected
