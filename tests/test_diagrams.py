"""The committed diagrams are the code's; --check notices drift."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recovery_fsm.machines import MACHINES

ROOT = Path(__file__).resolve().parent.parent
HAVE_DOT = shutil.which("dot") is not None


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recovery_fsm.cli", "diagrams", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture
def env_without_dot(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH holds no Graphviz, as on a fresh machine.

    diagrams.py finds ``dot`` through PATH (shutil.which), so a PATH of only the interpreter's
    directory and an empty one hides it even where Graphviz is installed.
    """
    empty = tmp_path / "bin"
    empty.mkdir()
    path = os.pathsep.join([str(empty), str(Path(sys.executable).parent)])
    assert shutil.which("dot", path=path) is None, path
    return {**os.environ, "PATH": path}


def test_committed_diagrams_match_the_code() -> None:
    done = _cli("--check", "--out", str(ROOT / "diagrams"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_fails_on_drift(tmp_path: Path) -> None:
    out = tmp_path / "diagrams"
    shutil.copytree(ROOT / "diagrams", out)
    (out / "checkpoint.mmd").write_text("stateDiagram-v2\n")
    done = _cli("--check", "--out", str(out))
    assert done.returncode == 1
    assert "checkpoint.mmd differs" in done.stderr
    (out / "worker_group.mmd").unlink()
    assert "worker_group.mmd is missing" in _cli("--check", "--out", str(out)).stderr


def test_every_state_of_every_machine_is_drawn() -> None:
    page = (ROOT / "diagrams" / "README.md").read_text()
    for name, cls in MACHINES.items():
        mermaid = (ROOT / "diagrams" / f"{name}.mmd").read_text()
        for state in cls.states_map:
            assert f"as {state}" in mermaid, (name, state)
        assert mermaid.strip() in page


def test_write_then_check_round_trips(tmp_path: Path) -> None:
    """With this machine's PATH: where Graphviz is installed (CI) SVGs are written and compared."""
    out = tmp_path / "fresh"
    written = _cli("--out", str(out))
    assert written.returncode == 0, written.stdout + written.stderr
    assert bool(list(out.glob("*.svg"))) == HAVE_DOT
    done = _cli("--check", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_dot_round_trip_and_committed_check_pass(
    tmp_path: Path, env_without_dot: dict[str, str]
) -> None:
    """No Graphviz: nothing to render, so check compares the text files and says SVGs were not."""
    out = tmp_path / "fresh"
    written = _cli("--out", str(out), env=env_without_dot)
    assert written.returncode == 0, written.stdout + written.stderr
    assert "SVG files not written" in written.stdout
    assert not list(out.glob("*.svg"))
    assert {p.name for p in out.glob("*.dot")} == {f"{name}.dot" for name in MACHINES}

    for directory in (out, ROOT / "diagrams"):
        done = _cli("--check", "--out", str(directory), env=env_without_dot)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SVG files not compared" in done.stdout


def test_without_dot_check_still_catches_dot_drift(
    tmp_path: Path, env_without_dot: dict[str, str]
) -> None:
    """Skipping the SVGs must not skip their .dot sources."""
    out = tmp_path / "diagrams"
    shutil.copytree(ROOT / "diagrams", out)
    (out / "checkpoint.dot").write_text("digraph {}\n")
    done = _cli("--check", "--out", str(out), env=env_without_dot)
    assert done.returncode == 1
    assert "checkpoint.dot differs" in done.stderr


@pytest.mark.skipif(not HAVE_DOT, reason="Graphviz `dot` is not installed here")
def test_with_dot_a_missing_svg_is_an_error(tmp_path: Path) -> None:
    """Where SVGs can be rendered, the committed ones are still demanded."""
    out = tmp_path / "diagrams"
    shutil.copytree(ROOT / "diagrams", out)
    (out / "worker_group.svg").unlink()
    done = _cli("--check", "--out", str(out))
    assert done.returncode == 1
    assert "worker_group.svg is missing" in done.stderr
