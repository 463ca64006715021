"""The Ray runtime on a real local Ray cluster, with tiny Llama engines built from a config.

One cluster for the module; every test makes its own runtime and kills only its own actors.
Each test's journal is replayed through the search's world model at the end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA, process_gone, serving, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import RecoveryConfig, Rules  # noqa: E402
from recovery_fsm.export import model_digest  # noqa: E402
from recovery_fsm.ray import RecoveryRuntime, ReferenceEngine, StartFailed  # noqa: E402
from recovery_fsm.search.replay import replay  # noqa: E402

# The engines that misbehave are defined here: Ray's workers cannot import a test module,
# so this one's classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = TINY_LLAMA


pytestmark = pytest.mark.usefixtures("ray_cluster")


def trainer() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def _state(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step(model: Any) -> None:
    """A stand-in for an optimizer step: every weight changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)



def runtime(tmp_path: Path, **kwargs: Any) -> RecoveryRuntime:
    options: dict[str, Any] = dict(
        groups=["g0", "g1"],
        model_config=LlamaConfig(**CONFIG).to_dict(),
        journal=tmp_path / "journal.jsonl",
        tick_s=0.1,
        probe_interval_s=0.5,
        probe_timeout_s=1.0,
        grace_s=0.5,
        call_timeout_s=60.0,
    )
    options.update(kwargs)
    return RecoveryRuntime(tmp_path / "ckpt", **options)


def journal_events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    records = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    return [r["event"] for r in records if r.get("event", {}).get("kind") == kind]


def serving_v1(rt: RecoveryRuntime, model: Any) -> None:
    """Boot the groups, make a step, sync it as version 1 and wait for its export."""
    rt.start(model)
    step(model)
    rt.sync(model, 1)
    wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")


def assert_replays_clean(tmp_path: Path) -> None:
    report = replay(tmp_path / "journal.jsonl")
    assert report.ok, report


def test_a_killed_group_boots_from_the_committed_checkpoint(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path) as rt:
        rt.start(model)
        step(model)
        assert rt.sync(model, 1) == {"g0": 1, "g1": 1}
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        before = rt.generate("g0", [1, 2, 3])
        assert (before.version, before.incarnation) == (1, 1)

        rt.kill("g0")
        # Routed, not only active: the routing effect runs just after the transition.
        wait_for(lambda: rt.controller.group("g0").incarnation == 2
                 and rt.routes["g0"] == (2, 1), what="g0 recovered")  # fmt: skip
        after = rt.generate("g0", [1, 2, 3])
        assert (after.version, after.incarnation) == (1, 2)
        assert after.tokens == before.tokens  # the same weights, so the same greedy tokens
        held = ray.get(rt.actors("g0", 2)[0].weights.remote())
        assert held.digest == model_digest(model)
        stats = rt.statistics()
        assert stats.recoveries == {"immediate": 1}
        assert rt.routes["g0"] == (2, 1)
    # The death was seen by the watch call (at once), not by missed probes.
    assert [e["reason"] for e in journal_events(tmp_path, "GroupFailed")] == ["actor died"]
    assert_replays_clean(tmp_path)


class HangingEngine(ReferenceEngine):
    """Boots from a checkpoint never (the first process only): a hung load."""

    def boot_from_checkpoint(self, path: str) -> Any:
        if self.incarnation == 2:
            time.sleep(3600)
        return super().boot_from_checkpoint(path)


def test_a_hung_load_is_killed_at_its_deadline_and_restarted(tmp_path: Path) -> None:
    model = trainer()
    config = RecoveryConfig(load_timeout_s=3.0, relaunch_timeout_s=30.0)
    with runtime(tmp_path, config=config, engine=HangingEngine) as rt:
        serving_v1(rt, model)
        rt.kill("g0")
        wait_for(lambda: rt.controller.group("g0").incarnation == 2, what="restart")
        assert rt.controller.group_state("g0") == "loading"
        # Past the deadline the load is stopped, recovery cools, and the group goes cold.
        wait_for(lambda: rt.controller.group("g0").incarnation >= 3
                 and rt.controller.group_state("g0") in ("pending_weights", "active"),
                 timeout=60, what="cold restart after the deadline")  # fmt: skip
        assert rt.controller.recovery_state("g0") == "cooldown"
        assert rt.actors("g0", 2) == []
        step(model)
        assert rt.sync(model, 2)["g0"] == rt.controller.incarnation("g0")
        # The sync admits it; its route reaches the router through the effect thread.
        wait_for(lambda: serving(rt, "g0"), what="g0 routed after the sync admitted it")
        assert rt.generate("g0", [5, 6]).version == 2
    assert_replays_clean(tmp_path)


