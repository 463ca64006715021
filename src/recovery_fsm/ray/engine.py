"""What a rollout engine must offer the runtime, and a reference engine that offers it.

The runtime talks to every engine process through these calls and reads nothing else:

- ``ping(stall_s)``: answers while the process is healthy (a probe; it runs beside a busy
  load) with the weight version the engine itself says it holds (None: none). A serving
  engine that answers another version than the controller believes (older, or none) has
  failed. With ``stall_s`` the probe goes through the generation loop: a running batch must
  have made a decoding step within ``stall_s`` (else ``EngineWedged``), and an idle engine
  runs a one-token generation before it answers (a wedged forward pass never answers).
- ``watch()``: never returns; it fails the moment the process dies, so death is noticed
  without polling.

(``ping`` and ``watch`` run in their own concurrency groups, ``health`` and ``watch``: a
subclass that overrides them must decorate them again with ``@ray.method``, or they queue
behind a load.)
- ``boot_from_checkpoint(path)``: load a committed recovery checkpoint, checking every
  byte, and report the version and the digest of the weights now held.
- ``load_checkpoint(path, incarnation)``: load a checkpoint in place, in the running
  process, which goes on under the number ``incarnation`` (its generations say so).
- ``boot_empty()``: start without real weights (the cold path; a weight sync follows).
- ``update_weights(version, weights)``: take a pushed version and report the digest held.
- ``weights()``: the version and digest held now.
- ``assume(group, incarnation)``: a warm standby is handed to ``group`` as its process
  ``incarnation`` (its generations say so from now on); answers what it holds.
- ``canary(prompt, new_tokens)``: greedy tokens and their log-probabilities
  (``export.canary.Answer``): admission asks every engine, after every boot, load and push.
- ``rollout(prompts, sampling)``: sample every prompt (``sampling.Sampling``) in one batch
  and answer a ``sampling.Batch`` tagged with the version, group and incarnation it ran as;
  ``abort()`` (in the ``health`` group) ends the running batch at its next step.
- ``shutdown()``: release what it holds.

How the serving engines map onto it (see the README): vLLM boots empty with
``load_format="dummy"`` and takes a checkpoint or pushed weights through its weight-update
calls (``collective_rpc`` on a worker extension that loads the tensors with
``model.load_weights``); SGLang boots from a path and reloads with
``update_weights_from_disk`` or takes tensors with ``update_weights_from_tensor``; its
``/health_generate`` is the probe. The digest is computed over the tensors the engine was
given (the checkpoint's, or the pushed ones), in the hub layout.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import attrs
import ray
import torch

from ..export.canary import Answer, greedy
from .sampling import Batch, Loop, Sampling, hf_sample


@attrs.frozen
class WeightsHeld:
    """What an engine process reports after a boot or an update."""

    version: int | None  # None: booted without weights
    digest: str | None


@attrs.frozen
class Generation:
    """Tokens an engine produced, tagged with the weights and process that produced them."""

    tokens: list[int]
    version: int | None
    group: str
    incarnation: int


class RolloutEngine(Protocol):
    def ping(self, stall_s: float | None = None) -> int | None: ...
    def rollout(self, prompts: list[list[int]], sampling: Sampling) -> Batch: ...
    def abort(self) -> bool: ...
    def whoami(self) -> tuple[str, int]: ...
    def booted(self) -> bool: ...
    def watch(self) -> None: ...
    def boot_from_checkpoint(self, path: str) -> WeightsHeld: ...
    def load_checkpoint(self, path: str, incarnation: int) -> WeightsHeld: ...
    def boot_empty(self) -> WeightsHeld: ...
    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> WeightsHeld: ...
    def weights(self) -> WeightsHeld: ...
    def assume(self, group: str, incarnation: int) -> WeightsHeld: ...
    def canary(self, prompt: list[int], new_tokens: int) -> Answer: ...
    def shutdown(self) -> None: ...


class ReferenceEngine:
    """A transformers causal LM in one Ray actor: boots through the verified load path,
    takes weight updates pushed through the object store, generates greedily.

    Made an actor by the runtime with ``concurrency_groups`` so that ``ping`` and ``watch``
    run beside a load. Tests subclass it to misbehave (hang, die, corrupt)."""

    def __init__(self, config: dict[str, Any], group: str, incarnation: int) -> None:
        self.config = config
        self.group = group
        self.incarnation = incarnation
        self.model: Any = None
        self.held = WeightsHeld(None, None)
        self._lock = threading.Lock()  # boots, updates and generation run one at a time
        self._forever = threading.Event()
        self._loop = Loop()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    @ray.method(concurrency_group="health")
    def ping(self, stall_s: float | None = None) -> int | None:
        if stall_s is not None:
            self._probe_loop(stall_s)
        return self.held.version

    def _probe_loop(self, stall_s: float) -> None:
        if self.model is not None:
            self._loop.probe(stall_s, self._lock, self._one_token)

    def _one_token(self) -> None:
        with torch.no_grad():
            self.model(input_ids=torch.tensor([[0]]))

    @ray.method(concurrency_group="health")
    def abort(self) -> bool:
        """End the running batch at its next step (its unfinished samples are dropped);
        False if none runs."""
        return self._loop.abort()

    @ray.method(concurrency_group="health")
    def whoami(self) -> tuple[str, int]:
        """The group and incarnation this process runs as, answered beside a load (a
        resumed runtime finds its engines by asking)."""
        return self.group, self.incarnation

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._forever.wait()

    def boot_from_checkpoint(self, path: str) -> WeightsHeld:
        from ..export import load_model, model_digest

        with self._lock:
            self.model = load_model(path).eval()  # every byte checked as it is read
            # The digest of what the model now holds, recomputed: the runtime compares it
            # with the manifest's before it routes any traffic here.
            self.held = WeightsHeld(manifest_version(path), model_digest(self.model))
            return self.held

    def load_checkpoint(self, path: str, incarnation: int) -> WeightsHeld:
        """The reference engine loads in place by booting its model again from ``path``. It
        runs as ``incarnation`` from the start of the load, so that a resumed runtime asking
        ``whoami`` meanwhile finds the process the controller knows."""
        self.incarnation = incarnation
        return self.boot_from_checkpoint(path)

    def assume(self, group: str, incarnation: int) -> WeightsHeld:
        """A standby becomes ``group``'s process ``incarnation``: its generations say so."""
        with self._lock:
            self.group, self.incarnation = group, incarnation
            return self.held

    def boot_empty(self) -> WeightsHeld:
        import transformers

        with self._lock:
            config = transformers.AutoConfig.for_model(**self.config)
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            self.model = model.eval()
            self.held = WeightsHeld(None, None)
            return self.held

    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> WeightsHeld:
        from ..export import model_digest

        with self._lock:
            if self.model is None:
                raise RuntimeError("update_weights before a boot")
            try:
                self.model.load_state_dict(weights, strict=True)
            except BaseException:
                # Part of it may have landed: a mix of two versions (an abort is no
                # rollback), which nobody vouches for. Probes see it at once.
                self.held = WeightsHeld(None, None)
                raise
            self.held = WeightsHeld(version, model_digest(self.model))
            return self.held

    def weights(self) -> WeightsHeld:
        return self.held

    def booted(self) -> bool:
        """Whether a boot ran (queued behind one in progress): an actor whose boot call
        died with the trainer that sent it holds no engine at all."""
        return self.model is not None

    def canary(self, prompt: list[int], new_tokens: int) -> Answer:
        with self._lock:
            if self.model is None:
                raise RuntimeError("canary before a boot")
            return greedy(self.model, prompt, new_tokens)

    def generate(self, prompt: list[int], max_new_tokens: int = 8) -> Generation:
        with self._lock:
            if self.model is None:
                raise RuntimeError("generate before a boot")
            ids = torch.tensor([prompt])
            with torch.no_grad():
                # Every prompt token is attended: a prompt of one is never padded, and
                # without this mask ``generate`` would infer one from the pad id, dropping
                # any real token that happens to equal it (token 0 said to be padding).
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=_pad_id(self.model.generation_config),
                )  # fmt: skip
            return Generation(
                out[0, len(prompt) :].tolist(), self.held.version, self.group, self.incarnation
            )

    def rollout(self, prompts: list[list[int]], sampling: Sampling) -> Batch:
        """Sample ``prompts`` in one batch at the version held now (a push waits for the
        batch, or aborts it)."""
        with self._lock:
            if self.model is None:
                raise RuntimeError("rollout before a boot")
            self._loop.begin()
            try:
                eos = _eos_ids(self.model.generation_config)
                samples = hf_sample(self.model, prompts, sampling, self._loop, eos)
            finally:
                elapsed = self._loop.end()
            return Batch(samples, self.held.version, self.group, self.incarnation,
                         self._loop.steps, elapsed)  # fmt: skip

    def shutdown(self) -> None:
        with self._lock:
            self.model = None
            self.held = WeightsHeld(None, None)


def _pad_id(generation: Any) -> int | None:
    """The model's own pad id, else its end of sequence (what ``generate`` falls back to,
    said here to spare the warning); only fills a finished row, never read as input."""
    if generation.pad_token_id is not None:
        return int(generation.pad_token_id)
    eos = generation.eos_token_id
    if isinstance(eos, list):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def _eos_ids(generation: Any) -> list[int]:
    eos = generation.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def manifest_version(path: str) -> int:
    """The version a committed checkpoint holds, from its manifest (read, not trusted: the
    load that follows checks the bytes)."""
    from pathlib import Path

    from ..export import CheckpointStore

    p = Path(path)
    return int(CheckpointStore(p.parent).read_manifest(p)["version"])
