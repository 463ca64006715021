"""A journal file holding two runs (a second controller appended to the same path) is refused
by every reader with one typed error and one message, before anything is rebuilt, replayed
or counted: a mix of two runs is the state of neither. A single run still reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import short_run

from recovery_fsm import MalformedEvent, cli
from recovery_fsm.journal import MixedJournal, mixed_journal, read_journal
from recovery_fsm.journal.ledger import Ledger
from recovery_fsm.search.replay import rebuild, replay


@pytest.fixture
def one_run(tmp_path: Path) -> Path:
    path = tmp_path / "journal.jsonl"
    short_run(path)
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """Two runs appended to one path, as a second run on the same ``journal=`` leaves it."""
    path = tmp_path / "journal.jsonl"
    short_run(path)
    short_run(path)
    return path


def second_header(path: Path) -> int:
    """The line (from 1) where the second run's header is."""
    lines = [n for n, line in enumerate(path.read_text().splitlines(), 1)
             if "header" in json.loads(line)]  # fmt: skip
    assert len(lines) == 2 and lines[0] == 1, lines
    return lines[1]


def timeline(path: Path) -> Any:
    pytest.importorskip("matplotlib")
    from recovery_fsm.journal.timeline import draw

    return draw(path, path.with_suffix(".png"))


READERS: dict[str, Callable[[Path], Any]] = {
    "read_journal": lambda p: list(read_journal(p)),
    "rebuild": rebuild,
    "replay": replay,
    "Ledger.read": Ledger.read,
    "timeline": timeline,
    "cli journal reader": cli._read_journal,  # what `replay` and `timeline` read through
}


def test_the_refusal_is_a_malformed_journal_that_names_what_to_do(two_runs: Path) -> None:
    err = mixed_journal(two_runs, 7, 0)
    assert isinstance(err, MalformedEvent)  # what a damaged journal already raised
    assert str(err).startswith(f"{two_runs}: a second run's header at line 7 (step 0)")
    assert "Split it before line 7" in str(err) and "never rebuilds" in str(err)


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_of_a_file_refuses_two_runs_alike(two_runs: Path, reader: str) -> None:
    before = two_runs.read_bytes()
    with pytest.raises(MixedJournal) as caught:
        READERS[reader](two_runs)
    assert str(caught.value) == str(mixed_journal(two_runs, second_header(two_runs), 0))
    assert two_runs.read_bytes() == before  # reading changed nothing
    assert not two_runs.with_suffix(".png").exists()


def test_a_ledger_fed_record_by_record_refuses_the_second_header(two_runs: Path) -> None:
    """A ledger is also a live journal sink: it has no file, the record count stands in
    for the line (the same number here: a JsonlJournal writes no blank line)."""
    records = [json.loads(line) for line in two_runs.read_text().splitlines()]
    at = second_header(two_runs)
    ledger = Ledger()
    for record in records[: at - 1]:
        ledger.add(record)
    failures = ledger.failures
    with pytest.raises(MixedJournal) as caught:
        ledger.add(records[at - 1])
    assert str(caught.value) == str(mixed_journal(None, at, 0))
    assert ledger.failures == failures and ledger.header == records[0]["header"]
    with pytest.raises(MixedJournal):
        Ledger(records)


@pytest.mark.parametrize("command", ["replay", "timeline"])
def test_the_cli_says_where_to_split_in_one_line(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    out = ["--out", str(tmp_path / "t.png")] if command == "timeline" else []
    assert cli.main([command, str(two_runs), *out]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "Traceback" not in err
    message = str(mixed_journal(two_runs, second_header(two_runs), 0))
    assert err == f"recovery-fsm {command}: error: {message}"
    assert not (tmp_path / "t.png").exists()


def test_resume_refuses_two_runs_before_it_touches_anything(two_runs: Path, tmp_path: Path) -> None:
    """Resume reads the journal before it starts anything: no Ray, no checkpoint root."""
    pytest.importorskip("ray")
    from recovery_fsm.ray.runtime import RecoveryRuntime

    before = two_runs.read_bytes()
    root = tmp_path / "ckpt"
    with pytest.raises(MixedJournal) as caught:
        RecoveryRuntime.resume(root, run="mixed", version=0, journal=two_runs)
    assert str(caught.value) == str(mixed_journal(two_runs, second_header(two_runs), 0))
    assert two_runs.read_bytes() == before and not root.exists()


def test_a_single_run_still_reads_everywhere(
    one_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = list(read_journal(one_run))
    assert sum("header" in r for r in records) == 1 and len(records) == 5
    assert rebuild(one_run).group_state("g1") == "loading"  # restarting from step-0
    assert replay(one_run).ok
    assert Ledger.read(one_run).failures == 1
    assert Ledger(records).failures == 1
    assert cli._read_journal(str(one_run)) == records
    assert cli.main(["replay", str(one_run)]) == 0
    pytest.importorskip("matplotlib")
    assert timeline(one_run).path.stat().st_size > 1000
    assert cli.main(["timeline", str(one_run), "--out", str(tmp_path / "t.png")]) == 0
    assert capsys.readouterr().err == ""