def test_a_group_killed_during_the_export_boots_when_it_commits(tmp_path: Path) -> None:
    model = trainer()
    release = threading.Event()

    def gated(path: Any) -> Any:  # the export writes nothing until the test says so
        release.wait(120)
        return open(path, "xb")  # the exporter closes it

    rt = runtime(tmp_path, exporter_options={"opener": gated})
    try:
        rt.start(model)
        step(model)
        rt.sync(model, 1)
        assert rt.controller.checkpoint_state(1) == "exporting"
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "awaiting_checkpoint", what="wait")
        time.sleep(1.0)  # it keeps waiting: nothing else will start it
        assert rt.controller.group_state("g0") == "awaiting_checkpoint"
        release.set()
        wait_for(lambda: serving(rt, "g0"), what="boot on commit")
        assert rt.statistics().recoveries == {"waited": 1}  # waited for the export, then booted
        assert rt.generate("g0", [7]).version == 1
    finally:
        release.set()
        rt.close()
    assert_replays_clean(tmp_path)


class SlowEngine(ReferenceEngine):
    """Its second process takes a few seconds to load a checkpoint."""

    def boot_from_checkpoint(self, path: str) -> Any:
        if self.incarnation == 2:
            time.sleep(4)
        return super().boot_from_checkpoint(path)


def test_a_checkpoint_in_use_outlives_its_sync_and_stale_weights_never_serve(
    tmp_path: Path,
) -> None:
    model = trainer()
    routed: list[Any] = []
    with runtime(tmp_path, engine=SlowEngine, router=routed.append) as rt:
        serving_v1(rt, model)
        step_1 = Path(rt.controller.checkpoints()[1].path or "")
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "loading", what="loading v1")
        step(model)
        assert "g0" not in rt.sync(model, 2)  # a sync meanwhile, without g0
        wait_for(lambda: rt.controller.checkpoint_state(2) == "ready", what="export of v2")
        # Superseded, but its load still reads it: not deleted.
        assert rt.controller.checkpoint_state(1) == "superseded" and step_1.is_dir()
        wait_for(lambda: not step_1.exists(), what="v1 deleted once its lease is released")
        # It loaded v1 after the fleet moved to v2: never routed on v1. Instead of idling
        # until the next sync, the same process loads C(2) in place and serves v2.
        # (the same process goes on as incarnation 3)
        wait_for(lambda: rt.routes.get("g0") == (3, 2), what="g0 caught up from C(2)")
        assert not [e for e in routed if e.group == "g0" and e.incarnation == 2
                    and getattr(e, "version", None) == 1]  # fmt: skip
        out = rt.generate("g0", [3])
        assert (out.version, out.incarnation) == (2, 3)  # the same process, renumbered
        records = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
        loads = [f for r in records for f in r.get("effects", ()) if f["kind"] == "LoadCheckpoint"]
        assert [(f["group"], f["incarnation"], f["version"], f["previous"]) for f in loads] == [
            ("g0", 3, 2, 2)
        ]
        # The process that loaded in place is still watched: its death is seen at once.
        rt.kill("g0")
        wait_for(lambda: any(e["incarnation"] == 3 and e["reason"] == "actor died"
                             for e in journal_events(tmp_path, "GroupFailed")),
                 timeout=30, what="the watch reports the death")  # fmt: skip
        wait_for(lambda: serving(rt, "g0"), what="g0 serves again")
        step(model)
        assert rt.sync(model, 3).get("g0") == rt.controller.incarnation("g0")
        assert rt.generate("g0", [3]).version == 3
        # After a restart, a load in place and a second restart: one watch per actor of the
        # current processes, one table entry per group.
        wait_for(lambda: rt.bookkeeping()["monitor.armed"] == 2, what="watches of 2 actors")
        sizes = rt.bookkeeping()
        assert sizes["actors.current"] == 2 and sizes["monitor.watches"] <= 2, sizes
    assert_replays_clean(tmp_path)


def gated_update(flags: str) -> type[ReferenceEngine]:
    """A reference engine whose weight update waits while ``<flags>/<group>`` exists."""

    class GatedUpdateEngine(ReferenceEngine):
        def update_weights(self, version: int, weights: Any) -> Any:
            while os.path.exists(os.path.join(flags, self.group)):
                time.sleep(0.02)
            return super().update_weights(version, weights)

    return GatedUpdateEngine


