"""The canary: what a model answers to one small fixed prompt, as admission evidence.

A digest proves that an engine was handed the right bytes, not that it serves the right
model: an engine that fuses or re-lays its parameters (vLLM) cannot recompute the hub
digest, a reload can leave a NaN behind, and a checkpoint whose layers were swapped and whose
manifest was rewritten to match passes every digest. So the trainer records, with every
export and every push, the greedy tokens of a fixed prompt and the log-probability of each,
computed on the weights it hands out; after a boot, a push or a load the engine answers the
same prompt and is admitted only if it agrees (``check``).

Agreement is exact for tokens and within a dtype-dependent tolerance for log-probabilities
(``TOLERANCE``): two engines differ in kernels and summation order. A step whose top two
log-probabilities the trainer saw closer than twice the tolerance is a near tie an engine may
break either way: an engine that picked the trainer's runner-up there, with about the same
log-probability, passes, and the comparison stops (what follows may differ); one that picked
the same token is compared on. So a tie never refuses a good engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

# Absolute tolerance on each log-probability, by the dtype the weights are served in. Set from
# measurements (docs/benchmarks.md): float32 engines agree with transformers to ~1e-5 on the
# test models; the half types round every activation.
TOLERANCE: Mapping[str, float] = {"float32": 2e-3, "bfloat16": 0.15, "float16": 0.05}
PROMPT_LENGTH = 8
NEW_TOKENS = 4


class CanaryError(ValueError):
    """A canary record that is not one (in a manifest, or given by a caller)."""


@attrs.frozen
class Answer:
    """What a model answers to the canary prompt: greedy tokens, the log-probability of each,
    how far ahead of the runner-up each was (the margin; empty if not measured), and the
    dtype it computed in if the engine says (an engine may serve in another dtype than the
    checkpoint's: vLLM's ``dtype="auto"`` serves a float32 model in bfloat16)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...] = ()
    dtype: str | None = None
    runner_ups: tuple[int, ...] = ()  # the second-best token of each step, if measured


def _known_dtype(_: object, __: object, dtype: str) -> None:
    if dtype not in TOLERANCE:
        raise CanaryError(f"a canary computed in {dtype!r}; known: {sorted(TOLERANCE)}")


def _usable(_: object, __: object, answer: Answer) -> None:
    """The trainer's answer must be one a check can hold an engine to."""
    if not answer.tokens or len(answer.logprobs) != len(answer.tokens):
        raise CanaryError("a canary needs at least one token and one log-probability each")
    for name in ("margins", "runner_ups"):
        if getattr(answer, name) and len(getattr(answer, name)) != len(answer.tokens):
            raise CanaryError(f"a canary's {name} must have one entry per token")
    if not all(math.isfinite(x) for x in (*answer.logprobs, *answer.margins)):
        raise CanaryError("a canary's log-probabilities must be finite (the model holds NaN?)")


@attrs.frozen
class Canary:
    """The trainer's answer on the weights it hands out, and the prompt that produced it."""

    prompt: tuple[int, ...] = attrs.field(validator=attrs.validators.min_len(1))
    answer: Answer = attrs.field(validator=_usable)
    dtype: str = attrs.field(validator=_known_dtype)  # of the weights it was computed on

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": list(self.prompt),
            "tokens": list(self.answer.tokens),
            "logprobs": list(self.answer.logprobs),
            "margins": list(self.answer.margins),
            "runner_ups": list(self.answer.runner_ups),
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, data: object) -> Canary:
        """Read back a manifest's ``canary`` record; ``CanaryError`` says what is wrong."""
        if not isinstance(data, dict):
            raise CanaryError(f"a canary record is a mapping, got {type(data).__name__}")
        try:
            prompt = tuple(_ints(data["prompt"], "prompt"))
            tokens = tuple(_ints(data["tokens"], "tokens"))
            logprobs = tuple(float(x) for x in data["logprobs"])
            margins = tuple(float(x) for x in data.get("margins", ()))
            runner_ups = tuple(_ints(data.get("runner_ups", []), "runner_ups"))
            dtype = str(data["dtype"])
        except KeyError as err:
            raise CanaryError(f"a canary record needs {err.args[0]!r}") from err
        except (TypeError, ValueError) as err:
            raise CanaryError(f"a canary record has a bad field: {err}") from err
        if not prompt:
            raise CanaryError("a canary record needs a prompt")
        return cls(prompt, Answer(tokens, logprobs, margins, dtype, runner_ups), dtype)


