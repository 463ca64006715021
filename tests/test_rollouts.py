"""Rollouts through the runtime on a real local Ray cluster, reference engines, real sampling.

Every sample is checked against the trainer's own model at the version its certificate
names (the log-probability of each sampled token), and its admission against the journal.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import TINY_LLAMA, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm import RecoveryConfig  # noqa: E402
from recovery_fsm.ray import (  # noqa: E402
    BadSampling,
    Policy,
    PromptSamples,
    RecoveryRuntime,
    ReferenceEngine,
    RolloutFailed,
    RolloutInLoop,
    Sampling,
)
from recovery_fsm.search.replay import replay  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("ray_cluster")

GRPO = Sampling(max_new_tokens=12, temperature=1.0, n=4, logprobs=2)
LONG = Sampling(max_new_tokens=60, temperature=1.0, n=4)  # over a second on SlowEngine


class SlowEngine(ReferenceEngine):
    """Each decoding step takes 20 ms (a batch lasts long enough to be interrupted), and
    the loop wedges while the file ``<flags>/<group>`` exists: the actor answers, the
    generation loop does not step."""

    FLAGS = ""

    def __init__(self, config: dict[str, Any], group: str, incarnation: int) -> None:
        super().__init__(config, group, incarnation)
        self._loop.on_step = self._step

    def _step(self) -> None:
        """Wedged while the flag exists, from the step it names if it names one."""
        time.sleep(0.02)
        flag = os.path.join(self.FLAGS, self.group)
        while os.path.exists(flag):
            try:
                text = Path(flag).read_text().strip()
            except FileNotFoundError:
                break
            if text.isdigit() and self._loop.steps < int(text):
                break
            time.sleep(0.05)

    def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
        """A push waits while the file ``<flags>/push`` exists, so a test can act on the
        fleet while a sync holds the gate, however fast the drain was."""
        while os.path.exists(os.path.join(self.FLAGS, "push")):
            time.sleep(0.05)
        return super().update_weights(version, weights)


def slow_engine(flags: Path) -> type[SlowEngine]:
    return type("SlowEngine", (SlowEngine,), {"FLAGS": str(flags)})


class Versions:
    """The trainer's model at every version it synced, to check samples against."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
        self.states: dict[int, dict[str, Any]] = {}
        self.keep(0)

    def keep(self, version: int) -> None:
        self.states[version] = {k: v.clone() for k, v in self.model.state_dict().items()}

    def step(self, version: int) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        self.keep(version)

    def check(self, results: list[PromptSamples], n: int) -> None:
        """Each prompt has exactly ``n`` samples whose log-probabilities are the trainer's
        model's at the version the certificate names."""
        probe = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
        for r in results:
            assert len(r.samples) == n, r
            for s in r.samples:
                probe.load_state_dict(self.states[s.certificate.version])
                ids = torch.tensor([[*r.prompt, *s.tokens]])
                with torch.no_grad():
                    lp = torch.log_softmax(probe(input_ids=ids).logits[0].float(), dim=-1)
                start = len(r.prompt) - 1
                want = [float(lp[start + k, t]) for k, t in enumerate(s.tokens)]
                assert s.logprobs == pytest.approx(want, abs=2e-3), (s.certificate, s.tokens)


def make(tmp_path: Path, **kwargs: Any) -> RecoveryRuntime:
    options: dict[str, Any] = dict(
        groups=["g0", "g1"], model_config=LlamaConfig(**TINY_LLAMA).to_dict(),
        journal=tmp_path / "journal.jsonl", tick_s=0.1, probe_interval_s=0.5,
        probe_timeout_s=1.0, grace_s=0.5, call_timeout_s=60.0,
    )  # fmt: skip
    options.update(kwargs)
    return RecoveryRuntime(tmp_path / "ckpt", **options)