def test_a_push_that_overlaps_a_load_in_place_does_not_vouch_for_that_process(
    tmp_path: Path,
) -> None:
    """g0 takes the push of v3, then loads C(2) in place (asked for while the push was under
    way) and ends up holding v2: the push must not report g0 as holding v3."""
    model = trainer()
    flags = tmp_path / "flags"
    flags.mkdir()
    release = threading.Event()
    released = False

    def gated(path: Any) -> Any:  # exports after v1 wait until the test says so
        if released or "step-1" in str(path):
            return open(path, "xb")
        release.wait(120)
        return open(path, "xb")

    rt = runtime(tmp_path, engine=gated_update(str(flags)), exporter_options={"opener": gated})
    with rt:
        serving_v1(rt, model)
        step(model)
        # The trainer's own transport delivers v2 to g1 only (g0 left out: pending; C(2) is
        # being written), then reports it.
        ray.get(rt.actors("g1")[0].update_weights.remote(2, _state(model)))
        rt.synced(2, {"g1": 1}, model)
        assert rt.controller.group_state("g0") == "pending_weights"
        (flags / "g1").touch()  # g1's update of v3 will wait
        step(model)
        got: dict[str, Any] = {}
        pushing = threading.Thread(target=lambda: got.update(rt.push(model, 3)))
        pushing.start()  # the snapshot: g0 (pending) and g1 will take v3
        time.sleep(1.0)  # g0 has taken v3 by now; g1 waits
        released = True
        release.set()  # C(2) commits: g0 loads it in place, after its v3 update
        wait_for(lambda: rt.routes.get("g0") == (2, 2), what="g0 caught up from C(2)")
        (flags / "g1").unlink()
        pushing.join(60)
        assert "g0" not in got and got.get("g1") == 1
        rt.synced(3, got, model)
        belief = rt.controller.group("g0")
        held = ray.get(rt.actors("g0")[0].weights.remote())
        # Left out of the sync it did not vouch for: demoted, and the controller's
        # belief is the weights it really holds (C(2), loaded after the push of v3).
        assert (belief.state, belief.version, held.version) == ("pending_weights", 2, 2)
        # g0's process was watched before its load in place and is watched after it.
        wait_for(lambda: serving(rt, "g0"), what="g0 serves v3")
        rt.kill("g0")
        wait_for(lambda: any(e["group"] == "g0" and e["reason"] == "actor died"
                             for e in journal_events(tmp_path, "GroupFailed")),
                 timeout=30, what="the watch reports the death")  # fmt: skip
    assert_replays_clean(tmp_path)


class WrongWeightsEngine(ReferenceEngine):
    """Loads the checkpoint, then holds other weights (a buggy reload): the digest it
    reports is not the manifest's."""

    def boot_from_checkpoint(self, path: str) -> Any:
        super().boot_from_checkpoint(path)
        with torch.no_grad():
            next(self.model.parameters()).add_(1.0)
        from recovery_fsm.export import model_digest

        self.held = type(self.held)(self.held.version, model_digest(self.model))
        return self.held


class UnseenWrongWeightsEngine(ReferenceEngine):
    """Loads the checkpoint, then changes the embedding of one token its canary never
    reads (neither in the prompt nor fed back from the answer; the head is untied): the
    canary's answer is the same to the bit, the digest is not. Only the digest gate sees it."""

    def boot_from_checkpoint(self, path: str) -> Any:
        super().boot_from_checkpoint(path)
        from recovery_fsm.export import canary, model_digest

        assert not self.model.config.tie_word_embeddings
        prompt = canary.prompt_for(int(self.model.config.vocab_size))
        read = {*prompt, *canary.greedy(self.model, prompt).tokens}
        unseen = max(set(range(int(self.model.config.vocab_size))) - read)
        with torch.no_grad():
            self.model.get_input_embeddings().weight[unseen].add_(1.0)
        self.held = type(self.held)(self.held.version, model_digest(self.model))
        return self.held


def _flip_a_bit(rt: RecoveryRuntime) -> None:
    shard = Path(rt.controller.checkpoints()[1].path or "") / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, the size unchanged
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("engine", "corrupt"),
    [
        (ReferenceEngine, _flip_a_bit),
        (WrongWeightsEngine, lambda rt: None),
        (UnseenWrongWeightsEngine, lambda rt: None),
    ],
    ids=["flipped-bit-on-disk", "engine-holds-other-weights", "unseen-by-the-canary"],
)
def test_wrong_weights_are_refused_and_the_group_goes_cold(
    tmp_path: Path, engine: type, corrupt: Callable[[RecoveryRuntime], None]
) -> None:
    model = trainer()
    with runtime(tmp_path, engine=engine) as rt:
        serving_v1(rt, model)
        corrupt(rt)
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "pending_weights",
                 what="cold restart")  # fmt: skip
        assert rt.controller.recovery_state("g0") == "cooldown"
        assert rt.routes["g0"] is None  # not serving on the cold process's random weights
        step(model)
        assert rt.sync(model, 2).get("g0") == rt.controller.incarnation("g0")
        assert rt.generate("g0", [4]).version == 2
        assert rt.statistics().recoveries == {"cold": 1}
        # A corrupt file fails the load itself (no refusal); wrong weights fail the digest.
        refused = {} if engine is ReferenceEngine else {"digest": 1}
        assert rt.statistics().admissions_refused == refused
    refusals = [e["error"] for e in journal_events(tmp_path, "RestartLoadFailed")]
    if engine is UnseenWrongWeightsEngine:  # the canary agreed: the digest alone refused it
        assert len(refusals) == 1 and "digest gate" in refusals[0], refusals
    assert_replays_clean(tmp_path)


