"""A resume fences the run it replaces: the journal's owner file names one epoch, engines
refuse an older epoch's commands, and the replaced runtime stops with a typed error.

The journal's part runs without Ray. The engines' part runs two runtimes of one named run
in this process on a local Ray cluster: the old one's monitor is stopped first (a trainer
hung in a push: it writes no journal record before it sends), so only the engines stand
between its push and the fleet the resume adopted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from recovery_fsm import ControllerStopped, Fenced, RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.journal import JournalHeld, JournalOwner, JsonlJournal, owner_path, read_journal

ray = pytest.importorskip("ray")


def test_a_claimed_journal_refuses_the_replaced_writer_and_names_who_holds_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    owner = JournalOwner(path)
    assert owner.claim(1, fresh=True) == 1
    old = JsonlJournal(path, owner=owner, epoch=1)
    c = RecoveryController(RecoveryConfig(), journal=old)
    c.handle(ev.GroupRegistered("g0", 0, at=1.0))
    before = path.read_bytes()

    assert JournalOwner(path).claim() == 2  # a resume: the next epoch above the holder's
    held_by = f"epoch 1 no longer owns .* held by epoch 2 \\(pid {os.getpid()}"
    with pytest.raises(Fenced, match=held_by):
        old({"step": 99})
    assert path.read_bytes() == before  # not a byte of the replaced run's record
    # Through a controller: the event stands (the sink's failure is counted), nothing written.
    c.handle(ev.Tick(at=2.0))
    assert c.journal_failures == 1 and path.read_bytes() == before
    held = json.loads(owner_path(path).read_text())
    assert held["epoch"] == 2 and held["pid"] == os.getpid()


def test_an_epoch_not_above_the_holders_is_refused_and_a_fresh_claim_ignores_a_dead_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    JournalOwner(path).claim(3)
    with pytest.raises(JournalHeld, match="held by epoch 3"):
        JournalOwner(path).claim(3)
    assert JournalOwner(path).claim(1, fresh=True) == 1  # a start on a journal with no run


# -- engines, on Ray -----------------------------------------------------------------------

pytestmark_ray = pytest.mark.usefixtures("ray_cluster")


def _model(seed: int) -> Any:
    from conftest import TINY_LLAMA
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()


def _options(tmp_path: Path) -> dict[str, Any]:
    from conftest import TINY_LLAMA
    from transformers import LlamaConfig

    return dict(
        groups=["g0"], model_config=LlamaConfig(**TINY_LLAMA).to_dict(),
        journal=tmp_path / "journal.jsonl", tick_s=0.1, probe_interval_s=0.5,
        probe_timeout_s=2.0, grace_s=1.0, call_timeout_s=60.0,
    )  # fmt: skip


@pytestmark_ray
def test_engines_refuse_the_replaced_runtimes_push_and_it_stops_without_killing_them(
    tmp_path: Path,
) -> None:
    from conftest import wait_for

    from recovery_fsm.export import model_digest
    from recovery_fsm.ray import RecoveryRuntime

    run = f"fence-{tmp_path.name}"
    old = RecoveryRuntime(tmp_path / "ckpt", run=run, **_options(tmp_path))
    new = None
    try:
        old.start(_model(0))
        v1 = _model(1)
        old.sync(v1, 1)
        wait_for(lambda: old.controller.checkpoint_state(1) == "ready", what="C(1)")
        old.monitor.stop()  # hung: the old trainer writes nothing before its next push
        options = {k: v for k, v in _options(tmp_path).items() if k != "journal"}
        new, found = RecoveryRuntime.resume(
            tmp_path / "ckpt", run=run, version=1, journal=tmp_path / "journal.jsonl", **options
        )
        assert found.epoch == 2 and found.adopted == ("g0",) and found.settled
        [actor] = new.actors("g0")

        with pytest.raises(ControllerStopped, match="replaced by a resume") as stopped:
            old.push(_model(99), 2)
        assert isinstance(stopped.value.first, Fenced)
        with pytest.raises(ControllerStopped):  # and every later call of its trainer
            old.sync(_model(99), 2)
        # The engine holds the resumed run's weights; an old-epoch command is refused by it.
        assert ray.get(actor.weights.remote(), timeout=30).digest == model_digest(v1)
        with pytest.raises(Fenced, match="from run epoch 1 refused"):
            ray.get(actor.assume.remote("g0", 9, epoch=1), timeout=30)
        assert ray.get(actor.whoami.remote(), timeout=30) == ("g0", 1)

        old.close(drain_timeout_s=5.0)  # it leaves the engines to the run that replaced it
        assert new.generate("g0", [1, 2, 3], 2).version == 1
        steps = [r["step"] for r in read_journal(tmp_path / "journal.jsonl") if "step" in r]
        assert steps == list(range(len(steps)))  # one writer at a time
    finally:
        old.close(drain_timeout_s=5.0)
        if new is not None:
            new.close()


def test_a_fenced_command_takes_an_epoch_even_once_its_engine_was_made_an_actor_unfenced() -> None:
    """``ray.remote`` pins a ``__signature__`` on an engine's methods; the fence must not
    copy it (the command would then refuse ``epoch=`` before it reached the engine)."""
    import inspect

    from recovery_fsm.ray import ReferenceEngine
    from recovery_fsm.ray.actors import fenced

    class Mine(ReferenceEngine):
        pass

    ray.remote(concurrency_groups={"health": 1, "watch": 1})(Mine)  # type: ignore[call-overload]
    for name in ("boot_empty", "update_weights", "load_checkpoint", "rollout"):
        assert "epoch" in inspect.signature(getattr(fenced(Mine), name)).parameters, name
