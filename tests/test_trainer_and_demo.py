"""The trainer hooks on a real Ray runtime, and a short seeded chaos demo run every way.

One local Ray cluster for the module; every test makes its own runtime and kills only the
actors it made.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import cli  # noqa: E402
from recovery_fsm.demo import DemoOptions, Display, main, plan  # noqa: E402
from recovery_fsm.journal.ledger import Ledger  # noqa: E402
from recovery_fsm.ray import RecoveryRuntime  # noqa: E402
from recovery_fsm.trainer import HookOrderError, RecoveryHooks  # noqa: E402

CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("ray_cluster")


def trainer() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def runtime(tmp_path: Path, **kwargs: Any) -> RecoveryRuntime:
    return RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0"], model_config=LlamaConfig(**CONFIG).to_dict(),
        journal=tmp_path / "journal.jsonl", tick_s=0.2, probe_interval_s=0.5, grace_s=0.5,
        **kwargs,
    )  # fmt: skip


def slow_opener(delay_s: float) -> Any:
    """Every file of an export opens ``delay_s`` late: the write takes longer than a push."""

    def opener(path: Any) -> Any:
        time.sleep(delay_s)
        return open(path, "xb")

    return opener


def sync(hooks: RecoveryHooks, rt: RecoveryRuntime, model: Any, v: int, **kw: Any) -> Any:
    hooks.before_weight_sync(v)
    return hooks.after_weight_sync(v, model, rt.push(model, v), **kw)


def test_close_runs_and_keeps_the_hf_save_when_the_trainer_raises(tmp_path: Path) -> None:
    model = trainer()
    rt = runtime(tmp_path, exporter_options={"opener": slow_opener(0.3)})
    with pytest.raises(RuntimeError, match="trainer bug"), RecoveryHooks(rt) as hooks:
        rt.start(model)
        save = sync(hooks, rt, model, 1, hf_save=True)
        assert not save.done()  # still being written when the trainer raises
        raise RuntimeError("trainer bug")
    # close() ran from __exit__: the save was flushed, not cancelled, and is kept on disk.
    assert save.result(timeout=0) == rt.store.path_for(1)
    assert (rt.store.path_for(1) / "config.json").is_file()
    assert rt.exporter.closed and rt.controller.closed and rt.controller.drained
    assert not rt.monitor.running
    assert rt.actors("g0", 1) == []
    records = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    kinds = [r["event"]["kind"] for r in records if "event" in r]
    assert "Shutdown" in kinds and kinds.index("ExportCommitted") < kinds.index("Shutdown")
    assert hooks.close().hf_saves == {1: rt.store.path_for(1)}  # idempotent
    with pytest.raises(HookOrderError, match="closed"):
        hooks.before_weight_sync(2)


def test_close_returns_this_processs_saves_when_the_runs_pins_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = trainer()
    rt = runtime(tmp_path)
    hooks = RecoveryHooks(rt)
    rt.start(model)
    sync(hooks, rt, model, 1, hf_save=True).result(timeout=60)

    def unanswered() -> Any:  # as a hosted controller that died would answer
        raise TimeoutError("the controller actor did not answer")

    monkeypatch.setattr(rt, "pinned_checkpoints", unanswered)
    closed = hooks.close()  # returns, and closes the runtime
    assert closed.hf_saves == {1: rt.store.path_for(1)} and closed.drained
    assert rt.controller.closed and rt.actors("g0", 1) == []


def test_hooks_refuse_calls_out_of_order_and_send_nothing(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path) as rt, RecoveryHooks(rt) as hooks:
        rt.start(model)
        got = rt.push(model, 1)
        seen = len(rt.ledger.syncs)
        with pytest.raises(HookOrderError, match="without before_weight_sync"):
            hooks.after_weight_sync(1, model, got)
        hooks.before_weight_sync(2)
        with pytest.raises(HookOrderError, match="without before_weight_sync"):
            hooks.after_weight_sync(1, model, got)
        with pytest.raises(HookOrderError, match="increase"):
            hooks.before_weight_sync(1)
        assert len(rt.ledger.syncs) == seen and rt.controller.version == 0
        assert not rt.store.root.exists() or not any(rt.store.root.iterdir())
        hooks.after_weight_sync(2, model, rt.push(model, 2))
        with pytest.raises(HookOrderError, match="increase"):
            hooks.before_weight_sync(2)
        assert rt.controller.version == 2


def test_metrics_are_recoverys_own_and_off_the_sync_timer(tmp_path: Path) -> None:
    """The hooks return before the export is written; the write shows in recovery's metrics
    (export duration), not in the trainer's time in the hooks (export stall)."""
    model = trainer()
    rt = runtime(tmp_path, exporter_options={"opener": slow_opener(0.5)})
    with rt, RecoveryHooks(rt) as hooks:
        rt.start(model)
        handle = sync(hooks, rt, model, 1)
        assert not handle.done()
        assert hooks.before_weight_sync(2) == "missed"  # v1 still being written
        hooks.after_weight_sync(2, model, rt.push(model, 2))
        m = hooks.metrics()
        assert all(k.startswith("recovery/") for k in m)
        assert m["recovery/syncs_missed"] == 1 and m["recovery/syncs_clean"] == 0
        # Less than one file's delay in the hooks: they never waited for a write.
        assert m["recovery/export_stall_total_s"] < 0.5
        rt.exporter.close()  # flush v2
        m = hooks.metrics()
        assert m["recovery/export_duration_s"] >= 1.0  # two files, each opened 0.5 s late
        assert m["recovery/exports_committed"] == 1
        assert m["recovery/cooldown_entries"] == 1  # the missed v1 cooled g0's switch
    assert hooks.metrics()["recovery/export_stall_total_s"] < 1.0


