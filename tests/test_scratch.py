"""An engine process's temporary files live in one folder that goes once the process is
gone, whatever killed it. Real processes here: a Python child claims its folder, writes in
it through ``tempfile`` as vLLM does, and is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")

from recovery_fsm.ray import scratch
from recovery_fsm.ray.actors import exited

CHILD = """
import sys, tempfile, time
from recovery_fsm.ray import scratch
from recovery_fsm.ray.actors import exited
mine = scratch.claim(exited)
with scratch.as_tempdir(mine):  # as VLLMEngine starts vLLM, which writes its rendezvous file
    fd, path = tempfile.mkstemp(prefix="vllm_dist_")
after = tempfile.mkstemp()[1]  # outside the block: the machine's folder again
import os; os.unlink(after)
assert not after.startswith(str(mine)), after
print(mine, path, flush=True)
time.sleep(600)
"""


def _child() -> tuple[subprocess.Popen[str], Path, Path]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    mine, path = proc.stdout.readline().split()
    return proc, Path(mine), Path(path)


def test_a_killed_engine_process_leaves_nothing_once_a_sweep_runs() -> None:
    proc, mine, written = _child()
    try:
        assert mine == scratch.folder(proc.pid) and mine.is_dir()
        assert written.parent == mine  # not in the machine's temporary folder
        assert proc.pid not in scratch.sweep(exited)
        assert mine.exists()  # alive: kept
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.pid in scratch.sweep(exited)
    assert not mine.exists() and not written.exists()


def test_the_wait_for_an_exit_removes_the_folder() -> None:
    from recovery_fsm.ray.actors import _exits_by

    proc, mine, _ = _child()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _exits_by(proc.pid, deadline=float("inf"))
    assert not mine.exists()


def test_another_hosts_folder_is_left_alone() -> None:
    base = Path(tempfile.gettempdir())
    other = base / f"{scratch.PREFIX}-another-host-1"  # another machine sharing the folder
    other.mkdir(exist_ok=True)
    try:
        scratch.sweep(exited)
        assert other.exists()
    finally:
        other.rmdir()
