"""Which Ray actors run which group's process, and how to start and kill them.

The table holds one entry per group, never one per incarnation: a group's current process
(its incarnation number and actor handles, when it started) and the highest incarnation told
to stop. Incarnations only grow and a group's starts run in order (one lane per group), so
"told to stop" is a floor, not a set: a boot for an incarnation at or below it comes too
late and is killed, whoever asked for it. A standby's name boots once: its floor is kept only
while that boot is queued or running, and a standby that stops or dies leaves the table, so a
run of days does not keep one entry per standby it ever booted.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import Fenced
from . import scratch
from .causes import cause_of
from .engine import WeightsHeld
from .errors import BadRuntimeInput

log = logging.getLogger(__name__)

_FOREVER = 2**62  # the stop floor of a retired group: above every incarnation
ENDED_KEPT = 64  # killed processes remembered until a report waits for their exit
PROCESSES_KEPT = 4096  # actors whose pid is remembered (a run's latest boots)


def _actor_id(actor: Any) -> str:
    return str(actor._actor_id.hex())


def exited(pid: int) -> bool:
    """What this host's operating system says: no such process, or one that exited and
    waits to be reaped by its parent (a zombie reads nothing and holds no file)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():  # Linux: the state follows the command's closing parenthesis
        try:
            return stat.read_text().rpartition(")")[2].split()[0] == "Z"
        except (OSError, IndexError):
            return True  # gone while read
    ps = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                        check=False)  # fmt: skip
    state = ps.stdout.strip()
    return state == "" or state.startswith("Z")


def _exits_by(pid: int, deadline: float) -> bool:
    """Poll ``exited`` until it holds or ``deadline`` (monotonic) passes."""
    while not exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    scratch.remove(pid)  # what it left in its temporary folder goes with it
    return True


@ray.remote(num_cpus=0)
def _exited_there(pid: int, timeout_s: float) -> bool:
    """``_exits_by`` asked on the node the process ran on."""
    return _exits_by(pid, time.monotonic() + timeout_s)


def wait_exited(asked: list[Any], timeout_s: float) -> bool:
    """Wait for the processes whose ``process()`` answers ``asked`` holds to exit. One whose
    answer never came died before it was built (it read nothing); one on a node that is
    gone is gone with it."""
    deadline = time.monotonic() + timeout_s
    here = ray.get_runtime_context().get_node_id()
    exited = True
    for ref in asked:
        try:
            pid, node = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            continue
        left = max(0.0, deadline - time.monotonic())
        if node == here:
            done = _exits_by(pid, deadline)
        else:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            try:
                done = bool(ray.get(_exited_there.options(scheduling_strategy=strategy)
                                    .remote(pid, left), timeout=left + 10.0))  # fmt: skip
            except Exception:
                done = True  # its node is gone
        if not done:
            log.warning("process %d on node %s still runs %.0f s after its kill", pid, node,
                        timeout_s)  # fmt: skip
            exited = False
    return exited


@attrs.frozen
class Process:
    """A group's current process: its number, its actors and when they started."""

    incarnation: int
    actors: tuple[Any, ...]
    started_at: float


def _created_as(actor_name: str) -> tuple[str, int] | None:
    """(group, incarnation) from a name ``Launcher`` gave: ``<group>#<incarnation>.<hex>``."""
    head, _, _ = actor_name.rpartition(".")
    group, _, number = head.rpartition("#")
    return (group, int(number)) if group and number.isdigit() and int(number) >= 1 else None


def namespace(run: str) -> str:
    """The Ray namespace a named run's engines live in."""
    return f"recovery-fsm.{run}"


