"""``recovery-fsm replay``: re-run a journal through a fresh controller, checking each step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recovery_fsm import (
    ControllerBroken,
    EventNotAllowed,
    MalformedEvent,
    RecoveryConfig,
    RecoveryController,
    Rules,
)
from recovery_fsm import events as ev
from recovery_fsm.journal import JsonlJournal
from recovery_fsm.search.replay import rebuild, replay


def _record(path: Path) -> None:
    config = RecoveryConfig(clean_syncs_to_reenable=2, restart_budget=3)
    with JsonlJournal(path) as journal:
        c = RecoveryController(config, journal=journal)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        c.handle(ev.GroupRegistered("g2", 0, at=1.0))
        c.handle(ev.ExportStarted(0, at=2.0))
        c.handle(ev.ExportCommitted(0, "/ckpt/step-0", at=3.0))
        _, restart = c.handle(ev.GroupFailed("g1", 1, at=4.0))
        with pytest.raises(MalformedEvent):
            c.handle(ev.Tick(at=0.5))  # time went backwards: refused, and journaled
        c.handle(ev.WeightsSynced(1, {"g2": 1}, at=5.0))
        c.handle(ev.RestartLoaded("g1", restart.incarnation, at=6.0))  # type: ignore[attr-defined]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recovery_fsm.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_a_recorded_run_replays_clean(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _record(path)
    report = replay(path)
    assert report.ok and report.steps == 8 and report.controller == "Rules"
    done = _cli("replay", str(path))
    assert done.returncode == 0 and "no violation" in done.stdout


def test_a_tampered_journal_shows_where_it_diverges(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _record(path)
    lines = path.read_text().splitlines()
    step5 = json.loads(lines[5])
    assert step5["event"]["kind"] == "GroupFailed"
    step5["effects"] = []  # pretend the controller had asked for nothing
    lines[5] = json.dumps(step5)
    path.write_text("\n".join(lines) + "\n")
    report = replay(path)
    assert not report.ok and report.violation_step is None
    assert report.divergences and report.divergences[0].startswith("step 5: GroupFailed")
    assert _cli("replay", str(path)).returncode == 1


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json\n", "not a JSON line"),
        ('{"step": 1, "nothing": 2}\n', "without an event"),
        ('{"step": 1, "event": {"kind": "Nope", "at": 1.0}}\n', "unknown event kind"),
        ('{"step": 0, "header": {"config": {"bogus": 1}}}\n', "not a RecoveryConfig"),
        ('{"step": 0, "header": {"rules": "os:system"}}\n', "unknown controller"),
    ],
)
def test_a_bad_journal_is_a_typed_error(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MalformedEvent, match=words):
        replay(path)


class CrashesOnProbeOk(Rules):
    def on_ProbeOk(self, e: ev.ProbeOk, found: Any) -> None:
        raise KeyError(e.group)


def test_a_crash_is_journaled_and_replays_as_a_violation(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JsonlJournal(path) as journal:
        c = RecoveryController(journal=journal, rules=CrashesOnProbeOk)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        with pytest.raises(ControllerBroken):
            c.handle(ev.ProbeOk("g1", 1, at=2.0))
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["step"] == 2 and last["error"]["type"] == "KeyError"
    report = replay(path, CrashesOnProbeOk)
    assert report.violation_step == 2 and "crashed" in report.violations[0]
    assert replay(path, Rules).divergences  # the real one accepts that ProbeOk


class BreaksOnSecondProbeOk(Rules):
    """A rule with a bug that shows on the second ProbeOk."""

    def on_ProbeOk(self, e: ev.ProbeOk, found: Any) -> None:
        if self.groups[e.group].record.restarts == 0 and self.now > 4.0:
            raise KeyError("a bug")
        super().on_ProbeOk(e, found)


def test_rebuild_from_the_journal_goes_on_after_a_broken_controller(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JsonlJournal(path) as journal:
        c = RecoveryController(journal=journal, rules=BreaksOnSecondProbeOk)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        c.handle(ev.ProbeFailed("g1", 1, at=2.0))
        c.handle(ev.ProbeOk("g1", 1, at=3.0))
        c.handle(ev.ProbeFailed("g1", 1, at=4.0))
        with pytest.raises(EventNotAllowed):
            c.handle(ev.GroupRegistered("g1", 0, at=4.5))  # a real refusal: skipped
        with pytest.raises(ControllerBroken):
            c.handle(ev.ProbeOk("g1", 1, at=5.0))
        with pytest.raises(ControllerBroken):
            c.handle(ev.ProbeFailed("g1", 1, at=6.0))  # really happened: refused unread
    # Rebuilt with the bug fixed: the breaking ProbeOk and the ProbeFailed after it count.
    fresh = rebuild(path, rules=Rules)
    assert fresh.broken is None and fresh.group_state("g1") == "suspect"
    assert fresh.snapshot()["groups"]["g1"]["probe_failures"] == 1
    assert fresh.handle(ev.ProbeOk("g1", 1, at=7.0)) == ()
    assert fresh.group_state("g1") == "active"
    # With the bug still there, rebuilding stops at the same event.
    with pytest.raises(ControllerBroken):
        rebuild(path, rules=BreaksOnSecondProbeOk)


def test_rebuild_refuses_a_journal_with_a_gap(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_text(
        '{"step": 0, "header": {"config": {}, "initial_version": 0}}\n'
        '{"step": 2, "lost": 1, "event": {"kind": "Tick", "at": 2.0}, "effects": []}\n'
    )
    with pytest.raises(MalformedEvent, match="1 records were lost"):
        rebuild(path)


def _steps(c: RecoveryController, last: int, pinned: int | None = None) -> RecoveryController:
    """g0 registered, then versions 1..last synced, exported (``pinned`` kept) and each
    superseded checkpoint deleted."""
    c.handle(ev.GroupRegistered("g0", 0, at=0.0))
    for v in range(1, last + 1):
        c.handle(ev.WeightsSynced(v, {"g0": 1}, at=float(v)))
        c.handle(ev.ExportStarted(v, pinned=v == pinned, at=float(v)))
        c.handle(ev.ExportCommitted(v, f"/ckpt/step-{v}", at=float(v)))
        for done in [k for k, view in c.checkpoints().items() if view.state == "deletable"]:
            c.handle(ev.CheckpointDeleted(done, at=float(v)))
    return c


def test_a_journal_longer_than_the_kept_final_states_replays_clean(tmp_path: Path) -> None:
    """The controller keeps the final states of its latest 16 checkpoints; the replay's world
    model checks no older ones (it used to ask for version 1 at the 18th and crash)."""
    path = tmp_path / "long.jsonl"
    with JsonlJournal(path) as sink:
        _steps(RecoveryController(RecoveryConfig(), journal=sink), 40)
    report = replay(path)
    assert report.ok and report.steps == 1 + 40 * 3 + 39, report.render()


def test_a_torn_last_line_is_cut_and_the_rebuilt_controller_goes_on_in_the_same_file(
    tmp_path: Path,
) -> None:
    from recovery_fsm.host import ControllerLink
    from recovery_fsm.journal import read_journal, trim_torn_tail

    path = tmp_path / "journal.jsonl"
    _record(path)
    whole = path.read_bytes()
    assert trim_torn_tail(path) == b""  # a journal ending on a whole line is left alone
    with path.open("ab") as f:  # the process died while writing a record
        f.write(b'{"step":99,"event":{"kind":"Tick","at":1')
    assert trim_torn_tail(path) == b'{"step":99,"event":{"kind":"Tick","at":1'
    assert path.read_bytes() == whole

    steps = [r["step"] for r in read_journal(path)]
    c = rebuild(path)
    with JsonlJournal(path) as journal:
        c.continue_journal(journal, steps[-1])
        last = c.now
        assert last is not None
        # A link on a clock far behind the recording (another host) stamps after it.
        link = ControllerLink(c, clock=lambda: 0.5)
        link.send(ev.Resumed, version=c.version, epoch=2, found=["g0#1"], silent=[])
    records = list(read_journal(path))
    assert [r["step"] for r in records[1:]] == [*steps[1:], steps[-1] + 1]
    assert records[-1]["event"]["kind"] == "Resumed" and records[-1]["event"]["at"] >= last
    assert sum("header" in r for r in records) == 1
    assert replay(path).ok  # the run and its resume replay as one


def test_continue_journal_refuses_a_step_behind_what_it_handled(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _record(path)
    c = rebuild(path)
    with pytest.raises(MalformedEvent, match="after_step must be an int"):
        c.continue_journal(lambda _r: None, 0)


def test_a_tick_that_changes_nothing_is_a_compact_record_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _record(path)
    c = rebuild(path)
    with JsonlJournal(path) as journal:
        c.continue_journal(journal, len(path.read_text().splitlines()) - 1)
        c.handle(ev.Tick(at=(c.now or 0.0) + 0.5))
    last = path.read_text().splitlines()[-1]
    assert set(json.loads(last)) == {"step", "event"}
    assert len(last) < 70, last  # bounded bytes per quiet tick
    assert replay(path).ok


def test_a_resume_after_the_kept_final_states_filled_up_replays_clean(tmp_path: Path) -> None:
    """A resume forgets the final states above its version, so the controller keeps fewer
    than 16: the world must not ask for those it evicted before (found by a soak's journal)."""
    path = tmp_path / "long.jsonl"
    with JsonlJournal(path) as sink:
        c = _steps(RecoveryController(RecoveryConfig(), journal=sink), 25, pinned=20)
        c.handle(ev.Resumed(20, epoch=2, found=["g0#1"], silent=[], at=30.0))
        c.handle(ev.CheckpointDeleted(25, at=31.0))
        c.handle(ev.GroupVerified("g0", 1, 25, at=32.0))
    report = replay(path)
    assert report.ok, report.render()
