"""A trainer in its own process, for tests/test_resume_ray.py: it runs a named run on the
test's Ray cluster and kills itself (SIGKILL) at a chosen point, or resumes such a run and
reports what it found as one JSON line. Weights are a function of the version (seeded), so
the trainer that resumes at v holds exactly what the dead one exported at v."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import ray
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from recovery_fsm import RecoveryConfig
from recovery_fsm.journal import read_journal
from recovery_fsm.ray import RecoveryRuntime
from recovery_fsm.search.replay import replay
from recovery_fsm.trainer import RecoveryHooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TINY_LLAMA

PINNED = 2  # the version the trainer "checkpoints": its recovery checkpoint is pinned


def model(version: int) -> Any:
    torch.manual_seed(1000 + version)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()


def options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        groups=["g0", "g1"],
        model_config=LlamaConfig(**TINY_LLAMA).to_dict(),
        config=RecoveryConfig(restart_budget=5, standby=args.standby),
        tick_s=0.1,
        probe_interval_s=0.5,
        probe_timeout_s=2.0,
        grace_s=1.0,
        call_timeout_s=60.0,
    )


def _id(actor: Any) -> str:
    return str(actor._actor_id.hex())


def alive(run: str) -> list[str]:
    """The actors of the run's namespace still in the cluster."""
    ns, out = f"recovery-fsm.{run}", []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == ns:
            try:
                out.append(_id(ray.get_actor(entry["name"], namespace=ns)))
            except ValueError:
                continue  # gone since it was listed
    return sorted(out)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def sync(rt: RecoveryRuntime, version: int, *, pinned: bool = False) -> Any:
    m = model(version)
    got = rt.push(m, version)
    return rt.synced(version, got, m, pinned=pinned)


def until(what: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise TimeoutError("the runtime did not get there in time")
        time.sleep(0.02)


def crash(args: argparse.Namespace) -> None:
    rt = RecoveryRuntime(args.root, run=args.run, journal=args.journal, **options(args))
    t0 = time.perf_counter()
    rt.start(model(0))
    start_s = time.perf_counter() - t0
    for v in range(1, PINNED + 1):
        sync(rt, v, pinned=v == PINNED).result(timeout=60)
    until(lambda: all(g.serving for g in rt.controller.groups().values()))
    until(lambda: len([s for s in rt.controller.standbys().values() if s.ready]) == args.standby)
    standby_actors = {
        s: [_id(a) for a in rt.actors_table.of(s, 1)] for s in rt.controller.standbys()
    }
    print(json.dumps({"boots": rt.launcher.boots, "start_s": start_s,
                      "standby_actors": standby_actors}), flush=True)  # fmt: skip
    if args.at == "sync":  # the weights of 3 reached the engines; nobody reported it
        rt.push(model(PINNED + 1), PINNED + 1)
        die()
    if args.at == "export":  # reported, its export still running
        sync(rt, PINNED + 1)
        die()
    if args.at == "commit":  # C(3) renamed into place; the trainer dies before reporting it
        send = rt.exporter._send

        def dies_on_commit(cls: Any, **fields: Any) -> None:
            if cls.__name__ == "ExportCommitted":
                die()
            send(cls, **fields)

        rt.exporter._send = dies_on_commit  # type: ignore[method-assign]
        sync(rt, PINNED + 1)
        time.sleep(60)  # killed long before
    if args.at == "recovered":  # g1 died and serves again, as incarnation 2; then quiet
        rt.kill("g1")
        until(lambda: rt.controller.group("g1").incarnation == 2)
        until(lambda: rt.controller.group("g1").serving)
        die()
    if args.at == "recovered-beside":  # and g1's first process is back beside its second,
        rt.kill("g1")  # as if the kill of it had never landed: two of g1 survive the trainer
        until(lambda: rt.controller.group("g1").incarnation == 2)
        until(lambda: rt.controller.group("g1").serving)
        # Made here, beside the runtime (its table would kill a stopped incarnation's).
        path, launcher = rt.controller.checkpoints()[PINNED].path, rt.launcher
        older = launcher._engine.options(
            **launcher.actor_options, **launcher._naming("g1", 1)
        ).remote(launcher._model_config, "g1", 1)
        ray.get(older.boot_from_checkpoint.remote(path, epoch=launcher.epoch), timeout=60)
        print(json.dumps({"g1_newest": [_id(a) for a in rt.actors_table.of("g1", 2)],
                          "g1_older": [_id(older)]}), flush=True)  # fmt: skip
        die()
    if args.at == "recovery":  # g1 died; its restart from C(2) is in flight
        rt.kill("g1")
        until(lambda: rt.controller.group("g1").starting)
        die()
    if args.at == "alive":  # never dies: it goes on pushing a future of its own
        keep_pushing(rt)
        return
    raise SystemExit(f"unknown point {args.at}")


def keep_pushing(rt: RecoveryRuntime) -> None:
    """The trainer a supervisor thought dead: it pushes versions 3, 4, ... (weights of its
    own, unlike the resumed run's) until the runtime stops it, and says how it was told."""
    v = PINNED
    try:
        while True:
            v += 1
            m = model(500 + v)
            got = rt.push(m, v)
            print(json.dumps({"pushed": v, "got": got}), flush=True)
            rt.synced(v, got, m)
            time.sleep(0.3)
    except Exception as err:
        first = getattr(err, "first", None)
        print(json.dumps({"stopped": type(err).__name__, "first": type(first).__name__,
                          "message": str(err), "at": v}), flush=True)  # fmt: skip
        rt.close(drain_timeout_s=5.0)
        left = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == f"recovery-fsm.{rt.launcher.run}"]  # fmt: skip
        print(json.dumps({"closed": True, "engines_left": len(left)}), flush=True)


