"""The journal records every event and transition; concurrent senders are serialized."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from recovery_fsm import EventNotAllowed, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.journal import JsonlJournal, decode_event, read_journal
from recovery_fsm.scenario import seed_race


def test_journal_lines_replay_to_the_same_state(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JsonlJournal(path) as journal:
        c = RecoveryController(journal=journal)
        c.handle(ev.GroupRegistered("g1", 0, 1.0))
        c.handle(ev.WeightsSynced(1, {"g1"}, 2.0))
        c.handle(ev.ExportStarted(1, 3.0))
        c.handle(ev.ExportCommitted(1, "/ckpt/step-1", 4.0))
        c.handle(ev.GroupFailed("g1", 5.0, reason="oom"))
        with pytest.raises(EventNotAllowed):
            c.handle(ev.Relaunched("g1", 6.0))  # g1 is loading, not relaunching
    header, *records = list(read_journal(path))
    assert header["step"] == 0
    assert header["header"]["controller"] == "recovery_fsm.controller:RecoveryController"
    assert header["header"]["config"]["restart_budget"] == 5
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[4]["transitions"] == [
        ["group:g1", "fail", "active", "failed"],
        ["group:g1", "load", "failed", "loading"],
    ]
    assert records[4]["effects"][0]["kind"] == "RestartFromCheckpoint"
    assert records[5]["error"]["type"] == "EventNotAllowed"
    assert all(json.loads(line) for line in path.read_text().splitlines())

    replay = RecoveryController()
    for record in records:
        event = decode_event(record["event"])
        if "error" in record:
            with pytest.raises(EventNotAllowed):
                replay.handle(event)
        else:
            replay.handle(event)
    assert replay.snapshot() == c.snapshot()


def test_decode_rejects_unknown_kinds() -> None:
    from recovery_fsm import MalformedEvent

    with pytest.raises(MalformedEvent, match="unknown event kind"):
        decode_event({"kind": "Explode", "at": 1.0})
    with pytest.raises(MalformedEvent, match="bad fields"):
        decode_event({"kind": "Tick"})


def test_concurrent_senders_are_serialized() -> None:
    c = RecoveryController()
    names = [f"g{i}" for i in range(8)]
    for i, name in enumerate(names):
        c.handle(ev.GroupRegistered(name, 0, float(i)))
    clock = iter(range(100, 10**9))
    clock_lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            for _ in range(200):
                for cls in (ev.ProbeFailed, ev.ProbeOk):
                    with clock_lock:  # the controller needs time that does not go backwards
                        at = float(next(clock))
                        c.handle(cls(name, at))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert c.check_invariants() == []
    assert all(c.group_state(n) == "active" for n in names)
    assert c.snapshot()["now"] == float(100 + 8 * 200 * 2 - 1)


def test_scripted_scenario_runs_and_drains() -> None:
    lines: list[str] = []
    c = seed_race(lines.append)
    assert c.drained
    text = "\n".join(lines)
    # The delete of C(1) comes only after g1's lease is released.
    assert text.index("RestartLoaded(group='g1'") < text.index("DeleteCheckpoint(version=1")