def kill(actors: Iterable[Any]) -> None:
    """Kill by handle, never by name: only actors this runtime made."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            log.debug("ray.kill of an actor that is already gone", exc_info=True)


class ActorTable:
    """The actor handles of each group's current process. Lock order: leaf (calls nothing
    while holding its lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._current: dict[str, Process] = {}
        self._stopped: dict[str, int] = {}  # group -> highest incarnation told to stop
        # Standbys whose one boot is queued or running: only these need a stop floor.
        self._booting: set[str] = set()
        # Processes a resume found, by (name, incarnation), until the rules' effects say:
        # adopted (verified), or stopped.
        self._found: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._closed = False  # any boot that comes later is killed
        # Each actor's answer to ``process()`` (its pid and node), asked as it was made, and
        # the actors taken to be killed whose exit nobody has waited for yet (the latest
        # ENDED_KEPT processes): a report that frees what they read waits for their exit.
        self._processes: collections.OrderedDict[str, Any] = collections.OrderedDict()
        # The handles of those actors (same keys): close() kills a boot still in flight too.
        self._made: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._ended: collections.OrderedDict[tuple[str, int], list[Any]] = (
            collections.OrderedDict()
        )

    def of(self, group: str, incarnation: int) -> list[Any]:
        """The actors of that process, or [] if it is not the group's current one."""
        with self._lock:
            p = self._current.get(group)
            return list(p.actors) if p is not None and p.incarnation == incarnation else []

    def owner(self, actor: Any) -> tuple[str, int] | None:
        """(group, incarnation) of the current process ``actor`` belongs to, if any."""
        with self._lock:
            for group, p in self._current.items():
                if actor in p.actors:
                    return group, p.incarnation
            return None

    def started_at(self, group: str, incarnation: int) -> float | None:
        with self._lock:
            p = self._current.get(group)
            return p.started_at if p is not None and p.incarnation == incarnation else None

    def replace(self, group: str, incarnation: int, actors: list[Any]) -> list[Any]:
        """Make ``actors`` the group's current process; returns the actors to kill: those
        they replace, or ``actors`` themselves if they come too late (this incarnation or a
        later one was told to stop, or the table is closed)."""
        with self._lock:
            current = self._current.get(group)
            late = (
                self._closed
                or incarnation <= self._stopped.get(group, 0)
                or (current is not None and incarnation < current.incarnation)
            )
            if late:
                return actors
            self._current[group] = Process(incarnation, tuple(actors), self._clock())
            return list(current.actors) if current is not None else []

    def hold_found(self, found: Mapping[tuple[str, int], list[Any]]) -> None:
        """What a resume found alive, held until the rules adopt or stop each process."""
        with self._lock:
            self._found.update({k: tuple(v) for k, v in found.items()})

    def adopt(self, name: str, incarnation: int) -> list[Any]:
        """A found process becomes ``name``'s current one (asked to verify); returns the
        actors to kill (as ``replace``)."""
        with self._lock:
            actors = self._found.pop((name, incarnation), None)
        return [] if actors is None else self.replace(name, incarnation, list(actors))

    def take_found(self, name: str, incarnation: int) -> list[Any]:
        """Remove (to kill) a found process the rules keep as nobody's."""
        with self._lock:
            return list(self._found.pop((name, incarnation), ()))

    def renumber(self, group: str, previous: int, incarnation: int) -> None:
        """The process ``previous`` goes on as ``incarnation`` (a load in place); nothing
        happens if it was replaced or stopped meanwhile."""
        with self._lock:
            p = self._current.get(group)
            if p is not None and p.incarnation == previous and p.actors:
                self._current[group] = attrs.evolve(p, incarnation=incarnation)

    def take(self, group: str, incarnation: int | None = None) -> list[Any]:
        """Remove (to kill) the group's current actors, or only those of ``incarnation``,
        which stays stopped even if its actors do not exist yet. Without ``incarnation`` the
        group is gone for good (retired): no later boot of it is kept."""
        with self._lock:
            return self._take(group, incarnation)

    def _take(self, group: str, incarnation: int | None) -> list[Any]:
        found = [a for k in list(self._found) if k[0] == group and incarnation in (None, k[1])
                 for a in self._found.pop(k)]  # fmt: skip
        return found + self._take_current(group, incarnation)

    def _take_current(self, group: str, incarnation: int | None) -> list[Any]:
        p = self._current.get(group)
        if incarnation is None:
            self._stopped[group] = _FOREVER
        else:
            self._stopped[group] = max(self._stopped.get(group, 0), incarnation)
            if p is None or p.incarnation != incarnation:
                return []
        if p is None:
            return []
        del self._current[group]
        self._ended.setdefault((group, p.incarnation), []).extend(p.actors)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        return list(p.actors)

    def made(self, actors: Iterable[Any]) -> None:
        """Actors just made: ask each which process it is (answered once it is built,
        beside whatever it runs next), for a wait on its exit later."""
        actors = list(actors)
        asked = {_actor_id(a): a.process.remote() for a in actors}
        with self._lock:
            self._processes.update(asked)
            self._made.update((_actor_id(a), a) for a in actors)
            while len(self._processes) > PROCESSES_KEPT:  # the oldest are long replaced
                self._made.pop(self._processes.popitem(last=False)[0], None)

    def wait_exited(
        self, group: str, incarnation: int, actors: Iterable[Any] = (), timeout_s: float = 30.0
    ) -> bool:
        """Wait until the processes of ``group#incarnation`` taken to be killed (and
        ``actors``) have exited, as their operating system says. Ray refuses a call to a
        killed actor at once, while its process may still run and read a checkpoint: a
        report that lets that checkpoint go is sent only after this. False if one still
        ran at the deadline."""
        with self._lock:
            ended = self._ended.pop((group, incarnation), []) + list(actors)
            asked = [self._processes.pop(_actor_id(a), None) for a in ended]
            for a in ended:
                self._made.pop(_actor_id(a), None)
        return wait_exited([r for r in asked if r is not None], timeout_s)

    def wait_gone(self, actors: Iterable[Any], timeout_s: float) -> bool:
        """Wait until ``actors``, killed, have exited (their scratch folders go with them);
        then remove those of every engine process of this machine that has exited (one
        killed earlier, whose exit nobody waited for). Other machines' go at their next
        engine's start."""
        with self._lock:
            asked = [self._processes.pop(_actor_id(a), None) for a in actors]
            for a in actors:
                self._made.pop(_actor_id(a), None)
        gone = wait_exited([r for r in asked if r is not None], timeout_s)
        scratch.sweep(exited)
        return gone

    def standby_boot_queued(self, standby: str) -> None:
        """A standby's one boot is queued: until it comes back, a stop needs a floor."""
        with self._lock:
            self._booting.add(standby)

    def standby_boot_ends(self, standby: str) -> None:
        """Its boot came back (kept, or killed as too late): no floor is needed any more."""
        with self._lock:
            self._booting.discard(standby)
            self._stopped.pop(standby, None)

    def take_standby(self, standby: str) -> list[Any]:
        """``take(standby, 1)``, keeping the stop floor only while the standby's boot is
        queued or running."""
        with self._lock:
            actors = self._take(standby, 1)
            if standby not in self._booting:
                del self._stopped[standby]
            return actors

    def close(self) -> list[Any]:
        """No boot is kept from now on; returns every actor still in the table, and every
        one made whose exit nobody waited for (a boot in flight, a process replaced), to
        kill (again: killing a dead actor does nothing)."""
        with self._lock:
            self._closed = True
            actors = [a for p in self._current.values() for a in p.actors]
            actors += [a for found in self._found.values() for a in found]
            known = {_actor_id(a) for a in actors}
            actors += [a for k, a in self._made.items() if k not in known]
            self._current.clear()
            self._found.clear()
            return actors

    def current(self) -> dict[str, tuple[int, list[Any]]]:
        """Each group's and standby's current incarnation, with a ref per actor to its
        answer to ``process()`` (pid, node), asked again where it is no longer kept."""
        with self._lock:
            now = {n: (p.incarnation, list(p.actors)) for n, p in self._current.items()}
            kept = dict(self._processes)
        return {
            name: (inc, [kept.get(_actor_id(a)) or a.process.remote() for a in actors])
            for name, (inc, actors) in now.items()
        }

    def sizes(self) -> Mapping[str, int]:
        """Entries per structure (for the bounded-bookkeeping test)."""
        with self._lock:
            return {
                "current": len(self._current),
                "stopped": len(self._stopped),
                "booting": len(self._booting),
                "ended": len(self._ended),
                "processes": len(self._processes),
                "made": len(self._made),
            }