def records(tmp_path: Path) -> dict[int, dict[str, Any]]:
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def admitted_in_journal(journal: dict[int, dict[str, Any]], cert: Any) -> bool:
    """The journal record at the certificate's step routed that process at that version, or
    is the sync that process took."""
    record = journal[cert.admission]
    event = record["event"]
    routes = [e for e in record.get("effects", ()) if e["kind"] == "RouteTraffic"]
    routed = any(
        (e["group"], e["incarnation"], e["version"])
        == (cert.group, cert.incarnation, cert.version)
        for e in routes
    )
    synced = (
        event["kind"] == "WeightsSynced"
        and event["version"] == cert.version
        and event["groups"].get(cert.group) == cert.incarnation
    )
    # The admission's evidence is in the record: what the process was held to.
    checked = "canary 4 tokens agreed" in event.get("evidence", "")
    return "error" not in record and (routed or synced) and checked


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two serving groups at version 1, shared by the tests that kill nothing."""
    tmp = tmp_path_factory.mktemp("fleet")
    versions = Versions()
    rt = make(tmp)
    rt.start(versions.model)
    versions.step(1)
    rt.sync(versions.model, 1)
    yield rt, versions, tmp
    rt.close()
    assert replay(tmp / "journal.jsonl").ok


def test_a_grpo_rollout_is_n_certified_samples_per_prompt_from_the_trainers_weights(
    fleet: Any,
) -> None:
    rt, versions, tmp = fleet
    prompts = [[1 + i, 7, 3 * i % 128, 5] for i in range(16)]
    results = rt.rollout(prompts, GRPO)
    assert [list(r.prompt) for r in results] == prompts
    versions.check(results, n=4)
    samples = [s for r in results for s in r.samples]
    assert {s.certificate.group for s in samples} == {"g0", "g1"}  # spread, batched
    assert {s.certificate.version for s in samples} == {1}
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    assert all(s.top_logprobs is not None and len(s.top_logprobs) == len(s.tokens)
               for s in samples)  # fmt: skip
    # Sampled, not greedy: a prompt's siblings differ.
    assert any(len({s.tokens for s in r.samples}) > 1 for r in results)
    journal = records(tmp)
    assert all(admitted_in_journal(journal, s.certificate) for s in samples)
    stats = rt.statistics().rollouts
    assert stats.samples >= 64 and stats.engine_calls >= 2


def test_greedy_answers_as_the_single_request_path_did(fleet: Any) -> None:
    rt, versions, _ = fleet
    prompts = [[1, 2, 3], [9, 8], [4]]
    [a, b, c] = rt.rollout(prompts, Sampling(max_new_tokens=8))
    for r in (a, b, c):
        [sample] = r.samples
        single = rt.generate(sample.certificate.group, list(r.prompt), 8)
        assert list(sample.tokens) == single.tokens
    versions.check([a, b, c], n=1)


def test_a_seed_makes_a_prompts_samples_reproducible(fleet: Any) -> None:
    rt, _, _ = fleet
    seeded = Sampling(max_new_tokens=6, temperature=1.0, n=3, seed=1234)
    runs = [rt.rollout([[5, 6, 7]], seeded, Policy(version="same")) for _ in range(2)]
    group = runs[0][0].samples[0].certificate.group
    again = [rt.rollout([[5, 6, 7]], seeded) for _ in range(2)]
    same_group = [r for r in [*runs, *again] if r[0].samples[0].certificate.group == group]
    assert len({tuple(s.tokens for s in r[0].samples) for r in same_group}) == 1


def test_hundreds_of_prompts_in_flight_from_asyncio_without_a_thread_each(fleet: Any) -> None:
    rt, versions, _ = fleet
    small = Sampling(max_new_tokens=4, temperature=0.8, n=2)
    before = rt.statistics().rollouts
    threads = threading.active_count()

    async def many() -> list[list[PromptSamples]]:
        calls = [rt.arollout([[i % 100 + 1, 2]] * 4, small) for i in range(60)]
        return await asyncio.gather(*calls)

    out = asyncio.run(many())
    assert threading.active_count() <= threads + 2  # no thread per request
    assert len(out) == 60 and all(len(r) == 4 and len(r[0].samples) == 2 for r in out)
    versions.check(out[0] + out[-1], n=2)
    after = rt.statistics().rollouts
    assert after.calls - before.calls == 60 and after.prompts - before.prompts == 240

    async def blocking_inside_a_loop() -> None:
        rt.rollout([[1]])

    with pytest.raises(RolloutInLoop, match="await arollout"):
        asyncio.run(blocking_inside_a_loop())


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(temperature=-1.0), "temperature must be a number in"),
        (dict(top_p=0.0), "top_p must be a number in"),
        (dict(n=4), "n > 1 needs temperature > 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be token ids"),
        (dict(seed="x"), "seed must be None or an int"),
        (dict(logprobs=99), "logprobs must be an int in"),
    ],
)
def test_bad_sampling_is_refused_before_anything_is_sent(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(BadSampling, match=match):
        Sampling(**bad)


def test_bad_prompts_are_refused_and_reach_no_engine(fleet: Any) -> None:
    rt, _, _ = fleet
    before = rt.statistics().rollouts
    for prompts, match in [([], "non-empty list"), ([[]], "prompt 0 must be a non-empty"),
                           ([[1, 128]], r"token ids in \[0, 128\)"), ("abc", "non-empty list"),
                           ([[1], [2.0]], "prompt 1 must hold token ids")]:  # fmt: skip
        with pytest.raises(BadSampling, match=match):
            rt.rollout(prompts)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy must be a Policy"):
        rt.rollout([[1]], Sampling(), "same")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version must be one of"):
        Policy(version="newest")  # type: ignore[arg-type]
    assert rt.statistics().rollouts.engine_calls == before.engine_calls


def test_a_sync_waits_for_rollouts_in_flight_and_none_starts_on_unadmitted_weights(
    fleet: Any,
) -> None:
    """Rollouts run without pause while the trainer syncs twice: every sample is the trainer's
    model at its certificate's version, admitted in the journal, and no batch was cut."""
    rt, versions, tmp = fleet
    results: list[PromptSamples] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def roll() -> None:
        try:
            while not stop.is_set():
                results.extend(rt.rollout([[3, 1, 4, 1, 5]] * 6, GRPO))
        except BaseException as err:  # surfaced below
            errors.append(err)

    reissued = rt.statistics().rollouts.reissued
    t = threading.Thread(target=roll)
    t.start()
    try:
        for v in (2, 3):
            time.sleep(0.3)
            versions.step(v)
            assert rt.sync(versions.model, v) == {"g0": 1, "g1": 1}
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    versions.check(results, n=4)
    seen = {s.certificate.version for r in results for s in r.samples}
    assert 3 in seen and seen <= {1, 2, 3}
    journal = records(tmp)
    assert all(admitted_in_journal(journal, s.certificate) for r in results for s in r.samples)
    # Waited for, not cut: nothing in flight at a sync was issued again.
    assert rt.statistics().rollouts.reissued == reissued