def resume(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    # With the journal lost, the resume rebuilds from the store and journals afresh there.
    lost = not os.path.exists(args.journal)
    rt, found = RecoveryRuntime.resume(
        args.root, run=args.run, version=PINNED, journal=args.journal, from_store=lost,
        pinned=[PINNED] if lost else [], **options(args),
    )  # fmt: skip
    resume_s = time.perf_counter() - t0
    boots_at_resume = rt.launcher.boots
    group_actors = {g: [_id(a) for a in rt.actors_table.of(g, v.incarnation)]
                    for g, v in rt.controller.groups().items()}  # fmt: skip
    kept = {i for ids in group_actors.values() for i in ids}
    kept |= {_id(a) for s in rt.controller.standbys() for a in rt.actors_table.of(s, 1)}
    with contextlib.suppress(TimeoutError):  # a kill lands shortly after it is asked;
        until(lambda: set(alive(args.run)) <= kept, timeout=30.0)  # the test says what stays
    alive_at_resume = alive(args.run)
    records = list(read_journal(args.journal))[found.replayed :]
    resumed_kinds = [r["event"]["kind"] for r in records if "event" in r]
    served_before_sync = {g: rt.generate(g, [1, 2, 3], 2).version for g in ("g0", "g1")}
    sync(rt, PINNED + 1).result(timeout=60)
    until(lambda: all(g.serving for g in rt.controller.groups().values()))
    served = {g: rt.generate(g, [1, 2, 3], 2).version for g in ("g0", "g1")}
    standbys = {s: [v.state, v.version, [_id(a) for a in rt.actors_table.of(s, 1)]]
                for s, v in rt.controller.standbys().items()}  # fmt: skip
    claimed: list[str] = []
    if args.standby:  # g0 dies: the standby that outlived the trainer takes its place
        n = rt.controller.group("g0").incarnation + 1
        rt.kill("g0")
        until(lambda: rt.controller.group("g0").incarnation == n)
        # Routed, not only serving: the route is applied on the effect thread just after.
        until(lambda: (r := rt.routes.get("g0")) is not None and r[0] == n)
        claimed = [_id(a) for a in rt.actors_table.of("g0", n)]
        served["g0 after its death"] = rt.generate("g0", [1, 2, 3], 2).version
    stats = rt.statistics()
    views = rt.controller.groups()
    # Each engine knows itself by the number the controller gives its process now.
    whoami = {g: [list(ray.get(a.whoami.remote(), timeout=30))
                  for a in rt.actors_table.of(g, v.incarnation)]
              for g, v in views.items()}  # fmt: skip
    dirs = sorted(os.listdir(args.root))
    closed = RecoveryHooks(rt).close()  # the trainer's hooks close the runtime
    drained = closed.drained
    left = [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == f"recovery-fsm.{args.run}"]  # fmt: skip
    report = replay(args.journal)
    print(json.dumps({
        "resumption": attrs.asdict(found),
        "boots_at_resume": boots_at_resume,
        "group_actors": group_actors,
        "alive_at_resume": alive_at_resume,
        "resumed_kinds": resumed_kinds,
        "resume_s": resume_s,
        "boots": rt.launcher.boots,
        "served_before_sync": served_before_sync,
        "served": served,
        "standbys": standbys,
        "claimed": claimed,
        "incarnations": {g: v.incarnation for g, v in views.items()},
        "whoami": whoami,
        "dirs": dirs,
        "dirs_after_close": sorted(os.listdir(args.root)),
        "hf_saves": {v: os.path.basename(p) for v, p in closed.hf_saves.items()},
        "loads_from_deleted": stats.loads_from_deleted,
        "refused_reports": stats.refused_reports,
        "drained": drained,
        "left": len(left),
        "replay_ok": report.ok,
        "replay": report.render(),
    }), flush=True)


def resume_beside(args: argparse.Namespace) -> None:
    """Resume while the old trainer still runs and pushes; sync 3 (the new run's weights),
    let the old one try for a while, and report what each engine holds."""
    from recovery_fsm.export import model_digest
    from recovery_fsm.journal import owner_path

    rt, found = RecoveryRuntime.resume(
        args.root, run=args.run, version=PINNED, journal=args.journal, **options(args)
    )
    sync(rt, PINNED + 1).result(timeout=60)
    until(lambda: all(g.serving for g in rt.controller.groups().values()))
    time.sleep(3.0)  # the old trainer pushes on, if it can
    views = rt.controller.groups()
    held = {g: [ray.get(a.weights.remote(), timeout=30).digest
                for a in rt.actors_table.of(g, v.incarnation)]
            for g, v in views.items()}  # fmt: skip
    stats = rt.statistics()
    records = list(read_journal(args.journal))
    print(json.dumps({
        "epoch": found.epoch,
        "resumption": attrs.asdict(found),
        "held": held,
        "want": model_digest(model(PINNED + 1)),
        "version": rt.controller.version,
        "serving": {g: v.serving for g, v in views.items()},
        "steps": [r["step"] for r in records if "step" in r],
        "owner": json.loads(owner_path(args.journal).read_text()),
        "pid": os.getpid(),
        "loads_from_deleted": stats.loads_from_deleted,
    }), flush=True)
    rt.close()
    print(json.dumps({"replay_ok": replay(args.journal).ok}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["crash", "resume", "resume-beside"])
    p.add_argument("--address", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--at", default="")
    p.add_argument("--standby", type=int, default=0)
    args = p.parse_args()
    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    {"crash": crash, "resume": resume, "resume-beside": resume_beside}[args.mode](args)


if __name__ == "__main__":
    main()
