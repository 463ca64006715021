"""The front's batcher: concurrent requests of one sampling share a rollout call, and a
request an engine refuses fails alone. The rollout here is a function standing in for
``RecoveryRuntime.arollout`` (the HTTP tests run the batcher on a real fleet)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from recovery_fsm.ray import Policy, PromptSamples, RolloutFailed, Sampling
from recovery_fsm.serve.batching import Batcher

REFUSED = [99]  # a prompt the "engine" refuses, as vLLM refuses one longer than it takes


class Fleet:
    """Answers each prompt with itself; records the calls; ``groups`` serving."""

    def __init__(self, groups: int = 1, fail_all: bool = False) -> None:
        self.groups = groups
        self.fail_all = fail_all
        self.calls: list[list[list[int]]] = []
        self.running = 0
        self.most_running = 0

    async def rollout(
        self, prompts: list[list[int]], sampling: Sampling, policy: Policy
    ) -> list[PromptSamples]:
        self.calls.append(prompts)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(0.05)
            if self.fail_all:
                raise RolloutFailed("no serving group within deadline_s", range(len(prompts)))
            if REFUSED in prompts:
                raise RolloutFailed("g0#1 refused it", range(len(prompts)), refused=True)
            return [PromptSamples(tuple(p), (), 0) for p in prompts]
        finally:
            self.running -= 1

    def batcher(self, max_prompts: int = 64) -> Batcher:
        return Batcher(self.rollout, Policy(), max_prompts=max_prompts,
                       calls_per_lane=lambda: self.groups)  # fmt: skip


def _run(batcher: Batcher, requests: list[list[list[int]]],
         samplings: list[Sampling] | None = None) -> list[Any]:  # fmt: skip
    async def go() -> list[Any]:
        many = samplings or [Sampling()] * len(requests)
        return await asyncio.gather(
            *(batcher.submit(r, s) for r, s in zip(requests, many, strict=True)),
            return_exceptions=True,
        )

    return asyncio.run(go())


def test_requests_that_wait_for_a_busy_group_go_in_one_call_and_get_their_own_answers() -> None:
    fleet = Fleet(groups=1)
    requests = [[[i, i + 1]] for i in range(1, 11)] + [[[50], [51]]]
    answers = _run(fleet.batcher(), requests)
    for request, answer in zip(requests, answers, strict=True):
        assert [list(a.prompt) for a in answer] == request
    assert len(fleet.calls) == 1  # all came within the gathering window
    assert fleet.most_running == 1


def test_requests_that_come_while_the_group_is_busy_wait_and_go_together() -> None:
    fleet = Fleet(groups=1)
    batcher = fleet.batcher()

    async def go() -> list[Any]:
        first = asyncio.ensure_future(batcher.submit([[1]], Sampling()))
        await asyncio.sleep(0.02)  # its call runs (50 ms): the group is busy
        later = [asyncio.ensure_future(batcher.submit([[i]], Sampling())) for i in (2, 3, 4)]
        return await asyncio.gather(first, *later)

    answers = asyncio.run(go())
    assert [[list(p.prompt) for p in a] for a in answers] == [[[1]], [[2]], [[3]], [[4]]]
    assert fleet.calls == [[[1]], [[2], [3], [4]]]
    assert fleet.most_running == 1 and not batcher._lanes  # nothing left behind


def test_a_client_that_leaves_while_waiting_is_not_asked_for() -> None:
    fleet = Fleet(groups=1)
    batcher = fleet.batcher()

    async def go() -> Any:
        first = asyncio.ensure_future(batcher.submit([[1]], Sampling()))
        await asyncio.sleep(0.02)
        gone = asyncio.ensure_future(batcher.submit([[2]], Sampling()))
        stays = asyncio.ensure_future(batcher.submit([[3]], Sampling()))
        await asyncio.sleep(0.01)
        gone.cancel()
        return await asyncio.gather(first, stays)

    asyncio.run(go())
    assert fleet.calls == [[[1]], [[3]]]


def test_a_call_holds_at_most_max_prompts_and_the_rest_take_the_next_slot() -> None:
    fleet = Fleet(groups=2)
    requests = [[[i]] for i in range(1, 8)]
    answers = _run(fleet.batcher(max_prompts=3), requests)
    assert [[list(a[0].prompt)] for a in answers] == requests
    assert [len(c) for c in fleet.calls] == [3, 3, 1]
    assert fleet.most_running == 2  # one call per group serving


def test_samplings_are_not_mixed_in_one_call() -> None:
    fleet = Fleet(groups=1)
    hot, cold = Sampling(temperature=1.0), Sampling(temperature=0.5)
    _run(fleet.batcher(), [[[1]], [[2]], [[3]]], [hot, cold, hot])
    assert sorted(sorted(p[0] for p in c) for c in fleet.calls) == [[1, 3], [2]]


def test_a_request_an_engine_refuses_fails_alone_not_the_requests_merged_with_it() -> None:
    fleet = Fleet(groups=1)
    answers = _run(fleet.batcher(), [[[1]], [REFUSED], [[2], [3]]])
    assert [list(a.prompt) for a in answers[0]] == [[1]]
    assert isinstance(answers[1], RolloutFailed) and answers[1].refused
    assert [list(a.prompt) for a in answers[2]] == [[2], [3]]
    assert len(fleet.calls) == 4  # merged, then each alone
    assert fleet.most_running == 1  # one after another, in the merged call's slot


def test_a_failure_of_the_fleet_is_every_requests_and_is_not_repeated() -> None:
    fleet = Fleet(groups=1, fail_all=True)
    answers = _run(fleet.batcher(), [[[1]], [[2]], [[3]]])
    assert all(isinstance(a, RolloutFailed) and not a.refused for a in answers)
    assert len(fleet.calls) == 1


@pytest.mark.parametrize("groups", [0, 1])
def test_with_no_group_serving_one_call_still_runs_to_learn_it(groups: int) -> None:
    fleet = Fleet(groups=groups)
    answers = _run(fleet.batcher(), [[[1]], [[2]]])
    assert [list(a[0].prompt) for a in answers] == [[1], [2]]
    assert fleet.most_running == 1
