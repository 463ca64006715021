"""The timeline picture, drawn from a journal written by a real controller run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread

from recovery_fsm import RecoveryController, RecoveryError
from recovery_fsm import events as ev
from recovery_fsm.effects import (
    CancelExport,
    DeleteCheckpoint,
    RestartCold,
    RestartFromCheckpoint,
)
from recovery_fsm.journal import JsonlJournal
from recovery_fsm.journal.ledger import Ledger
from recovery_fsm.journal.timeline import MARGINS_IN, ROW_IN, draw

GROUPS = ("g1", "g2", "g3")


def scenario(path: Path) -> None:
    """Three groups: g1 fails and boots at once from C(1), g2 fails while C(2) is written and
    waits for it, g3's load fails and it comes back cold, admitted by the next sync. C(3)'s
    export fails and C(4)'s is cancelled by the shutdown."""
    journal = JsonlJournal(path)
    c = RecoveryController(journal=journal)

    def send(event: ev.Event) -> set[type]:
        return {type(e) for e in c.handle(event)}

    try:
        for name in GROUPS:
            send(ev.GroupRegistered(name, 0, at=100.0))
        send(ev.WeightsSynced(1, c.up_groups(), at=110.0))
        send(ev.ExportStarted(1, at=111.0))
        send(ev.ExportCommitted(1, "/ckpt/1", at=125.0))
        assert RestartFromCheckpoint in send(ev.GroupFailed("g1", 1, at=130.0, reason="oom"))
        send(ev.RestartLoaded("g1", 2, at=138.0))

        assert DeleteCheckpoint in send(ev.WeightsSynced(2, c.up_groups(), at=150.0))
        send(ev.CheckpointDeleted(1, at=151.0))
        send(ev.ExportStarted(2, at=152.0))
        send(ev.GroupFailed("g2", 1, at=158.0, reason="nccl timeout"))
        assert c.group_state("g2") == "awaiting_checkpoint"
        assert RestartFromCheckpoint in send(ev.ExportCommitted(2, "/ckpt/2", at=170.0))
        send(ev.RestartLoaded("g2", 2, at=178.0))

        send(ev.GroupFailed("g3", 1, at=185.0, reason="xid 79"))
        assert RestartCold in send(ev.RestartLoadFailed("g3", 2, at=190.0, error="bad shard"))
        send(ev.Relaunched("g3", 3, at=200.0))
        send(ev.WeightsSynced(3, c.up_groups(), at=210.0))
        assert c.group_state("g3") == "active"
        send(ev.CheckpointDeleted(2, at=211.0))
        send(ev.ExportStarted(3, at=212.0))
        send(ev.ExportFailed(3, at=218.0, error="disk full"))
        send(ev.WeightsSynced(4, c.up_groups(), at=220.0))
        send(ev.ExportStarted(4, at=221.0))
        assert CancelExport in send(ev.Shutdown(at=225.0))
        send(ev.ExportCancelled(4, at=227.0))
        assert c.drained
    finally:
        journal.close()


def few_events(path: Path, groups: int) -> None:
    with JsonlJournal(path) as journal:
        c = RecoveryController(journal=journal)
        for i in range(groups):
            c.handle(ev.GroupRegistered(f"w{i}", 0, at=float(i)))
        c.handle(ev.WeightsSynced(1, c.up_groups(), at=10.0))
        c.handle(ev.Shutdown(at=12.0))


def png_size(path: Path) -> tuple[int, int]:
    pixels = imread(path)
    return pixels.shape[1], pixels.shape[0]


def expected_size(rows: int, width_in: float = 12.0, dpi: int = 100) -> tuple[int, int]:
    return round(width_in * dpi), round((rows * ROW_IN + MARGINS_IN) * dpi)


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    path = tmp_path / "journal.jsonl"
    scenario(path)
    return path


def test_draws_the_scenario(journal: Path, tmp_path: Path) -> None:
    info = draw(journal, tmp_path / "out" / "timeline.png", title="scenario")

    assert info.path == tmp_path / "out" / "timeline.png"
    assert info.path.stat().st_size > 1000
    assert info.rows == (*GROUPS, "exports")
    assert info.size == expected_size(len(info.rows))
    assert png_size(info.path) == info.size


def test_size_follows_width_dpi_and_rows(journal: Path, tmp_path: Path) -> None:
    small = draw(Ledger.read(journal), tmp_path / "small.png", width_in=8.0, dpi=60)
    assert small.size == expected_size(4, width_in=8.0, dpi=60) == png_size(small.path)

    many = tmp_path / "many.jsonl"
    few_events(many, groups=7)
    tall = draw(many, tmp_path / "tall.png")
    assert tall.rows == (*(f"w{i}" for i in range(7)), "exports")
    assert tall.size == expected_size(8) == png_size(tall.path)
    assert tall.size[1] > draw(journal, tmp_path / "short.png").size[1]


def test_ledger_saw_what_the_scenario_did(journal: Path) -> None:
    ledger = Ledger.read(journal)
    # g1, g2 once each; g3 twice (its first process, then the load of C(2)).
    assert [(m.group, m.incarnation) for m in ledger.crashes] == [
        ("g1", 1), ("g2", 1), ("g3", 1), ("g3", 2)
    ]  # fmt: skip
    # Registration at the fleet's version routes traffic too: 3 of those, then one re-entry
    # per group.
    assert [(m.group, m.incarnation) for m in ledger.admissions] == [
        ("g1", 1), ("g2", 1), ("g3", 1), ("g1", 2), ("g2", 2), ("g3", 3)
    ]  # fmt: skip
    assert [(r.group, r.path) for r in ledger.recoveries] == [
        ("g1", "immediate"), ("g2", "waited"), ("g3", "cold")
    ]  # fmt: skip
    assert [v for _, v in ledger.syncs] == [1, 2, 3, 4]
    assert [(e.version, e.outcome) for e in ledger.exports] == [
        (1, "committed"), (2, "committed"), (3, "failed"), (4, "cancelled")
    ]  # fmt: skip


def test_a_single_instant_draws(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    with JsonlJournal(path) as journal:
        RecoveryController(journal=journal).handle(ev.GroupRegistered("solo", 0, at=5.0))
    info = draw(path, tmp_path / "one.png")
    assert info.rows == ("solo", "exports")
    assert info.size == expected_size(2) == png_size(info.path)


def test_a_journal_without_events_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    with JsonlJournal(empty) as journal:
        RecoveryController(journal=journal)  # writes the header only
    assert empty.read_text().count("\n") == 1
    with pytest.raises(RecoveryError, match="no event"):
        draw(empty, tmp_path / "empty.png")
    with pytest.raises(ValueError, match="no event"):
        draw(Ledger(), tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()
