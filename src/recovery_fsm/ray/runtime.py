"""The Ray runtime: the parts that carry out the controller's decisions, and their lifetimes.

``RecoveryRuntime`` composes and owns; each part gets only what it uses:

- ``ActorTable`` (``actors.py``): which actors run each group's current process;
  ``Launcher`` starts and calls them and returns ``Booted``/``BootFailed``;
- ``SafetyCounters`` (``safety.py``): loads of deleted paths, loads in place, paths in use
  and the reporter's tallies, read as one ``SafetySnapshot``;
- ``Reporter`` (``reporter.py``): one send policy for every outcome, and the fail-stop
  latch that the first ``ControllerBroken`` trips;
- ``EffectRunner`` (``runner.py``): executes effects; ``HealthMonitor`` (``monitor.py``):
  detects death and hangs and sends ``Tick``; ``TrafficRouter`` (``router.py``): sends
  requests only where the routing effects say.

Lock order (a lock may be taken while holding the ones to its left, never the reverse):
link (``ControllerLink._lock``) -> controller -> journal sink (ledger). The table, the
counters, the router, the runner and the fail-stop latch hold leaf locks: nothing is called
while holding them (effects run, outcomes are reported and listeners are called outside).

After fail-stop the runner runs nothing more, the monitor stops, and every trainer call
(``start``, ``push``, ``sync``, ``synced``, ``generate``) raises ``ControllerStopped``, which
names the journal to rebuild from. ``close`` still kills the actors and closes the journal.

Ray must be initialised by the caller (``ray.init``); nothing here addresses another host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import ray
import torch

from .. import (
    ExporterClosed,
    Fenced,
    RecoveryConfig,
    RecoveryController,
    RecoveryError,
    Rules,
)
from .. import events as ev
from ..export import AsyncHFExporter, CheckpointStore, ExportHandle, model_digest
from ..export.canary import Canary
from ..export.canary import of_model as canary_of
from ..host import ControllerLink, ControllerQueries, EffectError, Link
from ..journal import JournalHeld, JournalOwner, JsonlJournal
from ..journal.ledger import PATHS, Ledger
from . import admission
from . import resume as resuming
from .actors import ActorTable, BootFailed, Launcher, kill
from .engine import Generation, ReferenceEngine
from .hosting import RemoteController, RemoteLink
from .monitor import HealthMonitor
from .placement import SharedRootError, check_shared_root
from .reporter import FailStop, Reporter
from .resume import BadRuntimeInput, Resumption, Takeover
from .rollouts import IN_FLIGHT_MODES, Policy, PromptSamples, RolloutClient, RolloutCounters
from .router import NoServingGroup, NotServing, TrafficRouter, UserRouter
from .runner import EffectRunner
from .safety import SafetyCounters, SafetySnapshot
from .sampling import Sampling

log = logging.getLogger(__name__)

Router = UserRouter

__all__ = [
    "AlreadyStarted",
    "BadRuntimeInput",
    "NoServingGroup",
    "NotServing",
    "RecoveryRuntime",
    "Resumption",
    "SharedRootError",
    "Statistics",
    "VersionNotAbove",
    "check_shared_root",
]


class AlreadyStarted(RecoveryError):
    """``start`` was called on a runtime that already started (or closed)."""


class VersionNotAbove(RecoveryError, ValueError):
    """A push or sync of a version not above the fleet's; nothing was pushed."""


@attrs.frozen
class Statistics:
    """What the runtime saw, for a trainer's metrics (a snapshot; plain values). Failures,
    recoveries and latencies are the ledger's (the same numbers as ``hooks.metrics()``)."""

    failures: int  # failures in the journal (deaths, hangs, deadlines, failed starts)
    recoveries: Mapping[str, int]  # per path: "immediate", "waited", "cold" (see ledger)
    latency_s: Mapping[str, tuple[float, ...]]  # from the failure to admitted, per path
    effects_in_flight: int  # starts and deletes queued or running
    failed_effects: int  # executions that raised or failed for good, kept for retry_failed
    safety: SafetySnapshot
    rollouts: RolloutCounters = attrs.field(factory=RolloutCounters)

    @property
    def refused_reports(self) -> int:
        return self.safety.refused_reports

    @property
    def lost_reports(self) -> int:
        return self.safety.lost_reports

    @property
    def loads_from_deleted(self) -> int:
        return self.safety.loads_from_deleted