class PartWayPushEngine(ReferenceEngine):
    """The push of 2 lands on g1 only in part and raises (an abort is no rollback: it holds
    a mix of 1 and 2); the push of 3 kills g0 half-way through."""

    def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
        if (self.group, version) in {("g1", 2), ("g0", 3)}:
            half = dict(list(weights.items())[: len(weights) // 2])
            if self.group == "g0":
                with torch.no_grad():
                    self.model.load_state_dict(half, strict=False)
                os._exit(1)
            return super().update_weights(version, half)  # raises: the rest is missing
        return super().update_weights(version, weights)


def test_a_push_that_fails_part_way_is_never_routed_and_is_repaired_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    """A process holding a mix of two versions says it holds none, is left out of the sync
    and withdrawn, serves nothing meanwhile, and serves again only once it holds C(v)'s
    weights exactly (a load in place; a process that died part-way restarts from C(v))."""
    model = trainer()
    with runtime(tmp_path, engine=PartWayPushEngine) as rt:
        serving_v1(rt, model)
        for version, broken, whole in ((2, "g1", "g0"), (3, "g0", "g1")):
            step(model)
            got = rt.sync(model, version)
            assert broken not in got and got[whole] == rt.controller.incarnation(whole)
            if broken == "g1":  # it raised: alive, holding a mix nobody vouches for
                [mixed] = rt.actors("g1")
                assert ray.get(mixed.weights.remote(), timeout=30).version is None
            wait_for(lambda b=broken: rt.routes[b] is None, what=f"{broken} withdrawn")
            answers = rt.rollout([[1, 2]] * 4)
            assert {s.certificate.group for r in answers for s in r.samples} == {whole}
            assert {s.certificate.version for r in answers for s in r.samples} == {version}
            wait_for(lambda b=broken: serving(rt, b), timeout=90, what=f"{broken} repaired")
            assert rt.generate(broken, [4]).version == version
            [engine] = rt.actors(broken)
            assert ray.get(engine.weights.remote(), timeout=30).digest == model_digest(model)
        assert rt.statistics().loads_from_deleted == 0
    assert_replays_clean(tmp_path)


def test_a_group_a_sync_brings_back_serves_when_the_sync_returns(tmp_path: Path) -> None:
    """Routing runs on the link's thread; ``sync`` waits for it, so the trainer's next
    request finds the group routed however slowly that thread runs."""
    model = trainer()
    with runtime(tmp_path) as rt:
        serving_v1(rt, model)
        _flip_a_bit(rt)
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "pending_weights",
                 what="cold restart")  # fmt: skip
        apply = rt.router.apply

        def slow(effect: Any, *, retry: bool = False) -> None:
            time.sleep(0.5)
            apply(effect, retry=retry)

        rt.router.apply = slow  # type: ignore[method-assign]
        step(model)
        assert rt.sync(model, 2).get("g0") == rt.controller.incarnation("g0")
        assert rt.generate("g0", [4]).version == 2
    assert_replays_clean(tmp_path)


class DyingEngine(ReferenceEngine):
    """Group g1's every restart dies while booting."""

    def _maybe_die(self) -> None:
        if self.group == "g1" and self.incarnation > 1:
            os._exit(1)

    def boot_from_checkpoint(self, path: str) -> Any:
        self._maybe_die()
        return super().boot_from_checkpoint(path)

    def boot_empty(self) -> Any:
        self._maybe_die()
        return super().boot_empty()


def test_a_group_that_keeps_dying_is_retired_and_the_others_serve(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path, engine=DyingEngine, config=RecoveryConfig(restart_budget=2)) as rt:
        serving_v1(rt, model)
        rt.kill("g1")
        wait_for(lambda: rt.controller.group_state("g1") == "retired", what="retired")
        assert rt.actors("g1", rt.controller.incarnation("g1")) == []
        assert serving(rt, "g0")
        assert rt.wait_ready(timeout_s=5.0)  # a retired group is not waited for
        assert rt.generate("g0", [1]).version == 1
        step(model)
        assert rt.sync(model, 2) == {"g0": 1}
    assert_replays_clean(tmp_path)


def test_closing_mid_recovery_leaves_nothing_behind(tmp_path: Path) -> None:
    model = trainer()
    rt = runtime(tmp_path, engine=SlowEngine)
    serving_v1(rt, model)
    actors = [a for g in ("g0", "g1") for a in rt.actors(g, 1)]
    rt.kill("g0")
    wait_for(lambda: rt.controller.group_state("g0") == "loading", what="loading")
    loading = rt.actors("g0", 2)
    assert rt.close() is True  # drained: the load's outcome arrived after its stop
    assert rt.controller.drained
    for actor in [*actors, *loading]:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    assert not [n for n in names if n.startswith(("recovery-fsm", "hf-export"))], names
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert any(r.get("event", {}).get("kind") == "Shutdown" for r in journal)
    assert_replays_clean(tmp_path)


class Reporter:
    """A health manager in another process: it finds the controller by name and reports."""

    def report_failure(self, name: str, group: str, incarnation: int) -> str:
        from recovery_fsm import WrongIncarnation
        from recovery_fsm import events as ev

        controller = ray.get_actor(name)
        try:
            ray.get(controller.send.remote(ev.GroupFailed, group=group,
                                           incarnation=incarnation, reason="reporter"))  # fmt: skip
        except ray.exceptions.RayTaskError as err:
            return f"refused: {err}"
        # A second report about the same, now replaced, process is refused.
        try:
            ray.get(controller.send.remote(ev.ProbeOk, group=group, incarnation=incarnation))
        except ray.exceptions.RayTaskError as err:
            assert isinstance(err.as_instanceof_cause(), WrongIncarnation)
            return "ok"
        return "the stale report was accepted"


def test_the_controller_as_a_named_actor_takes_reports_from_another_actor(
    tmp_path: Path,
) -> None:
    from recovery_fsm.ray import RecoveryControllerActor

    name = f"recovery-controller-{os.getpid()}-{tmp_path.name}"
    journal = tmp_path / "journal.jsonl"
    actor = RecoveryControllerActor.launch(name, journal=str(journal))
    model = trainer()
    try:
        with runtime(tmp_path, controller_actor=actor, journal=None) as rt:
            rt.start(model)
            step(model)
            rt.sync(model, 1)
            wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export")
            reporter = ray.remote(Reporter).options(num_cpus=0).remote()
            # The reporter says g0's process is gone; the runtime here restarts it.
            verdict = ray.get(reporter.report_failure.remote(name, "g0", 1), timeout=60)
            assert verdict == "ok"
            wait_for(lambda: serving(rt, "g0")
                     and rt.controller.incarnation("g0") == 2, what="restart")  # fmt: skip
            assert rt.generate("g0", [2]).version == 1
            ray.kill(reporter)
        assert rt.controller.drained
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
    assert_replays_clean(tmp_path)


def test_the_root_must_be_visible_from_every_node_a_group_may_use(tmp_path: Path) -> None:
    from recovery_fsm.ray.runtime import SharedRootError, check_shared_root

    assert check_shared_root(tmp_path, {}) == 1  # this one node sees it
    assert not list(tmp_path.iterdir())  # the marker is removed
    with pytest.raises(SharedRootError, match="no alive node"):
        check_shared_root(tmp_path, {"resources": {"checkpoint-fs": 1}})


def test_paused_probes_do_not_fail_a_slow_group_and_resumed_ones_do(tmp_path: Path) -> None:
    from recovery_fsm.ray.chaos import hangable

    os.makedirs(tmp_path / "flags")
    model = trainer()
    with runtime(tmp_path, engine=hangable(str(tmp_path / "flags")),
                 config=RecoveryConfig(suspect_threshold=2)) as rt:  # fmt: skip
        rt.start(model)
        rt.monitor.pause()  # the engines are offloaded while the trainer trains
        (tmp_path / "flags" / "g0").touch()
        time.sleep(4 * (rt.monitor.probe_interval_s + rt.monitor.probe_timeout_s))
        assert serving(rt, "g0")
        assert not journal_events(tmp_path, "ProbeFailed")
        rt.monitor.resume()
        wait_for(lambda: rt.controller.incarnation("g0") == 2, what="the hang is noticed")
        (tmp_path / "flags" / "g0").unlink()
        failed = journal_events(tmp_path, "ProbeFailed")
        assert [e["incarnation"] for e in failed if e["incarnation"] == 1] == [1, 1]
    assert_replays_clean(tmp_path)


def test_effects_held_by_a_stopped_runner_run_once_when_it_starts(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path) as rt:
        serving_v1(rt, model)
        assert rt.runner.pause(timeout=30)
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "loading", what="restart decided")
        time.sleep(1.0)
        assert rt.actors("g0", 2) == []  # held: nothing started
        assert rt.statistics().effects_in_flight >= 1
        rt.runner.resume()
        wait_for(lambda: serving(rt, "g0"), what="the held restart")
        assert rt.statistics().effects_in_flight == 0
    assert [e["incarnation"] for e in journal_events(tmp_path, "RestartLoaded")] == [2]
    assert_replays_clean(tmp_path)


