"""The Ray runtime: the parts that carry out the controller's decisions, and their lifetimes.

``RecoveryRuntime`` composes and owns; each part gets only what it uses: the ``ActorTable``
and ``Launcher`` (``actors.py``: which actors run each process, starting and calling them,
each call carrying the run's epoch); ``SafetyCounters`` (``safety.py``); the ``Reporter``
and its fail-stop latch (``reporter.py``); ``Weights`` (``weights.py``: the first boot,
pushes, exports); the ``EffectRunner`` (``runner.py``), the ``HealthMonitor``
(``monitor.py``), the ``TrafficRouter`` (``router.py``) and the ``RolloutClient``
(``rollouts.py``). A resume opens it from a ``Takeover`` (``resume.py``); what a trainer
reads of it is in ``views.py``.

Lock order (a lock may be taken while holding the ones to its left, never the reverse):
link (``ControllerLink._lock``) -> controller -> journal sink (ledger). The table, the
counters, the router, the runner and the fail-stop latch hold leaf locks: nothing is called
while holding them (effects run, outcomes are reported and listeners are called outside).

After fail-stop the runner runs nothing more, the monitor stops, and every trainer call
raises ``ControllerStopped``, which names the journal to rebuild from; ``close`` still kills
the actors and closes the journal. Replaced by a resume (``Fenced``), it kills nothing.

Ray must be initialised by the caller (``ray.init``); nothing here addresses another host.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import (
    ExporterClosed,
    Fenced,
    RecoveryConfig,
    RecoveryController,
    Rules,
)
from .. import events as ev
from ..export import AsyncHFExporter, CheckpointStore, ExportHandle
from ..export.canary import Canary
from ..export.canary import of_model as canary_of
from ..host import ControllerQueries, Link
from ..journal.ledger import Ledger
from . import resume as resuming
from .actors import ActorTable, Launcher, config_dict, kill
from .engine import Generation, ReferenceEngine
from .errors import AlreadyStarted, BadRuntimeInput, VersionNotAbove, checked_options
from .hosting import host_controller
from .monitor import HealthMonitor
from .placement import SharedRootError, check_shared_root
from .reporter import FailStop, Reporter
from .resume import Resumption, Takeover, open_journal
from .rollouts import Policy, PromptSamples, RolloutClient
from .router import NoServingGroup, NotServing, TrafficRouter, UserRouter
from .runner import EffectRunner
from .safety import SafetyCounters
from .sampling import Sampling
from .statistics import Statistics
from .views import RuntimeViews
from .weights import Weights

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


class RecoveryRuntime(RuntimeViews):
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
    ``tokenizer``: saved beside every recovery checkpoint; the HTTP front's by default.
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
        tokenizer: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.groups = list(groups)
        self.model_config = config_dict(model_config)
        self.config = checked_options(config or RecoveryConfig(), standby, standby_push,
                                      in_flight)  # fmt: skip
        self.initial_version = initial_version
        self.call_timeout_s = call_timeout_s
        self.push_timeout_s = push_timeout_s
        self.takeover = takeover
        self.epoch = 1 if takeover is None else takeover.epoch  # what every engine call carries
        self._journal = None if journal is None else open_journal(journal, takeover)
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
        rebuilt = None if takeover is None else takeover.controller
        if rebuilt is not None:
            self.config = rebuilt.config  # the run's, as its journal recorded it
        self.controller, self.link, journal_path = host_controller(
            rebuilt, controller_actor,
            lambda: RecoveryController(self.config, initial_version=initial_version,
                                       journal=self._record, rules=rules),
            journal=self._record, after_step=0 if takeover is None else takeover.after_step,
            execute=self._execute, report_timeout_s=report_timeout_s,
        )  # fmt: skip
        if journal_path is None and journal is not None:  # else the controller actor's own
            journal_path = str(journal)
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
        self.weights = Weights(
            launcher=self.launcher, table=self.actors_table, store=self.store,
            controller=self.controller, counters=self.counters, gate=self.rollouts.gate,
            push_timeout_s=push_timeout_s, in_flight=in_flight,
            push_to_standbys=standby_push and self.config.standby > 0,
        )  # fmt: skip
        self.exporter = AsyncHFExporter(
            self.store, report=self.reporter.send, **(exporter_options or {})
        )
        # One lane per group and one per checkpoint: a hung load never holds another group's.
        self.runner = EffectRunner(
            launcher=self.launcher, reporter=self.reporter, counters=self.counters,
            router=self.router, store=self.store, cancel_export=self.exporter.cancel,
            max_parallel=max_parallel or len(self.groups) + self.config.standby + 1,
            delete_attempts=delete_attempts, expected=lambda v: self.weights.expected(v),
        )  # fmt: skip
        self.monitor = HealthMonitor(
            reporter=self.reporter, controller=self.controller, table=self.actors_table,
            tick_s=tick_s, probe_interval_s=probe_interval_s, probe_timeout_s=probe_timeout_s,
            grace_s=grace_s, check_versions=check_versions,
            watch_standbys=self.config.standby > 0,
        )  # fmt: skip
        self.failstop.on_trip(self.runner.halt)
        self.failstop.on_trip(lambda: self.monitor.stop(timeout=0))
        # Replaced by a resume: the export in flight writes nothing more into the root.
        self.failstop.on_trip(lambda: self.fenced and self.exporter.cancel_current())
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
        checkpoint's), as the run's next epoch: the journal's owner file and every engine
        found learn it, so the runtime it replaces (dead, or not) can no longer act. The
        controller is rebuilt from ``journal`` (an unfinished last line is cut), the run's
        engines are found in its namespace, and ``Resumed`` reports them: the rules keep a
        process that answered (it serves again if it holds ``version``, else loads C(v) in
        place or waits for a push), recover a group whose process is gone or mute, stop
        every other, and delete the future's checkpoints. Returns once every group and
        standby came to rest and traffic reaches those serving (or ``settle_timeout_s``
        passed). ``options``: the constructor's (groups, model_config, engine, ...).

        ``from_store=True`` (the journal was lost with a node's disk) rebuilds from the
        checkpoint store instead and journals afresh to ``journal`` once ``Resumed`` is in
        it. Nothing of the history is known: a group's newest surviving process becomes its
        incarnation 1, C(v) the recovery source, ``pinned`` the versions kept (older ones
        stay on disk); every other committed checkpoint is deleted and restart budgets
        start full. Never chosen for you: a journal missing by mistake must not delete
        checkpoints it had pinned. See ``resume.py`` for the order of the steps."""
        return resuming.resume(cls, root, run, version, journal, from_store, pinned,
                               discover_timeout_s, settle_timeout_s, options)  # fmt: skip

    def publish_journal(self, path: Path | None) -> None:
        """A journal written while resuming from the store is complete: move it in place."""
        if path is not None and self._journal is not None:
            self._journal.move(path)
            self.failstop.journal = str(path)

    def start(self, model: Any) -> None:
        """Boot every group with ``model``'s weights (``initial_version``), then watch.
        Returns once every group serves; standbys boot after: ``wait_ready`` waits for them."""
        with self._lifetime:
            if self._started or self._closed:
                closed = " and closed" if self._closed else ""
                raise AlreadyStarted(f"this runtime was started already{closed}: start() boots"
                                     " the fleet once; make a new RecoveryRuntime")  # fmt: skip
            self._started = True
        self.failstop.check()
        check_shared_root(self.store.root, self.launcher.actor_options)
        routes: list[Any] = []

        def register(group: str, evidence: str) -> None:
            routes.extend(self.reporter.send(ev.GroupRegistered, group=group, evidence=evidence,
                                             version=self.initial_version))  # fmt: skip
            if self.controller.incarnation(group) != 1:
                raise RuntimeError(f"the controller numbered {group}'s first process otherwise")

        self.weights.boot(self.groups, self.initial_version, model, register)
        self.monitor.start()
        if not self.router.wait_routed(routes, self.call_timeout_s):  # as synced waits
            log.warning("start: routing not applied in %.0f s", self.call_timeout_s)

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
        try:
            return self.weights.push(model, version, canary)
        except Fenced as err:  # a resume replaced this run: its engines refused the push
            raise self.failstop.trip(err) from err

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
        its recovery checkpoint (``pinned``: never deleted; ``tokenizer``: saved with it).
        ``model`` is a transformers model, or full weights in the hub layout (gathered from
        FSDP or Megatron shards) with their ``config`` and ``canary`` (``canary.of_model`` on
        the full model: what admission compares engines with; computed here for a model)."""
        self.failstop.check()
        if self.exporter.closed:
            raise ExporterClosed(f"synced({version}) after the runtime's exporter was closed")
        # Sent directly: a refusal (an unknown group, a version not above the fleet's) is
        # the trainer's mistake and reaches it, before anything is exported.
        effects = self.reporter.send(ev.WeightsSynced, version=version, groups=dict(groups),
                                     evidence=self.weights.evidence(version))  # fmt: skip
        self.router.advance(version, groups)
        # A group this sync brought back serves when the call returns: its routing runs on
        # the link's thread, behind what was queued before it (a slow user router delays it).
        if not self.router.wait_routed(effects, self.call_timeout_s):
            log.warning("synced(%d): routing not applied in %.0f s", version, self.call_timeout_s)
        tok = self.tokenizer if tokenizer is None else tokenizer
        return self.weights.export(self.exporter, version, model, pinned=pinned, config=config,
                                   tokenizer=tok, canary=canary)  # fmt: skip

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

    def generate(self, group: str, prompt: list[int], max_new_tokens: int = 8) -> Generation:
        """Generate on ``group``, which must be serving (``NotServing`` otherwise)."""
        self.failstop.check()
        return self.router.generate(prompt, max_new_tokens, group=group)

    def rollout(self, prompts: list[list[int]], sampling: Sampling | None = None,
                policy: Policy | None = None) -> list[PromptSamples]:  # fmt: skip
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
            if self.fenced:
                log.warning("closing a runtime a resume replaced: its %d engines are the new "
                            "run's, left running", len(left))  # fmt: skip
            else:
                kill(left)
                self.actors_table.wait_gone(left, timeout_s=30.0)  # nothing of them remains
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