def test_export_wait_turns_a_miss_into_a_clean_sync(tmp_path: Path) -> None:
    model = trainer()
    rt = runtime(tmp_path, exporter_options={"opener": slow_opener(0.2)})
    with rt, RecoveryHooks(rt, export_wait_s=30) as hooks:
        rt.start(model)
        first = sync(hooks, rt, model, 1)
        assert hooks.before_weight_sync(2) == "clean"
        assert first.done()
        hooks.after_weight_sync(2, model, rt.push(model, 2))
        m = hooks.metrics()
        # The wait before the push belongs to this sync's stall, with the time after it.
        assert m["recovery/export_stall_s"] >= 0.2 and m["recovery/export_stall_total_s"] >= 0.2
        assert m["recovery/syncs_clean"] == 1 and m["recovery/syncs_missed"] == 0


def test_a_failed_export_is_a_missed_sync_in_every_count(tmp_path: Path) -> None:
    """The rules cool on a failed export as on a late one: the hooks and the metrics say
    "missed" for it too, so syncs_missed and cooldown_entries tell one story."""

    def refusing(path: Any) -> Any:
        raise OSError("the disk refused")

    model = trainer()
    rt = runtime(tmp_path, exporter_options={"opener": refusing})
    with rt, RecoveryHooks(rt) as hooks:
        rt.start(model)
        handle = sync(hooks, rt, model, 1)
        assert handle.exception(timeout=30) is not None
        assert hooks.before_weight_sync(2) == "missed"
        hooks.after_weight_sync(2, model, rt.push(model, 2))
        m = hooks.metrics()
        assert m["recovery/syncs_missed"] == 1 and m["recovery/syncs_clean"] == 0
        assert "recovery/syncs_failed" not in m
        assert m["recovery/cooldown_entries"] == len(rt.groups)  # every switch cooled once


def test_a_short_seeded_demo_run_every_way_reports_zeros_and_replays_clean(
    tmp_path: Path,
) -> None:
    options = DemoOptions(
        steps=6, groups=2, model="tiny", step_s=2.5, chaos_rate=1.0, seed=3,
        out=tmp_path / "demo", hf_interval=3, request_interval_s=0.1,
    )  # fmt: skip
    incidents = plan(options)
    assert [i.step for i in incidents] == [2, 3, 4]
    outcome = main(options, display=Display(live=False))
    standby, immediate, cold, free = outcome.reports
    assert [r.mode for r in outcome.results] == ["standby", "immediate", "cold", "free"]
    assert outcome.ok, outcome.reports
    assert standby.recoveries["standby"] >= 1 and immediate.recoveries["standby"] == 0
    assert free.failures_injected == 0 and free.goodput == 1.0
    assert all(r.goodput is not None and r.goodput > 0 for r in outcome.reports)
    for report in outcome.reports[:3]:
        assert set(report.safety.values()) == {0}
        assert report.replay_ok
        # An incident finds no serving group only when every group is recovering.
        assert report.incidents_skipped < len(incidents)
        assert report.failures_injected >= len(incidents) - report.incidents_skipped
        assert report.tokens > 0 and report.samples > 0
    assert standby.lost == immediate.lost == 0  # a serving group was always left
    assert sum(immediate.recoveries[p] for p in ("immediate", "waited")) >= 1
    assert cold.recoveries["immediate"] == cold.recoveries["waited"] == 0
    assert cold.recoveries["cold"] >= 1
    # The HF saves (v3, v6, and v9 if quiet steps ran that far) are kept; nothing else is.
    for result in outcome.results:
        kept = [int(Path(p).name.removeprefix("step-")) for p in result.kept]
        assert kept[:2] == [3, 6] and all(v % 3 == 0 for v in kept)
        assert {p.name for p in result.root.iterdir()} == {f"step-{v}" for v in kept}
        assert result.leaked == []
    for png in outcome.timelines:
        assert png.stat().st_size > 10_000
    # The report's figures are those of the journal on disk.
    ledger = Ledger.read(outcome.results[1].journal)
    assert ledger.idle_group_seconds() == pytest.approx(immediate.idle_group_s)


def test_the_demo_command_fails_when_a_safety_counter_is_not_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import recovery_fsm.demo as demo

    real = demo.main
    seen: list[Any] = []

    def recording(options: DemoOptions, **kw: Any) -> Any:
        seen.append(real(options, **kw))
        return seen[-1]

    def broken(options: DemoOptions, **kw: Any) -> Any:
        report = seen[0].reports[0]
        bad = attrs.evolve(report, safety={**report.safety, "lost effects": 1})
        return attrs.evolve(seen[0], reports=(bad,))

    # The defaults' shape: an output directory relative to where the command runs, and an HF
    # save that is kept (v2), which must not count as a leaked directory.
    monkeypatch.chdir(tmp_path)
    args = ["demo", "--steps", "3", "--groups", "1", "--model", "tiny", "--step-s", "1",
            "--chaos-rate", "0", "--hf-interval", "2", "--live", "off", "--no-timeline",
            "--out", "demo-out", "--runs", "immediate"]  # fmt: skip
    monkeypatch.setattr(demo, "main", recording)
    assert cli.main(args) == 0
    assert seen[0].ok and seen[0].reports[0].failures_injected == 0
    assert [Path(p).name for p in seen[0].results[0].kept] == ["step-2"]
    monkeypatch.setattr(demo, "main", broken)
    assert cli.main(args) == 1
