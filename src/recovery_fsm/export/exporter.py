"""Asynchronous Hugging Face export of the current weights, for immediate recovery.

The trainer's thread pays only for staging: one copy of every tensor into host buffers that
are reused across exports. Everything else (sharding, dtype conversion, hashing, writing,
fsync, the atomic rename) runs in the background, and every outcome is reported as an event.
What lands on disk is what ``save_pretrained`` would write for the model (see
``hf_layout``), so vLLM, SGLang and transformers load it as they load a hub checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import attrs
import torch

from .. import events as ev
from ..errors import BadExportInput, ExportCancelledError, ExporterClosed
from . import hf_layout
from .canary import Canary
from .safetensors_io import (
    DEFAULT_HASH,
    DTYPE_NAMES,
    HASHES,
    Writeback,
    best_writeback,
    nbytes,
    new_hasher,
    weights_digest,
    write_file,
)
from .store import FORMAT, MANIFEST, CheckpointStore, file_digest, fsync_dir

# report(EventClass, **fields): ControllerLink.send has this shape.
Report = Callable[..., object]
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_log = logging.getLogger(__name__)


class _Unset(enum.Enum):
    UNSET = "unset"


# "The exporter's own setting", for the per-export options (None means something else).
UNSET = _Unset.UNSET
WRITEBACKS = ("sync_file_range", "dontneed", "off")


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``1GiB`` or bytes, as transformers' ``max_shard_size`` accepts."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise BadExportInput(f"max_shard_size must be positive, got {size}")
        return size
    if not isinstance(size, str):
        raise BadExportInput(f"max_shard_size must be an int or a string like '2GB', got {size!r}")
    text = size.strip().upper()
    for suffix, factor in (
        ("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10),
        ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1),
    ):  # fmt: skip
        if text.endswith(suffix):
            try:
                return parse_size(int(float(text[: -len(suffix)]) * factor))
            except ValueError:
                break
    raise BadExportInput(f"max_shard_size {size!r} is not a size like '2GB' or '500MB'")


@attrs.frozen
class ExportHandle:
    """What ``export`` returns at once. The committed path travels only through ``future``."""

    version: int
    future: Future[Path] = attrs.field(repr=False)
    _cancel: threading.Event = attrs.field(repr=False, alias="cancel_flag")

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Path:
        return self.future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.future.exception(timeout)

    def cancel(self) -> None:
        """Ask the writer to stop at its next chunk; the future then raises
        ExportCancelledError (unless the write already committed)."""
        self._cancel.set()


class FailedReport(NamedTuple):
    """A ``report`` call from the writer thread that raised. Nobody waits on that thread, so
    the exporter keeps it (and logs it) instead of letting the pool swallow it."""

    event: str  # the event class's name: "ExportCommitted", "ExportFailed", "ExportCancelled"
    version: int
    error: BaseException


@attrs.define(eq=False)
class _Job:
    version: int
    tensors: list[tuple[str, torch.Tensor]]
    aliases: dict[str, str]
    buffers: dict[str, torch.Tensor]
    config_json: str | None
    generation_config_json: str | None
    tokenizer: Any
    handle: ExportHandle
    dtype: torch.dtype | None
    max_shard_size: int
    canary: Canary | None
    # Set when one shard writer failed, so the others stop at their next chunk.
    abort: threading.Event = attrs.field(factory=threading.Event)


class AsyncHFExporter:
    """One background export at a time into ``CheckpointStore(root)``.

    ``report`` receives every outcome as ``report(EventClass, **fields)``: ExportStarted from
    the caller's thread, then ExportCommitted, ExportFailed or ExportCancelled from the writer.
    ``write_threads`` shards are written at once; each writer hashes the bytes it writes
    (``hash_name``, xxh3-128 by default), so every byte is read from memory once.
    ``writeback`` says how the disk write is started before the final fsync (Linux):
    ``sync_file_range`` (the default there) keeps the written pages cached for a restart on
    this host, ``dontneed`` drops them, ``off`` leaves everything to the fsync.

    If ``report`` raises on ExportStarted, ``export`` raises it and that export never runs.
    If it raises on the writer's outcome, the export's own outcome stands (the handle resolves
    and the checkpoint stays committed as if it had not), and the error is logged to this
    module's logger and kept in ``report_errors``.
    """

    # How many FailedReports report_errors keeps (the latest); every one of them is logged.
    REPORT_ERRORS_KEPT = 100

    def __init__(
        self,
        root: str | os.PathLike[str] | CheckpointStore,
        *,
        report: Report | None = None,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        write_threads: int = 2,
        fsync: bool = True,
        hash_name: str = DEFAULT_HASH,
        writeback: Writeback | None = None,
        opener: Callable[[str | os.PathLike[str]], BinaryIO] | None = None,
    ) -> None:
        _check_dtype(dtype)
        if type(write_threads) is not int or write_threads < 1:
            raise BadExportInput(f"write_threads must be an int >= 1, got {write_threads!r}")
        if hash_name not in HASHES:
            raise BadExportInput(f"hash_name must be one of {sorted(HASHES)}, got {hash_name!r}")
        if writeback is not None and writeback not in WRITEBACKS:
            raise BadExportInput(f"writeback must be one of {WRITEBACKS}, got {writeback!r}")
        self.max_shard_size = parse_size(max_shard_size)
        self.store = root if isinstance(root, CheckpointStore) else CheckpointStore(root)
        self.dtype = dtype
        self.hash_name = hash_name
        self.writeback: Writeback = writeback or best_writeback()
        self._report = report
        self._fsync = fsync
        self._opener = opener  # tests inject writer faults here
        self._lock = threading.Lock()
        # Threads inside export() or reserve(): close() waits for them, so a job is never
        # submitted to a pool that close() has already shut down.
        self._staging: collections.Counter[int] = collections.Counter()
        self._staged = threading.Condition(self._lock)
        self._current: _Job | None = None
        self._last_version: int | None = None
        self._report_errors: collections.deque[FailedReport] = collections.deque(
            maxlen=self.REPORT_ERRORS_KEPT
        )
        self._free_buffers: list[dict[str, torch.Tensor]] = []
        self._closed = False
        # One orchestrator: a new job queues behind the one it cancelled, so at most one
        # export ever writes, and a cancelled job's buffers are free before they are reused.
        self._orchestrator = ThreadPoolExecutor(1, thread_name_prefix="hf-export")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="hf-export-shard")

    # -- the trainer's side ----------------------------------------------------------------

    def export(
        self,
        version: int,
        weights: Weights,
        *,
        config: Any = None,
        generation_config: Any = None,
        tokenizer: Any = None,
        pinned: bool = False,
        dtype: torch.dtype | _Unset | None = UNSET,
        max_shard_size: int | str | None = None,
        canary: Canary | None = None,
    ) -> ExportHandle:
        """Stage ``weights`` (the caller may change them as soon as this returns) and write
        them in the background as ``<root>/step-<version>``.

        For weights held outside a transformers model (gathered from FSDP or Megatron
        shards). What this path cannot know, the caller must give: tensor names already in
        the hub layout; for tied tensors (sharing storage) the first name given is kept, so
        give the canonical one first (the embedding before ``lm_head``); ``architectures``
        comes from ``config``, which is refused without it. ``dtype`` in ``config.json`` is
        set to the dtype of the first floating tensor on disk. ``dtype`` and
        ``max_shard_size`` override the exporter's for this export (``dtype=None`` keeps
        each tensor's own). ``canary``: the trainer's answer on these weights
        (``canary.of_model``), recorded in the manifest for admission."""
        export_dtype = self._dtype_for(dtype)
        shard_size = self._shard_size_for(max_shard_size)

        def configs(tensors: list[tuple[str, torch.Tensor]]) -> tuple[str | None, str | None]:
            on_disk = export_dtype or hf_layout.first_floating_dtype(tensors)
            cfg = (
                None
                if config is None
                else hf_layout.config_json(config, dtype=on_disk, architectures=None)
            )
            return cfg, hf_layout.generation_config_json(None, generation_config)

        return self._submit(
            version,
            lambda: (weights, {}),
            configs,
            tokenizer,
            pinned,
            export_dtype,
            shard_size,
            _checked(canary),
        )

    def export_model(
        self,
        version: int,
        model: Any,
        *,
        tokenizer: Any = None,
        generation_config: Any = None,
        pinned: bool = False,
        dtype: torch.dtype | _Unset | None = UNSET,
        max_shard_size: int | str | None = None,
        canary: Canary | None = None,
    ) -> ExportHandle:
        """Export a transformers model as ``save_pretrained`` would write it: tensors under
        their hub names (transformers' load-time conversions reverted), each tied group
        once under the model's canonical name (its other names recorded as aliases, which
        ``load_checkpoint`` restores), ``config.json`` with ``architectures`` and the
        ``dtype`` on disk, and ``generation_config.json`` (``generation_config``, else the
        model's own). The model and its config are not changed. For a model sharded by
        FSDP or tensor parallelism, gather the full weights and use ``export``. ``canary``:
        as for ``export``."""
        export_dtype = self._dtype_for(dtype)
        shard_size = self._shard_size_for(max_shard_size)
        if not callable(getattr(model, "state_dict", None)) or not hasattr(model, "config"):
            raise BadExportInput(
                f"export_model needs a transformers model, got {type(model).__name__}"
            )

        def configs(_tensors: list[tuple[str, torch.Tensor]]) -> tuple[str | None, str | None]:
            cfg = hf_layout.config_json(
                model.config,
                dtype=export_dtype or hf_layout.model_dtype(model),
                architectures=[hf_layout.architecture_of(model)],
            )
            return cfg, hf_layout.generation_config_json(model, generation_config)

        return self._submit(
            version,
            lambda: hf_layout.hub_weights(model),
            configs,
            tokenizer,
            pinned,
            export_dtype,
            shard_size,
            _checked(canary),
        )

    def _shard_size_for(self, max_shard_size: int | str | None) -> int:
        return self.max_shard_size if max_shard_size is None else parse_size(max_shard_size)

    def _dtype_for(self, dtype: torch.dtype | _Unset | None) -> torch.dtype | None:
        if dtype is UNSET:
            return self.dtype
        _check_dtype(dtype)
        return dtype

    def _submit(
        self,
        version: int,
        weights_of: Callable[[], tuple[Weights, dict[str, str]]],
        configs: Callable[[list[tuple[str, torch.Tensor]]], tuple[str | None, str | None]],
        tokenizer: Any,
        pinned: bool,
        dtype: torch.dtype | None,
        max_shard_size: int,
        canary: Canary | None,
    ) -> ExportHandle:
        if type(version) is not int or version < 0:
            raise BadExportInput(f"version must be an int >= 0, got {version!r}")
        with self._lock:
            self._check_order(version)  # before staging, so a refusal costs no copy
        with self._staging_slot() as buffers:
            try:
                weights, tied = weights_of()
                tensors, aliases = _stage(weights, buffers)
                # export_model's tied names, which hub_weights left out of the weights.
                aliases |= {a: aliases.get(t, t) for a, t in tied.items() if a not in aliases}
                config_json, gen_json = configs(tensors)
            except BaseException:
                self._give_back(buffers)
                raise
            handle = ExportHandle(version, Future(), threading.Event())
            job = _Job(version, tensors, aliases, buffers, config_json, gen_json, tokenizer,
                       handle, dtype, max_shard_size, canary)  # fmt: skip
            with self._lock:
                try:
                    self._check_order(version)  # again: another thread may have exported
                except BadExportInput:
                    self._give_back_locked(buffers)
                    raise
                previous, self._current = self._current, job
                last, self._last_version = self._last_version, version
            try:
                self._send(ev.ExportStarted, version=version, pinned=pinned)
            except BaseException as err:
                # The controller never heard of this export: it must not run, and the one
                # it would have replaced goes on as if this call had not happened.
                with self._lock:
                    if self._current is job:
                        self._current, self._last_version = previous, last
                self._finish(job, error=err)
                raise
            if previous is not None:
                previous.handle.cancel()
            self._orchestrator.submit(self._run, job)
        return handle

    def reserve(self, weights: Weights) -> None:
        """Allocate one set of staging buffers for weights shaped like these, and touch it.

        A fresh exporter's first export otherwise pays for new host memory inside the
        trainer's stall. Call it at start-up, outside the training step. (An export that
        starts while the previous one still writes needs a second set.)"""
        with self._staging_slot() as buffers:
            try:
                _stage(weights, buffers)
            finally:
                self._give_back(buffers)

    def _check_order(self, version: int) -> None:
        if self._last_version is not None and version <= self._last_version:
            raise BadExportInput(
                f"versions must increase: got {version} after {self._last_version}"
            )

    @contextlib.contextmanager
    def _staging_slot(self) -> Iterator[dict[str, torch.Tensor]]:
        """A free buffer set, with this thread counted as staging until the block ends."""
        me = threading.get_ident()
        with self._lock:
            if self._closed:
                raise ExporterClosed(
                    "the exporter is closed: a closed exporter takes no export (close() flushes "
                    "the one in flight; to wait for an export, use the handle export() returned)"
                )
            buffers = self._take_buffers()
            self._staging[me] += 1
        try:
            yield buffers
        finally:
            with self._lock:
                self._staging[me] -= 1
                if not self._staging[me]:
                    del self._staging[me]
                self._staged.notify_all()

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def cancel(self, version: int) -> bool:
        """Cancel the export of ``version`` if it is the one in flight (the CancelExport
        effect's executor). Returns whether there was one to cancel."""
        with self._lock:
            job = self._current
        if job is None or job.version != version or job.handle.done():
            return False
        job.handle.cancel()
        return True

    def cancel_current(self) -> bool:
        """Cancel whatever export is in flight (a runtime a resume replaced writes nothing
        more into the run's checkpoint root). Returns whether there was one."""
        with self._lock:
            job = self._current
        if job is None or job.handle.done():
            return False
        job.handle.cancel()
        return True

    def close(self, *, cancel: bool = False) -> None:
        """Flush: wait for the export in flight to commit (or cancel it first)."""
        me = threading.get_ident()
        with self._lock:
            self._closed = True
            # A report callback that closes from inside export() must not wait for itself.
            self._staged.wait_for(lambda: not set(self._staging) - {me})
            job = self._current
        if cancel and job is not None:
            job.handle.cancel()
        self._orchestrator.shutdown(wait=True)
        self._writers.shutdown(wait=True)

    @property
    def report_errors(self) -> tuple[FailedReport, ...]:
        """The writer thread's ``report`` calls that raised, oldest first (the latest
        ``REPORT_ERRORS_KEPT``). One for an outcome lands shortly after its handle resolves:
        ``close()`` first to see them all."""
        with self._lock:
            return tuple(self._report_errors)

    def __enter__(self) -> AsyncHFExporter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the background side ---------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        tmp = self.store.temp_path(job.version)
        final = self.store.path_for(job.version)
        try:
            self._check(job)
            if final.exists():
                raise FileExistsError(f"{final} already exists")
            tmp.mkdir()
            self._write(job, tmp)
            self._check(job)
            os.rename(tmp, final)
            if self._fsync:
                fsync_dir(self.store.root)
        except ExportCancelledError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            self._finish(job, error=err)
            self._send_outcome(ev.ExportCancelled, job.version)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            self._finish(job, error=err)
            self._send_outcome(ev.ExportFailed, job.version, error=f"{type(err).__name__}: {err}")
        else:
            self._finish(job, result=final)
            self._send_outcome(ev.ExportCommitted, job.version, path=str(final))

    def _finish(
        self, job: _Job, *, result: Path | None = None, error: BaseException | None = None
    ) -> None:
        job.tensors = []
        self._give_back(job.buffers)
        # A traceback that outlives the job (in its future, in report_errors) holds the job
        # through its frames: it must not also hold a buffer set that was not kept for reuse.
        job.buffers = {}
        job.tokenizer = None
        with self._lock:
            if self._current is job:
                self._current = None
        if error is not None:
            job.handle.future.set_exception(error)
        else:
            assert result is not None
            job.handle.future.set_result(result)

    def _check(self, job: _Job) -> None:
        if job.handle._cancel.is_set() or job.abort.is_set():
            raise ExportCancelledError(f"export of version {job.version} was cancelled")

    def _write(self, job: _Job, tmp: Path) -> dict[str, Any]:
        tensors = [(n, _convert(t, job.dtype)) for n, t in job.tensors]
        shards = _plan_shards(tensors, job.max_shard_size)
        names = (
            [SINGLE_FILE]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        futures: list[Future[Any]] = []  # the WrittenFile of each shard
        try:
            for name, shard in zip(names, shards, strict=True):
                futures.append(
                    self._writers.submit(
                        write_file,
                        tmp / name,
                        shard,
                        hash_name=self.hash_name,
                        check=lambda: self._check(job),
                        opener=self._opener,
                        fsync=self._fsync,
                        writeback=self.writeback,
                    )
                )
        except BaseException:
            # A pool refused work: stop what was already submitted before the caller
            # removes the directory and reuses the buffers those tasks still read.
            job.abort.set()
            wait(futures)
            raise
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            # One writer failed: stop the others and let them finish before the caller
            # removes the directory they write into.
            job.abort.set()
            wait(pending)
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            # The root cause, not the cancellations it caused in the other writers.
            raise next((e for e in errors if not isinstance(e, ExportCancelledError)), errors[0])

        shard_meta: dict[str, dict[str, Any]] = {}
        tensor_meta: dict[str, dict[str, Any]] = {}
        for name, shard, future in zip(names, shards, futures, strict=True):
            written = future.result()
            shard_meta[name] = {"size": written.size, "header_digest": written.header_digest}
            for tname, t in shard:
                tensor_meta[tname] = {
                    "dtype": DTYPE_NAMES[t.dtype],
                    "shape": list(t.shape),
                    "file": name,
                    "digest": written.tensor_digests[tname],
                }
        files: dict[str, dict[str, Any]] = {}
        if len(shards) > 1:
            index = {
                "metadata": {
                    "total_parameters": sum(t.numel() for _, t in tensors),
                    "total_size": sum(nbytes(t) for _, t in tensors),
                },
                "weight_map": {t: meta["file"] for t, meta in sorted(tensor_meta.items())},
            }
            self._write_small(tmp, INDEX_FILE, json.dumps(index, indent=2) + "\n", files)
        if job.config_json is not None:
            self._write_small(tmp, "config.json", job.config_json, files)
        if job.generation_config_json is not None:
            self._write_small(tmp, "generation_config.json", job.generation_config_json, files)
        if job.tokenizer is not None:
            self._check(job)
            before = set(os.listdir(tmp))
            job.tokenizer.save_pretrained(str(tmp))
            for extra in sorted(set(os.listdir(tmp)) - before):
                self._adopt(tmp / extra, files)

        digest = weights_digest(
            [(n, m["dtype"], m["shape"], m["digest"]) for n, m in tensor_meta.items()]
        )
        manifest = {
            "format": FORMAT,
            "version": job.version,
            "hash": self.hash_name,
            "weights_digest": digest,
            "dtype": str(job.dtype).removeprefix("torch.") if job.dtype else None,
            "shards": shard_meta,
            "files": files,
            "tensors": tensor_meta,
            "aliases": job.aliases,
        }
        if job.canary is not None:
            manifest["canary"] = job.canary.to_json()
        # Written last: only a directory holding a manifest can ever be taken as committed.
        self._write_small(tmp, MANIFEST, json.dumps(manifest, indent=1) + "\n", None)
        if self._fsync:
            fsync_dir(tmp)
        return manifest

    def _write_small(
        self, tmp: Path, name: str, text: str, files: dict[str, dict[str, Any]] | None
    ) -> None:
        path = tmp / name
        data = text.encode()
        open_ = self._opener or (lambda p: open(p, "xb"))  # noqa: SIM115
        with open_(path) as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        if files is not None:
            h = new_hasher(self.hash_name)
            h.update(data)
            files[name] = {"size": len(data), "digest": h.hexdigest()}

    def _adopt(self, path: Path, files: dict[str, dict[str, Any]]) -> None:
        """Record (and fsync) a file another library wrote into the checkpoint."""
        if not path.is_file():
            raise BadExportInput(f"tokenizer.save_pretrained wrote a directory {path.name}")
        if self._fsync:
            with path.open("rb") as f:
                os.fsync(f.fileno())
        files[path.name] = {
            "size": path.stat().st_size,
            "digest": file_digest(path, self.hash_name),
        }

    def _send(self, cls: type[ev.Event], **fields: Any) -> None:
        if self._report is not None:
            self._report(cls, **fields)

    def _send_outcome(self, cls: type[ev.Event], version: int, **fields: Any) -> None:
        """Report from the writer thread, after the outcome is recorded. An error here could
        reach nobody (the orchestrator's futures are not kept), so it is logged and kept."""
        try:
            self._send(cls, version=version, **fields)
        except BaseException as err:  # even SystemExit: this thread has no caller to stop
            with self._lock:
                self._report_errors.append(FailedReport(cls.__name__, version, err))
            _log.error(
                "report(%s, version=%d) raised in the export writer thread; the export's "
                "own outcome is unaffected, the error is kept in report_errors",
                cls.__name__, version, exc_info=err,
            )  # fmt: skip

    # -- staging buffers -------------------------------------------------------------------

    def _take_buffers(self) -> dict[str, torch.Tensor]:
        return self._free_buffers.pop() if self._free_buffers else {}

    def _give_back(self, buffers: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._give_back_locked(buffers)

    def _give_back_locked(self, buffers: dict[str, torch.Tensor]) -> None:
        if len(self._free_buffers) < 2:
            self._free_buffers.append(buffers)


def _checked(canary: object) -> Canary | None:
    if canary is not None and not isinstance(canary, Canary):
        raise BadExportInput(
            f"canary must be a recovery_fsm.export.canary.Canary (canary.of_model(model)), "
            f"got {type(canary).__name__}"
        )
    return canary


def _check_dtype(dtype: Any) -> None:
    ok = isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES and dtype.is_floating_point
    if dtype is not None and not ok:
        raise BadExportInput(
            f"dtype must be None or a floating torch dtype safetensors holds, got {dtype!r}"
        )


def _stage(
    weights: Weights, buffers: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Copy every tensor into host buffers (reused when shape, dtype and pinning match);
    tensors sharing storage (tied weights) are staged once and recorded as aliases.

    ``buffers`` (a free set) changes only on success: ``weights`` may be a one-pass iterator
    of tensors gathered one at a time, so a bad item can show up after others were copied.
    """
    items = weights.items() if isinstance(weights, Mapping) else weights
    try:
        iterator = iter(items)
    except TypeError:
        raise BadExportInput(
            f"weights must be a state dict or an iterable of (name, tensor) pairs, "
            f"got {type(weights).__name__}"
        ) from None
    staged: list[tuple[str, torch.Tensor]] = []
    used: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    names: set[str] = set()
    cuda_devices: set[torch.device] = set()
    try:
        for item in iterator:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise BadExportInput(f"expected (name, tensor) pairs, got {item!r:.80}")
            name, t = item
            if not isinstance(name, str) or not name:
                raise BadExportInput(f"tensor names must be non-empty strings, got {name!r}")
            if name in names:
                raise BadExportInput(f"tensor {name!r} appears twice")
            if not isinstance(t, torch.Tensor):
                raise BadExportInput(f"{name!r} is a {type(t).__name__}, expected a torch.Tensor")
            if t.layout != torch.strided or t.device.type == "meta":
                raise BadExportInput(
                    f"{name!r} is a {t.layout} tensor on {t.device}: cannot export"
                )
            if t.dtype not in DTYPE_NAMES:
                raise BadExportInput(f"{name!r} has dtype {t.dtype}, which safetensors cannot hold")
            names.add(name)
            t = t.detach()
            if t.numel() > 0:
                key = hf_layout.storage_key(t)
                if key in seen:
                    aliases[name] = seen[key]
                    continue
                seen[key] = name
            buf = buffers.get(name)
            if (
                buf is None
                or buf.shape != t.shape
                or buf.dtype != t.dtype
                or buf.is_pinned() != t.is_cuda
            ):
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda:
                cuda_devices.add(t.device)
            used[name] = buf
            staged.append((name, buf))
    finally:
        # Each device's copies were queued on its own stream: wait for every one of them,
        # also on failure, before any of these buffers can be handed out again.
        for device in cuda_devices:
            torch.cuda.synchronize(device)
    if not staged:
        raise BadExportInput("weights hold no tensors to export")
    buffers.clear()
    buffers.update(used)
    return staged, aliases


def _convert(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def _plan_shards(
    tensors: list[tuple[str, torch.Tensor]], limit: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy in order, as transformers does: a new shard when the next tensor would not fit."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = nbytes(t)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards
