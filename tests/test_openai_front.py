"""The OpenAI-compatible front, through the ``openai`` client, on a real local Ray cluster
with reference engines and a tokenizer trained here from a few sentences.

Every answer is checked against the trainer's model at the version it names (the
log-probability of each sampled token), and refused requests leave the fleet untouched.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA, serving, wait_for

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_rollouts import Versions, make, slow_engine  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

from recovery_fsm.serve import FrontLimits, OpenAIFront  # noqa: E402
from recovery_fsm.serve.openai_front import VERSION_HEADER  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("ray_cluster")

SENTENCES = [
    "the trainer syncs the weights and the fleet serves the new version",
    "a group dies and a standby serves at once from the checkpoint",
    "the engine samples tokens and returns their log probabilities",
    "every answer names the process and the version that produced it",
]
CHAT = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def small_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the tiny model's 128 ids, trained on the sentences above
    and filler words: nothing downloaded."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    size = TINY_LLAMA["vocab_size"]  # every id the model samples is a word
    trainer = trainers.WordLevelTrainer(vocab_size=size, special_tokens=["<unk>", "<s>", "</s>"])
    words = [":", "user", "assistant", "system", *(f"w{i}" for i in range(size))]
    tok.train_from_iterator([*SENTENCES, *words], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT
    assert fast.vocab_size == size
    return fast


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two groups at version 1 behind a front with a tokenizer and an API key."""
    tmp = tmp_path_factory.mktemp("front")
    versions, tok = Versions(), small_tokenizer()
    (tmp / "flags").mkdir()
    rt = make(tmp, engine=slow_engine(tmp / "flags"), tokenizer=tok)
    rt.start(versions.model)
    versions.step(1)
    rt.sync(versions.model, 1)
    front = OpenAIFront(rt, model="policy", api_key="sk-test").start()  # the runtime's tokenizer
    yield rt, versions, tok, front, tmp / "flags"
    front.stop()
    rt.close()


def client(front: OpenAIFront, **kw: Any) -> Any:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="sk-test", max_retries=0, **kw)


def check_choice(versions: Versions, prompt: list[int], choice: Any, n_top: int) -> None:
    """The choice's tokens carry the trainer's log-probabilities at its certificate's
    version, and its text is the decoding of its tokens."""
    extra = choice.model_extra
    cert, tokens = extra["certificate"], extra["token_ids"]
    probe = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
    probe.load_state_dict(versions.states[cert["version"]])
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        lp = torch.log_softmax(probe(input_ids=ids).logits[0].float(), dim=-1)
    want = [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(tokens)]
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=2e-3)
    tops = choice.logprobs.top_logprobs
    assert (tops is None) if n_top == 0 else all(len(top) == n_top for top in tops)


def test_a_completion_is_sampled_from_the_fleet_and_names_its_weights(served: Any) -> None:
    _rt, versions, tok, front, _flags = served
    prompt = tok.encode("the trainer syncs the weights")
    raw = client(front).completions.with_raw_response.create(
        model="policy", prompt=prompt, max_tokens=6, n=3, temperature=1.0, logprobs=2
    )
    answer = raw.parse()
    assert raw.headers[VERSION_HEADER] == "1"
    assert len(answer.choices) == 3 and [c.index for c in answer.choices] == [0, 1, 2]
    for c in answer.choices:
        assert c.model_extra["certificate"]["version"] == 1
        assert c.text == tok.decode(c.model_extra["token_ids"], skip_special_tokens=True)
        check_choice(versions, prompt, c, 2)
    assert answer.model_extra["weight_version"] == 1
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)


def test_text_and_chat_prompts_go_through_the_tokenizer_and_its_template(served: Any) -> None:
    _rt, versions, tok, front, _flags = served
    c = client(front)
    text = c.completions.create(model="policy", prompt="a group dies", max_tokens=5, logprobs=0)
    check_choice(versions, tok.encode("a group dies"), text.choices[0], 0)
    messages = [{"role": "user", "content": "the engine samples tokens"}]
    chat = c.chat.completions.create(
        model="policy", messages=messages, max_tokens=5, seed=3, logprobs=True, top_logprobs=1
    )
    [choice] = chat.choices
    tokens = choice.model_extra["token_ids"]
    assert choice.message.content == tok.decode(tokens, skip_special_tokens=True)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    probe = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
    probe.load_state_dict(versions.states[choice.model_extra["certificate"]["version"]])
    with torch.no_grad():
        lp = torch.log_softmax(probe(input_ids=torch.tensor([[*prompt, *tokens]])).logits[0], -1)
    want = [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(tokens)]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    got = [x.logprob for x in choice.logprobs.content]
    assert got == pytest.approx(want, abs=2e-3)
    # A seed makes the answer reproducible on the same weights.
    again = c.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=3)
    if (
        again.choices[0].model_extra["certificate"]["group"]
        == choice.model_extra["certificate"]["group"]
    ):
        assert again.choices[0].model_extra["token_ids"] == tokens


