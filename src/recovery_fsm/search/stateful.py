"""Hypothesis rules over the real controller: the trainer, the health manager and the
scheduler that completes pending effects are each a rule, so Hypothesis chooses the
interleaving. Needs ``hypothesis`` (the ``dev`` extra).

    RaceSearch = race_search()                      # the real controller
    TestRaces = RaceSearch.TestCase                 # for pytest / unittest
    run_state_machine_as_test(race_search(MyRules))
    run_state_machine_as_test(race_search(host=MyController))  # a broken hosting
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from ..controller import RecoveryController
from ..rules import Rules
from .sim import SCHEDULER, TRAINER, Action, Scope, Sim, small_config, subject_name
from .world import SpareStatus

# Hypothesis searches a wider world than the explorer: three groups, probes, pins,
# syncs that leave a group out, more versions and failures.
WIDE = Scope(
    groups=("g0", "g1", "g2"),
    max_version=12,
    max_failures=8,
    probes=True,
    pins=True,
    partial_syncs=True,
    late_syncs=True,
    sink_failures=True,
)
# The same world with a pool of one standby (a boot budget of 2, so a pool that keeps
# failing gives up within an example).
WIDE_STANDBY = attrs.evolve(WIDE, config=small_config(standby=1, standby_boot_budget=2))
# The same world with a restart budget that refills: restarts older than 25 s stop counting
# (longer than each deadline, so a budget both empties and refills within an example).
WIDE_WINDOW = attrs.evolve(WIDE, config=small_config(restart_window_s=25.0))
# The standby world where the trainer may crash and resume twice.
WIDE_RESUME = attrs.evolve(WIDE_STANDBY, resumes=2)


def small_standby(size: int = 1) -> Scope:
    """The explorer's world for standbys: one group beside a pool of ``size`` (two boot
    failures exhaust it)."""
    return Scope(groups=("g0",), config=small_config(standby=size, standby_boot_budget=2))


def small_resume() -> Scope:
    """The explorer's world for a trainer's restart: one group beside a standby, a resume
    at most."""
    return attrs.evolve(small_standby(), resumes=1)


def small_window(window_s: float = 25.0) -> Scope:
    """The explorer's world for a refilling budget: one group, its budget of two refilling
    over ``window_s``, failing up to four times."""
    return Scope(groups=("g0",), max_failures=4, config=small_config(restart_window_s=window_s))


# Rules group the actions so the common moves of a race are drawn often and the rest
# still happen: Hypothesis picks among enabled rules evenly. A few rules take a short
# sequence in one go (a training step, a push racing a restart): drawn move by move among
# everything else, those shapes come up on some seeds only, and with them the bugs that
# need them (every broken variant must be found on every seed).
TRAINER_STEPS = frozenset({"sync", "export", "tick"})
EXPORT = frozenset({"export"})
SYNC = frozenset({"sync"})
FAILURES = frozenset({"fail"})
COMPLETIONS = frozenset(
    {
        "commit",
        "loaded",
        "loaded_ahead",
        "loaded_synced",
        "relaunched",
        "deleted",
        "standby_booted",
        "standby_loaded",
        "verified",
        "standby_verified",
    }
)
MISHAPS = frozenset(
    {
        "export_fails",
        "export_cancelled",
        "load_fails",
        "relaunch_fails",
        "killed_dies",
        "standby_boot_fails",
        "standby_load_fails",
        "standby_dies",
        "verify_fails",
        "late_verified",
        "standby_verify_fails",
    }
)
RESUME = frozenset({"resume"})  # every current process found and answering
# A resume that finds one process gone, one mute, or a stray beside them.
FINDINGS = frozenset({"resume_gone", "resume_silent", "resume_stray"})
UNPIN = frozenset({"unpin"})
# A claim's check found the version of a push in flight, or of one whose sync landed since.
AHEAD = frozenset({"loaded_ahead", "loaded_synced"})
PUSHED = frozenset({"loaded_ahead"})  # ... of a push still in flight
PIN = frozenset({"pin"})
STANDBY_UP = frozenset({"standby_booted", "standby_loaded", "standby_verified"})
# "sync" here is a sync before the current version was exported at all.
RARE = frozenset(
    {
        "sync",
        "sync_without",
        "sync_late",
        "export_pinned",
        "pin",
        "shutdown",
        "probe_failed",
        "probe_ok",
        "sink_fails",
    }
)


def _enabled(sim: Sim, kinds: frozenset[str]) -> list[Action]:
    return [a for a in sim.actions() if a.kind in kinds]


def _claim_may_race(sim: Sim, kinds: frozenset[str]) -> bool:
    """A claim's check may report ``kinds`` now, or a death now would claim a standby holding
    the fleet's weights while a next version is still to be pushed."""
    if _enabled(sim, kinds):
        return True
    return sim.world.fleet < sim.scope.max_version and _standby_may_serve(sim)


