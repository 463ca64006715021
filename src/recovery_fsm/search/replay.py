"""Replay a journal through a fresh controller, checking every step.

After each replayed event: the controller's invariants and the world model's checks (what
the real system would hold). The first violation is reported with its step. Where the
fresh controller answers differently from the recording (refuses what was accepted, or
asks for other effects), that is reported as a divergence: the journal came from another
controller, or the code changed since.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, cast

import attrs

from ..codec import decode_event, encode
from ..config import RecoveryConfig
from ..controller import JournalSink, RecoveryController
from ..errors import ControllerBroken, MalformedEvent, RecoveryError
from ..journal import read_journal
from ..rules import Rules
from .world import World

REAL = "recovery_fsm.rules:Rules"


@attrs.frozen
class ReplayReport:
    controller: str
    steps: int  # events replayed
    violation_step: int | None = None
    violations: tuple[str, ...] = ()
    divergences: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.violation_step is None and not self.divergences

    def render(self) -> str:
        lines = [f"replayed {self.steps} events through {self.controller}"]
        lines += [f"divergence: {d}" for d in self.divergences]
        if self.violation_step is None:
            lines.append("no violation")
        else:
            lines.append(f"step {self.violation_step}: violation")
            lines += [f"  {v}" for v in self.violations]
        return "\n".join(lines)


def rules_class(name: str) -> type[Rules]:
    """``real``, or a rules class by ``module:Class`` (what a journal's header records): the
    real ``recovery_fsm.rules:Rules`` or any other importable one, say a broken variant a
    test wrote. Importing the module runs it: name only modules you trust."""
    if not isinstance(name, str):
        raise MalformedEvent(f"a controller is named by a string, got {name!r:.80}")
    if name in {"real", REAL}:
        return Rules
    module, _, qualname = name.partition(":")
    unknown = f"unknown controller {name!r}; expected 'real' or a rules class as module:Class"
    if not module or not qualname:
        raise MalformedEvent(unknown)
    try:
        found: object = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as err:
        raise MalformedEvent(f"{unknown} ({type(err).__name__}: {err})") from err
    if not (isinstance(found, type) and callable(getattr(found, "apply", None))):
        raise MalformedEvent(f"{unknown} ({name} is not a rules class)")
    return cast("type[Rules]", found)


def _opening(
    path: str | os.PathLike[str], records: list[dict[str, Any]], rules: type[Rules] | None
) -> tuple[RecoveryConfig, int, type[Rules]]:
    """The run a journal's header describes (taken off ``records``), every field checked;
    and every record's shape checked, so that a damaged journal is refused before any of
    it is replayed."""
    header: Any = records.pop(0)["header"] if records and "header" in records[0] else {}
    if not isinstance(header, dict) or not isinstance(header.get("config", {}), dict):
        raise MalformedEvent(f"{path}: the header is not a run's header: {header!r:.120}")
    try:
        config = RecoveryConfig(**header.get("config", {}))
    except TypeError as err:
        raise MalformedEvent(f"{path}: the header's config is not a RecoveryConfig: {err}") from err
    for record in records:
        error = record.get("error", {})
        if not isinstance(error, dict) or not isinstance(error.get("type", ""), str):
            raise MalformedEvent(f"{path}: a record's error is not an error: {record!r:.120}")
        finding = record.get("finding", [])
        if not isinstance(finding, list) or not all(isinstance(f, str) for f in finding):
            raise MalformedEvent(f"{path}: a finding is not a list of texts: {record!r:.120}")
    return config, header.get("initial_version", 0), rules or rules_class(header.get("rules", REAL))


def replay(path: str | os.PathLike[str], rules: type[Rules] | None = None) -> ReplayReport:
    """Replay the run a journal holds (one holding two runs raises ``MixedJournal``, from
    ``read_journal``, before anything is replayed)."""
    records = list(read_journal(path))
    config, initial_version, cls = _opening(path, records, rules)
    c = RecoveryController(config, initial_version=initial_version, rules=cls)
    world = World(config, fleet=c.version)
    divergences: list[str] = []
    steps = 0
    for record in records:
        if "finding" in record:
            # The search's own finding (see Sim._found): it holds if the replay answered
            # the same way as the recording up to here.
            if not divergences:
                found = [f"(recorded by the search) {f}" for f in record["finding"]]
                return _report(cls, steps, record.get("step", steps), found, divergences)
            continue
        if "event" not in record:
            raise MalformedEvent(f"{path}: a record without an event: {record!r:.120}")
        step = record.get("step", steps + 1)
        try:
            event = decode_event(record["event"])
        except MalformedEvent:
            if "error" in record:
                continue  # a refused non-event (say, handle("x")): nothing to replay
            raise
        steps += 1
        try:
            effects = c.handle(event)
        except ControllerBroken as err:
            first = err.first
            crash = f"the controller crashed on {event!r}: {type(first).__name__}: {first}"
            return _report(cls, steps, step, [crash], divergences)
        except RecoveryError as err:
            if "error" not in record:
                divergences.append(f"step {step}: {event.kind} was accepted, now refused: {err}")
            elif record["error"].get("type") != type(err).__name__:
                divergences.append(
                    f"step {step}: {event.kind} was refused with {record['error'].get('type')}, "
                    f"now with {type(err).__name__}: {err}"
                )
            continue
        if "error" in record:
            divergences.append(f"step {step}: {event.kind} was refused, now accepted")
        elif record.get("effects", []) != [encode(f) for f in effects]:
            divergences.append(f"step {step}: {event.kind} now asks for {list(effects)}")
        problems = world.observe(event, effects) + world.check(c) + c.check_invariants()
        if problems:
            return _report(cls, steps, step, problems, divergences)
    return _report(cls, steps, None, [], divergences)


def rebuild(
    path: str | os.PathLike[str],
    *,
    rules: type[Rules] | None = None,
    journal: JournalSink | None = None,
) -> RecoveryController:
    """A fresh controller holding the state a journal recorded, fed every event that really
    happened: the accepted ones, the one that stopped a broken controller, and those a broken
    controller refused unread. Ordinary refusals changed nothing and are skipped, as is any
    event the fresh controller refuses. This is how to go on after ``ControllerBroken``:
    rebuild with fixed ``rules``, look at ``outstanding()``, carry on. A journal with a gap
    (records a failing sink lost) is refused: the state it would give is not the real one;
    so is one holding two runs (``MixedJournal``, from ``read_journal``)."""
    records = list(read_journal(path))
    config, initial_version, cls = _opening(path, records, rules)
    c = RecoveryController(config, initial_version=initial_version, rules=cls, journal=journal)
    for record in records:
        if "lost" in record:
            raise MalformedEvent(
                f"{path}: {record['lost']} records were lost before step {record.get('step')}; "
                "the journal cannot rebuild the controller"
            )
        error = record.get("error", {}).get("type")
        if "event" not in record or (
            error not in {None, "ControllerBroken"} and not record.get("broke")
        ):
            continue
        try:
            c.handle(decode_event(record["event"]))
        except ControllerBroken:
            raise
        except RecoveryError:
            continue  # refused now, so it changes nothing now either
    return c


def _report(
    cls: type[Rules],
    steps: int,
    step: int | None,
    problems: list[str],
    divergences: list[str],
) -> ReplayReport:
    return ReplayReport(cls.__name__, steps, step, tuple(problems), tuple(divergences))
