"""Requests go only where the controller's routing effects say.

``apply`` takes every ``RouteTraffic``/``WithdrawTraffic`` (on the link's thread: it only
records and hands the effect on to the user's router), ``advance`` moves a routed group to
the version a sync gave it, and ``generate`` sends a request to a serving group, round
robin; a request on a process that dies or does not answer is tried on the next serving
group, and when none is left it fails with ``NoServingGroup``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray

from .. import RecoveryError
from .. import effects as fx
from .actors import ActorTable
from .engine import Generation

log = logging.getLogger(__name__)

_ADMISSIONS_KEPT = 8  # per group: enough for the batches still in flight across a few syncs

UserRouter = Callable[[fx.RouteTraffic | fx.WithdrawTraffic], None]


class NoServingGroup(RecoveryError):
    """No group serves (or every one tried failed the request); try again after a sync or a
    recovery."""


class NotServing(RecoveryError):
    """The group named is not routed: it is down, recovering or holds stale weights."""


class TrafficRouter:
    """Lock order: leaf, except that the user's router is called after the lock is
    released."""

    def __init__(
        self, table: ActorTable, *, call_timeout_s: float, user: UserRouter | None = None
    ) -> None:
        self._table = table
        self._timeout = call_timeout_s
        self._user = user
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)  # notified on every routing effect
        self._routes: dict[str, tuple[int, int] | None] = {}  # group -> (incarnation, version)
        # The latest routing effect each group got: a retried older one is stale.
        self._latest: dict[str, fx.RouteTraffic | fx.WithdrawTraffic] = {}
        self._turn = itertools.count()
        # group -> {(incarnation, version): journal step that admitted it}, a few kept.
        self._admitted: dict[str, dict[tuple[int, int], int]] = {}

    def apply(self, effect: fx.RouteTraffic | fx.WithdrawTraffic, *, retry: bool = False) -> None:
        """Record a routing effect and hand it on. ``retry``: it failed before (the user's
        router raised) and runs again; it is dropped if a newer one for its group came since,
        so a retry never routes to a group that was withdrawn meanwhile (or the reverse)."""
        with self._lock:
            if retry and self._latest.get(effect.group) is not effect:
                log.info("dropped a stale retried %r", effect)
                return
            self._latest[effect.group] = effect
            route = self._routes.get(effect.group)
            if isinstance(effect, fx.RouteTraffic):
                version = effect.version
                if route is not None and route[0] == effect.incarnation:
                    version = max(version, route[1])  # a sync may have advanced it already
                self._routes[effect.group] = (effect.incarnation, version)
            else:
                self._routes[effect.group] = None
            self._applied.notify_all()
        if self._user is not None:
            self._user(effect)

    def wait_routed(self, effects: Iterable[fx.Effect], timeout: float) -> bool:
        """Wait until every ``RouteTraffic`` among ``effects`` is recorded here, or a newer
        routing effect of its group is (routing runs on the link's thread); False on
        timeout. Compares by value: a remote link's effects are copies."""
        routes = [e for e in effects if isinstance(e, fx.RouteTraffic)]

        def reached(e: fx.RouteTraffic) -> bool:
            latest = self._latest.get(e.group)
            if isinstance(latest, fx.RouteTraffic):
                return latest == e or latest.incarnation > e.incarnation
            return latest is not None and latest.incarnation >= e.incarnation

        with self._applied:
            return self._applied.wait_for(lambda: all(reached(e) for e in routes), timeout)

    def note(self, record: Mapping[str, Any]) -> None:
        """Fold a journal record (the controller's sink calls this before the record's
        effects run): a route, or a sync a routed process took, is an admission, numbered
        by the record's step. A sample's certificate names it."""
        if "error" in record or not isinstance(record.get("step"), int):
            return
        step, event = record["step"], record.get("event", {})
        admitted = [
            (e["group"], e["incarnation"], e["version"])
            for e in record.get("effects", ())
            if e.get("kind") == "RouteTraffic"
        ]
        if event.get("kind") == "WeightsSynced":
            admitted += [(g, inc, event["version"]) for g, inc in event["groups"].items()]
        if not admitted:
            return
        with self._lock:
            for g, inc, version in admitted:
                kept = self._admitted.setdefault(g, {})
                kept.setdefault((int(inc), int(version)), step)
                while len(kept) > _ADMISSIONS_KEPT:
                    del kept[next(iter(kept))]

    def admission(self, group: str, incarnation: int, version: int) -> int | None:
        """The journal step that admitted ``group``'s process ``incarnation`` at
        ``version``, if it was (and is among the last few of its group)."""
        with self._lock:
            return self._admitted.get(group, {}).get((incarnation, version))

    def advance(self, version: int, groups: Mapping[str, int]) -> None:
        """A sync the controller accepted: each listed process still routed holds
        ``version`` now (it stays serving without a new routing effect)."""
        with self._lock:
            for g, inc in groups.items():
                route = self._routes.get(g)
                if route is not None and route[0] == inc:
                    self._routes[g] = (inc, version)

    @property
    def routes(self) -> dict[str, tuple[int, int] | None]:
        """Group -> (incarnation, version) it serves, or None while it does not."""
        with self._lock:
            return dict(self._routes)

    def generate(
        self, prompt: list[int], max_new_tokens: int = 8, *, group: str | None = None
    ) -> Generation:
        """Greedy tokens from a serving group (``group``: that one only)."""
        with self._lock:
            serving = sorted(g for g, r in self._routes.items() if r is not None)
            turn = next(self._turn)
        if group is not None:
            if group not in serving:
                raise NotServing(
                    f"group {group!r} is not serving (routes: {self.routes}); send the request "
                    "without a group to let the router pick one"
                )
            order = [group]
        else:
            k = turn % len(serving) if serving else 0
            order = serving[k:] + serving[:k]
        errors: list[str] = []
        for g in order:
            route = self.routes.get(g)
            if route is None:
                continue  # withdrawn since
            actors = self._table.of(g, route[0])
            if not actors:
                continue
            try:
                out: Generation = ray.get(
                    actors[0].generate.remote(prompt, max_new_tokens), timeout=self._timeout
                )
                return out
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                log.info("a request on %s#%d failed (%s); trying the next group", g, route[0],
                         type(err).__name__)  # fmt: skip
                errors.append(f"{g}: {type(err).__name__}")
        if group is not None:
            raise NotServing(f"group {group!r} did not answer: {errors}")
        raise NoServingGroup(
            f"no serving group answered ({errors or 'none is routed'}); the controller "
            "routes a group again once it recovers or a sync admits it"
        )

    def sizes(self) -> Mapping[str, int]:
        with self._lock:
            return {"routes": len(self._routes), "latest": len(self._latest),
                    "admitted": sum(len(k) for k in self._admitted.values())}  # fmt: skip
