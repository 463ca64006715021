"""Each engine process's temporary files in one folder, removed once the process is gone.

vLLM writes files in the temporary folder at every boot (its rendezvous file, the config
folder of a boot without weights) that only an orderly shutdown removes, and the runtime
kills engines rather than shut them down: over a run with restarts and standbys they would
pile up. An engine process instead writes them in ``<tmp>/recovery-fsm-engine-<host>-<pid>``
(its temporary folder while it starts the engine), so they go with it:
the runtime removes the folder when it sees the process exit, and every engine that starts
on a machine first removes those of processes that no longer run there (whatever killed
them: Ray, the kernel, a user).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

PREFIX = "recovery-fsm-engine"


def _base() -> Path:
    """The machine's temporary folder, also when asked inside an engine's own."""
    here = Path(tempfile.gettempdir())
    return here.parent if here.name.startswith(PREFIX + "-") else here


def folder(pid: int) -> Path:
    """The scratch folder of process ``pid`` on this machine."""
    return _base() / f"{PREFIX}-{socket.gethostname()}-{pid}"


def claim(exited: Callable[[int], bool]) -> Path:
    """This process's scratch folder, made after removing those of processes of this
    machine that ``exited``."""
    sweep(exited)
    mine = folder(os.getpid())
    mine.mkdir(exist_ok=True)
    return mine


@contextlib.contextmanager
def as_tempdir(path: Path) -> Iterator[None]:
    """``path`` is the temporary folder (``tempfile``, ``TMPDIR``) within the block only:
    for the files an engine's start writes there. Not for the whole process: caches that
    must outlive it (torch's compiled headers, under the temporary folder) would be built
    again at every boot."""
    before_dir, before_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(path), str(path)
    try:
        yield
    finally:
        tempfile.tempdir = before_dir
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env


def remove(pid: int) -> None:
    """Remove the scratch folder of ``pid``, which has exited."""
    shutil.rmtree(folder(pid), ignore_errors=True)


def sweep(exited: Callable[[int], bool]) -> list[int]:
    """Remove the scratch folders of this machine's processes that ``exited``; returns
    their pids. Another user's folders are left alone (not ours to remove, or to read)."""
    gone = []
    mark = f"{PREFIX}-{socket.gethostname()}-"
    for path in _base().glob(mark + "*"):
        pid = path.name.removeprefix(mark)
        try:
            mine = path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if pid.isdigit() and mine and exited(int(pid)):
            remove(int(pid))
            gone.append(int(pid))
    return gone