def test_every_checkpoint_carries_the_trainers_tokenizer_and_its_chat_template(
    served: Any,
) -> None:
    rt, _versions, tok, _front, _flags = served
    wait_for(lambda: rt.controller.checkpoint_state(1) == "ready", 60, "export of v1")
    path = rt.store.root / "step-1"
    saved = AutoTokenizer.from_pretrained(str(path))
    text = "the engine samples tokens"
    assert saved.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "the fleet"}]
    assert saved.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    manifest = json.loads((path / "recovery_manifest.json").read_text())
    assert "tokenizer.json" in manifest["files"]  # recorded and digested like the weights


def test_a_stream_carries_each_choice_whole_with_its_certificate(served: Any) -> None:
    _rt, _versions, _tok, front, _flags = served
    c = client(front)
    chunks = list(
        c.completions.create(
            model="policy", prompt="every answer names", max_tokens=4, n=2, stream=True
        )
    )
    assert sorted(ch.choices[0].index for ch in chunks) == [0, 1]
    assert all(ch.model_extra["weight_version"] == 1 for ch in chunks)
    assert all(ch.choices[0].finish_reason in ("stop", "length") for ch in chunks)
    chat = list(
        c.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "the fleet"}],
            max_tokens=4,
            stream=True,
        )
    )
    [one] = chat
    assert one.choices[0].delta.role == "assistant"
    tokens = one.choices[0].model_extra["certificate"]
    assert tokens["version"] == 1


def test_many_async_clients_are_merged_into_few_calls_and_answered_once_each(
    served: Any,
) -> None:
    rt, versions, _tok, front, _flags = served
    before = rt.statistics().rollouts

    async def many() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="sk-test", max_retries=0)
        prompts = [[1 + i, 7, 9] for i in range(12)]
        calls = [
            c.completions.create(model="policy", prompt=p, max_tokens=4, logprobs=0)
            for p in prompts
        ]
        answers = await asyncio.gather(*calls)
        await c.close()
        return list(zip(prompts, answers, strict=True))

    for prompt, answer in asyncio.run(many()):
        check_choice(versions, prompt, answer.choices[0], 0)
    after = rt.statistics().rollouts
    assert after.prompts == before.prompts + 12  # each asked once
    # Requests that came while the groups were busy went together (one call each: 12).
    assert after.calls - before.calls < 12, after.calls - before.calls


def _post(front: OpenAIFront, path: str, body: Any, key: str | None = "sk-test") -> Any:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{front.url}{path}", content=data, headers=headers, timeout=30)


