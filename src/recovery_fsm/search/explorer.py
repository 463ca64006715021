"""Exhaustive small-scope search: every ordering of events and completions up to a depth.

Breadth-first from the initial state over ``Sim.actions()``, on the real controller (each
branch is a ``fork`` of it, not a model of its rules). States with equal keys are visited
once. Because the search is breadth-first, the first violation found has a shortest trace.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import attrs

from ..controller import RecoveryController
from ..rules import Rules
from .sim import Scope, Sim, subject_name


@attrs.frozen
class Exploration:
    depth: int  # the deepest level fully explored (or where the violation was found)
    new_states: tuple[int, ...]  # distinct states first reached at depth 1, 2, ...
    transitions: int  # actions taken in all
    seconds: float
    trace: tuple[str, ...] | None = None  # the shortest counterexample, if any
    violations: tuple[str, ...] = ()
    journal: Path | None = None

    @property
    def states(self) -> int:
        return 1 + sum(self.new_states)

    @property
    def found(self) -> bool:
        return self.trace is not None

    def report(self) -> str:
        lines = [f"depth {d}: {n} new states" for d, n in enumerate(self.new_states, 1)]
        lines.append(
            f"{self.states} distinct states, {self.transitions} transitions, {self.seconds:.2f} s"
        )
        if self.trace is not None:
            lines.append(f"counterexample at depth {len(self.trace)}: " + " -> ".join(self.trace))
            lines += [f"  violation: {v}" for v in self.violations]
            if self.journal is not None:
                lines.append(f"  journal: {self.journal} (recovery-fsm replay {self.journal})")
        return "\n".join(lines)


def explore(
    depth: int = 8,
    scope: Scope | None = None,
    rules: type[Rules] = Rules,
    *,
    liveness: bool = False,
    journal_dir: str | os.PathLike[str] | None = None,
    host: type[RecoveryController] = RecoveryController,
) -> Exploration:
    """Search every ordering up to ``depth`` actions; stop at the first violation.

    With ``liveness``, every new state is also settled fairly (on a fork) and must reach a
    state where every group is active, retired or stopped. ``host`` hosts the rules (see
    ``Sim``).
    """
    started = time.perf_counter()
    root = Sim(scope, rules, host)
    seen = {root.key()}
    frontier = [root]
    new_states: list[int] = []
    transitions = 0
    for level in range(1, depth + 1):
        following: list[Sim] = []
        for sim in frontier:
            actions = sim.actions()
            for i, action in enumerate(actions):
                # The parent is not needed after its last branch: step it instead of a copy.
                child = sim if i == len(actions) - 1 else sim.fork()
                transitions += 1
                problems = child.step(action)
                if not problems:
                    key = child.key()
                    if key in seen:
                        continue
                    seen.add(key)
                    if liveness:
                        probe = child.fork()
                        problems = probe.settle()
                        if problems:
                            child = probe
                if problems:
                    new_states.append(len(following))
                    journal = None
                    if journal_dir is not None:
                        # The scope in the name: searches run side by side do not share a file.
                        world = hashlib.sha256(repr(scope).encode()).hexdigest()[:8]
                        name = f"explore-{subject_name(rules, host)}-{world}.jsonl"
                        journal = child.write_journal(Path(journal_dir) / name)
                    return Exploration(
                        level,
                        tuple(new_states),
                        transitions,
                        time.perf_counter() - started,
                        tuple(child.trace),
                        tuple(problems),
                        journal,
                    )
                following.append(child)
        new_states.append(len(following))
        frontier = following
        if not frontier:
            break
    return Exploration(
        len(new_states), tuple(new_states), transitions, time.perf_counter() - started
    )
