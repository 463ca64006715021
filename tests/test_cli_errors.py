"""``recovery-fsm`` tells a user what went wrong in one line, never a traceback: a bad flag
(exit 2), or a file that is missing or not a journal, or a refusal by the library (exit 1).
Real journals are recorded by a real controller; the broken ones are made from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import short_run

from recovery_fsm import cli


def record(path: Path) -> list[str]:
    """A short real run's journal, as lines."""
    short_run(path)
    return path.read_text().splitlines()


def edited(lines: list[str], n: int, key: str, field: str, value: object) -> list[str]:
    record = json.loads(lines[n])
    record[key][field] = value
    return [*lines[:n], json.dumps(record), *lines[n + 1 :]]


def journals(tmp: Path) -> dict[str, Path]:
    """Files a user might hand to `replay` or `timeline` by mistake, by name."""
    good = record(tmp / "good.jsonl")
    made = {
        "two runs": good + good,  # what the demo used to leave after a second run
        "a list": ["[1, 2]"],
        "a number": ["42"],
        "text": ["hello"],
        "empty": [],
        "header not an object": ['{"step": 0, "header": [1]}', *good[1:]],
        "event not an object": [good[0], '{"step": 1, "event": "x"}'],
        "event without a time": [good[0], good[1], json.dumps(
            {**json.loads(good[2]), "event": {"kind": "ExportStarted", "version": 0}})],
        "unknown controller in the header": edited(good, 0, "header", "rules", "x:Nope"),
    }  # fmt: skip
    paths = {}
    for name, lines in made.items():
        paths[name] = tmp / f"{name.replace(' ', '-')}.jsonl"
        paths[name].write_text("".join(f"{line}\n" for line in lines))
    paths["missing"] = tmp / "missing.jsonl"
    paths["a directory"] = tmp
    return paths


def one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and " error: " in lines[0], err
    return lines[0]


@pytest.mark.parametrize("command", ["replay", "timeline"])
@pytest.mark.parametrize(
    "name",
    ["two runs", "a list", "a number", "text", "empty", "header not an object",
     "event not an object", "event without a time", "missing", "a directory"],
)  # fmt: skip
def test_a_file_that_is_not_a_journal_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, name: str
) -> None:
    path = journals(tmp_path)[name]
    assert cli.main([command, str(path), *(["--out", str(tmp_path / "t.png")]
                                           if command == "timeline" else [])]) == 1  # fmt: skip
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert path.name in line  # which file, and what to pass instead
    assert "journal" in line
    assert not (tmp_path / "t.png").exists()


def test_two_runs_in_one_journal_say_to_use_each_runs_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["replay", str(journals(tmp_path)["two runs"])]) == 1
    assert "each run's own journal" in one_line_error(capsys.readouterr().err)


def test_a_refusal_by_the_library_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The replay's ``rules_class`` refuses the controller the header names."""
    path = journals(tmp_path)["unknown controller in the header"]
    assert cli.main(["replay", str(path)]) == 1
    assert "unknown controller 'x:Nope'" in one_line_error(capsys.readouterr().err)


def test_a_good_journal_still_replays_and_draws(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checks refuse what is not a journal, not a journal."""
    path = journals(tmp_path)["two runs"].with_name("good.jsonl")
    assert cli.main(["replay", str(path)]) == 0
    pytest.importorskip("matplotlib")
    assert cli.main(["timeline", str(path), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--steps", "0"],
        ["demo", "--chaos-rate", "2"],
        ["demo", "--hf-interval", "-1"],
        ["demo", "--model", "huge"],
        ["explore", "--depth", "0"],
        ["explore", "--controller", "nope"],
        ["replay", "j.jsonl", "--controller", "nope"],
        ["bogus"],
        [],
    ],
    ids=lambda argv: " ".join(argv) or "no command",
)
def test_a_bad_flag_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert "--help" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["demo", "diagrams"])
def test_an_out_that_is_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Found before anything starts (the demo would have started Ray first)."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert cli.main([command, "--out", str(taken)]) == 2
    assert "--out" in one_line_error(capsys.readouterr().err)
    assert taken.read_text() == "mine"


def test_the_installed_command_exits_1_with_one_line(tmp_path: Path) -> None:
    """As a user runs it: a process, its exit status, its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "recovery_fsm.cli", "replay", str(tmp_path / "missing.jsonl")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no such file" in one_line_error(done.stderr).lower()