def test_the_controller_actor_keeps_effects_until_they_are_acknowledged() -> None:
    """Run in this process (no Ray call): a batch lost to a timeout is handed out again,
    and one acknowledged is never handed out twice."""
    from recovery_fsm import events as ev
    from recovery_fsm.ray import RecoveryControllerActor

    host = RecoveryControllerActor(RecoveryConfig(), 0, None)
    host.send(ev.GroupRegistered, group="g0", version=0)
    host.send(ev.GroupRegistered, group="g1", version=0)
    first = host.take_effects(0, 0.0)
    assert [n for n, _ in first] == [1, 2]
    assert host.take_effects(0, 0.0) == first  # not acknowledged: the same batch again
    assert host.pending_after(1) == 1
    host.send(ev.GroupFailed, group="g0", incarnation=1)
    later = host.take_effects(2, 0.0)
    assert [n for n, _ in later] == [3, 4] and host.pending_after(4) == 0
    assert [type(e).__name__ for _, e in later] == ["WithdrawTraffic", "RestartCold"]


def test_a_start_that_raises_in_the_runner_still_reports_its_outcome(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path) as rt:
        serving_v1(rt, model)

        def unreadable(path: Any) -> Any:
            raise OSError("the manifest could not be read")

        rt.store.read_manifest = unreadable  # type: ignore[method-assign]
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "pending_weights",
                 what="failed restart, then cold")  # fmt: skip
        assert rt.actors("g0", 2) == []  # the started actors were killed
        [failed] = journal_events(tmp_path, "RestartLoadFailed")
        assert "the manifest could not be read" in failed["error"]
    assert_replays_clean(tmp_path)