class RecoveryRuntime:
    """Everything between the controller and the Ray actors, with one owner of every lifetime.

    ``groups`` names the worker groups; each is ``actors_per_group`` actors of ``engine``
    (the reference engine by default) built from ``model_config`` (a dict, or a transformers
    config) and restarted together. ``router`` receives every routing effect.
    ``controller_actor``: a ``RecoveryControllerActor`` that hosts the controller (and its
    journal) in its own process; by default it lives here, with ``rules``.
    ``check_versions``: a serving engine whose probe answers an older weight version than the
    controller believes has failed. A trainer that pushes through its own transport (not
    ``push``) must set each engine's version in that push, or turn this off.
    ``standby``: warm standby engines kept booted beside the groups (sets the config's
    ``standby``), placed with the same ``actor_options``. ``standby_push``: each sync pushes
    to the standbys too, so they are current at once (the push's cost per standby); False:
    they load each recovery checkpoint in place when it commits (a disk read per standby,
    current only from the commit on). ``in_flight``: what a sync does to rollout calls in
    flight, ``"wait"`` for them (within ``push_timeout_s``) or ``"abort"`` them (they are
    issued again at the new version); either way no new call starts until the sync ends.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        groups: Iterable[str],
        model_config: Mapping[str, Any] | Any,
        config: RecoveryConfig | None = None,
        engine: type = ReferenceEngine,
        actors_per_group: int = 1,
        actor_options: Mapping[str, Any] | None = None,
        journal: str | Path | None = None,
        router: Router | None = None,
        tick_s: float = 1.0,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 2.0,
        grace_s: float = 5.0,
        call_timeout_s: float = 120.0,
        push_timeout_s: float = 30.0,
        check_versions: bool = True,
        report_timeout_s: float = 10.0,
        max_parallel: int | None = None,
        delete_attempts: int = 5,
        initial_version: int = 0,
        exporter_options: Mapping[str, Any] | None = None,
        controller_actor: Any = None,
        rules: type[Rules] = Rules,
        standby: int | None = None,
        standby_push: bool = True,
        run: str | None = None,
        in_flight: str = "wait",
        takeover: Takeover | None = None,
    ) -> None:
        self.groups = list(groups)
        self.model_config = _config_dict(model_config)
        self.config = config or RecoveryConfig()
        if standby is not None:
            if type(standby) is not int or standby < 0:
                raise BadRuntimeInput(f"standby must be an int >= 0, got {standby!r}")
            self.config = attrs.evolve(self.config, standby=standby)
        if not isinstance(standby_push, bool):
            raise BadRuntimeInput(f"standby_push must be a bool, got {standby_push!r}")
        self.standby_push = standby_push
        if in_flight not in IN_FLIGHT_MODES:
            raise BadRuntimeInput(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        self.in_flight = in_flight
        # What the latest pushed version should show at admission: (version, digest, canary).
        self._pushed: tuple[int, str | None, Canary] | None = None
        self._push_evidence: tuple[int, str] | None = None  # what the last push checked
        self.initial_version = initial_version
        self.call_timeout_s = call_timeout_s
        self.push_timeout_s = push_timeout_s
        self.takeover = takeover
        self.epoch = 1 if takeover is None else takeover.epoch  # what every engine call carries
        self._journal = None if journal is None else _journal_for(journal, takeover)
        self.ledger = Ledger()  # every record the controller journals, folded
        for record in () if takeover is None else takeover.records:
            self.ledger.add(record)  # the run's failures and recoveries so far
        self.store = CheckpointStore(root)

        # Before the controller: its journal sink feeds the router's admissions from step 0.
        self.actors_table = ActorTable()
        self.router = TrafficRouter(self.actors_table, call_timeout_s=call_timeout_s, user=router)
        self.failstop = FailStop(None)  # before the controller: its journal sink reads it
        self.controller: ControllerQueries
        self.link: Link
        self.runner: EffectRunner  # set below: the link's executor needs it
        if takeover is not None and takeover.controller is not None:
            # resume: the rebuilt controller goes on writing its journal
            local = takeover.controller
            self.config = local.config
            local.continue_journal(self._record, takeover.after_step)
            self.controller = local
            self.link = ControllerLink(local, execute=self._execute)
            journal_path = None if journal is None else str(journal)
        elif controller_actor is None:
            local = RecoveryController(
                self.config, initial_version=initial_version, journal=self._record, rules=rules
            )
            self.controller = local
            self.link = ControllerLink(local, execute=self._execute)
            journal_path = None if journal is None else str(journal)
        else:  # hosted by a RecoveryControllerActor, which keeps its own journal
            remote = RemoteController(controller_actor)
            self.controller = remote
            self.link = RemoteLink(controller_actor, execute=self._execute,
                                   timeout_s=report_timeout_s)  # fmt: skip
            journal_path = remote.journal_path()

        self.failstop.journal = journal_path
        self.counters = SafetyCounters()
        self.reporter = Reporter(self.link, self.counters, self.failstop)
        self.launcher = Launcher(
            self.actors_table, engine, self.model_config, actors_per_group=actors_per_group,
            actor_options={"num_cpus": 0.1, **(actor_options or {})},
            call_timeout_s=call_timeout_s, run=run,
        )  # fmt: skip
        self.launcher.epoch = self.epoch
        vocab = self.model_config.get("vocab_size")
        self.rollouts = RolloutClient(
            self.actors_table, lambda: self.router.routes, self.router.admission,
            certified=controller_actor is None, vocab_size=vocab if type(vocab) is int else None,
            epoch=lambda: self.launcher.epoch,
        )  # fmt: skip
        self.exporter = AsyncHFExporter(
            self.store, report=self.reporter.send, **(exporter_options or {})
        )
        # One lane per group and one per checkpoint: a hung load never holds another group's.
        self.runner = EffectRunner(
            launcher=self.launcher, reporter=self.reporter, counters=self.counters,
            router=self.router, store=self.store, cancel_export=self.exporter.cancel,
            max_parallel=max_parallel or len(self.groups) + self.config.standby + 1,
            delete_attempts=delete_attempts, expected=self._expected,
        )  # fmt: skip
        self.monitor = HealthMonitor(
            reporter=self.reporter, controller=self.controller, table=self.actors_table,
            tick_s=tick_s, probe_interval_s=probe_interval_s, probe_timeout_s=probe_timeout_s,
            grace_s=grace_s, check_versions=check_versions,
            watch_standbys=self.config.standby > 0,
        )  # fmt: skip
        self.failstop.on_trip(self.runner.halt)
        self.failstop.on_trip(lambda: self.monitor.stop(timeout=0))
        self.failstop.on_trip(self._if_fenced)
        self._started = takeover is not None  # a resume's runtime runs the fleet it found
        self._closed = False
        self._lifetime = threading.Lock()

    # -- the trainer's side ------------------------------------------------------------------

    @classmethod
    def resume(
        cls,
        root: str | Path,
        *,
        run: str,
        version: int,
        journal: str | Path | None,
        from_store: bool = False,
        pinned: Collection[int] = (),
        discover_timeout_s: float = 30.0,
        settle_timeout_s: float = 300.0,
        **options: Any,
    ) -> tuple[RecoveryRuntime, Resumption]:
        """Take over a named ``run`` after the trainer's restart at ``version`` (its own
        checkpoint's). The controller is rebuilt from ``journal`` (an unfinished last line is
        cut and reported), the run's engines that survived are found in its namespace, and
        ``Resumed`` decides: a process holding ``version`` serves again without a reboot, one
        holding another loads C(v) in place (or waits for the next push), a missing one
        restarts; a surviving standby is asked likewise (kept current, or loads C(v); no
        boot), orphans are killed, the future's checkpoints deleted. Returns once every
        group and standby answered and came to rest (serving, or waiting for a push), traffic
        reaches those serving and those checkpoints are gone (or ``settle_timeout_s``
        passed). ``options``: the constructor's (groups, model_config, engine, ...).

        ``from_store=True`` (the journal lost with a node's disk, never flushed) rebuilds the
        controller from the checkpoint store instead, and journals afresh to ``journal`` if a
        path is given (only once ``Resumed`` was sent: a crash before leaves no journal that
        a second resume would trust). Nothing of the run's history is known then: each
        group's newest surviving process is taken as its incarnation 1 (standbys are killed
        and booted again), C(v) as the recovery
        source, ``pinned`` as the versions the trainer pinned (C(v) stays pinned; older ones
        stay on disk, the trainer's to delete), and every other committed checkpoint is
        deleted; restart budgets start full. It is never chosen for you: a journal missing
        by mistake must not delete checkpoints it had pinned."""
        path, pins = resuming.checked_arguments(version, from_store, pinned, journal, options)
        if from_store and options.get("controller_actor") is not None:
            raise BadRuntimeInput("resume runs the controller in this process: no controller_actor")
        if from_store:
            log.warning("resuming from the checkpoint store %s: the history is not known", root)
        # Written beside the journal, moved there once Resumed is in it: a resume that dies
        # before leaves no journal a second resume would trust.
        staging = None if path is None or not from_store else path.with_name(
            path.name + ".resuming")  # fmt: skip
        if staging is not None:
            staging.unlink(missing_ok=True)  # a resume that died before it finished
        if from_store:  # the controller starts at the trainer's version, told the rest
            takeover = resuming.from_store(path)
            options = {**options, "initial_version": version}
        else:
            assert path is not None  # checked_arguments: a resume reads the run's journal
            takeover = resuming.from_journal(path, version)
        try:
            rt = cls(root, run=run, journal=staging or path, takeover=takeover, **options)
        except BaseException:
            if takeover.owner is not None:
                takeover.owner.close()
            raise
        try:
            found = resuming.take_over(
                rt, version, discover_timeout_s, settle_timeout_s,
                store_pins=pins if from_store else None,
                published=(lambda: rt._publish(path)) if staging is not None else None,
            )  # fmt: skip
        except BaseException:
            rt.close(drain_timeout_s=5.0)
            if staging is not None:
                staging.unlink(missing_ok=True)  # not published: nobody resumes from it
            raise
        return rt, found

    def _if_fenced(self) -> None:
        """Replaced by a resume: the export in flight writes nothing more into the root."""
        stopped = self.failstop.error
        if stopped is not None and isinstance(stopped.first, Fenced):
            self.exporter.cancel_current()

    def _publish(self, path: Path | None) -> None:
        """A journal written while resuming from the store is complete: move it in place."""
        if path is not None and self._journal is not None:
            self._journal.move(path)
            self.failstop.journal = str(path)

    def start(self, model: Any) -> None:
        """Boot every group with ``model``'s weights (``initial_version``), then watch."""
        with self._lifetime:
            if self._started or self._closed:
                raise AlreadyStarted(
                    "this runtime was started already"
                    + (" and closed" if self._closed else "")
                    + ": start() boots the fleet once; make a new RecoveryRuntime to start over"
                )
            self._started = True
        self.failstop.check()
        version = self.initial_version
        check_shared_root(self.store.root, self.launcher.actor_options)
        weights = ray.put(_cpu_state(model))
        digest = model_digest(model)
        expected = canary_of(model)
        # A registered group's first process is incarnation 1 (the controller's count). The
        # groups boot at once; they register one by one, in order.
        epoch = self.launcher.epoch
        with ThreadPoolExecutor(len(self.groups) or 1) as pool:
            booted = list(pool.map(
                lambda g: self.launcher.boot(g, 1, lambda a: a.boot_empty.remote(epoch=epoch)),
                self.groups,
            ))  # fmt: skip
        for g, outcome in zip(self.groups, booted, strict=True):
            if isinstance(outcome, BootFailed):
                raise RuntimeError(f"group {g} did not boot: {outcome.reason}")
            pushed = self.launcher.call_all(
                g, 1, lambda a: a.update_weights.remote(version, weights, epoch=self.launcher.epoch)
            )
            why = (
                pushed.reason
                if isinstance(pushed, BootFailed)
                else admission.refusal(self.launcher, g, 1, pushed, digest=digest, canary=expected)
            )
            if why is not None:
                raise RuntimeError(f"group {g} did not take the initial weights: {why}")
            self.reporter.send(
                ev.GroupRegistered,
                group=g,
                version=version,
                evidence=admission.evidence(self.launcher, digest, expected),
            )
            if self.controller.incarnation(g) != 1:
                raise RuntimeError(f"the controller numbered {g}'s first process otherwise")
        self.monitor.start()

    def sync(self, model: Any, version: int) -> dict[str, int]:
        """A weight sync to ``version``: ``push``, then ``synced`` (report and export).
        Returns the incarnations that took ``version``."""
        self.failstop.check()
        if self.exporter.closed:  # before anything is pushed or reported
            raise ExporterClosed(f"sync({version}) after the runtime's exporter was closed")
        expected = canary_of(model)  # once for the push and the export
        self.rollouts.gate.hold()  # no rollout call starts until the routes say the version
        try:
            got = self.push(model, version, canary=expected)
            self.synced(version, got, model, canary=expected)
        finally:
            self.rollouts.gate.release()
        return got

    def push(self, model: Any, version: int, *, canary: Canary | None = None) -> dict[str, int]:
        """Push ``model``'s weights to every up group through the object store (one
        ``ray.put`` shared by all) and return the incarnations that took them: each actor
        answered within ``push_timeout_s`` (one bound for the whole push, however many groups
        die or hang), reports the trainer's digest where its engine computes one, and answers
        the canary as the trainer's model does (``canary``: computed here if not given).
        Reports nothing: a trainer with its own push skips this."""
        self.failstop.check()
        fleet = self.controller.version
        if type(version) is not int or version <= fleet:
            raise VersionNotAbove(
                f"push of version {version!r}: it must be an int above the fleet's version "
                f"{fleet}; nothing was pushed"
            )
        weights = ray.put(_cpu_state(model))
        digest = model_digest(model) if self.launcher.computes_digest else None
        expected = canary if canary is not None else canary_of(model)
        loads_before = self.counters.loads_in_place_by_group()  # before the snapshot of who is up
        up = self.controller.up_groups()
        if self.standby_push and self.config.standby:
            up |= dict.fromkeys(self.controller.up_standbys(), 1)
        prompt, n = list(expected.prompt), len(expected.answer.tokens)
        deadline = time.monotonic() + self.push_timeout_s
        self.rollouts.gate.hold()
        try:
            # Rollout calls in flight end first (waited for, or aborted and issued again):
            # a push queued behind a batch would otherwise wait for all of it. Bounded by
            # the push's own deadline; what still runs then is waited for by the engine.
            if not self.rollouts.gate.drain(self.in_flight, self.push_timeout_s / 2):
                log.warning("push of %d: rollout calls still in flight after %.1f s",
                            version, self.push_timeout_s / 2)  # fmt: skip
            answered = self._push_round(up, version, weights, prompt, n, deadline)
        except Fenced as err:  # a resume replaced this run: its engines refused the push
            raise self.failstop.trip(err) from err
        finally:
            self.rollouts.gate.release()
        loads_after = self.counters.loads_in_place_by_group()
        got: dict[str, int] = {}
        for (g, inc), answers in answered.items():
            why = (
                answers
                if isinstance(answers, str)
                else admission.push_refusal(expected, digest, answers)
            )
            if why is not None:
                log.warning("weight push of %d to %s#%d refused: %s", version, g, inc, why)
            elif loads_after.get(g, 0) != loads_before.get(g, 0):
                # A load in place may have replaced these weights since.
                log.info("push of %d to %s#%d overlapped a load in place: not reported",
                         version, g, inc)  # fmt: skip
            else:
                got[g] = inc
        self._pushed = (version, digest, expected)
        self._push_evidence = (version, admission.evidence(self.launcher, digest, expected))
        return got

    def _push_round(
        self,
        up: Mapping[str, int],
        version: int,
        weights: Any,
        prompt: list[int],
        n: int,
        deadline: float,
    ) -> dict[tuple[str, int], tuple[Any, ...] | str]:
        """Each actor's canary is asked right behind its update (an actor runs its calls in
        order), so both answers come back in one round under the push's one deadline."""
        epoch = self.launcher.epoch
        return _answers(
            {(g, inc): [ref for a in self.actors_table.of(g, inc)
                        for ref in (a.update_weights.remote(version, weights, epoch=epoch),
                                    a.canary.remote(prompt, n))]
             for g, inc in up.items() if self.actors_table.of(g, inc)},
            deadline,
        )  # fmt: skip

    def synced(
        self,
        version: int,
        groups: Mapping[str, int],
        model: Any,
        *,
        pinned: bool = False,
        config: Any = None,
        tokenizer: Any = None,
        canary: Canary | None = None,
    ) -> ExportHandle:
        """Report that ``groups`` (name -> incarnation) took ``version``, then export it as
        its recovery checkpoint (``pinned``: never deleted; ``tokenizer``: saved beside it).
        ``model`` is a transformers model, or full weights in the hub layout (gathered from
        FSDP or Megatron shards) with their ``config`` and ``canary``
        (``export.canary.of_model`` on the full model: what admission compares engines with;
        a model's own is computed here unless given)."""
        self.failstop.check()
        if self.exporter.closed:
            raise ExporterClosed(f"synced({version}) after the runtime's exporter was closed")
        # Sent directly: a refusal (an unknown group, a version not above the fleet's) is
        # the trainer's mistake and reaches it, before anything is exported.
        checked = self._push_evidence
        evidence = checked[1] if checked is not None and checked[0] == version else ""
        effects = self.reporter.send(ev.WeightsSynced, version=version, groups=dict(groups),
                                     evidence=evidence)  # fmt: skip
        self.router.advance(version, groups)
        # A group this sync brought back serves when the call returns: its routing runs on
        # the link's thread, behind what was queued before it (a slow user router delays it).
        if not self.router.wait_routed(effects, self.call_timeout_s):
            log.warning("synced(%d): routing not applied in %.0f s", version, self.call_timeout_s)
        if isinstance(model, Mapping):
            if canary is None and not self.launcher.computes_digest:
                log.warning(
                    "synced(%d) with full weights and no canary: the engines compute no digest, "
                    "so every restart from this checkpoint will be refused (pass canary=)",
                    version,
                )
            return self.exporter.export(
                version, model, config=config, pinned=pinned, tokenizer=tokenizer, canary=canary
            )
        return self.exporter.export_model(
            version, model, pinned=pinned, tokenizer=tokenizer,
            canary=canary if canary is not None else canary_of(model),
        )  # fmt: skip

    def pin(self, version: int) -> None:
        """Keep checkpoint ``version`` on disk (its trainer checkpoint is kept too)."""
        self.failstop.check()
        self.reporter.send(ev.CheckpointPinned, version=version)

    def unpin(self, version: int) -> None:
        """Let checkpoint ``version`` go (its trainer checkpoint was rotated out): it is
        deleted once it is no recovery source and no start reads it. A refusal (unknown, or
        not pinned) reaches the caller and changes nothing."""
        self.failstop.check()
        self.reporter.send(ev.CheckpointUnpinned, version=version)

    def _expected(self, version: int) -> tuple[str | None, Canary | None] | None:
        """What an engine holding ``version`` should show at admission: the push's record, or
        the manifest of that version's checkpoint if it is on disk."""
        pushed = self._pushed
        if pushed is not None and pushed[0] == version:
            return pushed[1], pushed[2]
        path = self.store.path_for(version)
        if path.is_dir():
            manifest = self.store.read_manifest(path)
            return manifest["weights_digest"], admission.manifest_canary(manifest)
        return None

    def generate(self, group: str, prompt: list[int], max_new_tokens: int = 8) -> Generation:
        """Generate on ``group``, which must be serving (``NotServing`` otherwise)."""
        self.failstop.check()
        return self.router.generate(prompt, max_new_tokens, group=group)

    def rollout(
        self,
        prompts: list[list[int]],
        sampling: Sampling | None = None,
        policy: Policy | None = None,
    ) -> list[PromptSamples]:
        """Sample every prompt (token ids) ``sampling.n`` times on the serving groups, in
        batches, and return each prompt's samples with their tokens, log-probabilities,
        finish reasons and certificates; a call on a process that dies or hangs is issued
        again under ``policy`` (``RolloutFailed`` names the prompts it could not answer).
        Blocks; from an asyncio loop, await ``arollout``. See ``rollouts.py``."""
        self.failstop.check()
        return self.rollouts.run(prompts, sampling or Sampling(), policy or Policy())

    async def arollout(
        self,
        prompts: list[list[int]],
        sampling: Sampling | None = None,
        policy: Policy | None = None,
    ) -> list[PromptSamples]:
        """``rollout`` on the caller's asyncio loop: many calls may be in flight at once."""
        self.failstop.check()
        return await self.rollouts.arun(prompts, sampling or Sampling(), policy or Policy())

    def raise_if_stopped(self) -> None:
        """Raise ``ControllerStopped`` once the controller broke (for the trainer hooks)."""
        self.failstop.check()

    @property
    def routes(self) -> dict[str, tuple[int, int] | None]:
        """Group -> (incarnation, version) it serves, or None while it does not."""
        return self.router.routes

    def kill(self, group: str) -> int:
        """Chaos: kill the group's current process through Ray (as a crash would); returns
        the incarnation killed."""
        inc = self.controller.incarnation(group)
        kill(self.actors_table.of(group, inc))
        return inc

    def actors(self, group: str, incarnation: int | None = None) -> list[Any]:
        """The actor handles of a group's process (default: its current incarnation); empty
        once that process was stopped."""
        inc = self.controller.incarnation(group) if incarnation is None else incarnation
        return self.actors_table.of(group, inc)

    @property
    def errors(self) -> tuple[EffectError, ...]:
        """Effects whose execution failed, from every executor (the link's dispatcher and
        the runner's lanes), kept until ``retry_failed``."""
        return self.link.errors + self.runner.errors

    def retry_failed(self) -> int:
        """Execute every kept failed effect again; returns how many. After fail-stop it
        raises ``ControllerStopped``: nothing runs any more, and the effects stay kept."""
        self.failstop.check()
        return self.link.retry_failed() + self.runner.retry_failed()

    def statistics(self) -> Statistics:
        latency = {p: tuple(self.ledger.latencies(p)) for p in PATHS}
        return Statistics(
            self.ledger.failures,
            {p: n for p, n in self.ledger.recovered.items() if n},
            {p: v for p, v in latency.items() if v},
            self.runner.in_flight,
            len(self.errors),
            self.counters.snapshot(),
            self.rollouts.snapshot(),
        )

    def bookkeeping(self) -> dict[str, int]:
        """The size of every structure the runtime keeps per group, path or process (they
        stay bounded over a long run)."""
        return {
            **{f"actors.{k}": v for k, v in self.actors_table.sizes().items()},
            **{f"safety.{k}": v for k, v in self.counters.sizes().items()},
            **{f"monitor.{k}": v for k, v in self.monitor.sizes().items()},
            **{f"runner.{k}": v for k, v in self.runner.sizes().items()},
            **{f"router.{k}": v for k, v in self.router.sizes().items()},
        }

    def wait_drained(self, timeout: float) -> bool:
        """Wait until the controller has nothing outstanding (after ``Shutdown``)."""
        return self.reporter.wait(lambda: self.controller.drained, timeout)

    def close(self, *, drain_timeout_s: float = 60.0) -> bool:
        """Stop in order: monitor, exporter (cancel), Shutdown, drain, link, runner, actors,
        journal. Returns whether the controller drained in time (False after fail-stop). A
        runtime a resume replaced (``Fenced``) kills nothing: its engines are the new run's."""
        with self._lifetime:
            if self._closed:
                return self.failstop.error is None and self.controller.drained
            self._closed = True
        drained = False
        try:
            self.monitor.stop()
            self.runner.resume()  # a paused runner runs what it holds: the drain needs it
            self.exporter.close(cancel=True)  # an export in flight now would be stale at once
            if self.failstop.error is None:
                # A controller actor that stops answering must not keep the rest open: every
                # step below runs whatever the one before it raised.
                try:
                    if not self.controller.closed:
                        self.reporter.report(ev.Shutdown)
                    # Shutdown stops every process; what is owed (a load's outcome, a
                    # delete) arrives from the runner meanwhile.
                    drained = self.wait_drained(drain_timeout_s)
                except Exception:
                    log.exception("the controller did not answer while closing: not drained")
            try:
                self.link.close(timeout=drain_timeout_s)
            finally:
                self.runner.close(timeout=drain_timeout_s)
        finally:
            left = self.actors_table.close()
            stopped = self.failstop.error
            if stopped is not None and isinstance(stopped.first, Fenced):
                log.warning("closing a runtime a resume replaced: its %d engines are the new "
                            "run's, left running", len(left))  # fmt: skip
            else:
                kill(left)
            if self._journal is not None:
                self._journal.close()
        return drained

    def __enter__(self) -> RecoveryRuntime:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- wiring ------------------------------------------------------------------------------

    def _execute(self, effect: Any) -> None:
        self.runner.execute(effect)

    def _record(self, record: dict[str, Any]) -> None:
        """The controller's journal sink: the file (only while this run owns it), then the
        ledger and the router's admissions (they cannot fail)."""
        try:
            if self._journal is not None:
                self._journal(record)
        except Fenced as err:  # a resume replaced this run: stop before any effect runs
            self.failstop.trip(err)
            raise
        finally:
            if self.failstop.error is None:
                self.ledger.add(record)
                self.router.note(record)


def _journal_for(journal: str | Path, takeover: Takeover | None) -> JsonlJournal:
    """The journal file, written only while this run's epoch owns it: a resume claimed it
    already; a new run takes epoch 1, on a journal that holds no run (else it would mix two)."""
    if takeover is not None:
        return JsonlJournal(journal, owner=takeover.owner, epoch=takeover.epoch)
    path = Path(journal)
    if path.is_file() and path.stat().st_size:
        holder = JournalOwner(path)
        try:
            who = holder.holder()
        finally:
            holder.close()
        raise JournalHeld(
            f"the journal {path} holds a run already"
            + (f" (held by epoch {who['epoch']}, pid {who.get('pid')} on {who.get('host')})"
               if who.get("epoch") else "")
            + ": resume it (RecoveryRuntime.resume), or give this run a journal of its own"
        )  # fmt: skip
    owner = JournalOwner(path)
    try:
        owner.claim(1, fresh=True)
    except BaseException:
        owner.close()
        raise
    return JsonlJournal(path, owner=owner, epoch=1)


def _config_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return dict(model_config)
    to_dict = getattr(model_config, "to_dict", None)
    if callable(to_dict):  # a transformers PretrainedConfig
        out = to_dict()
        if isinstance(out, Mapping):
            return dict(out)
    raise BadRuntimeInput(
        f"model_config must be a mapping (config.to_dict()) or a transformers config, got "
        f"{type(model_config).__name__}"
    )


def _answers(
    calls: Mapping[tuple[str, int], list[Any]], deadline: float
) -> dict[tuple[str, int], tuple[Any, ...] | str]:
    """Every process's answers to its calls, or why there are none, waiting until
    ``deadline`` at most (a dead or hung process costs no more than that)."""
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
                raise  # an engine serves a newer run: this runtime must stop, not count it
            except Exception as err:
                out[key] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return out


def _cpu_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