# The calls that change what an engine holds, runs as or serves: each carries the caller's
# run epoch (``epoch=``) and is refused (``Fenced``) below the highest epoch the engine saw.
COMMANDS = (
    "boot_from_checkpoint", "boot_empty", "load_checkpoint", "update_weights", "assume",
    "rollout", "generate",
)  # fmt: skip


def _fence_lock(engine: Any) -> threading.Lock:
    """The engine's fence lock, made on first use (the class is shipped by value to its
    actor, so it holds no lock of its own): commands and ``fence`` run on two threads."""
    lock: threading.Lock = engine.__dict__.setdefault("_run_epoch_lock", threading.Lock())
    return lock


def fenced(engine: type) -> type:
    """``engine`` with a run-epoch fence: every command takes ``epoch=`` (None: a caller that
    is no runtime, as tests are) and is refused below the highest epoch the engine saw; a
    new ``fence(epoch)`` (answered beside a load) raises that epoch and says who the process
    runs as. The fence wraps the class outermost, so a subclass's overrides are fenced too."""
    if getattr(engine, "__recovery_fenced__", False):
        return engine

    def command(name: str) -> Callable[..., Any]:
        inner = getattr(engine, name)

        @functools.wraps(inner)
        def call(self: Any, *args: Any, epoch: int | None = None, **kwargs: Any) -> Any:
            if epoch is not None:
                with _fence_lock(self):
                    seen = getattr(self, "_run_epoch", 0)
                    if epoch < seen:
                        raise Fenced(
                            f"{name} from run epoch {epoch} refused by {self.group}#"
                            f"{self.incarnation}: a resume took it over as epoch {seen}"
                        )
                    self._run_epoch = epoch
            return inner(self, *args, **kwargs)

        # Ray reads the signature, which must show ``epoch``: not the inner one's, nor the
        # ``__signature__`` Ray pins on a method once its class was made an actor unfenced
        # (``wraps`` copies it; seen when a test made an engine an actor by hand first).
        del call.__wrapped__
        call.__dict__.pop("__signature__", None)
        return call

    @ray.method(concurrency_group="health")
    def fence(self: Any, epoch: int) -> tuple[str, int]:
        """Serve ``epoch`` from now on (never an older one) and say who this process is."""
        with _fence_lock(self):
            self._run_epoch = max(epoch, getattr(self, "_run_epoch", 0))
        return self.whoami()  # type: ignore[no-any-return]

    @ray.method(concurrency_group="health")
    def process(self: Any) -> tuple[int, str]:
        """The operating system's id of this process and the Ray node it runs on: what a
        user looks for in ``ps``, and what a check that it exited asks the system about."""
        return os.getpid(), str(ray.get_runtime_context().get_node_id())

    body: dict[str, Any] = {name: command(name) for name in COMMANDS if hasattr(engine, name)}
    body |= {"fence": fence, "process": process, "__recovery_fenced__": True,
             "__module__": engine.__module__, "__qualname__": engine.__qualname__}  # fmt: skip
    return type(engine.__name__, (engine,), body)


