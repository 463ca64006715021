"""The trainer's own crash, for real: a trainer process on this Ray cluster runs a named run
(detached engines), SIGKILLs itself in the middle of a sync, of an export or of a recovery;
a new trainer process resumes at its checkpoint's version. Counted: engine boots (none where
a surviving engine holds the weights or can load them), directories left behind (none but
the pinned checkpoint and the new one), stale admissions (none: every answer comes from
the fleet's version), and the whole run's journal replays clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("ray_cluster")

TRAINER = Path(__file__).parent / "procs" / "resume_trainer.py"


def trainer(
    mode: str, tmp_path: Path, at: str = "", standby: int = 0
) -> tuple[int, list[dict[str, Any]]]:
    address = ray.get_runtime_context().gcs_address
    cmd = [
        sys.executable, str(TRAINER), mode, "--address", address,
        "--root", str(tmp_path / "ckpt"), "--journal", str(tmp_path / "journal.jsonl"),
        "--run", f"resume-{tmp_path.name}", "--at", at, "--standby", str(standby),
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, check=False)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if mode == "resume" and done.returncode != 0:
        raise AssertionError(f"the resumed trainer failed:\n{done.stderr[-4000:]}")
    return done.returncode, lines


@pytest.mark.parametrize("at", ["sync", "export", "commit", "recovery"])
def test_a_trainer_killed_mid_way_resumes_on_the_engines_that_survived(
    tmp_path: Path, at: str
) -> None:
    code, before = trainer("crash", tmp_path, at)
    assert code == -9, f"the trainer was to die by SIGKILL at {at}"
    assert before and before[0]["boots"] == 2  # one engine per group, both alive

    _, (after,) = trainer("resume", tmp_path)
    found = after["resumption"]
    assert found["settled"] and found["version"] == 2
    if at == "recovery":
        # g0 held C(2)'s weights: adopted as it was. g1's restart from C(2) may have booted
        # before the crash (then it is adopted too) or not (then it boots now, once).
        assert "g0" in found["adopted"]
        assert after["boots_at_resume"] <= 1
    else:
        # Both engines hold version 3, which no record vouches for after the crash: each
        # loads C(2) in place. Not one engine boots.
        assert sorted(found["reloaded"]) == ["g0", "g1"]
        assert after["boots_at_resume"] == 0
    # No stale admission: before and after the next sync, every answer is the fleet's.
    assert after["served_before_sync"] == {"g0": 2, "g1": 2}
    assert after["served"] == {"g0": 3, "g1": 3}
    # Nothing leaked: the pinned C(2) and the new C(3); no temporaries, no abandoned C(3).
    assert after["dirs"] == ["step-2", "step-3"]
    assert after["dirs_after_close"] == ["step-2"]  # shutdown deletes what is not pinned
    assert after["hf_saves"] == {"2": "step-2"}  # the run's save, made before the crash
    assert after["loads_from_deleted"] == 0
    assert after["drained"] and after["left"] == 0  # every detached engine is gone
    assert after["replay_ok"], after["replay"]
    if at == "commit":  # C(3) was on disk, never reported: reported at the resume, then deleted
        assert "ExportCommitted" in after["resumed_kinds"]


def test_a_standby_that_outlived_the_trainer_is_kept_and_claimed_without_a_boot(
    tmp_path: Path,
) -> None:
    """Killed mid-export, the standby holds version 3 (the push reached it), which nothing
    vouches for after the crash: asked like a group, it loads C(2) in place. Not one engine
    boots at the resume; the same standby process then takes over a killed g0 and answers
    with the fleet's weights."""
    code, before = trainer("crash", tmp_path, "export", standby=1)
    assert code == -9
    assert before and before[0]["boots"] == 3  # g0, g1 and the standby
    (standby,) = before[0]["standby_actors"]["standby-1"]

    _, (after,) = trainer("resume", tmp_path, standby=1)
    found = after["resumption"]
    assert found["settled"] and found["standbys"] == ["standby-1"]
    assert after["boots_at_resume"] == 0 and found["killed"] == 0
    assert sorted(found["reloaded"]) == ["g0", "g1"]
    # Current after the resume's sync to 3 (pushed to once it answered), the same process.
    assert after["standbys"]["standby-1"] == ["ready", 3, [standby]]
    assert after["claimed"] == [standby]  # g0's second process is the standby's
    assert after["served"] == {"g0": 3, "g1": 3, "g0 after its death": 3}
    assert after["loads_from_deleted"] == 0 and after["refused_reports"] == 0
    assert after["drained"] and after["left"] == 0
    assert after["replay_ok"], after["replay"]


