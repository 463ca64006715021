"""What a rollout asks an engine for and what the engine answers, shared by every engine.

A trainer's rollout is many prompts (token ids) with one set of ``Sampling`` parameters; an
engine answers one ``Batch``: for each prompt, its samples (tokens, the log-probability of
each sampled token under the model's own distribution, optional top-k alternatives, why it
ended), and the weight version, group and incarnation it ran as, read under the engine's
lock with the tokens. Engines hold one lock around generation and every weight change, so a
batch runs at one version: a push waits for it, or stops it (``Loop.abort``).

``Loop`` is the engine's generation loop as the probe sees it: every decoding step beats,
an abort ends the batch at the next step. A loop that stops beating while a batch runs is
wedged even if the actor still answers calls (vLLM #36451); the probe says so.

Log-probabilities are the raw model's (``log_softmax`` of its logits, before temperature,
top-p or top-k), as vLLM returns them by default: what a trainer's importance ratio needs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from .. import RecoveryError

# Outside the decoding steps (a prefill, the log-probabilities after the last step) a batch
# may take longer than one step without being wedged: the probe allows this much there.
OUTSIDE_STEP_GRACE_S = 30.0


class BadSampling(RecoveryError, ValueError):
    """A sampling parameter out of range: the message says what was expected."""


class EngineWedged(RecoveryError):
    """The engine's generation loop made no step within the probe's bound while a batch
    ran: the actor answers, the engine does not."""


def _check(cond: bool, what: str, value: object) -> None:
    if not cond:
        raise BadSampling(f"{what}, got {value!r}")


def _token_ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)  # a typed converter: checked in __attrs_post_init__


@attrs.frozen
class Sampling:
    """How to sample, as vLLM and the OpenAI API name it. ``temperature=0`` is greedy
    (``n`` must then be 1: greedy samples are all the same); ``top_k=0`` and ``top_p=1`` are
    off; ``logprobs``: how many top alternatives to return per token besides the sampled
    token's own log-probability (always returned); ``seed`` makes a prompt's samples
    reproducible on one engine at one version."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    seed: int | None = None
    logprobs: int = 0

    def __attrs_post_init__(self) -> None:
        _check(type(self.max_new_tokens) is int and 1 <= self.max_new_tokens <= 65536,
               "max_new_tokens must be an int in [1, 65536]", self.max_new_tokens)  # fmt: skip
        t = self.temperature
        _check(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
               and 0 <= t <= 100, "temperature must be a number in [0, 100]", t)  # fmt: skip
        p = self.top_p
        _check(isinstance(p, int | float) and not isinstance(p, bool) and 0 < p <= 1,
               "top_p must be a number in (0, 1]", p)  # fmt: skip
        _check(type(self.top_k) is int and self.top_k >= 0,
               "top_k must be an int >= 0 (0: off)", self.top_k)  # fmt: skip
        _check(type(self.n) is int and 1 <= self.n <= 1024, "n must be an int in [1, 1024]",
               self.n)  # fmt: skip
        _check(t > 0 or self.n == 1, "n > 1 needs temperature > 0 (greedy samples are "
               "identical)", self.n)  # fmt: skip
        _check(all(type(s) is int and s >= 0 for s in self.stop_token_ids),
               "stop_token_ids must be token ids (ints >= 0)", self.stop_token_ids)  # fmt: skip
        _check(self.seed is None or (type(self.seed) is int and 0 <= self.seed < 2**63),
               "seed must be None or an int in [0, 2**63)", self.seed)  # fmt: skip
        _check(type(self.logprobs) is int and 0 <= self.logprobs <= 20,
               "logprobs must be an int in [0, 20] (top alternatives per token)",
               self.logprobs)  # fmt: skip


def check_prompts(prompts: object, vocab_size: int | None = None) -> list[list[int]]:
    """Prompts as plain lists of token ids, or ``BadSampling`` saying what was expected."""
    _check(isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes)
           and len(prompts) > 0, "prompts must be a non-empty list of token-id lists",
           type(prompts).__name__)  # fmt: skip
    assert isinstance(prompts, Sequence)
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        _check(isinstance(p, Sequence) and not isinstance(p, str | bytes) and len(p) > 0,
               f"prompt {i} must be a non-empty list of token ids", p)  # fmt: skip
        ok = all(type(t) is int and t >= 0 and (vocab_size is None or t < vocab_size) for t in p)
        _check(ok, f"prompt {i} must hold token ids in [0, {vocab_size or 'vocab'})", p)
        out.append(list(p))
    return out


