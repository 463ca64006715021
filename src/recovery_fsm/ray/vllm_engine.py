"""vLLM as a rollout engine (extra ``[vllm]``): one ``vllm.LLM`` inside one Ray actor.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no engine
core or worker child processes, no shared-memory segments, so killing the actor (by Ray, or
SIGKILL from outside) leaves nothing behind. vLLM's default, an engine-core process beside
the API process, leaves its shared memory behind on a kill (measured: two segments of 160 and
240 MB apparent size per kill on this machine); tensor parallelism needs that mode, and
this engine does not offer it (see the README's limitations).

How each call of the protocol maps onto vLLM:

- ``boot_from_checkpoint(path)``: the store checks every byte against the manifest, then
  ``LLM(model=path)`` reads the exporter's directory as it reads any Hugging Face checkpoint;
- ``boot_empty()``: ``LLM(load_format="dummy")`` over a directory holding only the config;
- ``load_checkpoint(path, incarnation)`` and ``update_weights(version, weights)``: vLLM's
  own in-place reload (``model_runner.reload_weights``, through ``collective_rpc`` on a worker
  extension, ``vllm_worker.py``) from the checkpoint's files or from the pushed tensors. vLLM's
  weight-transfer engines need NCCL or CUDA IPC; on CPU the pushed tensors are handed to the
  in-process worker by reference instead;
- after each: prefix caching is off (a cached prefix computed with the old weights would be
  served with the new ones), and the engine's own weight version is set
  (``set_weight_version``) and read back by every ``ping``;
- ``rollout``: the batch is enqueued (``LLM.enqueue``) and stepped here
  (``llm_engine.step``), so every step beats the probe's heartbeat and an ``abort`` ends the
  batch between two steps (``llm_engine.abort_request``); log-probabilities are vLLM's
  default, the raw model's;
- ``canary``: greedy generation with log-probabilities; the engine computes no digest of
  what it holds (its parameters are fused and re-laid), so admission rests on the canary.

A reload that raises leaves vLLM's model half loaded: the call raises. A load from a
checkpoint then failed, and the runner kills the process; a push leaves the group out of
the sync (demoted, it serves nothing), and its next load in place or canary decides.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import ray
import torch

from ..export.canary import Answer
from . import scratch
from .actors import exited
from .engine import Generation, WeightsHeld, manifest_version
from .sampling import Batch, EngineSample, Loop, Sampling
from .vllm_worker import shard_files

_REQUESTS = itertools.count()  # request ids, unique within the process

# Set in the actor's process before vLLM is imported there.
ENGINE_ENV: Mapping[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in the actor's process
    "OMP_NUM_THREADS": "1",  # two threads on two cores made each generation 20x slower
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}

# ``vllm.LLM`` arguments for small models on CPU; ``VLLMEngine.with_options`` changes them.
DEFAULT_OPTIONS: Mapping[str, Any] = {
    "skip_tokenizer_init": True,  # the runtime speaks token ids
    "enforce_eager": True,  # no graph capture: on CPU it costs boot time and buys nothing
    "enable_prefix_caching": False,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "kv_cache_memory_bytes": 32 * 2**20,
    "disable_log_stats": True,
    "seed": 0,
    "dtype": "auto",
}


class VLLMEngine:
    """The ``RolloutEngine`` protocol on ``vllm.LLM``; made an actor by the runtime."""

    COMPUTES_DIGEST: ClassVar[bool] = False
    # Merged under the runtime's actor options: the environment vLLM needs, set before the
    # actor's process starts.
    ACTOR_OPTIONS: ClassVar[Mapping[str, Any]] = {"runtime_env": {"env_vars": dict(ENGINE_ENV)}}
    OPTIONS: ClassVar[Mapping[str, Any]] = DEFAULT_OPTIONS

    @classmethod
    def with_options(cls, **options: Any) -> type[VLLMEngine]:
        """This engine with other ``vllm.LLM`` arguments (e.g. ``max_model_len``)."""
        return type(cls.__name__, (cls,), {"OPTIONS": {**cls.OPTIONS, **options}})

    def __init__(self, config: dict[str, Any], group: str, incarnation: int) -> None:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        # What vLLM writes at a boot goes in a folder removed once this process is gone.
        self._scratch = scratch.claim(exited)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.config = config
        self.group = group
        self.incarnation = incarnation
        self.llm: Any = None
        self._lock = threading.Lock()  # boots, loads and generation run one at a time
        self._forever = threading.Event()
        self._config_dir: str | None = None
        self._loop = Loop()
        self.timings: dict[str, float] = {}  # seconds of the last boot's and load's phases

    # -- health ------------------------------------------------------------------------------

    @ray.method(concurrency_group="health")
    def ping(self, stall_s: float | None = None) -> int | None:
        """The version the engine itself says it holds (``set_weight_version``); with
        ``stall_s``, through the generation loop (see ``engine.py``)."""
        if stall_s is not None and self.llm is not None:
            self._loop.probe(stall_s, self._lock,
                             lambda: self._generate_locked([0], 1, until_eos=False))  # fmt: skip
        return self._held_version()

    @ray.method(concurrency_group="health")
    def abort(self) -> bool:
        """End the running batch between two engine steps; False if none runs."""
        return self._loop.abort()

    @ray.method(concurrency_group="health")
    def whoami(self) -> tuple[str, int]:
        """The group and incarnation this process runs as, answered beside a load (a
        resumed runtime finds its engines by asking)."""
        return self.group, self.incarnation

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._forever.wait()

    # -- weights -----------------------------------------------------------------------------

    def boot_from_checkpoint(self, path: str) -> WeightsHeld:
        from ..export import CheckpointStore

        with self._lock:
            began = time.perf_counter()
            p = os.path.abspath(path)
            CheckpointStore(os.path.dirname(p)).verify(p, full=True)  # every byte, first
            verified = time.perf_counter()
            version = manifest_version(path)
            self._boot(p, load_format="auto")
            self.timings["verify_s"] = verified - began
            return self._set_version(version)

    def boot_empty(self) -> WeightsHeld:
        with self._lock:
            self._config_dir = tempfile.mkdtemp(prefix="recovery-fsm-vllm-config-",
                                                dir=self._scratch)  # fmt: skip
            with open(os.path.join(self._config_dir, "config.json"), "w") as f:
                json.dump(self.config, f)
            self._boot(self._config_dir, load_format="dummy")
            return self._set_version(None)

    def load_checkpoint(self, path: str, incarnation: int) -> WeightsHeld:
        from ..export import CheckpointStore

        with self._lock:
            self._require_boot("load_checkpoint")
            self.incarnation = incarnation  # from the start: a resumed runtime asks meanwhile
            began = time.perf_counter()
            p = os.path.abspath(path)
            CheckpointStore(os.path.dirname(p)).verify(p, full=True)
            with self._unvouched_on_error():
                self.llm.collective_rpc("recovery_load_files", kwargs={"files": shard_files(p)})
            self.timings["load_s"] = time.perf_counter() - began
            return self._set_version(manifest_version(path))

    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> WeightsHeld:
        with self._lock:
            self._require_boot("update_weights")
            named = list(weights.items())
            with self._unvouched_on_error():
                self.llm.collective_rpc("recovery_load_tensors", kwargs={"named": named})
            return self._set_version(version)

    def weights(self) -> WeightsHeld:
        return WeightsHeld(self._held_version(), None)

    def booted(self) -> bool:
        """Whether a boot ran (queued behind one in progress)."""
        return self.llm is not None

    def assume(self, group: str, incarnation: int) -> WeightsHeld:
        """A standby becomes ``group``'s process ``incarnation``: its generations say so."""
        with self._lock:
            self.group, self.incarnation = group, incarnation
            return WeightsHeld(self._held_version(), None)

    # -- requests ----------------------------------------------------------------------------

    def canary(self, prompt: list[int], new_tokens: int) -> Answer:
        tokens, logprobs = self._generate(prompt, new_tokens, until_eos=False)
        served = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return Answer(tuple(tokens), tuple(logprobs), dtype=served)

    def generate(self, prompt: list[int], max_new_tokens: int = 8) -> Generation:
        with self._lock:  # the tags are read with the tokens, before a push can land
            self._require_boot("generate")
            tokens, _ = self._generate_locked(prompt, max_new_tokens, until_eos=True)
            return Generation(tokens, self._held_version(), self.group, self.incarnation)

    def rollout(self, prompts: list[list[int]], sampling: Sampling) -> Batch:
        """Sample ``prompts`` in one batch, stepping vLLM's engine here."""
        vllm = importlib.import_module("vllm")
        params = vllm.SamplingParams(
            n=sampling.n, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
            top_k=sampling.top_k, seed=sampling.seed, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), logprobs=sampling.logprobs,
            output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,  # whole samples
        )  # fmt: skip
        with self._lock:
            self._require_boot("rollout")
            engine = self.llm.llm_engine
            self._loop.begin()
            try:
                ids = [f"rollout-{next(_REQUESTS)}" for _ in prompts]
                added: list[str] = []
                try:
                    for rid, p in zip(ids, prompts, strict=True):
                        engine.add_request(rid, {"prompt_token_ids": p}, params)
                        added.append(rid)
                except Exception:
                    # A prompt refused (too long, say): none of the batch stays queued, or
                    # the next generation (a probe, the canary) would run it.
                    if added:
                        engine.abort_request(added)
                    raise
                self._loop.outside_step()  # the first step is a prefill
                done: dict[str, Any] = {}
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out
                    if self._loop.beat():
                        engine.abort_request([i for i in ids if i not in done])
                        break
                self._loop.outside_step()
            finally:
                elapsed = self._loop.end()
            samples = tuple(_samples(done.get(i), sampling) for i in ids)
            return Batch(samples, self._held_version(), self.group, self.incarnation,
                         self._loop.steps, elapsed)  # fmt: skip

    def shutdown(self) -> None:
        with self._lock:
            self.llm = None
            if self._config_dir is not None:
                shutil.rmtree(self._config_dir, ignore_errors=True)
                self._config_dir = None

    # -- inside ------------------------------------------------------------------------------

    def _boot(self, model: str, load_format: str) -> None:
        began = time.perf_counter()
        vllm = importlib.import_module("vllm")
        imported = time.perf_counter()
        with scratch.as_tempdir(self._scratch):  # its rendezvous file
            self.llm = vllm.LLM(
                model=model,
                load_format=load_format,
                worker_extension_cls="recovery_fsm.ray.vllm_worker.WeightLoader",
                **self.OPTIONS,
            )
        booted = time.perf_counter()
        # The first forward pass costs seconds (kernels packed, caches sized): paid here, not
        # by the first request or the admission check.
        self._generate_locked([0], 1, until_eos=False)
        self.timings.update(
            import_s=imported - began,
            init_s=booted - imported,
            warmup_s=time.perf_counter() - booted,
        )

    def _held_version(self) -> int | None:
        llm = self.llm
        return None if llm is None else _version(llm.llm_engine.get_weight_version())

    @contextlib.contextmanager
    def _unvouched_on_error(self) -> Iterator[None]:
        """A transfer that fails part-way leaves a mix of two versions (an abort is no
        rollback, vLLM #57854): from then on the engine says it holds none."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to see
                self._set_version(None)
            raise

    def _set_version(self, version: int | None) -> WeightsHeld:
        self.llm.llm_engine.set_weight_version("none" if version is None else str(version))
        return WeightsHeld(version, None)

    def _require_boot(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what} before a boot")

    def _generate(
        self, prompt: list[int], n: int, *, until_eos: bool
    ) -> tuple[list[int], list[float]]:
        with self._lock:
            self._require_boot("generate")
            return self._generate_locked(prompt, n, until_eos=until_eos)

    def _generate_locked(
        self, prompt: list[int], n: int, *, until_eos: bool
    ) -> tuple[list[int], list[float]]:
        vllm = importlib.import_module("vllm")
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=not until_eos
        )
        (out,) = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
        done = out.outputs[0]
        tokens = list(done.token_ids)
        logprobs = [float(done.logprobs[i][t].logprob) for i, t in enumerate(tokens)]
        return tokens, logprobs


def _samples(out: Any, sampling: Sampling) -> tuple[EngineSample, ...]:
    """A finished vLLM request's completions as samples (none for an aborted request)."""
    if out is None:
        return ()
    samples = []
    for c in out.outputs:
        tokens = tuple(int(t) for t in c.token_ids)
        steps = c.logprobs or []
        logprobs = tuple(float(steps[k][t].logprob) for k, t in enumerate(tokens))
        top = None
        if sampling.logprobs:
            top = tuple(
                {int(t): float(lp.logprob) for t, lp in step.items()
                 if lp.rank is not None and lp.rank <= sampling.logprobs}
                for step in steps
            )  # fmt: skip
        reason = "length" if c.finish_reason == "length" else "stop"
        samples.append(EngineSample(tokens, logprobs, top, reason))
    return tuple(samples)


def _version(text: str) -> int | None:
    """The engine's weight version as the runtime numbers it (None: no weights)."""
    return int(text) if text.isdigit() else None