@pytest.mark.parametrize("at", ["export", "recovered", "recovered-beside"])
def test_a_trainer_whose_journal_is_lost_resumes_from_the_checkpoint_store(
    tmp_path: Path, at: str
) -> None:
    """The journal went with the trainer (a node's local disk): the resume rebuilds from the
    store. Not one engine boots: killed mid-export both hold 3, which nothing vouches for,
    and load C(2) in place; killed after g1's recovery both hold C(2)'s weights and serve
    again as they are, g1 on its second process, renamed to the new controller's number.
    The pinned C(2) is the source, the rest is deleted, the new journal replays clean."""
    code, before = trainer("crash", tmp_path, at)
    assert code == -9, f"the trainer was to die by SIGKILL at {at}"
    assert before and before[0]["boots"] == 2
    (tmp_path / "journal.jsonl").unlink()  # lost

    _, (after,) = trainer("resume", tmp_path)
    found = after["resumption"]
    assert found["rebuilt_from"] == "store" and found["replayed"] == 0
    if at == "recovered-beside":  # two of g1 survived: its newest is kept, the older goes
        beside = before[1]
        assert after["group_actors"]["g1"] == beside["g1_newest"]
        assert not set(beside["g1_older"]) & set(after["alive_at_resume"])
    assert found["settled"] and found["version"] == 2
    moved = "reloaded" if at == "export" else "adopted"
    assert sorted(found[moved]) == ["g0", "g1"] and found["restarted"] == []
    assert after["boots_at_resume"] == 0
    # Renamed: the new controller numbers each process from 1 (a load in place counts on);
    # each engine answers with the controller's number (a later resume finds it by that).
    assert after["whoami"] == {g: [[g, n]] for g, n in after["incarnations"].items()}
    assert after["served_before_sync"] == {"g0": 2, "g1": 2}
    assert after["served"] == {"g0": 3, "g1": 3}
    assert after["dirs"] == ["step-2", "step-3"]  # no temporary, no untracked C(3)
    assert after["dirs_after_close"] == ["step-2"]  # pinned=[2] kept it
    assert after["loads_from_deleted"] == 0
    assert after["drained"] and after["left"] == 0
    assert after["replay_ok"], after["replay"]


def test_a_resume_the_journal_cannot_take_is_refused_before_anything_is_touched(
    tmp_path: Path,
) -> None:
    """A version past the journal's fleet, or a run that was closed, is refused before an
    engine is killed or a directory scanned: an orphaned temporary and a checkpoint of the
    future stay on disk, the journal keeps every byte."""
    from conftest import TINY_LLAMA

    from recovery_fsm import RecoveryConfig, RecoveryController
    from recovery_fsm import events as ev
    from recovery_fsm.export import CheckpointStore
    from recovery_fsm.journal import JsonlJournal
    from recovery_fsm.ray import BadRuntimeInput, RecoveryRuntime

    store = CheckpointStore(tmp_path / "ckpt")
    temp, future = store.temp_path(3), store.path_for(3)
    temp.mkdir()
    future.mkdir()

    def journal(name: str, *, closed: bool) -> Path:
        path = tmp_path / name
        with JsonlJournal(path) as sink:
            c = RecoveryController(RecoveryConfig(), journal=sink)
            c.handle(ev.GroupRegistered("g0", 0, at=0.0))
            for v in (1, 2):
                c.handle(ev.WeightsSynced(v, {"g0": 1}, at=float(v)))
            if closed:
                c.handle(ev.Shutdown(at=3.0))
        return path

    def refused(path: Path | None, version: Any, match: str, **kw: Any) -> None:
        before = path.read_bytes() if path is not None and path.is_file() else None
        with pytest.raises(BadRuntimeInput, match=match):
            RecoveryRuntime.resume(
                store.root, run=f"refused-{tmp_path.name}", version=version, journal=path,
                **{"groups": ["g0"], "model_config": TINY_LLAMA, **kw},
            )  # fmt: skip
        assert temp.is_dir() and future.is_dir()
        assert before is None or path is None or path.read_bytes() == before
        assert not list(tmp_path.glob("*.resuming"))  # no journal half-written

    running = journal("running.jsonl", closed=False)
    refused(running, 3, "only reached 2")
    refused(running, "2", "an int >= 0")
    refused(journal("closed.jsonl", closed=True), 2, "was closed")
    # The store is never chosen for the user: a journal missing by mistake must not lose
    # the checkpoints it pinned; and a journal that is there is the run's account.
    refused(tmp_path / "typo.jsonl", 2, "from_store=True rebuilds")
    refused(None, 2, "needs the run's journal")
    refused(running, 2, "there is a journal", from_store=True)
    refused(running, 2, "a journal's pins are the run's", pinned=[2])
    refused(None, 2, "a collection of versions", from_store=True, pinned=2)
    refused(None, 2, "a collection of versions", from_store=True, pinned=["2"])
    refused(None, 2, "a collection of versions", from_store=True, pinned=[-1])
    refused(None, 2, "from_store must be a bool", from_store="yes")
    refused(None, 2, "not initial_version", from_store=True, initial_version=2)
    refused(tmp_path / "no" / "j.jsonl", 2, "does not exist", from_store=True)
    refused(tmp_path, 2, "is not a file")  # a directory where the journal should be
    # Bad groups are refused from the store too, before any engine or file is touched.
    refused(tmp_path / "new.jsonl", 2, "groups=", from_store=True, groups=["g0", "g0"])
    assert not (tmp_path / "new.jsonl").exists()