def _ints(values: Sequence[Any], name: str) -> list[int]:
    if not all(type(v) is int and v >= 0 for v in values):
        raise CanaryError(f"canary {name} must be token ids (ints >= 0)")
    return list(values)


def prompt_for(vocab_size: int, length: int = PROMPT_LENGTH) -> tuple[int, ...]:
    """A fixed prompt that spreads over the vocabulary (no tokenizer is needed)."""
    if vocab_size < 2:
        raise CanaryError(f"a canary needs a vocabulary of at least 2, got {vocab_size}")
    return tuple((1 + 7919 * i) % vocab_size for i in range(length))


def greedy(model: Any, prompt: Sequence[int], new_tokens: int = NEW_TOKENS) -> Answer:
    """Greedy decoding of ``prompt`` on a transformers causal LM, one full forward per step
    (no cache: the canary is short, and the answer must not depend on a cache's layout), in
    eval mode (dropout off; the model's mode is restored), on the model's device."""
    first = next(model.parameters())
    ids = torch.tensor([list(prompt)], device=first.device)
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    runner_ups: list[int] = []
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
                lp = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(lp, 2)
                token = int(top.indices[0])
                tokens.append(token)
                runner_ups.append(int(top.indices[1]))
                logprobs.append(float(top.values[0]))
                margins.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, torch.tensor([[token]], device=first.device)], dim=1)
    finally:
        model.train(training)
    dtype = str(first.dtype).removeprefix("torch.")
    return Answer(tuple(tokens), tuple(logprobs), tuple(margins), dtype, tuple(runner_ups))


def of_model(model: Any, new_tokens: int = NEW_TOKENS) -> Canary:
    """The canary of a transformers model as it is now (its own dtype)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype not in TOLERANCE:
        raise CanaryError(f"no canary tolerance for {dtype}; known: {sorted(TOLERANCE)}")
    prompt = prompt_for(int(model.config.vocab_size))
    return Canary(prompt, greedy(model, prompt, new_tokens), dtype)


def check(expected: Canary, got: Answer) -> str | None:
    """None if ``got`` agrees with ``expected``, else why not, in one line. The tolerance is
    that of the coarser of the canary's dtype and the one the engine served in."""
    served = got.dtype or expected.dtype
    if served not in TOLERANCE:
        return f"canary: answered in {served}, which has no tolerance; known: {sorted(TOLERANCE)}"
    tol = max(TOLERANCE[expected.dtype], TOLERANCE[served])
    want = expected.answer
    if len(got.tokens) < len(want.tokens) or len(got.logprobs) < len(want.tokens):
        return f"canary: answered {len(got.tokens)} tokens, expected {len(want.tokens)}"
    for i, (token, lp) in enumerate(zip(want.tokens, want.logprobs, strict=True)):
        try:
            answer_lp = float(got.logprobs[i])
        except (TypeError, ValueError):
            return f"canary: step {i} log-probability is {got.logprobs[i]!r}, not a number"
        if not math.isfinite(answer_lp):
            return f"canary: step {i} log-probability is {answer_lp} (weights hold NaN or inf?)"
        margin = want.margins[i] if want.margins else math.inf
        if got.tokens[i] != token:
            # Only a near tie lets an engine pick another token: the trainer's runner-up,
            # with about the same log-probability. What follows may differ: stop there.
            runner_up = want.runner_ups[i] if want.runner_ups else got.tokens[i]
            if margin >= 2 * tol or got.tokens[i] != runner_up:
                return f"canary: step {i} token {got.tokens[i]}, expected {token}"
            if abs(answer_lp - lp) > margin + tol:
                return f"canary: step {i} log-probability {answer_lp:.5f}, expected {lp:.5f}"
            return None
        if abs(answer_lp - lp) > tol:
            return (
                f"canary: step {i} log-probability {answer_lp:.5f}, expected {lp:.5f} "
                f"(tolerance {tol})"
            )
    return None