def test_a_delete_that_keeps_failing_is_kept_and_retried(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path, delete_attempts=2) as rt:
        serving_v1(rt, model)
        step_1 = Path(rt.controller.checkpoints()[1].path or "")
        delete = rt.store.delete

        def refuse(path: Any) -> None:
            raise PermissionError("the filesystem refused")

        rt.store.delete = refuse  # type: ignore[method-assign]
        step(model)
        rt.sync(model, 2)  # supersedes v1, whose delete now fails
        wait_for(lambda: rt.statistics().failed_effects == 1, what="the failed delete")
        assert step_1.is_dir() and rt.controller.checkpoint_state(1) == "deletable"
        rt.store.delete = delete  # type: ignore[method-assign]
        assert rt.retry_failed() == 1
        wait_for(lambda: not step_1.exists(), what="the retried delete")
        assert rt.statistics().failed_effects == 0
    assert_replays_clean(tmp_path)


class BrokenOnSecondDeath(Rules):
    """A bug in the rules: the second death reported raises inside the controller."""

    def on_GroupFailed(self, e: Any, found: Any) -> None:
        self.deaths = getattr(self, "deaths", 0) + 1
        if self.deaths == 2:
            raise RuntimeError("a bug in the rules")
        super().on_GroupFailed(e, found)


def test_a_broken_controller_stops_the_runtime_and_the_trainer_hears_of_it(
    tmp_path: Path,
) -> None:
    from recovery_fsm import ControllerStopped
    from recovery_fsm.search.replay import rebuild
    from recovery_fsm.trainer import RecoveryHooks

    model = trainer()
    journal = tmp_path / "journal.jsonl"
    rt = runtime(tmp_path, rules=BrokenOnSecondDeath)
    try:
        serving_v1(rt, model)
        assert rt.runner.pause(timeout=30)  # g0's restart will wait in its lane
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "loading", what="restart decided")
        rt.kill("g1")  # its report breaks the controller
        wait_for(lambda: rt.failstop.error is not None, what="fail-stop")
        wait_for(lambda: not rt.monitor.running, what="the monitor stops")
        rt.runner.resume()  # halted: the held restart must not run now
        records = len(journal.read_text().splitlines())
        time.sleep(1.5)  # ten ticks' worth: nothing more reaches the controller
        assert len(journal.read_text().splitlines()) == records
        assert rt.actors("g0", 2) == []  # the restart never ran
        step(model)
        for call in (lambda: rt.sync(model, 2), lambda: rt.push(model, 2),
                     lambda: rt.synced(2, {}, model), lambda: rt.rollout([[1]])):  # fmt: skip
            with pytest.raises(ControllerStopped) as stopped:
                call()
            assert str(journal) in str(stopped.value) and "replay.rebuild" in str(stopped.value)
        hooks = RecoveryHooks(rt)
        with pytest.raises(ControllerStopped):
            hooks.before_weight_sync(2)
    finally:
        assert rt.close() is False  # not drained: it stopped
    # What the error says to do works: the journal rebuilds, with the fixed rules.
    again = rebuild(journal, rules=Rules)
    assert again.group_state("g0") == "loading" and again.group_state("g1") == "loading"


