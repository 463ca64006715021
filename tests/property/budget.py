"""Search budgets. CI runs the fast profile; ``RECOVERY_FSM_PROFILE=deep`` runs more
examples, longer examples and a deeper exhaustive search (see the README). A plain module,
not a conftest: ``tests/conftest.py`` already owns that module name."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings


@attrs.frozen
class Budget:
    examples: int  # Hypothesis examples over the real controller
    steps: int  # rules per example
    mutant_examples: int  # at most, per broken variant (the search stops at the first find)
    depth: int  # exhaustive search of the real controller
    liveness_depth: int  # ... with every state also settled fairly
    seeds: int  # each broken variant must be found on every one of this many seeds


PROFILES = {
    "ci": Budget(examples=150, steps=40, mutant_examples=1000, depth=6, liveness_depth=5, seeds=5),
    "deep": Budget(
        examples=3000, steps=80, mutant_examples=3000, depth=8, liveness_depth=7, seeds=20
    ),
}
PROFILE = os.environ.get("RECOVERY_FSM_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"RECOVERY_FSM_PROFILE must be one of {sorted(PROFILES)}")
BUDGET = PROFILES[PROFILE]

# Where a failing example's journal lands: keep it after the run to replay it.
TRACES = Path(os.environ.get("RECOVERY_FSM_TRACES", Path(tempfile.gettempdir()) / "recovery-fsm"))


def search_settings(examples: int, *, shrink: bool = True, derandomize: bool = False) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        stateful_step_count=BUDGET.steps,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