@attrs.frozen
class Booted:
    """Every actor of the process answered; what each says it holds."""

    held: tuple[WeightsHeld, ...]

    def digest_gate(self, expected: str) -> str | None:
        """None if every actor holds exactly the ``expected`` weights, else why not."""
        wrong = [h.digest for h in self.held if h.digest != expected]
        if wrong:
            return f"digest gate: {len(wrong)} of {len(self.held)} actors hold other weights"
        return None


@attrs.frozen
class BootFailed:
    """The process did not start, or a call on it failed or timed out."""

    reason: str


Outcome = Booted | BootFailed


class Launcher:
    """Starts a group's engine actors for an incarnation and calls them, one timeout per
    call. ``model_config`` travels to every actor as a plain dict."""

    def __init__(
        self,
        table: ActorTable,
        engine: type,
        model_config: Mapping[str, Any],
        *,
        actors_per_group: int,
        actor_options: Mapping[str, Any],
        call_timeout_s: float,
        run: str | None = None,
    ) -> None:
        self.table = table
        # A named run's engines are detached and named in the run's namespace: they outlive
        # the trainer's process, and a resumed runtime finds them there (``survivors``).
        self.run = run
        self.boots = 0  # engine processes started by this launcher
        self.epoch = 1  # the run epoch every command carries (a resume raises it)
        # Probes and watches get their own threads, so they answer beside a load.
        groups = {"health": 1, "watch": 1}
        self._engine: Any = ray.remote(concurrency_groups=groups)(fenced(engine))  # type: ignore[call-overload]
        self._model_config = dict(model_config)
        # Whether the engine reports the digest of what it holds (the hub layout's): an engine
        # that fuses its parameters (vLLM) cannot, and is admitted by its canary alone.
        self.computes_digest = bool(getattr(engine, "COMPUTES_DIGEST", True))
        self.actors_per_group = actors_per_group
        # What the engine class needs of its process (vLLM: environment variables) first.
        self.actor_options = {**getattr(engine, "ACTOR_OPTIONS", {}), **actor_options}
        if self.actor_options.get("max_concurrency", 1) != 1:
            # A push asks each actor for its canary right behind its update: that holds only
            # while the actor runs one call at a time (probes have their own threads).
            raise ValueError(
                f"actor_options max_concurrency={self.actor_options['max_concurrency']}: an "
                "engine actor must run one call at a time (ping and watch have their own)"
            )
        self.call_timeout_s = call_timeout_s

    def boot(self, group: str, incarnation: int, call: Callable[[Any], Any]) -> Outcome:
        """New actors for ``incarnation`` (the ones they replace are killed), then ``call``
        on each."""
        actors = [
            self._engine.options(**self.actor_options, **self._naming(group, incarnation)).remote(
                self._model_config, group, incarnation
            )
            for _ in range(self.actors_per_group)
        ]
        self.boots += len(actors)
        self.table.made(actors)
        kill(self.table.replace(group, incarnation, actors))
        return self.call_all(group, incarnation, call)

    def _naming(self, group: str, incarnation: int) -> dict[str, Any]:
        if self.run is None:
            return {}
        name = f"{group}#{incarnation}.{uuid.uuid4().hex[:8]}"
        return {"name": name, "namespace": namespace(self.run), "lifetime": "detached"}

    def survivors(
        self, timeout_s: float
    ) -> tuple[dict[tuple[str, int], list[Any]], dict[tuple[str, int], list[Any]]]:
        """The run's engines still alive, each told the launcher's epoch (``fence``: from
        now on it refuses the replaced run's commands), by the (name, incarnation) each says
        it runs as; and those that did not answer within ``timeout_s``, by the name they were
        created under. Only actors of this run's namespace are looked at."""
        if self.run is None:
            return {}, {}
        ns = namespace(self.run)
        handles: list[tuple[str, Any]] = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == ns:
                try:
                    handles.append((entry["name"], ray.get_actor(entry["name"], namespace=ns)))
                except ValueError:
                    continue  # gone since it was listed
        refs: list[Any] = [h.fence.remote(self.epoch) for _, h in handles]
        done: list[Any] = []
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        found: dict[tuple[str, int], list[Any]] = {}
        silent: dict[tuple[str, int], list[Any]] = {}
        for (name, h), ref in zip(handles, refs, strict=True):
            try:
                if ref not in done:
                    raise TimeoutError
                answer: tuple[str, int] = ray.get(ref, timeout=0)
                group, incarnation = answer
                found.setdefault((group, incarnation), []).append(h)
            except Exception:
                created = _created_as(name)
                if created is None:
                    log.warning("actor %r in %s is not one this runtime names: left", name, ns)
                    continue
                silent.setdefault(created, []).append(h)
        for key in set(found) & set(silent):  # one of its actors did not answer: it is mute
            silent[key] += found.pop(key)
        return found, silent

    def call_all(self, group: str, incarnation: int, call: Callable[[Any], Any]) -> Outcome:
        answers = self.ask(group, incarnation, call)
        return answers if isinstance(answers, BootFailed) else Booted(answers)

    def ask(
        self, group: str, incarnation: int, call: Callable[[Any], Any]
    ) -> tuple[Any, ...] | BootFailed:
        """``call`` on every actor of that process; their answers, or why there are none.
        ``call`` may return several refs (calls an actor runs in order): their answers follow
        one another, actor by actor."""
        actors = self.table.of(group, incarnation)
        if not actors:
            return BootFailed("stopped before it started")
        try:
            refs = []
            for a in actors:
                ref = call(a)
                refs += list(ref) if isinstance(ref, tuple) else [ref]
            return tuple(ray.get(refs, timeout=self.call_timeout_s))
        except Exception as err:  # the engine's own exception, not Ray's banner
            return BootFailed(cause_of(err))


def config_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return dict(model_config)
    to_dict = getattr(model_config, "to_dict", None)
    if callable(to_dict):  # a transformers PretrainedConfig
        out = to_dict()
        if isinstance(out, Mapping):
            return dict(out)
    raise BadRuntimeInput(
        f"model_config must be a mapping (config.to_dict()) or a transformers config, got "
        f"{type(model_config).__name__}"
    )
