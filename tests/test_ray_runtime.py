"""The Ray runtime on a real local Ray cluster, with tiny Llama engines built from a config.

One cluster for the module; every test makes its own runtime and kills only its own actors.
Each test's journal is replayed through the search's world model at the end.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import RecoveryConfig  # noqa: E402
from recovery_fsm.export import model_digest  # noqa: E402
from recovery_fsm.ray import RecoveryRuntime, ReferenceEngine  # noqa: E402
from recovery_fsm.replay import replay  # noqa: E402

# The engines that misbehave are defined here: Ray's workers cannot import a test module,
# so this one's classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    yield
    ray.shutdown()


def trainer() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def step(model: Any) -> None:
    """A stand-in for an optimizer step: every weight changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.05)


def runtime(tmp_path: Path, **kwargs: Any) -> RecoveryRuntime:
    options: dict[str, Any] = dict(
        groups=["g0", "g1"],
        model_config=LlamaConfig(**CONFIG).to_dict(),
        journal=tmp_path / "journal.jsonl",
        tick_s=0.1,
        probe_interval_s=0.5,
        probe_timeout_s=1.0,
        grace_s=0.5,
        call_timeout_s=60.0,
    )
    options.update(kwargs)
    return RecoveryRuntime(tmp_path / "ckpt", **options)


def assert_replays_clean(tmp_path: Path) -> None:
    report = replay(tmp_path / "journal.jsonl")
    assert report.ok, report


def test_a_killed_group_boots_from_the_committed_checkpoint(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path) as rt:
        rt.start(model)
        step(model)
        assert rt.sync(model, 1) == {"g0": 1, "g1": 1}
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        before = rt.generate("g0", [1, 2, 3])
        assert (before.version, before.incarnation) == (1, 1)

        rt.kill("g0")
        wait_for(lambda: rt.controller.group("g0").incarnation == 2
                 and rt.controller.group_state("g0") == "active", what="g0 recovered")  # fmt: skip
        after = rt.generate("g0", [1, 2, 3])
        assert (after.version, after.incarnation) == (1, 2)
        assert after.tokens == before.tokens  # the same weights, so the same greedy tokens
        held = ray.get(rt._actors.of("g0", 2)[0].weights.remote())
        assert held.digest == model_digest(model)
        stats = rt.statistics()
        assert stats.recoveries == {"immediate": 1}
        assert rt.routes["g0"] == (2, 1)
    assert_replays_clean(tmp_path)


class HangingEngine(ReferenceEngine):
    """Boots from a checkpoint never (the first process only): a hung load."""

    def boot_from_checkpoint(self, path: str) -> Any:
        if self.incarnation == 2:
            time.sleep(3600)
        return super().boot_from_checkpoint(path)


def test_a_hung_load_is_killed_at_its_deadline_and_restarted(tmp_path: Path) -> None:
    model = trainer()
    config = RecoveryConfig(load_timeout_s=3.0, relaunch_timeout_s=30.0)
    with runtime(tmp_path, config=config, engine=HangingEngine) as rt:
        rt.start(model)
        step(model)
        rt.sync(model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        rt.kill("g0")
        wait_for(lambda: rt.controller.group("g0").incarnation == 2, what="restart")
        assert rt.controller.group_state("g0") == "loading"
        # Past the deadline the load is stopped, recovery cools, and the group goes cold.
        wait_for(lambda: rt.controller.group("g0").incarnation >= 3
                 and rt.controller.group_state("g0") in ("pending_weights", "active"),
                 timeout=60, what="cold restart after the deadline")  # fmt: skip
        assert rt.controller.recovery_state("g0") == "cooldown"
        assert rt._actors.of("g0", 2) == []
        step(model)
        assert rt.sync(model, 2)["g0"] == rt.controller.incarnation("g0")
        assert rt.generate("g0", [5, 6]).version == 2
    assert_replays_clean(tmp_path)
