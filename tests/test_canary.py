"""Admission by canary: what digests cannot see (a NaN left by a reload, swapped layers whose
manifest matches, a config of another architecture) is refused; a good engine never is.

The first tests need no cluster; the last ones run the runtime on a real local Ray cluster
with the reference engine told that it computes no digest, as vLLM cannot.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import TINY_LLAMA, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from recovery_fsm.export import AsyncHFExporter, CheckpointStore, canary, load_model  # noqa: E402
from recovery_fsm.export.canary import Answer, Canary, CanaryError  # noqa: E402
from recovery_fsm.ray import RecoveryRuntime, ReferenceEngine  # noqa: E402
from recovery_fsm.search.replay import replay  # noqa: E402
from recovery_fsm.trainer import RecoveryHooks  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Weights large enough that the outputs depend on them, as a trained model's do: at the
# default 0.02 a tiny model answers nearly the same with any activation.
CONFIG = {**TINY_LLAMA, "initializer_range": 0.2}


def trainer(seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**CONFIG, **overrides})).eval()


def swapped(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights with its two layers exchanged: every tensor intact, so every
    digest computed over them is consistent, yet another model."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = dict(state)
    for name, t in state.items():
        if ".layers.0." in name:
            out[name.replace(".layers.0.", ".layers.1.")] = t
        elif ".layers.1." in name:
            out[name.replace(".layers.1.", ".layers.0.")] = t
    return out


def with_weights(model: Any, weights: dict[str, torch.Tensor], **overrides: Any) -> Any:
    other = trainer(**overrides)
    other.load_state_dict(weights)
    return other


# -- the check, without a cluster ---------------------------------------------------------


def test_a_model_agrees_with_its_own_canary_and_with_a_reload_of_its_checkpoint(
    tmp_path: Path,
) -> None:
    model = trainer()
    expected = canary.of_model(model)
    assert len(expected.answer.tokens) == canary.NEW_TOKENS and expected.dtype == "float32"
    assert canary.check(expected, canary.greedy(model, expected.prompt)) is None
    with AsyncHFExporter(CheckpointStore(tmp_path), report=lambda *a, **k: None) as ex:
        path = ex.export_model(1, model, canary=expected).result(timeout=60)
    manifest = CheckpointStore(tmp_path).read_manifest(path)
    assert Canary.from_json(manifest["canary"]) == expected  # recorded, and read back whole
    reloaded = load_model(path).eval()
    assert canary.check(expected, canary.greedy(reloaded, expected.prompt)) is None


@pytest.mark.parametrize(
    "tamper",
    ["nan-parameter", "swapped-layers", "wrong-architecture", "another-model"],
)
def test_what_digests_miss_the_canary_refuses(tamper: str) -> None:
    model = trainer()
    expected = canary.of_model(model)
    if tamper == "nan-parameter":
        bad = with_weights(model, model.state_dict())
        with torch.no_grad():
            bad.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    elif tamper == "swapped-layers":
        bad = with_weights(model, swapped(model))
    elif tamper == "wrong-architecture":  # the same tensors, read as another model
        bad = with_weights(model, model.state_dict(), hidden_act="gelu")
    else:
        bad = trainer(seed=1)
    why = canary.check(expected, canary.greedy(bad, expected.prompt))
    assert why is not None and why.startswith("canary:"), why


def test_a_near_tie_is_not_a_refusal_but_a_wrong_log_probability_is() -> None:
    expected = Canary((1, 2), Answer((5, 6), (-0.70, -0.1), (1e-4, 3.0)), "float32")
    # The engine broke the tie the other way: its token differs, its log-probability does not.
    assert canary.check(expected, Answer((9, 3), (-0.7001, -2.0))) is None
    assert canary.check(expected, Answer((9, 3), (-0.9, -2.0))) is not None
    decisive = attrs.evolve(expected, answer=Answer((5, 6), (-0.7, -0.1), (3.0, 3.0)))
    assert "token 9" in (canary.check(decisive, Answer((9, 6), (-0.7, -0.1))) or "")
    assert canary.check(decisive, Answer((5, 6), (-0.7, math.nan))) is not None
    assert canary.check(decisive, Answer((5,), (-0.7,))) is not None  # too short
    # With the runner-up recorded, only it passes at a tie; the same token is compared on.
    tied = Canary((1, 2), Answer((5, 6), (-0.7, -0.1), (1e-4, 3.0), runner_ups=(9, 4)), "float32")
    assert canary.check(tied, Answer((9, 3), (-0.7001, -2.0))) is None
    assert "token 8" in (canary.check(tied, Answer((8, 3), (-0.7001, -2.0))) or "")
    assert "token 99" in (canary.check(tied, Answer((5, 99), (-0.7, -0.1))) or "")
    assert canary.check(tied, Answer((5, 6), (-0.7, None))) is not None  # type: ignore[arg-type]
    # An engine serving in bfloat16 is held to bfloat16's tolerance, not float32's.
    assert canary.check(decisive, Answer((5, 6), (-0.75, -0.1))) is not None
    assert canary.check(decisive, Answer((5, 6), (-0.75, -0.1), dtype="bfloat16")) is None
    assert canary.check(decisive, Answer((5, 6), (-0.7, -0.1), dtype="int4")) is not None


@pytest.mark.parametrize(
    "record",
    [
        "not a mapping",
        {"prompt": [1], "tokens": [2], "logprobs": [-1.0]},  # no dtype
        {"prompt": [1], "tokens": [2], "logprobs": [], "dtype": "float32"},
        {"prompt": [-1], "tokens": [2], "logprobs": [-1.0], "dtype": "float32"},
        {"prompt": [1], "tokens": [2], "logprobs": [-1.0], "dtype": "int8"},
        {"prompt": [1], "tokens": [], "logprobs": [], "dtype": "float32"},  # checks nothing
        {"prompt": [1], "tokens": [2], "logprobs": [float("nan")], "dtype": "float32"},
    ],
)
def test_a_canary_record_that_is_not_one_is_a_typed_error(record: object) -> None:
    with pytest.raises(CanaryError):
        Canary.from_json(record)


def test_the_canary_is_taken_in_eval_mode_and_leaves_the_model_as_it_was() -> None:
    model = trainer(hidden_dropout=0.0, attention_dropout=0.5)
    model.train()
    first = canary.of_model(model)
    assert model.training  # restored
    assert canary.of_model(model) == first  # dropout off while it answers: the same answer
    with torch.no_grad():
        model.model.norm.weight[0] = math.nan
    with pytest.raises(CanaryError, match="finite"):
        canary.of_model(model)


def test_an_exporter_refuses_a_canary_that_is_not_one(tmp_path: Path) -> None:
    from recovery_fsm import BadExportInput

    with (
        AsyncHFExporter(CheckpointStore(tmp_path), report=lambda *a, **k: None) as ex,
        pytest.raises(BadExportInput, match="canary"),
    ):
        ex.export_model(1, trainer(), canary={"tokens": [1]})  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing written


# -- admission on a real cluster ----------------------------------------------------------


class NoDigestEngine(ReferenceEngine):
    """The reference engine admitted as vLLM is: by its canary alone."""

    COMPUTES_DIGEST = False


class NaNAfterLoadEngine(NoDigestEngine):
    """A load from a checkpoint that succeeds and leaves one parameter NaN (as a layerwise
    reload can); pushed weights are taken correctly."""

    def boot_from_checkpoint(self, path: str) -> Any:
        held = super().boot_from_checkpoint(path)
        with torch.no_grad():
            self.model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
        return held


def step(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("tamper", ["nan-after-load", "swapped-layers", "wrong-architecture"])
def test_a_restart_the_canary_refuses_cools_and_the_group_comes_back_on_the_right_weights(
    tmp_path: Path, tamper: str
) -> None:
    model = trainer()
    journal = tmp_path / "journal.jsonl"
    engine = NaNAfterLoadEngine if tamper == "nan-after-load" else ReferenceEngine
    with RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0"], model_config=LlamaConfig(**CONFIG).to_dict(),
        engine=engine, journal=journal, tick_s=0.1, probe_interval_s=0.5, grace_s=0.5,
        call_timeout_s=60.0,
    ) as rt:  # fmt: skip
        rt.start(model)
        hooks = RecoveryHooks(rt)  # the trainer's own calls, canary passed through
        hooks.before_weight_sync(1)
        step(model)
        got = rt.push(model, 1)
        assert got == {"g0": 1}
        truth = canary.of_model(model)
        if tamper == "nan-after-load":
            hooks.after_weight_sync(1, model, got)
        elif tamper == "swapped-layers":  # the manifest matches the swapped tensors
            hooks.after_weight_sync(1, swapped(model), got, config=model.config, canary=truth)
        else:  # the right tensors, a config.json of another activation
            wrong = LlamaConfig(**{**CONFIG, "hidden_act": "gelu"})
            hooks.after_weight_sync(1, model.state_dict(), got, config=wrong, canary=truth)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        path = rt.controller.checkpoints()[1].path or ""
        CheckpointStore(tmp_path / "ckpt").verify(path, full=True)  # every digest passes

        rt.kill("g0")
        wait_for(lambda: rt.controller.group_state("g0") == "pending_weights", what="cold")
        assert rt.controller.recovery_state("g0") == "cooldown"
        assert rt.routes["g0"] is None  # never served what the canary refused
        step(model)
        assert rt.sync(model, 2) == {"g0": rt.controller.incarnation("g0")}
        served = rt.generate("g0", list(truth.prompt), max_new_tokens=4)
        assert served.version == 2
        assert tuple(served.tokens) == canary.of_model(model).answer.tokens
        assert rt.statistics().recoveries == {"cold": 1}
    failures = [
        json.loads(line)["event"]
        for line in journal.read_text().splitlines()
        if '"RestartLoadFailed"' in line
    ]
    assert [f["error"].split(":")[0] for f in failures] == ["canary"]
    assert replay(journal).ok


@pytest.mark.usefixtures("ray_cluster")
def test_a_push_the_canary_refuses_is_left_out_of_the_sync(tmp_path: Path) -> None:
    model = trainer()
    with RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0", "g1"], model_config=LlamaConfig(**CONFIG).to_dict(),
        engine=NaNOnPushToG1, journal=tmp_path / "journal.jsonl", tick_s=0.1,
        probe_interval_s=0.5, grace_s=0.5, call_timeout_s=60.0,
    ) as rt:  # fmt: skip
        rt.start(model)
        step(model)
        assert rt.sync(model, 1) == {"g0": 1}  # g1 took the push and answers NaN
        assert rt.controller.group_state("g1") == "pending_weights"
        # The withdrawal runs on the link's thread: a sync waits for the routes it adds only.
        wait_for(lambda: rt.routes["g1"] is None, timeout=10.0, what="g1 withdrawn")


class NaNOnPushToG1(NoDigestEngine):
    def update_weights(self, version: int, weights: dict[str, Any]) -> Any:
        held = super().update_weights(version, weights)
        if self.group == "g1" and version >= 1:
            with torch.no_grad():
                self.model.model.layers[0].self_attn.q_proj.weight[0, 0] = math.nan
        return held


class ForgetfulEngine(ReferenceEngine):
    """An engine whose own weight version can be lost (as a reload that reset it would)."""

    def forget(self, version: int | None = None) -> None:
        """Say it holds ``version`` (None: nothing) from now on."""
        self.held = type(self.held)(version, self.held.digest)


@pytest.mark.usefixtures("ray_cluster")
def test_a_serving_engine_that_says_it_holds_another_version_has_failed(tmp_path: Path) -> None:
    model = trainer()
    journal = tmp_path / "journal.jsonl"
    with RecoveryRuntime(
        tmp_path / "ckpt", groups=["g0"], model_config=LlamaConfig(**CONFIG).to_dict(),
        engine=ForgetfulEngine, journal=journal, tick_s=0.1, probe_interval_s=0.3,
        grace_s=0.3, call_timeout_s=60.0,
    ) as rt:  # fmt: skip
        rt.start(model)
        step(model)
        rt.sync(model, 1)
        wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", what="export of v1")
        time.sleep(1.0)  # probes pass while it holds version 1
        assert rt.controller.group("g0").incarnation == 1
        # No version, then an older one than the controller believes: each has failed.
        for incarnation, older in ((2, None), (3, 0)):
            ray.get(rt.actors("g0")[0].forget.remote(older))

            def recovered(i: int = incarnation) -> bool:
                view = rt.controller.group("g0")
                return view.incarnation == i and view.state == "active"

            wait_for(recovered, what=f"g0 recovered as #{incarnation}")
    reasons = [
        json.loads(line)["event"].get("reason")
        for line in journal.read_text().splitlines()
        if '"GroupFailed"' in line
    ]
    assert reasons == ["holds version None, not 1", "holds version 0, not 1"]
    assert replay(journal).ok


def test_a_push_refusal_says_which_gate_refused_it() -> None:
    """Each way admission refuses a process's answers to a push has its own kind (what the
    runtime counts per kind), the words staying the journal's reason."""
    from recovery_fsm.ray import Refusal, RefusalKind, WeightsHeld
    from recovery_fsm.ray.admission import push_refusal

    expected = Canary((1, 2), Answer((5, 6), (-0.7, -0.1), (3.0, 3.0)), "float32")
    right, wrong = Answer((5, 6), (-0.7, -0.1)), Answer((9, 6), (-0.7, -0.1))
    ok = WeightsHeld(2, "d-2")

    def kind(digest: str | None, *answers: object) -> RefusalKind | None:
        why = push_refusal(expected, digest, answers)
        assert why is None or (isinstance(why, Refusal) and str(why) == why.detail)
        return None if why is None else why.kind

    assert kind("d-2", ok, right, ok, right) is None
    assert kind("d-2", ok, right, WeightsHeld(2, "other"), right) is RefusalKind.DIGEST
    assert kind(None, ok, right, ok, wrong) is RefusalKind.CANARY
    assert kind("d-2", ok, "not an answer") is RefusalKind.NOT_IN_PROTOCOL
