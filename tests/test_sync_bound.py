"""A weight sync never waits for a dead or hung engine longer than ``push_timeout_s``.

The reference engine on a real local Ray cluster; one group's push dies or hangs on request
(a flag file), with the probes running and paused (as they are while a colocated trainer
holds the devices). The call timeout is far above the push's bound, so a push that waited for
the call timeout would fail every assertion on how long the sync took.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA, serving
from conftest import wait_for as _wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import RecoveryConfig  # noqa: E402
from recovery_fsm.ray import RecoveryRuntime, ReferenceEngine  # noqa: E402
from recovery_fsm.search.replay import replay  # noqa: E402

wait_for = functools.partial(_wait_for, timeout=90.0)  # engine boots take longer
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("ray_cluster")

CONFIG = TINY_LLAMA
PUSH_TIMEOUT_S = 3.0
CALL_TIMEOUT_S = 120.0


def push_gate(flags: str) -> type[ReferenceEngine]:
    """An engine whose push dies (``die``) or hangs (``hang``, until the file goes) while the
    file ``<flags>/<group>`` says so. Made in a function: Ray ships it by value."""

    class PushGateEngine(ReferenceEngine):
        def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
            flag = Path(flags) / self.group
            if flag.exists() and flag.read_text() == "die":
                os._exit(1)
            while flag.exists():
                time.sleep(0.05)
            return super().update_weights(version, weights)

    return PushGateEngine


def test_a_sync_leaves_out_a_group_that_dies_or_hangs_in_the_push_within_its_bound(
    tmp_path: Path,
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    # One clean sync re-enables a switch: see the race after a death, below.
    config = RecoveryConfig(clean_syncs_to_reenable=1)
    with RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0", "g1"], model_config=LlamaConfig(**CONFIG).to_dict(),
        engine=push_gate(str(flags)), journal=tmp_path / "journal.jsonl", tick_s=0.1,
        probe_interval_s=0.5, grace_s=0.5, call_timeout_s=CALL_TIMEOUT_S,
        push_timeout_s=PUSH_TIMEOUT_S, config=config,
    ) as rt:  # fmt: skip
        rt.start(model)
        cases = [("hang", "paused"), ("hang", "running"), ("die", "paused"), ("die", "running")]
        g1 = functools.partial(rt.controller.group, "g1")
        version = 0
        for fault, probes in cases:
            version += 1
            if probes == "paused":
                rt.monitor.pause()
            (flags / "g1").write_text(fault)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            began = time.monotonic()
            got = rt.sync(model, version)
            took = time.monotonic() - began
            (flags / "g1").unlink()
            rt.monitor.resume()
            assert got == {"g0": rt.controller.incarnation("g0")}, (fault, probes)
            # Bounded by the push's timeout (plus the canary and the report), not the call's.
            assert took < PUSH_TIMEOUT_S + 10.0 < CALL_TIMEOUT_S, (fault, probes, took)
            assert rt.generate("g0", [1, 2]).version == version
            # The group left out comes back on this version (a load in place of C(v), or a
            # restart from it after its death). After a death the export's commit may reach
            # the dead process before its death is seen: that load in place fails, cools its
            # recovery (a death while loading counts against the checkpoint), and the group
            # restarts cold and waits for the next sync, which admits it.
            wait_for(lambda v=version: (serving(rt, "g1") and g1().version == v)  # type: ignore[misc]
                     or (g1().state == "pending_weights" and g1().recovery == "cooldown"),
                     what=f"g1 back after {fault} with probes {probes}")  # fmt: skip
            if not serving(rt, "g1"):
                assert fault == "die", (fault, probes)
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                assert rt.sync(model, version)["g1"] == rt.controller.incarnation("g1")
                wait_for(lambda: serving(rt, "g1"), what=f"g1 admitted by sync {version}")
    assert replay(tmp_path / "journal.jsonl").ok
