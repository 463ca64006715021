"""The committed diagrams are the code's; --check notices drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from recovery_fsm.machines import MACHINES

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recovery_fsm.cli", "diagrams", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


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
    out = tmp_path / "fresh"
    assert _cli("--out", str(out)).returncode == 0
    assert _cli("--check", "--out", str(out)).returncode == 0