def _standby_may_serve(sim: Sim) -> bool:
    """A standby holds the fleet's weights, and a group may die now."""
    w = sim.world
    ready = any(s.status == SpareStatus.UP and s.holds == w.fleet for s in w.spares.values())
    return ready and bool(_enabled(sim, FAILURES))


def _deadlines(sim: Sim) -> list[float]:
    """Seconds from now until each running start or wait reaches its deadline."""
    return [d for d in sim.waits() if d >= 0]


class RaceFound(AssertionError):
    """A violation, with the trace that led to it and the journal that replays it."""

    def __init__(self, violations: Sequence[str], trace: Sequence[str], journal: Path | None):
        self.violations = list(violations)
        self.trace = list(trace)
        self.journal = journal
        lines = ["race found:", *(f"  {v}" for v in violations), "after: " + " -> ".join(trace)]
        if journal is not None:
            lines.append(f"journal: {journal}   (recovery-fsm replay {journal})")
        super().__init__("\n".join(lines))


def race_search(
    rules: type[Rules] = Rules,
    scope: Scope = WIDE,
    journal_dir: str | os.PathLike[str] | None = None,
    host: type[RecoveryController] = RecoveryController,
) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class searching races in a controller with ``rules``, hosted
    by ``host``. Each example draws its own N (clean syncs to re-enable), restart budget and
    probe threshold. A failing example is written to ``journal_dir`` as a journal (the
    shrunk one last)."""
    label = subject_name(rules, host)

    class RaceSearch(RuleBasedStateMachine):
        examples = 0  # how many examples ran: the search benchmark reads it

        sim: Sim

        def __init__(self) -> None:
            super().__init__()
            type(self).examples += 1
            self.failed = False

        @initialize(
            n=st.integers(1, 3),
            budget=st.integers(1, 4),
            threshold=st.integers(1, 3),
            warm=st.booleans(),
        )
        def configure(self, n: int, budget: int, threshold: int, warm: bool) -> None:
            """``warm``: the run resumes from a committed checkpoint of its first weights, so
            a failure before the first sync restarts from it rather than cold."""
            config = attrs.evolve(
                scope.config,
                clean_syncs_to_reenable=n,
                restart_budget=budget,
                suspect_threshold=threshold,
            )
            self.sim = Sim(attrs.evolve(scope, config=config), rules, host)
            if warm:
                self._check(self.sim.step(Action(TRAINER, "export")))
                self._check(self.sim.step(Action(SCHEDULER, "commit", self.sim.world.fleet)))

        def _check(self, problems: list[str]) -> None:
            if not problems:
                return
            self.failed = True  # teardown must not bury this finding under another
            journal = None
            if journal_dir is not None:
                name = f"race-{label}.jsonl"
                journal = self.sim.write_journal(Path(journal_dir) / name)
            raise RaceFound(problems, self.sim.trace, journal)

        def _take(self, data: st.DataObject, kinds: frozenset[str]) -> None:
            choice: Action = data.draw(st.sampled_from(_enabled(self.sim, kinds)))
            self._check(self.sim.step(choice))

        def _step_if_enabled(self, action: Action) -> bool:
            if action not in self.sim.actions():
                return False
            self._check(self.sim.step(action))
            return True

        @precondition(lambda self: bool(_enabled(self.sim, TRAINER_STEPS)))
        @rule(data=st.data())
        def trainer(self, data: st.DataObject) -> None:
            """Export the version just synced, else sync the next one or let time pass."""
            self._take(data, EXPORT if _enabled(self.sim, EXPORT) else TRAINER_STEPS)

        @precondition(lambda self: bool(_enabled(self.sim, SYNC)))
        @rule(commit=st.sampled_from([True, True, True, False]))
        def training_step(self, commit: bool) -> None:
            """A whole step of the trainer: export the version it serves, let the export
            land (mostly) or not (a miss), sync the next. Runs of these reach the clean-sync
            streak's corners (a miss while cooling down after some clean syncs), and keep
            immediate recovery enabled often enough for restarts from checkpoints to race."""
            self._step_if_enabled(Action(TRAINER, "export"))
            if commit:  # unless it failed or landed already
                self._step_if_enabled(Action(SCHEDULER, "commit", self.sim.world.fleet))
            self._check(self.sim.step(Action(TRAINER, "sync")))

        @precondition(lambda self: bool(_enabled(self.sim, FAILURES) and _enabled(self.sim, SYNC)))
        @rule(data=st.data(), back_first=st.booleans())
        def push_races_restart(self, data: st.DataObject, back_first: bool) -> None:
            """A group dies while the trainer pushes the next weights: its restart finishes
            before or after the push is reported, and the report names the process the push
            was sent to, the one that died."""
            died: Action = data.draw(st.sampled_from(_enabled(self.sim, FAILURES)))
            self._check(self.sim.step(died))
            assert isinstance(died.target, str)
            group = died.target
            if back_first:
                self._restart_finishes(group)
            if not self._step_if_enabled(Action(TRAINER, "sync_late", group)):
                self._step_if_enabled(Action(TRAINER, "sync"))  # it was the first process
            if not back_first:
                self._restart_finishes(group)

        @precondition(lambda self: _standby_may_serve(self.sim) and bool(_enabled(self.sim, SYNC)))
        @rule(data=st.data())
        def sync_outruns_standbys(self, data: st.DataObject) -> None:
            """A sync lands and a group dies before the standby holding the version before
            has loaded the new one in place: no claim may take it as it is."""
            self._check(self.sim.step(Action(TRAINER, "sync")))
            if _enabled(self.sim, FAILURES):
                self._take(data, FAILURES)

        @precondition(lambda self: bool(_enabled(self.sim, STANDBY_UP)))
        @rule(data=st.data())
        def standby_gets_ready(self, data: st.DataObject) -> None:
            """A standby boots and loads the fleet's weights in one go. Drawn among every
            other completion and mishap, a pool was more often exhausted by failed boots than
            ready when a group died, and the races of a claim came up on some seeds only."""
            action: Action = data.draw(st.sampled_from(_enabled(self.sim, STANDBY_UP)))
            for kind in ("standby_booted", "standby_loaded", "standby_verified"):
                self._step_if_enabled(Action(SCHEDULER, kind, action.target))

        def _restart_finishes(self, group: str) -> None:
            """The group's current start (a load or a cold start), if one runs, succeeds."""
            current = f"{group}#{self.sim.world.procs[group].incarnation}"
            for kind in ("loaded", "relaunched"):
                self._step_if_enabled(Action(SCHEDULER, kind, current))

        def _claim_in_check(self, data: st.DataObject, kinds: frozenset[str]) -> Action | None:
            """A claim whose check may report ``kinds``: one running, or (a standby holding
            the fleet's weights, a next version to push) the claim of a group dying now.
            Drawn move by move, a ready standby, a death and the push come together on some
            seeds only."""
            if not _enabled(self.sim, kinds):
                self._take(data, FAILURES)
            running = _enabled(self.sim, kinds)
            return data.draw(st.sampled_from(running)) if running else None

        def _claim_ahead(self, data: st.DataObject) -> Action | None:
            """The check of such a claim finds the version of the push in flight."""
            action = self._claim_in_check(data, PUSHED)
            if action is not None:
                self._check(self.sim.step(action))
            return action

        @precondition(lambda self: _claim_may_race(self.sim, PUSHED))
        @rule(data=st.data(), listed=st.booleans())
        def push_races_claim(self, data: st.DataObject, listed: bool) -> None:
            """A claimed standby's check finds the version of the push in flight; then the
            sync of that push lands, listing the group or only the standby's old name."""
            action = self._claim_ahead(data)
            if action is None:
                return
            group = None if listed else str(action.target).partition("#")[0]
            if not self._step_if_enabled(
                Action(TRAINER, "sync_without" if group else "sync", group)
            ):
                self._step_if_enabled(Action(TRAINER, "sync"))

        @precondition(lambda self: _claim_may_race(self.sim, PUSHED))
        @rule(data=st.data())
        def claim_outlives_push(self, data: st.DataObject) -> None:
            """A claimed standby's check finds the version of the push in flight, and no sync
            of it lands by the load deadline: its weights are nobody's, and C(v) commits, if
            it can, for the group to load it. A rule of its own: as a draw within the rule
            above it came up on some seeds only."""
            if self._claim_ahead(data) is None:
                return
            self._check(
                self.sim.step(Action(TRAINER, "tick", self.sim.scope.config.deadline("load")))
            )
            self._step_if_enabled(Action(TRAINER, "export"))
            self._step_if_enabled(Action(SCHEDULER, "commit", self.sim.world.fleet))

        @precondition(lambda self: _claim_may_race(self.sim, AHEAD))
        @rule(data=st.data())
        def sync_lands_before_claim_check(self, data: st.DataObject) -> None:
            """The push reached a claimed standby and its sync lands (not listing the claim)
            before the claim's check reports: the check finds the fleet's new version."""
            action = self._claim_in_check(data, AHEAD)
            if action is None:
                return
            # A claim is not up: a plain sync leaves it out too.
            if self._step_if_enabled(Action(TRAINER, "sync")):
                self._step_if_enabled(Action(SCHEDULER, "loaded_synced", action.target))

        @precondition(lambda self: bool(_enabled(self.sim, UNPIN)))
        @rule(data=st.data())
        def trainer_unpins(self, data: st.DataObject) -> None:
            """The trainer rotated out its own checkpoint of a pinned version: it lets the
            recovery checkpoint go (superseded, still the source, or still being written)."""
            self._take(data, UNPIN)

        @precondition(lambda self: bool(_enabled(self.sim, RESUME)))
        @rule(data=st.data())
        def trainer_resumes(self, data: st.DataObject) -> None:
            """The trainer crashed and resumed from its checkpoint (of the fleet's version or
            the one before), with whatever the runtime had in flight."""
            self._take(data, RESUME)

        @precondition(lambda self: bool(_enabled(self.sim, RESUME) and _enabled(self.sim, PIN)))
        @rule(data=st.data())
        def trainer_resumes_with_pins(self, data: st.DataObject) -> None:
            """The user pinned checkpoints (the trainer keeps its own of those steps), a sync
            supersedes them, and the trainer resumes: pins at or below the resumed version
            hold through it."""
            for pin in _enabled(self.sim, PIN):
                self._step_if_enabled(pin)
            self._step_if_enabled(Action(TRAINER, "sync"))
            self._take(data, RESUME)

        @precondition(lambda self: bool(_enabled(self.sim, FINDINGS)))
        @rule(data=st.data())
        def trainer_resumes_with_losses(self, data: st.DataObject) -> None:
            """A resume at the fleet's version that finds one process gone, one mute, or a
            stray beside the rest (a rule of its own: the plain resume keeps its share)."""
            self._take(data, FINDINGS)

        @precondition(
            lambda self: bool(_enabled(self.sim, RESUME) and _enabled(self.sim, FAILURES))
        )
        @rule(data=st.data(), then=st.sampled_from(["late", "tick", "answer"]))
        def crash_during_restart(self, data: st.DataObject, then: str) -> None:
            """Once the current version committed, a group dies and the trainer crashes while
            its restart runs. ``late``: it resumes at the fleet's version, syncs and exports
            the next, and the restarted process answers after its deadline, when it was
            killed. ``tick``: it resumes at the version before and time runs to the deadline.
            ``answer``: it resumes at the version before, the re-run syncs that number again,
            and only then do the processes answer, holding the dead run's."""
            self._step_if_enabled(Action(TRAINER, "export"))  # a restart from C(v) is leased
            self._step_if_enabled(Action(SCHEDULER, "commit", self.sim.world.fleet))
            if _enabled(self.sim, FAILURES):
                self._take(data, FAILURES)
            by_version = sorted(_enabled(self.sim, RESUME), key=lambda a: int(a.target or 0))
            if not by_version:
                return
            self._check(self.sim.step(by_version[-1 if then == "late" else 0]))
            if then != "tick":
                self._step_if_enabled(Action(TRAINER, "sync"))
                self._step_if_enabled(Action(TRAINER, "export"))
            if then == "answer":
                for answer in _enabled(self.sim, frozenset({"verified", "standby_verified"})):
                    self._step_if_enabled(answer)
            else:
                load = self.sim.scope.config.deadline("load")
                self._check(self.sim.step(Action(TRAINER, "tick", load)))
                for late in _enabled(self.sim, frozenset({"late_verified"})):
                    self._step_if_enabled(late)

        @precondition(
            lambda self: (
                self.sim.resumes + 2 <= self.sim.scope.resumes
                and bool(_enabled(self.sim, FAILURES))
            )
        )
        @rule(data=st.data())
        def crash_back_and_forth(self, data: st.DataObject) -> None:
            """Two groups die once C(v) committed (one beyond a standby's claim, so a restart
            reads C(v)), the trainer crashes and resumes at the version before, the re-run
            syncs v again, crashes and resumes at v, and a group dies: the dead run's C(v),
            still read, is not v's weights. A rule of its own (as one branch of the rule
            above, it was drawn too rarely to be found on every seed)."""
            if self.sim.world.fleet == 0:  # a version before to go back to
                self._step_if_enabled(Action(TRAINER, "export"))
                self._step_if_enabled(Action(SCHEDULER, "commit", 0))
                self._step_if_enabled(Action(TRAINER, "sync"))
            self._step_if_enabled(Action(TRAINER, "export"))  # a restart from C(v) is leased
            self._step_if_enabled(Action(SCHEDULER, "commit", self.sim.world.fleet))
            for _ in range(2):
                if _enabled(self.sim, FAILURES):
                    self._take(data, FAILURES)
            for last in (False, True):
                by_version = sorted(_enabled(self.sim, RESUME), key=lambda a: int(a.target or 0))
                if not by_version:
                    return
                self._check(self.sim.step(by_version[-1 if last else 0]))
                if not last:
                    self._step_if_enabled(Action(TRAINER, "sync"))
            if _enabled(self.sim, FAILURES):
                self._take(data, FAILURES)

        @precondition(lambda self: bool(_enabled(self.sim, FAILURES)))
        @rule(data=st.data())
        def group_dies(self, data: st.DataObject) -> None:
            """The health manager reports a group dead (also while it restarts)."""
            self._take(data, FAILURES)

        @precondition(lambda self: bool(_enabled(self.sim, COMPLETIONS)))
        @rule(data=st.data())
        def effect_completes(self, data: st.DataObject) -> None:
            """One pending effect finishes well; the others keep hanging."""
            self._take(data, COMPLETIONS)

        @precondition(lambda self: bool(_enabled(self.sim, MISHAPS)))
        @rule(data=st.data())
        def effect_fails(self, data: st.DataObject) -> None:
            """One pending effect fails or is cancelled."""
            self._take(data, MISHAPS)

        @precondition(lambda self: bool(_enabled(self.sim, RARE)))
        @rule(data=st.data())
        def rarely(self, data: st.DataObject) -> None:
            """Pins, probes, a sync that leaves a group out, shutdown."""
            self._take(data, RARE)

        @rule(index=st.integers(0, 511))
        def wrong_event(self, index: int) -> None:
            """A completion delivered again, a report nobody asked for (or sent to another
            process), or something the trainer must not send: refused, nothing changes. One
            rule for all, so that refusals, always possible, do not crowd out the moves of a
            race."""
            kind, n = index % 4, index // 4
            if kind == 1 and self.sim.delivered:
                self._check(self.sim.duplicate(n))
            elif kind in {2, 3}:
                self._check(self.sim.wrong_report(n, misdirected=kind == 2))
            else:
                self._check(self.sim.misuse(n))

        @precondition(lambda self: bool(_deadlines(self.sim)))
        @rule(data=st.data())
        def start_hangs(self, data: st.DataObject) -> None:
            """Nothing reports until a drawn start (or wait) reaches its deadline: the
            trainer's ticks land only on the earliest one, and a load rarely hangs that long
            when its completion is drawn as often as everything else."""
            seconds: float = data.draw(st.sampled_from(_deadlines(self.sim)))
            self._check(self.sim.step(Action(TRAINER, "tick", seconds)))

        @rule(seconds=st.floats(0.0, 25.0, allow_nan=False))
        def time_passes(self, seconds: float) -> None:
            """Time passes by a drawn amount (the trainer's ticks land on deadlines too)."""
            self._check(self.sim.step(Action(TRAINER, "tick", seconds)))

        def teardown(self) -> None:
            """Liveness from wherever the example ended: failures stop, effects complete
            fairly, and every group must end active, retired or stopped."""
            if not self.failed and hasattr(self, "sim"):
                self._check(self.sim.settle())

    RaceSearch.__name__ = RaceSearch.__qualname__ = f"RaceSearch[{label}]"
    return RaceSearch
