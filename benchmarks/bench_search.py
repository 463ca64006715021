"""How fast the race search finds each broken controller, and how big the explored space is.

    .venv/bin/python benchmarks/bench_search.py [--runs 5] [--depth 7]

Per broken rule set: Hypothesis's time and examples to the first failing example (independent
random runs, no shrinking; median and worst over the runs), and the explorer's depth, distinct
states and time to its shortest counterexample. Then the real controller's exhaustive
search: new states per depth. The aims are: every variant found in under 10 s by
Hypothesis and by depth 8 by the explorer. The variants are the tests' source patches of the
rules (``tests/property/variants.py``), loaded the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from recovery_fsm.search import Scope, explore
from recovery_fsm.search.stateful import RaceFound, race_search

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "property"))
from variants import VARIANTS, explored, load, searched  # the tests' module, on the path above


def hypothesis_find(cls: type, budget: int, scope: Scope) -> tuple[float, int] | None:
    machine = race_search(cls, scope)
    config = settings(
        max_examples=budget,
        stateful_step_count=40,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    start = time.perf_counter()
    try:
        run_state_machine_as_test(machine, settings=config)
    except RaceFound:
        return time.perf_counter() - start, machine.examples  # type: ignore[attr-defined]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="independent Hypothesis runs")
    parser.add_argument("--budget", type=int, default=2000, help="examples before giving up")
    parser.add_argument("--depth", type=int, default=7, help="real controller's search depth")
    parser.add_argument(
        "--explorer-depth", type=int, default=8, help="how deep the explorer looks per variant"
    )
    a = parser.parse_args()

    print(f"{'variant':24} {'hypothesis: median s':>21} {'worst s':>8} {'examples':>9}"
          f"   {'explorer: depth':>15} {'states':>7} {'s':>6}")  # fmt: skip
    for name in (v.name for v in VARIANTS):
        cls = load(name)
        runs = [hypothesis_find(cls, a.budget, searched(name)) for _ in range(a.runs)]
        found = [r for r in runs if r is not None]
        ex = explore(a.explorer_depth, explored(name), rules=cls)
        if found:
            secs = [t for t, _ in found]
            examples = statistics.median(n for _, n in found)
            hyp = f"{statistics.median(secs):21.2f} {max(secs):8.2f} {examples:9.0f}"
        else:
            hyp = f"{'not found':>21} {'':8} {'':9}"
        missed = "" if len(found) == len(runs) else f"  (missed in {len(runs) - len(found)} runs)"
        depth = ex.depth if ex.found else "survived"
        print(f"{name:24} {hyp}   {depth:>15} {ex.states:7} {ex.seconds:6.2f}{missed}")

    print(f"\nreal controller, exhaustive to depth {a.depth} (the explorer's default scope):")
    result = explore(a.depth)
    print(result.report())


if __name__ == "__main__":
    main()