def test_a_resume_fences_the_trainer_it_replaces_while_that_one_still_pushes(
    tmp_path: Path,
) -> None:
    """The old trainer was not dead (a supervisor killed its wrapper): it goes on pushing
    weights of its own while a new trainer resumes the run. The resume claims the journal's
    next epoch and tells every engine; from then on the engines refuse the old trainer's
    commands and its journal records are refused. Checked: every engine holds exactly the
    new run's weights after the old one kept trying, the journal has one writer (steps
    consecutive, replays clean), no engine was booted or killed by either, and the old
    trainer stopped with ``ControllerStopped`` caused by ``Fenced``."""
    address = ray.get_runtime_context().gcs_address
    common = ["--address", address, "--root", str(tmp_path / "ckpt"), "--journal",
              str(tmp_path / "journal.jsonl"), "--run", f"fence-{tmp_path.name}"]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    old = subprocess.Popen(
        [sys.executable, str(TRAINER), "crash", *common, "--at", "alive"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        lines: list[dict[str, Any]] = []
        assert old.stdout is not None
        while not any("pushed" in x for x in lines):  # it runs, and pushes
            line = old.stdout.readline()
            assert line, "the old trainer ended early"
            if line.startswith("{"):
                lines.append(json.loads(line))
        new = subprocess.run(
            [sys.executable, str(TRAINER), "resume-beside", *common],
            capture_output=True, text=True, timeout=400, env=env, check=False,
        )  # fmt: skip
        assert new.returncode == 0, new.stderr[-4000:]
        out, _ = old.communicate(timeout=120)
    finally:
        if old.poll() is None:
            old.kill()
    lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    report, replayed = [json.loads(x) for x in new.stdout.splitlines() if x.startswith("{")]
    assert report["epoch"] == 2 and report["owner"]["epoch"] == 2
    assert report["owner"]["pid"] == report["pid"]  # one writer: the resumed trainer
    # Not one of the old trainer's commands ran after the takeover: every engine holds the
    # new run's weights of 3, though the old trainer pushed its own 3, 4, ... meanwhile.
    assert report["version"] == 3 and all(report["serving"].values())
    assert report["held"] == {g: [report["want"]] for g in ("g0", "g1")}
    assert report["resumption"]["restarted"] == [] and report["loads_from_deleted"] == 0
    steps = report["steps"]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # no interleaved writer
    assert replayed["replay_ok"]
    # The old trainer was told why, and left the engines to the run that replaced it.
    [stopped] = [x for x in lines if "stopped" in x]
    assert stopped["stopped"] == "ControllerStopped" and stopped["first"] == "Fenced"
    assert "replaced by a resume" in stopped["message"]
    assert any(x.get("closed") for x in lines)
