"""The trainer's weights on their way to the engines: the first boot, every push under one
bound, and what each pushed version must show when an engine holding it is admitted.

Every call carries the run's epoch; an engine that serves a newer run refuses it
(``Fenced``), which ends the push at once: the runtime that sent it was replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from ..errors import Fenced
from ..export import AsyncHFExporter, CheckpointStore, ExportHandle, model_digest
from ..export.canary import Canary
from ..export.canary import of_model as canary_of
from ..host import ControllerQueries
from . import admission
from .actors import ActorTable, BootFailed, Launcher
from .causes import cause_of
from .errors import StartFailed
from .rollouts import SyncGate
from .safety import SafetyCounters

log = logging.getLogger(__name__)


class Weights:
    """Pushes for one runtime, and the record of the last one (its digest and canary are
    what a standby that took it is admitted against; its evidence goes to the journal)."""

    def __init__(
        self,
        *,
        launcher: Launcher,
        table: ActorTable,
        store: CheckpointStore,
        controller: ControllerQueries,
        counters: SafetyCounters,
        gate: SyncGate,
        push_timeout_s: float,
        in_flight: str,
        push_to_standbys: bool,
    ) -> None:
        self._launcher = launcher
        self._table = table
        self._store = store
        self._controller = controller
        self._counters = counters
        self._gate = gate
        self.push_timeout_s = push_timeout_s
        self._in_flight = in_flight
        self._to_standbys = push_to_standbys
        # What the latest pushed version should show at admission: (version, digest, canary).
        self._pushed: tuple[int, str | None, Canary] | None = None
        self._evidence: tuple[int, str] | None = None  # what the last push checked

    def boot(
        self, groups: list[str], version: int, model: Any, register: Callable[[str, str], None]
    ) -> None:
        """Boot every group at once, push ``model`` (``version``) to each and admit it; then
        ``register(group, evidence)`` one by one, in order (incarnation 1 each)."""
        weights = ray.put(cpu_state(model))
        digest = model_digest(model)
        expected = canary_of(model)
        epoch = self._launcher.epoch
        with ThreadPoolExecutor(len(groups) or 1) as pool:
            booted = list(pool.map(
                lambda g: self._launcher.boot(g, 1, lambda a: a.boot_empty.remote(epoch=epoch)),
                groups,
            ))  # fmt: skip
        for g, outcome in zip(groups, booted, strict=True):
            if isinstance(outcome, BootFailed):
                raise StartFailed(f"group {g} did not boot: {outcome.reason}")
            pushed = self._launcher.call_all(
                g, 1, lambda a: a.update_weights.remote(version, weights, epoch=epoch)
            )
            why = (
                pushed.reason
                if isinstance(pushed, BootFailed)
                else admission.refusal(
                    self._launcher, g, 1, pushed, digest=digest, canary=expected
                )
            )
            if why is not None:
                raise StartFailed(f"group {g} did not take the initial weights: {why}")
            register(g, admission.evidence(self._launcher, digest, expected))

    def push(self, model: Any, version: int, canary: Canary | None) -> dict[str, int]:
        """Push to every up group (and standby, if they take pushes) and return the
        incarnations that took it and passed admission. Rollout calls in flight end first
        (waited for, or aborted), within half of the push's bound."""
        weights = ray.put(cpu_state(model))
        digest = model_digest(model) if self._launcher.computes_digest else None
        expected = canary if canary is not None else canary_of(model)
        loads_before = self._counters.loads_in_place_by_group()  # before who is up is read
        up = self._controller.up_groups()
        if self._to_standbys:
            up |= dict.fromkeys(self._controller.up_standbys(), 1)
        deadline = time.monotonic() + self.push_timeout_s
        # Known from the first tensor on: a claim checked during the round may find a
        # standby this push already reached, and is checked against this record.
        self._pushed = (version, digest, expected)
        self._gate.hold()
        try:
            # A push queued behind a batch would otherwise wait for all of it; what still
            # runs after the drain's bound is waited for by the engine.
            if not self._gate.drain(self._in_flight, self.push_timeout_s / 2):
                log.warning("push of %d: rollout calls still in flight after %.1f s",
                            version, self.push_timeout_s / 2)  # fmt: skip
            answered = self._round(up, version, weights, expected, deadline)
        finally:
            self._gate.release()
        loads_after = self._counters.loads_in_place_by_group()
        got: dict[str, int] = {}
        for (g, inc), answers in answered.items():
            why = (
                answers
                if isinstance(answers, str)
                else admission.push_refusal(expected, digest, answers)
            )
            if isinstance(why, admission.Refusal):
                self._counters.admission_refused(why.kind)
            if why is not None:
                log.warning("weight push of %d to %s#%d refused: %s", version, g, inc, why)
            elif loads_after.get(g, 0) != loads_before.get(g, 0):
                # A load in place may have replaced these weights since.
                log.info("push of %d to %s#%d overlapped a load in place: not reported",
                         version, g, inc)  # fmt: skip
            else:
                got[g] = inc
        self._pushed = (version, digest, expected)
        self._evidence = (version, admission.evidence(self._launcher, digest, expected))
        return got

    def _round(
        self, up: Mapping[str, int], version: int, weights: Any, canary: Canary, deadline: float
    ) -> dict[tuple[str, int], tuple[Any, ...] | str]:
        """Each actor's canary is asked right behind its update (an actor runs its calls in
        order), so both answers come back in one round under the push's one deadline."""
        epoch = self._launcher.epoch
        prompt, n = list(canary.prompt), len(canary.answer.tokens)
        return answers(
            {(g, inc): [ref for a in self._table.of(g, inc)
                        for ref in (a.update_weights.remote(version, weights, epoch=epoch),
                                    a.canary.remote(prompt, n))]
             for g, inc in up.items() if self._table.of(g, inc)},
            deadline,
        )  # fmt: skip

    def export(
        self,
        exporter: AsyncHFExporter,
        version: int,
        model: Any,
        *,
        pinned: bool,
        config: Any,
        tokenizer: Any,
        canary: Canary | None,
    ) -> ExportHandle:
        """Export ``version`` as its recovery checkpoint: a transformers model, or full
        weights in the hub layout with their ``config`` (and ``canary``, else computed)."""
        if isinstance(model, Mapping):
            if canary is None and not self._launcher.computes_digest:
                log.warning(
                    "synced(%d) with full weights and no canary: the engines compute no digest, "
                    "so every restart from this checkpoint will be refused (pass canary=)",
                    version,
                )
            return exporter.export(
                version, model, config=config, pinned=pinned, tokenizer=tokenizer, canary=canary
            )
        return exporter.export_model(
            version, model, pinned=pinned, tokenizer=tokenizer,
            canary=canary if canary is not None else canary_of(model),
        )  # fmt: skip

    def evidence(self, version: int) -> str:
        """What the push of ``version`` checked (empty: it was not pushed here)."""
        checked = self._evidence
        return checked[1] if checked is not None and checked[0] == version else ""

    def expected(self, version: int) -> tuple[str | None, Canary | None] | None:
        """What an engine holding ``version`` should show at admission: the push's record, or
        the manifest of that version's checkpoint if it is on disk."""
        pushed = self._pushed
        if pushed is not None and pushed[0] == version:
            return pushed[1], pushed[2]
        path = self._store.path_for(version)
        if path.is_dir():
            manifest = self._store.read_manifest(path)
            return manifest["weights_digest"], admission.manifest_canary(manifest)
        return None


def answers(
    calls: Mapping[tuple[str, int], list[Any]], deadline: float
) -> dict[tuple[str, int], tuple[Any, ...] | str]:
    """Every process's answers to its calls, or why there are none, waiting until
    ``deadline`` at most (a dead or hung process costs no more than that). An engine that
    serves a newer run (``Fenced``) ends it: the caller was replaced."""
    every = [r for refs in calls.values() for r in refs]
    timeout = max(0.0, deadline - time.monotonic())
    done, _ = ray.wait(every, num_returns=len(every), timeout=timeout) if every else ([], [])
    finished = set(done)
    out: dict[tuple[str, int], tuple[Any, ...] | str] = {}
    for key, refs in calls.items():
        if not refs:
            out[key] = "no actors (stopped meanwhile)"
        elif not all(r in finished for r in refs):
            out[key] = f"no answer within the push's bound ({timeout:.1f} s)"
        else:
            try:
                out[key] = tuple(ray.get(refs, timeout=0))
            except Fenced:
                raise
            except Exception as err:
                out[key] = cause_of(err)
    return out


def cpu_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
