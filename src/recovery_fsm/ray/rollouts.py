"""Rollouts for RL: many prompts, sampled, spread over the serving groups, every sample
certified, none lost to a death.

A call (``RecoveryRuntime.rollout`` or ``arollout``) takes prompts as token ids and one
``Sampling``; it splits the prompts over the groups the router says serve, one engine call
per group (the engine batches it), and awaits the Ray object references on an asyncio loop:
no thread per request, hundreds of prompts in flight. What comes back is checked before it
is kept:

- the batch names the process it was sent to (group and incarnation), and a version that the
  controller admitted on that process: the admission id is the journal step of the record
  that routed the process at that version (its start, verification or claim passing its
  digest and canary, or the sync whose push passed them), so any sample traces to a checked
  admission from the journal alone. A batch at a version not (yet) admitted is held until the
  admission lands (a push the sync has not reported) or issued again;
- under ``Policy(version="same")`` every sample is at the version the call started at:
  a batch at another is issued again on a group serving it, until ``deadline_s``, then
  ``RolloutFailed`` names the prompts;
- a call whose process dies or does not answer within ``request_timeout_s`` is issued again
  on a serving group (the answer that arrives late, if any, is never read);
- a prompt whose siblings came back incomplete (an abort kept those that had ended) keeps
  them and asks for the missing ones (``siblings="missing"``), or asks for all ``n`` again
  (``siblings="group"``, the default: a group of samples is then one process at one
  version).

Each prompt is answered exactly once: its samples are kept only while it still owes some,
and the call returns when none owes any. A sync closes the gate (``SyncGate``) for new
engine calls; what is in flight is waited for (``in_flight="wait"``) or aborted and issued
again at the new version (``"abort"``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import ray

from .. import RecoveryError
from .actors import ActorTable
from .causes import cause_of
from .sampling import Batch, EngineSample, Sampling, check_prompts

log = logging.getLogger(__name__)

IN_FLIGHT_MODES = ("wait", "abort")


class RolloutFailed(RecoveryError):
    """Prompts the policy could not answer: no group served what it asks for before the
    deadline, or they were issued ``attempts`` times. ``prompts``: their indices.
    ``refused``: an engine refused the request itself (a prompt too long for it), so no
    retry could answer it; else the fleet did not."""

    def __init__(self, message: str, prompts: Sequence[int], refused: bool = False) -> None:
        super().__init__(message)
        self.prompts = tuple(prompts)
        self.refused = refused


class RolloutInLoop(RecoveryError):
    """The blocking ``rollout`` was called from a running asyncio loop: await ``arollout``."""


def _choice(allowed: tuple[str, ...]) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


def _positive(_: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


@attrs.frozen
class Policy:
    """What a rollout does when an engine dies, hangs, or the fleet moves on.

    ``version``: ``"current"`` takes samples at whatever version the serving group holds
    (each certificate says which); ``"same"`` only at the version the call started at.
    ``siblings``: after an incomplete group of ``n``, ask again for the missing ones only, or
    the whole group. ``deadline_s`` bounds the whole call; ``request_timeout_s`` one engine
    call (a hang); ``attempts`` how many times a prompt is issued at most."""

    version: Literal["same", "current"] = attrs.field(
        default="current", validator=_choice(("same", "current"))
    )
    siblings: Literal["group", "missing"] = attrs.field(
        default="group", validator=_choice(("group", "missing"))
    )
    deadline_s: float = attrs.field(default=300.0, validator=_positive)
    request_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    attempts: int = attrs.field(default=5, validator=_positive)


@attrs.frozen
class Certificate:
    """Who produced a sample: one process (group, incarnation) at one weight version, admitted
    at journal step ``admission`` (None only when the journal is kept by a controller actor,
    which this process does not read)."""

    group: str
    incarnation: int
    version: int
    admission: int | None


@attrs.frozen
class Sample:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...] | None
    finish_reason: str
    certificate: Certificate


@attrs.frozen
class PromptSamples:
    """A prompt's ``n`` samples and how many times it was issued again to get them."""

    prompt: tuple[int, ...]
    samples: tuple[Sample, ...]
    reissued: int

    @property
    def versions(self) -> frozenset[int]:
        return frozenset(s.certificate.version for s in self.samples)