def test_same_version_policy_refuses_to_mix_and_names_what_it_could_not_answer(
    fleet: Any,
) -> None:
    rt, versions, _ = fleet
    fleet_version = rt.controller.version
    same = rt.rollout([[2, 2]] * 4, GRPO, Policy(version="same"))
    assert {s.certificate.version for r in same for s in r.samples} == {fleet_version}
    # The fleet moves on while a same-version call waits behind the sync's gate: nothing
    # serves its version any more, so it fails by policy, naming every prompt.
    rt.rollouts.gate.hold()
    try:
        box: list[BaseException] = []

        def call() -> None:
            try:
                rt.rollout([[1]] * 3, GRPO, Policy(version="same", deadline_s=3.0))
            except BaseException as err:
                box.append(err)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)  # the call has read the fleet's version and waits at the gate
        versions.step(fleet_version + 1)
        rt.sync(versions.model, fleet_version + 1)
    finally:
        rt.rollouts.gate.release()
        t.join(30)
    [err] = box
    assert isinstance(err, RolloutFailed) and err.prompts == (0, 1, 2)
    assert f"at version {fleet_version}" in str(err)
    assert rt.statistics().rollouts.failed_by_policy >= 3


def test_a_death_or_a_wedged_loop_mid_batch_loses_no_sample(tmp_path: Path) -> None:
    """g0 is killed while its batch runs, later g1's generation loop wedges while its actor
    still answers: every prompt is answered exactly once, from processes the journal
    admitted, and the wedged group is failed by its probes."""
    flags = tmp_path / "flags"
    flags.mkdir()
    versions = Versions()
    config = RecoveryConfig(suspect_threshold=2)
    with make(tmp_path, engine=slow_engine(flags), config=config) as rt:
        rt.start(versions.model)
        versions.step(1)
        rt.sync(versions.model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        prompts = [[i + 1, 9] for i in range(8)]
        box: list[Any] = []
        (flags / "g0").write_text("2")  # g0's batch stays in flight (its loop wedges)
        t = threading.Thread(target=lambda: box.append(rt.rollout(prompts, GRPO)))
        t.start()
        wait_for(lambda: rt.rollouts.gate.in_flight() > 0, what="a batch in flight")
        time.sleep(0.5)
        [killed] = rt.actors("g0")
        rt.kill("g0")
        (flags / "g0").unlink()
        t.join(120)
        [results] = box
        versions.check(results, n=4)
        first = rt.statistics().rollouts
        assert first.reissued >= 1
        assert all(s.certificate.group == "g1" or s.certificate.incarnation > 1
                   for r in results for s in r.samples)  # fmt: skip
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(killed.ping.remote(), timeout=30)
        wait_for(lambda: rt.routes.get("g0") is not None and rt.routes["g0"][0] == 2,
                 what="g0 recovered")  # fmt: skip

        # g1's loop wedges mid-batch; its actor's ping answers without the loop check.
        (flags / "g1").touch()
        box.clear()
        t = threading.Thread(target=lambda: box.append(rt.rollout(prompts, GRPO)))
        t.start()
        wait_for(lambda: rt.controller.group_state("g1") != "active", timeout=30,
                 what="g1 failed by its probes")  # fmt: skip
        t.join(120)
        (flags / "g1").unlink()
        [results] = box
        versions.check(results, n=4)
    assert replay(tmp_path / "journal.jsonl").ok
    journal = records(tmp_path)
    events = [r["event"] for r in journal.values() if "event" in r]
    assert any(e["kind"] == "ProbeFailed" and e["group"] == "g1" for e in events)


def test_abort_mode_ends_batches_in_flight_and_issues_them_at_the_new_version(
    tmp_path: Path,
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    versions = Versions()
    long = Sampling(max_new_tokens=120, temperature=1.0, n=2)
    with make(tmp_path, engine=slow_engine(flags), in_flight="abort", groups=["g0"]) as rt:
        rt.start(versions.model)
        box: list[Any] = []
        (flags / "g0").write_text("3")  # the batch wedges at its third step, at version 0
        t = threading.Thread(target=lambda: box.append(rt.rollout([[1, 2]] * 3, long)))
        t.start()
        wait_for(lambda: rt.rollouts.gate.in_flight() > 0, what="a batch in flight")
        time.sleep(0.5)
        versions.step(1)
        synced: list[Any] = []
        syncer = threading.Thread(target=lambda: synced.append(rt.sync(versions.model, 1)))
        syncer.start()
        wait_for(lambda: rt.rollouts.gate.aborts > 0, what="the sync's abort")
        (flags / "g0").unlink()
        syncer.join(60)
        t.join(120)
        assert synced == [{"g0": 1}]
        [results] = box
        # The batch at version 0 was cut: every prompt was issued again and answered at 1.
        assert {s.certificate.version for r in results for s in r.samples} == {1}
        assert all(r.reissued >= 1 for r in results)
        versions.check(results, n=2)
        stats = rt.statistics().rollouts
        assert stats.reissued >= 3
    assert replay(tmp_path / "journal.jsonl").ok


def _siblings_that_end_apart(actor: Any) -> tuple[Sampling, tuple[int, ...]]:
    """A seeded sampling under which sibling 0 stops at its second token while another runs
    past step 6 (found on the engine itself: a seed fixes a prompt's samples)."""
    for seed in range(200):
        base = Sampling(max_new_tokens=12, temperature=1.0, n=4, seed=seed)
        rows = [s.tokens for s in ray.get(actor.rollout.remote([[3, 4]], base)).samples[0]]
        if len(rows[0]) < 2:
            continue
        stop = rows[0][1]
        firsts = [next((k for k, t in enumerate(r) if t == stop), 99) for r in rows]
        if firsts[0] == 1 and max(firsts[1:]) > 6 and min(len(r) for r in rows[1:]) > 6:
            return attrs.evolve(base, stop_token_ids=(stop,)), rows[0][:2]
    raise AssertionError("no seed ends the siblings apart")


@pytest.mark.parametrize("siblings", ["missing", "group"])
def test_an_abort_keeps_the_finished_siblings_or_asks_for_the_whole_group_by_policy(
    tmp_path: Path, siblings: str
) -> None:
    """A sync aborts a batch after its fourth step: sibling 0 had ended, the others had not.
    ``missing`` keeps sibling 0 (at the old version) and asks for three more at the new one;
    ``group`` asks for all four again, so the group is one version."""
    flags = tmp_path / "flags"
    flags.mkdir()
    versions = Versions()
    with make(tmp_path, engine=slow_engine(flags), in_flight="abort", groups=["g0"]) as rt:
        rt.start(versions.model)
        [actor] = rt.actors("g0")
        sampling, ended = _siblings_that_end_apart(actor)
        (flags / "g0").write_text("4")  # the loop wedges from its fourth step
        box: list[Any] = []
        policy = Policy(siblings=siblings)  # type: ignore[arg-type]
        roller = threading.Thread(target=lambda: box.append(rt.rollout([[3, 4]], sampling,
                                                                       policy)))  # fmt: skip
        roller.start()
        wait_for(lambda: rt.rollouts.gate.in_flight() > 0, what="the batch in flight")
        time.sleep(0.5)  # wedged at step 4
        versions.step(1)
        syncer = threading.Thread(target=rt.sync, args=(versions.model, 1))
        syncer.start()
        wait_for(lambda: rt.rollouts.gate.held,
                 what="the sync's gate")  # fmt: skip
        wait_for(lambda: rt.rollouts.gate.aborts > 0, what="the sync's abort")
        (flags / "g0").unlink()
        syncer.join(60)
        roller.join(60)
        [[result]] = box
        versions.check([result], n=4)
        by_version = sorted(s.certificate.version for s in result.samples)
        if siblings == "missing":
            assert by_version == [0, 1, 1, 1]
            [kept] = [s for s in result.samples if s.certificate.version == 0]
            assert kept.tokens == ended and kept.finish_reason == "stop"
        else:
            assert by_version == [1, 1, 1, 1]
            assert rt.statistics().rollouts.discarded >= 1  # the ended sibling was let go


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_two_groups_killed_at_once_during_a_sync_lose_no_sample_in_either_pause_mode(
    tmp_path: Path, mode: str
) -> None:
    """Rollouts keep running while the trainer syncs; in the middle of the sync two of three
    groups are killed at once. Every call answers every prompt with samples that are the
    trainer's model at their certified version, none twice."""
    flags = tmp_path / "flags"
    flags.mkdir()
    versions = Versions()
    results: list[PromptSamples] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with make(tmp_path, engine=slow_engine(flags), in_flight=mode,
              groups=["g0", "g1", "g2"]) as rt:  # fmt: skip
        rt.start(versions.model)
        versions.step(1)
        rt.sync(versions.model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")

        def roll() -> None:
            try:
                while not stop.is_set():
                    results.extend(rt.rollout([[i + 2, 6] for i in range(9)], LONG))
            except BaseException as err:  # surfaced below
                errors.append(err)

        roller = threading.Thread(target=roll)
        roller.start()
        wait_for(lambda: rt.rollouts.gate.in_flight() > 0, what="rollouts in flight")
        versions.step(2)
        (flags / "push").touch()  # the push waits, the gate stays held
        syncer = threading.Thread(target=rt.sync, args=(versions.model, 2))
        syncer.start()
        wait_for(lambda: rt.rollouts.gate.held, what="the sync's gate")
        rt.kill("g0")
        rt.kill("g1")
        (flags / "push").unlink()
        syncer.join(60)
        wait_for(lambda: all(r is not None and r[0] >= 2 for g, r in rt.routes.items()
                             if g != "g2"), what="g0 and g1 recovered")  # fmt: skip
        time.sleep(0.5)  # a few more calls on the recovered groups
        stop.set()
        roller.join(120)
        assert not errors, errors
        versions.check(results, n=4)
        stats = rt.statistics().rollouts
        assert stats.failed_by_policy == 0
        seen = {s.certificate.version for r in results for s in r.samples}
        # Waited for, the batch in flight ends at 1; aborted, it is issued again at 2.
        assert seen == ({1, 2} if mode == "wait" else {2}) and stats.reissued >= 1
    assert replay(tmp_path / "journal.jsonl").ok
