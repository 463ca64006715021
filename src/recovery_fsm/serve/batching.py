"""Concurrent HTTP requests merged into the rollout calls of the engines.

An engine actor runs one call at a time, so a front that made one rollout call per HTTP
request would queue concurrent requests behind each other on each engine, where an
engine's own server steps them together. The batcher merges them instead: a request waits
only while every serving group already runs a call of the same sampling, and then joins
the next call with every other request that waited (up to ``max_prompts`` prompts). A
merged call is one rollout call, so its answers are at one version and carry their
certificates as before.

A merged call can fail because of one of its requests (a prompt an engine refuses): then
each request is run again alone, so one bad request never fails the others. A failure of
the fleet (no group serving before the deadline) is every request's, and is not repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import attrs

from ..ray import BadSampling, Policy, PromptSamples, RolloutFailed, Sampling

Rollout = Callable[[list[list[int]], Sampling, Policy], Awaitable[list[PromptSamples]]]


@attrs.define
class _Waiting:
    prompts: list[list[int]]
    answer: asyncio.Future[list[PromptSamples]]


@attrs.define
class _Lane:
    """The requests of one sampling: those waiting, how many calls of theirs run, and
    whether one is gathering its requests."""

    waiting: list[_Waiting] = attrs.Factory(list)
    running: int = 0
    gathering: bool = False


class Batcher:
    """``submit`` answers like ``rollout(prompts, sampling, policy)``, merged with others.

    ``calls_per_lane()``: how many calls of one sampling may run at once. The front gives
    the number of groups serving: a call of one prompt goes to one group (the next in
    turn), so a group idles only while no request waits; a call of many is split over
    every group, so an engine may queue up to that many calls of one sampling.
    ``gather_s``: how long a call waits for company before it is sent; the clients of a
    call that just ended send their next requests within it, and so stay in one call."""

    def __init__(
        self,
        rollout: Rollout,
        policy: Policy,
        *,
        max_prompts: int,
        calls_per_lane: Callable[[], int],
        gather_s: float = 0.002,
    ) -> None:
        self._rollout = rollout
        self._policy = policy
        self._max_prompts = max_prompts
        self._calls_per_lane = calls_per_lane
        self._gather_s = gather_s
        self._lanes: dict[Sampling, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # held, or the loop may drop them

    async def submit(self, prompts: list[list[int]], sampling: Sampling) -> list[PromptSamples]:
        lane = self._lanes.setdefault(sampling, _Lane())
        me = _Waiting(prompts, asyncio.get_running_loop().create_future())
        lane.waiting.append(me)
        self._dispatch(sampling, lane)
        return await me.answer

    def _dispatch(self, sampling: Sampling, lane: _Lane) -> None:
        """A call for the waiting requests if a slot is free and none is gathering."""
        if lane.waiting and not lane.gathering and lane.running < max(1, self._calls_per_lane()):
            lane.running += 1
            lane.gathering = True
            task = asyncio.get_running_loop().create_task(self._call(sampling, lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif not lane.waiting and not lane.running:
            self._lanes.pop(sampling, None)

    async def _call(self, sampling: Sampling, lane: _Lane) -> None:
        took = False
        try:
            await asyncio.sleep(self._gather_s)
            taken: list[_Waiting] = []
            size = 0
            while lane.waiting and (not taken or size + len(lane.waiting[0].prompts)
                                    <= self._max_prompts):  # fmt: skip
                w = lane.waiting.pop(0)
                if not w.answer.done():  # a client that left is not asked for
                    taken.append(w)
                    size += len(w.prompts)
            lane.gathering, took = False, True
            self._dispatch(sampling, lane)  # more than one call's worth: the next slot
            if taken:
                await self._answer(sampling, taken)
        finally:
            if not took:  # cancelled while gathering
                lane.gathering = False
            lane.running -= 1
            self._dispatch(sampling, lane)

    async def _answer(self, sampling: Sampling, taken: list[_Waiting]) -> None:
        try:
            results = await self._rollout([p for w in taken for p in w.prompts], sampling,
                                          self._policy)  # fmt: skip
        except BaseException as err:
            refused = isinstance(err, BadSampling) or (
                isinstance(err, RolloutFailed) and err.refused
            )
            if len(taken) > 1 and refused:
                # One request's fault, perhaps: each alone (in turn, in this call's slot),
                # so it fails only its own.
                for w in taken:
                    await self._answer(sampling, [w])
                return
            _settle(taken, err)
            if not isinstance(err, Exception):
                raise
            return
        start = 0
        for w in taken:
            if not w.answer.done():
                w.answer.set_result(results[start : start + len(w.prompts)])
            start += len(w.prompts)


def _settle(taken: list[_Waiting], err: BaseException) -> None:
    for w in taken:
        if not w.answer.done():
            if isinstance(err, asyncio.CancelledError):
                w.answer.cancel()
            else:
                w.answer.set_exception(err)
