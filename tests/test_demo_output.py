"""``recovery-fsm demo`` run again into the same ``--out``: each run's files are its own.

A journal appended to by a second run no longer replays (two headers), and a checkpoint
directory left from the first run would count as leaked; so a run replaces what the previous
run wrote there, and refuses a directory holding anything else. One local Ray cluster for
the module, as in test_trainer_and_demo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("rich")

from recovery_fsm import cli  # noqa: E402
from recovery_fsm.search.replay import replay  # noqa: E402

# The smallest run the CLI test in test_trainer_and_demo.py makes: one group, three short
# steps, no chaos, an HF save at v2 (kept, so not leaked).
ARGS = ["demo", "--steps", "3", "--groups", "1", "--model", "tiny", "--step-s", "1",
        "--chaos-rate", "0", "--hf-interval", "2", "--live", "off", "--no-timeline",
        "--out", "demo-out", "--runs", "immediate"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("ray_cluster")


def headers(journal: Path) -> int:
    return sum("header" in json.loads(line) for line in journal.read_text().splitlines())


def test_a_second_run_into_the_same_out_replaces_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`demo --runs immediate,cold`, then `demo --runs immediate`: the second run's journal is
    a journal of one run, and the first run's cold path, which the second did not run, is
    not left beside it."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([*ARGS[:-1], "immediate,cold"]) == 0
    out = tmp_path / "demo-out"
    first = (out / "immediate" / "journal.jsonl").read_text()
    assert (out / "cold" / "journal.jsonl").is_file()
    capsys.readouterr()

    assert cli.main(ARGS) == 0
    said = capsys.readouterr()
    journal = out / "immediate" / "journal.jsonl"
    assert headers(journal) == 1 and journal.read_text() != first
    assert replay(journal).ok
    assert not (out / "cold").exists()
    assert [p.name for p in (out / "immediate" / "checkpoints").iterdir()] == ["step-2"]
    notes = [line for line in said.out.splitlines() if "replac" in line]
    assert len(notes) == 1 and "demo-out" in notes[0], said.out
    assert "Traceback" not in said.err


def test_a_run_refuses_an_out_holding_files_it_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replacing means deleting: only what a demo run writes is ever deleted."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "demo-out" / "immediate" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep me")
    assert cli.main(ARGS) == 1
    err = capsys.readouterr().err
    assert mine.read_text() == "keep me"
    assert len(err.strip().splitlines()) == 1 and "--out" in err, err
    assert not (mine.parent / "journal.jsonl").exists()