@attrs.define
class RolloutCounters:
    """Counted over the runtime's life (``Statistics.rollouts``)."""

    calls: int = 0  # rollout calls answered
    prompts: int = 0  # prompts answered
    samples: int = 0  # samples returned
    engine_calls: int = 0
    reissued: int = 0  # prompts issued again (a death, a hang, an abort, a version)
    failed_by_policy: int = 0  # prompts a RolloutFailed named
    discarded: int = 0  # samples read and not kept (wrong version, no admission, partial)
    duplicates: int = 0  # samples refused because their prompt owed none (stays 0)


class SyncGate:
    """Holds new engine calls while a sync runs and knows the calls in flight (thread-safe:
    rollouts run on any thread's loop)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holds = 0
        self._calls: dict[int, Any] = {}  # call id -> actor
        self._ids = itertools.count()
        self.aborts = 0  # rounds of aborts sent (tests wait on it)

    def hold(self) -> None:
        with self._cond:
            self._holds += 1

    def release(self) -> None:
        with self._cond:
            self._holds = max(0, self._holds - 1)
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        with self._cond:
            return self._holds > 0

    def enter(self, actor: Any) -> int | None:
        """A call id if the gate is open (the call is then in flight), else None."""
        with self._cond:
            if self._holds:
                return None
            cid = next(self._ids)
            self._calls[cid] = actor
            return cid

    def leave(self, cid: int) -> None:
        with self._cond:
            self._calls.pop(cid, None)
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._calls)

    def drain(self, mode: str, timeout: float) -> bool:
        """With the gate held: wait for the calls in flight to end (``abort``: ask each
        engine to stop its batch first). False if some still run after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                actors = list(self._calls.values())
            if not actors:
                return True
            if mode == "abort":
                # Again each round: a batch queued behind the one stopped starts afresh.
                self.aborts += 1
                for a in {id(a): a for a in actors}.values():
                    a.abort.remote()  # answered beside the batch (health group); not awaited
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait_for(lambda: not self._calls, min(left, 0.1))


@attrs.frozen
class _Route:
    group: str
    incarnation: int
    version: int


class RolloutClient:
    """Dispatches rollouts over the routes of ``routes()`` (group -> (incarnation, version)
    or None) to the actors of ``table``; ``admission(group, incarnation, version)`` is the
    journal step that admitted that process at that version, or None."""

    def __init__(
        self,
        table: ActorTable,
        routes: Callable[[], Mapping[str, tuple[int, int] | None]],
        admission: Callable[[str, int, int], int | None],
        *,
        certified: bool,
        vocab_size: int | None,
        epoch: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.epoch = epoch  # the run epoch each engine call carries (fenced engines)
        self._table = table
        self._routes = routes
        self._admission = admission
        self._certified = certified  # False: admissions are not readable here
        self._vocab = vocab_size
        self.gate = SyncGate()
        self.counters = RolloutCounters()
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def run(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
            policy: Policy) -> list[PromptSamples]:  # fmt: skip
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(prompts, sampling, policy))
        raise RolloutInLoop("rollout() blocks; from a running asyncio loop, await arollout()")

    async def arun(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, policy: Policy
    ) -> list[PromptSamples]:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}")
        asked = check_prompts(prompts, self._vocab)
        return await _Call(self, asked, sampling, policy).run()

    # -- what the call needs from the runtime ------------------------------------------------

    def serving(self, version: int | None) -> list[_Route]:
        out = [
            _Route(g, r[0], r[1])
            for g, r in sorted(self._routes().items())
            if r is not None and (version is None or r[1] == version)
        ]
        k = next(self._turn) % len(out) if out else 0
        return out[k:] + out[:k]  # round robin over calls

    def groups_serving(self) -> int:
        return sum(r is not None for r in self._routes().values())

    def fleet_version(self) -> int | None:
        versions = [r[1] for r in self._routes().values() if r is not None]
        return max(versions) if versions else None

    def certify(self, batch: Batch, route: _Route) -> Certificate | str:
        """The certificate of ``batch`` sent to ``route``, or why it has none (yet)."""
        if (batch.group, batch.incarnation) != (route.group, route.incarnation):
            return f"answered as {batch.group}#{batch.incarnation}"
        if batch.version is None:
            return "the engine holds no weights"
        if not self._certified:  # no journal here: hold it to the route's version
            if batch.version != route.version:
                return f"version {batch.version}, routed at {route.version}"
            return Certificate(batch.group, batch.incarnation, batch.version, None)
        step = self._admission(batch.group, batch.incarnation, batch.version)
        if step is None:
            return f"version {batch.version} {_NOT_ADMITTED}"
        return Certificate(batch.group, batch.incarnation, batch.version, step)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + d)

    def snapshot(self) -> RolloutCounters:
        with self._lock:
            return attrs.evolve(self.counters)