def test_bad_requests_get_a_400_saying_what_was_expected_and_touch_nothing(served: Any) -> None:
    rt, _versions, _tok, front, _flags = served
    good = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 2}
    before = rt.statistics().rollouts
    cases = [
        ("{not json", "JSON"),
        ({**good, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({**good, "temperature": -1}, "temperature must be a number in [0, 100]"),
        ({**good, "top_p": 0}, "top_p"),
        ({**good, "n": 17}, "n must be in [1, 16]"),
        ({**good, "n": 2, "temperature": 0}, "n > 1 needs temperature > 0"),
        ({**good, "max_tokens": 0}, "max_tokens must be in"),
        ({**good, "prompt": list(range(5000))}, "at most 4096 tokens"),
        ({**good, "prompt": [1, 2, 500]}, "token ids in [0, 128)"),
        ({**good, "prompt": []}, "1 to 64 prompts, got 0"),
        ({**good, "prompt": [[1], []]}, "at least one token"),
        ({**good, "stop": ["a", "b", "c", "d", "e"]}, "stop must be up to 4"),
    ]
    for body, expected in cases:
        r = _post(front, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert expected in error["message"] and error["type"] == "invalid_request_error", r.text
    chat = {"model": "policy", "messages": [{"role": "robot", "content": "hi"}]}
    assert _post(front, "/v1/chat/completions", chat).status_code == 400
    wrong_model = _post(front, "/v1/completions", {**good, "model": "gpt-4"})
    assert wrong_model.status_code == 404 and "not served here" in wrong_model.text
    # Nothing reached the fleet: no rollout call, no engine call.
    after = rt.statistics().rollouts
    assert (after.calls, after.engine_calls) == (before.calls, before.engine_calls)
    assert _post(front, "/v1/completions", good).status_code == 200


def test_an_api_key_is_required_when_set(served: Any) -> None:
    _rt, _versions, _tok, front, _flags = served
    body = {"model": "policy", "prompt": [1, 2], "max_tokens": 2}
    for key in (None, "sk-wrong"):
        r = _post(front, "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{front.url}/v1", api_key="nope", max_retries=0).models.list()
    [model] = client(front).models.list().data
    assert model.id == "policy" and model.model_extra["weight_version"] == 1


def test_a_client_past_its_bound_of_requests_in_flight_gets_429(served: Any) -> None:
    """The sync gate holds the first request in flight; a second from the same key is
    refused, another key's is not."""
    rt, _versions, tok, _front, _flags = served
    bounded = OpenAIFront(rt, tokenizer=tok, limits=FrontLimits(in_flight_per_client=1))
    bounded.start()
    body = {"model": "policy", "prompt": [1, 2], "max_tokens": 2}
    rt.rollouts.gate.hold()
    try:
        first: list[Any] = []
        t = threading.Thread(
            target=lambda: first.append(_post(bounded, "/v1/completions", body, key="a"))
        )
        t.start()
        wait_for(lambda: _in_flight(bounded) == 1, 10, "the first request in flight")
        second = _post(bounded, "/v1/completions", body, key="a")
        assert second.status_code == 429 and second.headers["Retry-After"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
        other = threading.Thread(
            target=lambda: first.append(_post(bounded, "/v1/completions", body, key="b"))
        )
        other.start()
        wait_for(lambda: _in_flight(bounded) == 2, 10, "another client's request in flight")
    finally:
        rt.rollouts.gate.release()
    t.join(30)
    other.join(30)
    assert [r.status_code for r in first] == [200, 200]
    bounded.stop()


def _in_flight(front: OpenAIFront) -> int:
    return int(httpx.get(f"{front.url}/health", timeout=10).json()["in_flight"])


def test_no_group_serving_is_a_503_with_retry_after_then_the_same_front_answers(
    tmp_path: Path,
) -> None:
    versions = Versions()
    rt = make(tmp_path, groups=["g0"])
    front = OpenAIFront(rt).start()
    try:
        health = httpx.get(f"{front.url}/health", timeout=10)
        assert health.status_code == 503 and health.headers["Retry-After"] == "1"
        body = {"model": "policy", "prompt": [1, 2], "max_tokens": 2}
        r = _post(front, "/v1/completions", body, key=None)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        rt.start(versions.model)
        wait_for(lambda: rt.rollouts.fleet_version() is not None, 60, "g0 serving")
        ok = _post(front, "/v1/completions", body, key=None)
        assert ok.status_code == 200 and ok.headers[VERSION_HEADER] == "0"
        assert ok.json()["choices"][0]["text"] == ""  # no tokenizer: token ids only
        assert len(ok.json()["choices"][0]["token_ids"]) >= 1
    finally:
        front.stop()
        rt.close()


def test_requests_in_flight_when_an_engine_dies_are_answered_once_from_the_trainers_weights(
    served: Any,
) -> None:
    """g0's loop wedges with requests on it and is killed: every request is answered once,
    issued again on g1 (or g0's next process), each from the trainer's weights."""
    rt, versions, _tok, front, flags = served
    before = rt.statistics().rollouts.reissued

    async def many() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="sk-test", max_retries=0)
        prompts = [[2 + i, 5, 11] for i in range(8)]
        (flags / "g0").write_text("2")  # g0's calls stay in flight from their second step
        tasks = [
            asyncio.ensure_future(
                c.completions.create(model="policy", prompt=p, max_tokens=6, logprobs=0)
            )
            for p in prompts
        ]
        while rt.rollouts.gate.in_flight() < 2:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        rt.kill("g0")
        (flags / "g0").unlink()
        answers = await asyncio.gather(*tasks)
        await c.close()
        return list(zip(prompts, answers, strict=True))

    for prompt, answer in asyncio.run(many()):
        check_choice(versions, prompt, answer.choices[0], 0)
        cert = answer.choices[0].model_extra["certificate"]
        assert cert["group"] == "g1" or cert["incarnation"] > 1, cert
    assert rt.statistics().rollouts.reissued > before
    wait_for(lambda: serving(rt, "g0"), 120, "g0 serving again")


def test_requests_across_a_sync_wait_for_it_and_each_answer_is_one_version(served: Any) -> None:
    """A sync while async clients send requests: the sync's gate holds new engine calls,
    every request is answered, each at the version before or after, from those weights."""
    rt, versions, _tok, front, _flags = served

    async def across() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="sk-test", max_retries=0)
        prompts = [[3 + i, 8, 1] for i in range(12)]
        tasks = []
        for k, p in enumerate(prompts):
            create = c.completions.create(model="policy", prompt=p, max_tokens=6, logprobs=0)
            tasks.append(asyncio.ensure_future(create))
            if k == 4:  # the sync lands among them, while calls are in flight
                while rt.rollouts.gate.in_flight() == 0:
                    await asyncio.sleep(0.01)
                versions.step(2)
                await asyncio.to_thread(rt.sync, versions.model, 2)
        answers = await asyncio.gather(*tasks)
        await c.close()
        return list(zip(prompts, answers, strict=True))

    seen = set()
    for prompt, answer in asyncio.run(across()):
        check_choice(versions, prompt, answer.choices[0], 0)
        seen.add(answer.choices[0].model_extra["certificate"]["version"])
    assert seen == {1, 2}