def test_misuse_is_refused_with_what_to_do_and_changes_nothing(tmp_path: Path) -> None:
    from recovery_fsm.ray import AlreadyStarted, BadRuntimeInput, VersionNotAbove

    with pytest.raises(BadRuntimeInput, match="model_config must be a mapping"):
        runtime(tmp_path, model_config=["not", "a", "config"])
    model = trainer()
    # A transformers config object is taken as it is.
    with runtime(tmp_path, model_config=LlamaConfig(**CONFIG)) as rt:
        serving_v1(rt, model)
        assert rt.routes == {"g0": (1, 1), "g1": (1, 1)}  # the sync moved the routes to v1
        with pytest.raises(AlreadyStarted, match="make a new RecoveryRuntime"):
            rt.start(model)
        step(model)
        with pytest.raises(VersionNotAbove, match="nothing was pushed"):
            rt.push(model, 1)
        assert {rt.generate(g, [1]).version for g in ("g0", "g1")} == {1}
        assert rt.controller.up_groups() == {"g0": 1, "g1": 1}
    assert_replays_clean(tmp_path)


def dead(rt: RecoveryRuntime, group: str) -> None:
    """Kill the group's process and wait until Ray says it is gone (``ray.kill`` returns
    before the process has died)."""
    [actor] = rt.actors(group)
    rt.kill(group)

    def gone() -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_for(gone, what=f"{group}'s process is gone")


def test_requests_go_only_to_serving_groups_and_move_on_when_one_dies(tmp_path: Path) -> None:
    from recovery_fsm.ray import NoServingGroup, NotServing, Policy, RolloutFailed

    def groups(results: list[Any]) -> set[str]:
        return {s.certificate.group for r in results for s in r.samples}

    model = trainer()
    with runtime(tmp_path) as rt:
        serving_v1(rt, model)
        assert groups(rt.rollout([[1, 2]] * 4)) == {"g0", "g1"}  # spread over both
        rt.monitor.stop()  # the death goes unnoticed: g0 stays routed
        dead(rt, "g0")
        answers = rt.rollout([[1, 2]] * 4)
        assert groups(answers) == {"g1"}  # the call on g0 was issued again on g1
        assert rt.statistics().rollouts.reissued >= 1
        with pytest.raises(NotServing, match="did not answer"):
            rt.generate("g0", [1])
        dead(rt, "g1")
        with pytest.raises(NoServingGroup):
            rt.router.generate([1])
        with pytest.raises(RolloutFailed, match="no serving group") as failed:
            rt.rollout([[1], [2]], policy=Policy(deadline_s=2.0))
        assert failed.value.prompts == (0, 1)


def test_a_load_killed_at_its_deadline_releases_a_superseded_checkpoint_only_once_dead(
    tmp_path: Path,
) -> None:
    """The load of C(1) hangs, C(1) is superseded meanwhile, the deadline kills the load:
    C(1) may be deleted only once the process reading it is really gone, as the operating
    system says (Ray refuses a call to a killed actor at once, exited or not)."""
    model = trainer()
    config = RecoveryConfig(load_timeout_s=10.0, relaunch_timeout_s=30.0)  # it boots first
    seen_at_delete: list[str] = []
    with runtime(tmp_path, config=config, engine=HangingEngine) as rt:
        serving_v1(rt, model)
        step_1 = Path(rt.controller.checkpoints()[1].path or "")
        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "loading", what="loading C(1)")
        [reader] = rt.actors("g0", 2)
        pid, _node = ray.get(reader.process.remote(), timeout=10)  # beside the hung load
        assert not process_gone(pid)
        delete = rt.store.delete

        def checked(path: Any) -> None:
            if Path(path) == step_1:
                seen_at_delete.append("dead" if process_gone(pid) else "alive")
            delete(path)

        rt.store.delete = checked  # type: ignore[method-assign]
        step(model)
        assert "g0" not in rt.sync(model, 2)
        wait_for(lambda: rt.controller.checkpoint_state(2) == "ready", what="export of v2")
        assert rt.controller.checkpoint_state(1) == "superseded"  # leased by the hung load
        wait_for(lambda: not step_1.exists(), timeout=60, what="C(1) deleted after the kill")
        assert seen_at_delete == ["dead"]
        assert rt.statistics().loads_from_deleted == 0
        # The killed load cooled its switch: cold, then admitted by the next sync.
        wait_for(lambda: rt.controller.group_state("g0") == "pending_weights", what="cold")
        step(model)
        assert rt.sync(model, 3)["g0"] == rt.controller.incarnation("g0")
    assert_replays_clean(tmp_path)