@attrs.frozen
class EngineSample:
    """One sampled continuation as an engine produced it."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # of each sampled token, raw model distribution
    top_logprobs: tuple[dict[int, float], ...] | None  # per token, if asked for
    finish_reason: str  # "stop" (a stop or end token), "length", "abort"


@attrs.frozen
class Batch:
    """An engine's answer to one rollout call: ``samples[i]`` are prompt i's (empty for a
    prompt an abort ended before any sibling finished), and the process and weights that
    produced every one of them."""

    samples: tuple[tuple[EngineSample, ...], ...]
    version: int | None
    group: str
    incarnation: int
    steps: int  # decoding steps the engine ran for this batch
    elapsed_s: float = 0.0  # inside the engine, lock held: what a benchmark compares with


class Loop:
    """The heartbeat and the abort switch of an engine's generation loop. ``begin``/``end``
    bracket a batch (under the engine's lock); ``beat`` is called at every decoding step;
    ``abort`` and ``stalled`` are called from other threads (the actor's health group)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False
        self._beat = time.monotonic()
        self._abort = threading.Event()
        self.steps = 0
        self.began = self._beat
        self._outside = False
        # Called at every step, outside the lock (tests wedge a loop here on purpose).
        self.on_step: Callable[[], None] | None = None

    def begin(self) -> None:
        with self._lock:
            self._running, self._beat, self.steps = True, time.monotonic(), 0
            self.began = self._beat
            self._outside = True
            self._abort.clear()

    def outside_step(self) -> None:
        """Work that is not a decoding step begins (a prefill, or the post-processing after
        the last step): the probe allows ``OUTSIDE_STEP_GRACE_S`` until the next beat."""
        with self._lock:
            self._beat, self._outside = time.monotonic(), True

    def end(self) -> float:
        """The batch's seconds."""
        with self._lock:
            self._running = False
            return time.monotonic() - self.began

    def beat(self) -> bool:
        """One decoding step done; True if the batch should stop (aborted)."""
        with self._lock:
            self._beat, self._outside = time.monotonic(), False
            self.steps += 1
        if self.on_step is not None:
            self.on_step()
        return self._abort.is_set()

    def abort(self) -> bool:
        """Ask the running batch to stop at its next step; False if none runs."""
        with self._lock:
            if self._running:
                self._abort.set()
            return self._running

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def probe(self, stall_s: float, lock: threading.Lock, work: Callable[[], object]) -> None:
        """The probe through the loop: a running batch must have stepped within ``stall_s``
        (else ``EngineWedged``); an idle engine (``lock`` free) runs ``work``, a one-token
        pass. A load in progress holds ``lock``: its own deadline covers it."""
        stalled = self.stalled(stall_s)
        if stalled is not None:
            raise EngineWedged(f"no engine step for {stalled:.1f} s while a batch runs")
        if not lock.acquire(blocking=False):
            return
        try:
            work()
        finally:
            lock.release()

    def stalled(self, bound_s: float) -> float | None:
        """Seconds since the last step, if a batch runs and that exceeds ``bound_s`` (or the
        grace, outside a decoding step)."""
        with self._lock:
            idle = time.monotonic() - self._beat
            bound = max(bound_s, OUTSIDE_STEP_GRACE_S) if self._outside else bound_s
            return idle if self._running and idle > bound else None


def hf_sample(
    model: Any, prompts: list[list[int]], sampling: Sampling, loop: Loop, eos: list[int]
) -> tuple[tuple[EngineSample, ...], ...]:
    """Sample ``prompts`` on a transformers causal LM in one left-padded batch (one batch per
    prompt when seeded, so a prompt's samples depend on its seed alone), beating ``loop``
    at every step and stopping when it is aborted."""
    if sampling.seed is not None:
        out: list[tuple[EngineSample, ...]] = []
        for p in prompts:
            torch.manual_seed(sampling.seed)
            out.extend(_hf_batch(model, [p], sampling, loop, eos))
            if loop.aborted:
                break
        return tuple(out) + tuple(() for _ in range(len(prompts) - len(out)))
    return _hf_batch(model, prompts, sampling, loop, eos)


class _Beat:
    """A transformers stopping criterion that is the loop's heartbeat and abort switch."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop

    def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
        stop = self.loop.beat()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)


def _hf_batch(
    model: Any, prompts: list[list[int]], sampling: Sampling, loop: Loop, eos: list[int]
) -> tuple[tuple[EngineSample, ...], ...]:
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    pad = eos[0] if eos else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stops = sorted({*eos, *sampling.stop_token_ids})
    greedy = sampling.temperature == 0
    loop.outside_step()  # the prefill
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy, temperature=None if greedy else float(sampling.temperature),
            top_p=None if greedy else float(sampling.top_p),
            top_k=None if greedy else sampling.top_k,
            num_return_sequences=sampling.n, eos_token_id=stops or None, pad_token_id=pad,
            output_logits=True, return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([_Beat(loop)]),
        )  # fmt: skip
    loop.outside_step()  # the log-probabilities
    new = out.sequences[:, width:]
    logps = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in out.logits], dim=1)
    result: list[tuple[EngineSample, ...]] = []
    for i in range(len(prompts)):
        siblings: list[EngineSample] = []
        for j in range(sampling.n):
            row = i * sampling.n + j
            sample = _cut(new[row].tolist(), logps[row], stops, sampling, loop.aborted)
            if sample is not None:
                siblings.append(sample)
        # An abort keeps the siblings that had ended on their own, and none of a prompt
        # whose siblings are incomplete: a partial continuation is no sample.
        result.append(tuple(siblings))
    return tuple(result)


def _cut(
    row: list[int], logp: torch.Tensor, stops: list[int], sampling: Sampling, aborted: bool
) -> EngineSample | None:
    """One generated row up to (and with) its first stop token; None if an abort cut it."""
    end = next((k + 1 for k, t in enumerate(row) if t in stops), None)
    if end is not None:
        reason = "stop"
    elif len(row) >= sampling.max_new_tokens:
        end, reason = sampling.max_new_tokens, "length"
    else:
        end, reason = len(row), "abort"
    if reason == "abort" or (aborted and end > logp.shape[0]):
        return None
    tokens = row[:end]
    steps = logp[: len(tokens)]
    picked = steps.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    top = None
    if sampling.logprobs:
        values, indices = torch.topk(steps, sampling.logprobs, dim=-1)
        top = tuple(
            {int(t): float(v) for t, v in zip(ix.tolist(), vs.tolist(), strict=True)}
            for ix, vs in zip(indices, values, strict=True)
        )
    return EngineSample(tuple(tokens), tuple(float(x) for x in picked), top, reason)