_NOT_ADMITTED = "not admitted on this process"  # yet, perhaps: the sync's record may follow
_ADMISSION_WAIT_S = 10.0  # a batch at a pushed version waits this long for the sync's report


class _Call:
    """One rollout call: what each prompt still owes, issued in rounds until none owes."""

    def __init__(self, client: RolloutClient, prompts: list[list[int]], sampling: Sampling,
                 policy: Policy) -> None:  # fmt: skip
        self.c = client
        self.prompts = prompts
        self.sampling = sampling
        self.policy = policy
        self.kept: list[list[Sample]] = [[] for _ in prompts]
        self.issued = [0] * len(prompts)
        self.errors: dict[int, str] = {}  # the last failure of each prompt's engine call
        self.deadline = time.monotonic() + policy.deadline_s
        self.target: int | None = None
        self.bad: set[tuple[str, int]] = set()  # processes that failed a call: not again
        self.fatal: str | None = None  # the engine refused the request itself: no retry

    def owed(self, i: int) -> int:
        return self.sampling.n - len(self.kept[i])

    async def run(self) -> list[PromptSamples]:
        if self.policy.version == "same":
            self.target = await self._wait_for(lambda: self.c.fleet_version(), "serving group")
        while pending := [i for i in range(len(self.prompts)) if self.owed(i)]:
            exhausted = [i for i in pending if self.issued[i] >= self.policy.attempts]
            if exhausted:
                last = self.errors.get(exhausted[0], "none kept")
                self._fail(pending, f"prompt {exhausted[0]} issued {self.policy.attempts} "
                                    f"times without an answer (last: {last})")  # fmt: skip
            if time.monotonic() > self.deadline:
                last = self.errors.get(pending[0], "none kept")
                self._fail(pending, f"not answered within deadline_s={self.policy.deadline_s} "
                                    f"(last: {last})")  # fmt: skip
            routes = await self._wait_for(self._open_routes, self._wanted())
            issued = await asyncio.gather(*(
                self._issue(route, pending[k :: len(routes)])
                for k, route in enumerate(routes[: len(pending)])
            ))  # fmt: skip
            if self.fatal is not None:
                self._fail(pending, self.fatal, refused=True)
            if not any(issued):
                await asyncio.sleep(0.02)  # routes without actors, or a gate just closed
        self.c.count(calls=1, prompts=len(self.prompts),
                     samples=sum(len(k) for k in self.kept))  # fmt: skip
        return [
            PromptSamples(tuple(p), tuple(k), max(0, n - 1))
            for p, k, n in zip(self.prompts, self.kept, self.issued, strict=True)
        ]

    def _wanted(self) -> str:
        return "serving group" + ("" if self.target is None else f" at version {self.target}")

    def _open_routes(self) -> list[_Route] | None:
        if self.c.gate.held:
            return None
        fine = [r for r in self.c.serving(self.target) if (r.group, r.incarnation) not in self.bad]
        return fine or None

    async def _wait_for(self, get: Callable[[], Any], what: str) -> Any:
        while (got := get()) is None:
            if time.monotonic() > self.deadline:
                pending = [i for i in range(len(self.prompts)) if self.owed(i)]
                self._fail(pending, f"no {what} (not failed in this call) within "
                                    f"deadline_s={self.policy.deadline_s}")  # fmt: skip
            await asyncio.sleep(0.02)
        return got

    def _fail(self, prompts: list[int], why: str, refused: bool = False) -> None:
        self.c.count(failed_by_policy=len(prompts))
        raise RolloutFailed(f"prompts {prompts[:8]}{'...' if len(prompts) > 8 else ''}: {why}",
                            prompts, refused)  # fmt: skip

    async def _issue(self, route: _Route, chunk: list[int]) -> bool:
        """One engine call for ``chunk`` on ``route``; keeps what it may, else they owe.
        False if nothing was sent."""
        actors = self.c._table.of(route.group, route.incarnation)
        if not actors:
            # Stopped, its withdrawal not applied yet: not this process again in this call.
            self.bad.add((route.group, route.incarnation))
            return False
        cid = self.c.gate.enter(actors[0])
        if cid is None:
            return False  # a sync closed the gate meanwhile
        again = [i for i in chunk if self.issued[i]]
        for i in chunk:
            self.issued[i] += 1
            if self.policy.siblings == "group" and self.owed(i) < self.sampling.n:
                self.c.count(discarded=len(self.kept[i]))
                self.kept[i] = []  # an incomplete group is asked for whole
        if again:
            self.c.count(reissued=len(again))
        # Prompts owing the same number of samples go in one call.
        by_need: dict[int, list[int]] = {}
        for i in chunk:
            by_need.setdefault(self.owed(i), []).append(i)
        try:
            self.c.count(engine_calls=len(by_need))
            await asyncio.gather(*(self._call(actors[0], route, need, idx)
                                   for need, idx in by_need.items()))  # fmt: skip
        finally:
            self.c.gate.leave(cid)
        return True

    async def _call(self, actor: Any, route: _Route, need: int, idx: list[int]) -> None:
        sampling = attrs.evolve(self.sampling, n=need)
        ref = actor.rollout.remote([self.prompts[i] for i in idx], sampling, epoch=self.c.epoch())
        left = max(0.1, self.deadline - time.monotonic())
        try:
            batch: Batch = await asyncio.wait_for(ref, min(self.policy.request_timeout_s, left))
            if len(batch.samples) != len(idx):
                raise ValueError(f"answered {len(batch.samples)} prompts of {len(idx)}")
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError | TypeError):
                # The request itself is refused (a prompt longer than the engine takes):
                # every engine would refuse it again.
                self.fatal = f"{route.group}#{route.incarnation} refused it: {err.cause}"[:300]
                return
            self._failed(route, idx, err)
            return
        except Exception as err:  # a death, a hang, an answer not in the protocol
            self._failed(route, idx, err)
            return
        else:
            await self._accept(batch, route, idx)

    def _failed(self, route: _Route, idx: list[int], err: BaseException) -> None:
        """That process is not asked again in this call; its prompts still owe."""
        self.bad.add((route.group, route.incarnation))
        why = f"{route.group}#{route.incarnation}: {cause_of(err)}"
        for i in idx:
            self.errors[i] = why
        log.info("a rollout call on %s#%d failed (%s): its %d prompts are issued again",
                 route.group, route.incarnation, type(err).__name__, len(idx))  # fmt: skip

    async def _accept(self, batch: Batch, route: _Route, idx: list[int]) -> None:
        cert = self.c.certify(batch, route)
        if isinstance(cert, str) and cert.endswith(_NOT_ADMITTED):
            cert = await self._admitted(batch, route)
        if isinstance(cert, str) or (self.target is not None and cert.version != self.target):
            why = cert if isinstance(cert, str) else f"version {cert.version}"
            log.info("a rollout batch from %s#%d not kept: %s", route.group,
                     route.incarnation, why)  # fmt: skip
            self.c.count(discarded=sum(len(s) for s in batch.samples))
            for i in idx:
                self.errors[i] = f"{route.group}#{route.incarnation}: {why}"
            return
        for i, samples in zip(idx, batch.samples, strict=True):
            self._keep(i, samples, cert)

    async def _admitted(self, batch: Batch, route: _Route) -> Certificate | str:
        """A batch at a version pushed but not yet reported: wait for its admission."""
        until = min(self.deadline, time.monotonic() + _ADMISSION_WAIT_S)
        while isinstance(cert := self.c.certify(batch, route), str) and time.monotonic() < until:
            await asyncio.sleep(0.02)
        return cert

    def _keep(self, i: int, samples: tuple[EngineSample, ...], cert: Certificate) -> None:
        owed = self.owed(i)
        if len(samples) > owed:
            self.c.count(duplicates=len(samples) - owed)
            samples = samples[:owed]
        self.kept[i].extend(
            Sample(s.tokens, s.logprobs, s.top_logprobs, s.finish_reason, cert) for s in samples
        )
