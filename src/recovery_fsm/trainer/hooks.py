"""The trainer's side: four calls at the hook points a trainer already has.

::

    with RecoveryHooks(runtime) as hooks:          # close() runs in a finally
        for step in ...:
            train_step()
            v = step + 1
            hooks.before_weight_sync(v)            # did C(v-1) commit in time?
            groups = push_weights(model, v)        # the trainer's own push, on its own timer
            hooks.after_weight_sync(v, model, groups, hf_save=(v % hf_interval == 0))
            logger.log(hooks.metrics())            # recovery's figures, apart from the sync's

The hooks send events and time themselves; what they measure goes to ``metrics()``, never
into the trainer's sync timer. ``hf_save=True`` makes the recovery export of v the trainer's
Hugging Face save of v as well (it is what ``save_pretrained`` writes): one write instead of
two, pinned so that recovery never deletes it (``rt.unpin`` lets it go).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from .. import RecoveryError, sync_verdict
from ..export import ExportHandle
from ..journal.ledger import Ledger

log = logging.getLogger(__name__)


class HookOrderError(RecoveryError):
    """A hook was called out of order (a trainer bug); nothing was sent or changed."""


class Runtime(Protocol):
    """What the hooks need from a runtime (``recovery_fsm.ray.RecoveryRuntime`` has it)."""

    ledger: Ledger

    def synced(
        self,
        version: int,
        groups: Mapping[str, int],
        model: Any,
        *,
        pinned: bool = False,
        config: Any = None,
        tokenizer: Any = None,
        canary: Any = None,
    ) -> ExportHandle: ...

    def pinned_checkpoints(self) -> Mapping[int, Path]: ...

    def close(self) -> bool: ...

    def raise_if_stopped(self) -> None:
        """Raise ``ControllerStopped`` once the controller broke (fail-stop)."""
        ...


@attrs.frozen
class Closed:
    """What ``close`` did, so nothing in flight is dropped silently."""

    drained: bool  # the controller settled every start and delete it had asked for
    hf_saves: Mapping[int, Path]  # the run's pinned checkpoints that committed (rt.pin too)
    hf_saves_failed: Mapping[int, str]  # pinned exports that did not commit, and why
    export_cancelled: int | None  # the version of an unpinned export still running at close


class RecoveryHooks:
    """Calls a trainer makes around each weight sync, and ``close`` (also as ``with``).

    ``export_wait_s`` lets ``before_weight_sync`` wait that long for the previous export to
    commit (trainer stall, counted in ``metrics``) rather than miss it; 0 never waits.
    ``flush_timeout_s`` bounds how long ``close`` waits for Hugging Face saves still being
    written; one that takes longer is reported as failed, and the runtime is closed anyway.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        export_wait_s: float = 0.0,
        flush_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("export_wait_s", export_wait_s), ("flush_timeout_s", flush_timeout_s)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.flush_timeout_s = float(flush_timeout_s)
        self.runtime = runtime
        self.export_wait_s = float(export_wait_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._announced: int | None = None  # before_weight_sync(v) seen, after not yet
        self._last_version: int | None = None
        self._last: ExportHandle | None = None
        self._hf_saves: dict[int, ExportHandle] = {}
        self._stall_s = 0.0  # the last sync's, before and after the push together
        self._stall_total_s = 0.0
        self._closed: Closed | None = None

    # -- the hook points -----------------------------------------------------------------

    def before_weight_sync(self, version: int) -> str:
        """Call before pushing ``version``. Looks at the previous export in the rules'
        words: ``"clean"`` (it committed), ``"missed"`` (it failed, or is still writing:
        unless it commits before the sync is reported it is abandoned; either way recovery
        cools), or ``"none"``. ``metrics()`` counts what the controller decided."""
        self.runtime.raise_if_stopped()
        with self._lock:
            self._check_open()
            if type(version) is not int or version < 0:
                raise HookOrderError(f"version must be an int >= 0, got {version!r}")
            if self._announced is not None and version < self._announced:
                raise HookOrderError(
                    f"before_weight_sync({version}) while the sync to {self._announced} "
                    "is open: versions must increase"
                )
            if self._announced is not None:  # that push failed: nothing was reported
                log.warning("the sync to %d was never completed", self._announced)
            if self._last_version is not None and version <= self._last_version:
                raise HookOrderError(
                    f"before_weight_sync({version}) after version {self._last_version}: "
                    "versions must increase"
                )
            last = self._last
            self._announced = version
        start = self._clock()
        committed = None
        if last is not None:
            if not last.done() and self.export_wait_s > 0:
                with contextlib.suppress(Exception):  # a timeout: then it is missed
                    last.future.exception(timeout=self.export_wait_s)
            committed = last.done() and last.future.exception() is None
        self._stalled(self._clock() - start, new_sync=True)
        return sync_verdict(committed)

    def after_weight_sync(
        self,
        version: int,
        model: Any,
        groups: Mapping[str, int],
        *,
        hf_save: bool = False,
        config: Any = None,
        tokenizer: Any = None,
        canary: Any = None,
    ) -> ExportHandle:
        """Call once ``groups`` (name -> incarnation) hold ``version``: reports the sync and
        starts the asynchronous export of ``model`` (a transformers model, or full weights in
        the hub layout with their ``config``). With ``hf_save`` that export is also the
        trainer's Hugging Face save of ``version``, pinned until ``rt.unpin``; its handle resolves
        to the directory (``tokenizer``, if given, is saved in it too). Full weights come
        with their ``canary`` (``export.canary.of_model`` on the full model: what engines
        are admitted by; a transformers model's own is computed). A push that failed needs
        no call: the next ``before_weight_sync`` starts over."""
        with self._lock:
            self._check_open()
            if self._announced != version:
                raise HookOrderError(
                    f"after_weight_sync({version}) without before_weight_sync({version})"
                    + (f" (the open sync is to {self._announced})" if self._announced else "")
                )
        self.runtime.raise_if_stopped()
        start = self._clock()
        try:
            extra = {} if canary is None else {"canary": canary}
            handle = self.runtime.synced(
                version, groups, model, pinned=hf_save, config=config, tokenizer=tokenizer,
                **extra,
            )  # fmt: skip
        finally:
            self._stalled(self._clock() - start)
        with self._lock:
            self._announced = None
            self._last_version = version
            self._last = handle
            if hf_save:
                self._hf_saves[version] = handle
        return handle

    def close(self) -> Closed:
        """Flush the Hugging Face saves still being written, then close the runtime
        (monitor, exporter, controller drain, runner, actors, journal). Idempotent."""
        with self._lock:
            if self._closed is not None:
                return self._closed
            last, saves = self._last, dict(self._hf_saves)
        cancelled = None
        saved: dict[int, Path] = {}
        failed: dict[int, str] = {}
        drained = False
        deadline = self._clock() + self.flush_timeout_s
        try:
            for v, handle in saves.items():
                try:  # a kept save is flushed, not cancelled, within flush_timeout_s
                    saved[v] = handle.result(timeout=max(0.0, deadline - self._clock()))
                except Exception as err:
                    failed[v] = f"{type(err).__name__}: {err}"
            if last is not None and not last.done() and last.version not in saves:
                cancelled = last.version
            # The run's saves made before a resume (by the trainer it replaced) too; a
            # controller that does not answer leaves this process's saves only.
            try:
                run_saves = self.runtime.pinned_checkpoints()
            except Exception:
                log.exception("the run's pinned checkpoints could not be read at close")
                run_saves = {}
            saved = {v: p for v, p in run_saves.items() if v not in failed} | saved
        finally:
            drained = self.runtime.close()
            closed = Closed(drained, saved, failed, cancelled)
            with self._lock:
                self._closed = closed
        if failed:
            log.error("Hugging Face saves that did not commit: %s", failed)
        return closed

    def __enter__(self) -> RecoveryHooks:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- what a trainer logs ------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Recovery's own figures as plain floats under ``recovery/``: export stall (the
        trainer's time in these hooks), export duration, recovery latency per path, idle
        group-seconds, cooldown entries, and the syncs by the controller's verdict (the
        ledger's, so ``syncs_missed`` and ``cooldown_entries`` tell one story)."""
        out = self.runtime.ledger.metrics()
        with self._lock:
            out["recovery/export_stall_s"] = self._stall_s
            out["recovery/export_stall_total_s"] = self._stall_total_s
            out["recovery/hf_saves"] = float(len(self._hf_saves))
        return out

    @property
    def hf_saves(self) -> dict[int, ExportHandle]:
        with self._lock:
            return dict(self._hf_saves)

    def _stalled(self, seconds: float, *, new_sync: bool = False) -> None:
        """Add to the stall of this sync (``new_sync``: its first part, before the push)."""
        with self._lock:
            self._stall_s = seconds if new_sync else self._stall_s + seconds
            self._stall_total_s += seconds

    def _check_open(self) -> None:
        if self._closed is not None:
            raise HookOrderError("the hooks are closed")