def test_the_remote_link_keeps_an_effect_whose_execution_raised_for_a_retry() -> None:
    """The one executor policy, on the controller actor: delivered is not done."""
    from recovery_fsm import events as ev
    from recovery_fsm.ray import RecoveryControllerActor, RemoteLink

    actor = RecoveryControllerActor.launch(f"recovery-controller-{os.getpid()}-keep")
    ran: list[str] = []
    failing = {"RestartCold"}

    def execute(effect: Any) -> None:
        if effect.kind in failing:
            raise RuntimeError("the adapter failed")
        ran.append(effect.kind)

    link = RemoteLink(actor, execute=execute)
    try:
        link.send(ev.GroupRegistered, group="g0", version=0)
        link.send(ev.GroupFailed, group="g0", incarnation=1)
        assert link.join(30)
        assert [f.effect.kind for f in link.errors] == ["RestartCold"]
        assert ran == ["RouteTraffic", "WithdrawTraffic"]  # the rest still ran, in order
        failing.clear()
        assert link.retry_failed() == 1
        assert ran[-1] == "RestartCold" and link.errors == ()
    finally:
        link.close(10)
        ray.kill(actor)


def test_a_hosted_controller_that_breaks_stops_the_runtime_too(tmp_path: Path) -> None:
    """ControllerBroken crosses Ray from the controller actor as itself, so fail-stop works
    when the controller lives in its own actor."""
    from recovery_fsm import ControllerStopped
    from recovery_fsm.ray import RecoveryControllerActor

    journal = tmp_path / "journal.jsonl"
    name = f"recovery-controller-{os.getpid()}-broken"
    actor = RecoveryControllerActor.launch(name, journal=str(journal), rules=BrokenOnSecondDeath)
    model = trainer()
    try:
        rt = runtime(tmp_path, controller_actor=actor, journal=None)
        try:
            serving_v1(rt, model)
            rt.kill("g0")
            wait_for(lambda: rt.controller.incarnation("g0") == 2, what="g0's restart")
            rt.kill("g1")  # its report breaks the hosted controller
            wait_for(lambda: rt.failstop.error is not None, what="fail-stop")
            wait_for(lambda: not rt.monitor.running, what="the monitor stops")
            step(model)
            with pytest.raises(ControllerStopped, match=str(journal)):
                rt.sync(model, 2)
            assert rt.statistics().lost_reports == 0  # a broken answer is not a lost report
        finally:
            assert rt.close() is False
    finally:
        ray.kill(actor)


class UnbuildableEngine(ReferenceEngine):
    """Refuses its model in the constructor, as vLLM's CPU build refuses a head size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("head size 8 is not supported by this build\nuse 64")


def test_a_boot_failure_names_the_engines_own_error(tmp_path: Path) -> None:
    rt = runtime(tmp_path, engine=UnbuildableEngine, groups=["g0"])
    try:
        with pytest.raises(StartFailed) as caught:
            rt.start(trainer())
        # The engine's exception type and message, not the first line of Ray's banner.
        assert "ValueError: head size 8 is not supported by this build" in str(caught.value)
        assert "use 64" in str(caught.value)
    finally:
        rt.close()


class FailingRestartEngine(ReferenceEngine):
    """g1's restart from the checkpoint raises (incarnation 2); its cold relaunches then
    crash on an illegal instruction, with no Python exception."""

    def boot_from_checkpoint(self, path: str) -> Any:
        if self.group == "g1" and self.incarnation == 2:
            raise OSError("checkpoint shard unreadable")
        return super().boot_from_checkpoint(path)

    def boot_empty(self) -> Any:
        if self.group == "g1" and self.incarnation > 2:
            import signal

            os.kill(os.getpid(), signal.SIGILL)
        return super().boot_empty()


def test_a_failed_restart_journals_the_engines_own_error(tmp_path: Path) -> None:
    model = trainer()
    with runtime(tmp_path, engine=FailingRestartEngine) as rt:
        serving_v1(rt, model)
        rt.kill("g1")
        wait_for(lambda: journal_events(tmp_path, "RelaunchFailed"), what="failed relaunch")
    loaded = [e["error"] for e in journal_events(tmp_path, "RestartLoadFailed")]
    assert loaded == ["OSError: checkpoint shard unreadable"], loaded
    # A crash without a Python exception: the process's pid and the fatal line it wrote.
    crashed = journal_events(tmp_path, "RelaunchFailed")[0]["error"]
    assert "ActorDiedError: the engine process (pid " in crashed, crashed
    assert "Fatal Python error: Illegal instruction" in crashed, crashed
    assert_replays_clean(tmp_path)
