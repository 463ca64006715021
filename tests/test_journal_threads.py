"""The journal records every event and transition; concurrent senders are serialized."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from recovery_fsm import EventNotAllowed, MalformedEvent, RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.cli.scenario import seed_race
from recovery_fsm.codec import decode_event, encode
from recovery_fsm.journal import JsonlJournal, read_journal
from recovery_fsm.search.replay import replay


def _record_run(path: Path) -> RecoveryController:
    """A short run: registration, a sync, an export, a failure, and one refusal."""
    with JsonlJournal(path) as journal:
        c = RecoveryController(RecoveryConfig(restart_budget=4), journal=journal)
        c.handle(ev.GroupRegistered("g1", 0, at=1.0))
        c.handle(ev.WeightsSynced(1, {"g1": 1}, at=2.0))
        c.handle(ev.ExportStarted(1, at=3.0))
        c.handle(ev.ExportCommitted(1, "/ckpt/step-1", at=4.0))
        c.handle(ev.GroupFailed("g1", 1, reason="oom", at=5.0))
        with pytest.raises(EventNotAllowed):
            c.handle(ev.Relaunched("g1", 2, at=6.0))  # g1 is loading, not relaunching
        c.handle(ev.RestartLoaded("g1", 2, at=7.0))
    return c


def test_journal_lines_replay_to_the_same_state(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    c = _record_run(path)
    header, *records = list(read_journal(path))
    assert header["step"] == 0
    assert header["header"]["rules"] == "recovery_fsm.rules:Rules"
    assert header["header"]["config"]["restart_budget"] == 4
    assert header["header"]["initial_version"] == 0
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    failed = records[4]
    assert failed["event"] == encode(ev.GroupFailed("g1", 1, reason="oom", at=5.0))
    assert failed["transitions"] == [
        ["group:g1", "fail", "active", "failed"],
        ["group:g1", "load", "failed", "loading"],
    ]
    assert [e["kind"] for e in failed["effects"]] == ["WithdrawTraffic", "RestartFromCheckpoint"]
    assert failed["effects"][1]["incarnation"] == 2
    assert records[5]["error"]["type"] == "EventNotAllowed"
    assert "effects" not in records[5]
    assert all("lost" not in r for r in records)
    assert all(json.loads(line) for line in path.read_text().splitlines())

    fresh = RecoveryController(RecoveryConfig(restart_budget=4))
    for record in records:
        event = decode_event(record["event"])
        if "error" in record:
            with pytest.raises(EventNotAllowed):
                fresh.handle(event)
        else:
            assert [encode(f) for f in fresh.handle(event)] == record.get("effects", [])
    assert fresh.snapshot() == c.snapshot()


def test_the_replay_tool_reads_the_journal_back(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _record_run(path)
    report = replay(path)
    assert report.ok, report.render()
    assert report.steps == 7


def test_decode_rejects_unknown_kinds() -> None:
    with pytest.raises(MalformedEvent, match="unknown event kind"):
        decode_event({"kind": "Explode", "at": 1.0})
    with pytest.raises(MalformedEvent, match="bad fields"):
        decode_event({"kind": "Tick"})
    with pytest.raises(MalformedEvent, match="bad fields"):
        decode_event({"kind": "ProbeOk", "group": "g1", "at": 1.0})  # no incarnation
    with pytest.raises(MalformedEvent, match="map each group name"):
        decode_event({"kind": "WeightsSynced", "version": 1, "groups": ["g1"], "at": 1.0})


def test_decoded_events_round_trip_through_json() -> None:
    events = [
        ev.WeightsSynced(3, {"g2": 4, "g1": 1}, at=1.5),
        ev.ExportStarted(3, pinned=True, at=2.0),
        ev.GroupFailed("g1", 7, reason="oom", at=3.0),
        ev.Tick(at=4.0),
    ]
    for event in events:
        assert decode_event(json.loads(json.dumps(encode(event)))) == event


def test_concurrent_senders_are_serialized() -> None:
    records: list[dict[str, object]] = []
    c = RecoveryController(journal=records.append)
    names = [f"g{i}" for i in range(8)]
    for i, name in enumerate(names):
        c.handle(ev.GroupRegistered(name, 0, at=float(i)))
    clock = iter(range(100, 10**9))
    clock_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def worker(name: str) -> None:
        try:
            start.wait()
            for _ in range(200):
                for cls in (ev.ProbeFailed, ev.ProbeOk):
                    with clock_lock:  # the controller needs time that does not go backwards
                        at = float(next(clock))
                        c.handle(cls(name, 1, at=at))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert not any(t.is_alive() for t in threads)
    assert c.check_invariants() == []
    assert all(c.group_state(n) == "active" for n in names)
    assert c.snapshot()["now"] == float(100 + 8 * 200 * 2 - 1)
    # One record per event, numbered in the order the controller took them.
    steps = [r["step"] for r in records]
    assert steps == list(range(len(steps)))
    assert len(steps) == 1 + len(names) + len(names) * 200 * 2


def test_scripted_scenario_runs_and_drains() -> None:
    lines: list[str] = []
    c = seed_race(lines.append)
    assert c.drained
    assert c.leases == {}
    text = "\n".join(lines)
    # The delete of C(1) comes only after g1's lease is released.
    assert text.index("RestartLoaded(group='g1'") < text.index("DeleteCheckpoint(version=1")
