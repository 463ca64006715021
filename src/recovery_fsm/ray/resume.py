"""Taking over a named run after the trainer's restart: claim, rebuild, find, report.

A resume runs in this order, each step before the next:

1. Read the journal as it is and refuse what it cannot resume (a closed run, a version past
   its fleet's): nothing is claimed, killed or deleted yet.
2. Claim the journal's next run epoch (``journal/owner.py``): from here on the runtime it
   replaces writes no record, and stops (``Fenced``) at its next one.
3. Rebuild the controller from the journal (read again: the old run may have written
   between 1 and 2).
4. Find the run's engines in its Ray namespace, each told the new epoch (``fence``): from
   here on they refuse the old run's commands.
5. Report what was found (``Resumed``: the epoch, each process that answered, those that
   did not). The rules decide which to adopt, verify, reload or stop; the runner executes.
   Nothing here chooses a process to keep or kill.
6. Wait until every group and standby came to rest, and describe it (``Resumption``).

From the store (the journal is lost) step 3 is a reconstruction: the controller is told
what the store and the survivors can vouch for, a group's newest surviving process taking
the number 1 the new journal gives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import ray

from .. import CheckpointState, GroupState, RecoveryController, RecoveryError, StandbyState
from .. import events as ev
from ..journal import JournalHeld, JournalOwner, JsonlJournal, read_journal, trim_torn_tail
from ..search.replay import rebuild
from .actors import kill
from .errors import BadRuntimeInput
from .placement import check_shared_root

if TYPE_CHECKING:
    from .runtime import RecoveryRuntime

log = logging.getLogger(__name__)


@attrs.frozen
class Resumption:
    """What ``RecoveryRuntime.resume`` found and did."""

    version: int  # the trainer's version it resumed at
    torn: int  # bytes of an unfinished last journal line, cut (0: none)
    replayed: int  # journal records the controller was rebuilt from
    adopted: tuple[str, ...]  # groups whose surviving process serves again without a reboot
    reloaded: tuple[str, ...]  # ... that load C(v) (or wait for a push): they held another version
    restarted: tuple[str, ...]  # groups whose process was gone or failed its check
    killed: int  # surviving engines the rules did not keep (stopped, or failed their check)
    removed_dirs: tuple[str, ...]  # temporaries, untracked checkpoints newer than v (from the
    # store: and older ones not pinned)
    settled: bool  # every group and standby answered, the future's checkpoints gone, in time
    rebuilt_from: str = "journal"  # or "store": there was no journal to rebuild from
    # Standbys whose surviving engine is kept (answered, or loading C(v) since); from the
    # store none: they are killed and booted again.
    standbys: tuple[str, ...] = ()
    epoch: int = 0  # the run epoch this resume took over as


@attrs.frozen
class Takeover:
    """How a resume opens its runtime (``RecoveryRuntime.resume`` makes it): the epoch it
    claimed and the journal owner file it claimed it in (None: no journal), the controller
    rebuilt from the journal and the records it was rebuilt from (None: from the store)."""

    epoch: int
    owner: JournalOwner | None
    controller: RecoveryController | None = None
    records: tuple[dict[str, Any], ...] = ()
    torn: int = 0  # bytes cut off the journal's unfinished last line

    @property
    def after_step(self) -> int:
        return max((r["step"] for r in self.records if type(r.get("step")) is int), default=0)

    @property
    def replayed(self) -> int:
        return sum(1 for r in self.records if type(r.get("step")) is int)


def checked_arguments(
    version: Any, from_store: Any, pinned: Any, journal: Any, options: Mapping[str, Any]
) -> tuple[Path | None, frozenset[int]]:
    """The journal's path and the pins, or ``BadRuntimeInput`` before anything is touched."""
    if type(version) is not int or version < 0:
        raise BadRuntimeInput(f"resume version must be an int >= 0, got {version!r}")
    if not isinstance(from_store, bool):
        raise BadRuntimeInput(f"from_store must be a bool, got {from_store!r}")
    pins = (
        tuple(pinned)
        if isinstance(pinned, Collection) and not isinstance(pinned, str | bytes)
        else None
    )
    if pins is None or not all(type(p) is int and p >= 0 for p in pins):
        raise BadRuntimeInput(f"pinned must be a collection of versions (ints >= 0), "
                              f"got {pinned!r}")  # fmt: skip
    if pins and not from_store:
        raise BadRuntimeInput(
            f"pinned={sorted(pins)} without from_store=True: a journal's pins are the run's"
        )
    if "initial_version" in options:
        raise BadRuntimeInput("resume starts at version=, not initial_version=")
    path = None if journal is None else Path(journal)
    if path is not None and path.exists() and not path.is_file():
        raise BadRuntimeInput(f"the journal {path} is not a file")
    if from_store:
        if path is not None and path.is_file() and path.stat().st_size:
            raise BadRuntimeInput(
                f"from_store=True, but there is a journal at {path}: resume from it (the "
                "run's history and pins are in it), or move it away first"
            )
        if path is not None and not path.parent.is_dir():
            raise BadRuntimeInput(f"the journal's directory {path.parent} does not exist")
    elif path is None or not path.is_file():
        raise BadRuntimeInput(
            f"resume needs the run's journal; {path} is not a file (if it is lost, "
            "from_store=True rebuilds from the checkpoint store, without the history)"
        )
    return path, frozenset(pins)


def _rebuilt(path: Path, version: int) -> tuple[RecoveryController, list[dict[str, Any]]]:
    """The controller the journal holds, refused (``BadRuntimeInput``) if there is nothing
    to resume at ``version``: refused here, before anything is claimed or touched."""
    records = list(read_journal(path))
    controller = rebuild(path)
    if controller.closed:
        raise BadRuntimeInput(f"the run in {path} was closed: there is nothing to resume")
    if version > controller.version:
        raise BadRuntimeInput(
            f"resume at version {version}, but the journal's fleet only reached "
            f"{controller.version}: a trainer resumes from a checkpoint it synced"
        )
    return controller, records


def claim_journal(path: Path, version: int) -> Takeover:
    """Steps 1 to 3: check, claim the journal's next epoch, rebuild."""
    torn = trim_torn_tail(path)
    if torn:
        log.warning("journal %s ended in an unfinished line (%d bytes): cut", path, len(torn))
    _rebuilt(path, version)  # refused before the claim: a refusal fences nobody
    owner = JournalOwner(path)
    try:
        epoch = owner.claim()  # from here on the run it replaces writes nothing
        controller, records = _rebuilt(path, version)
        if controller.epoch >= epoch:  # the owner file was lost: go above the journal's
            epoch = owner.claim(controller.epoch + 1)
    except BaseException:
        owner.close()
        raise
    return Takeover(epoch, owner, controller, tuple(records), len(torn))


def claim_store(journal: Path | None) -> Takeover:
    """Step 2 without a journal to read: the epoch above whoever held ``journal`` (2 at
    least: the replaced run's engines may hold 1)."""
    if journal is None:
        return Takeover(2, None)
    owner = JournalOwner(journal)
    try:
        held = owner.holder().get("epoch", 0)
        epoch = owner.claim(max(held if type(held) is int else 0, 1) + 1)
    except BaseException:
        owner.close()
        raise
    return Takeover(epoch, owner)


def reconstruct(
    rt: RecoveryRuntime, version: int, pins: frozenset[int], found: dict[tuple[str, int], list[Any]]
) -> tuple[dict[tuple[str, int], list[Any]], list[Any]]:
    """What a store-rebuilt controller is told, straight into the controller and its
    journal, its effects not run (``Resumed`` re-decides all of them, as after a rebuild
    from a journal): every group registered at ``version`` (trusted by none until
    verified), C(v) committed if it is on disk, and pinned if the trainer says so. A
    group's newest surviving process is renamed its incarnation 1, how the journal will
    know it; older ones of that group cannot be told apart from it by number, and go."""
    local = rt.controller
    assert isinstance(local, RecoveryController)
    at = time.monotonic()
    try:  # first: bad groups are refused before an engine is touched
        for g in rt.groups:
            local.handle(ev.GroupRegistered(g, version, at=at))
    except RecoveryError as err:
        raise BadRuntimeInput(f"groups={rt.groups!r}: {err}") from err
    committed = rt.store.scan().committed  # verified manifests; temporaries removed
    if version in committed:
        local.handle(ev.ExportStarted(version, at=at))
        local.handle(ev.ExportCommitted(version, str(committed[version]), at=at))
        if version in pins:
            local.handle(ev.CheckpointPinned(version, at=at))
    else:
        log.warning("no committed checkpoint of %d in %s: no recovery source until a sync",
                    version, rt.store.root)  # fmt: skip
    if ignored := sorted(p for p in pins if p > version or p not in committed):
        log.warning("pinned %s: not on disk, or of the future the resume abandons", ignored)
    newest: dict[str, int] = {}
    for g, inc in found:
        if g in rt.groups:
            newest[g] = max(inc, newest.get(g, 0))
    older = [a for (g, inc), actors in found.items() if g in newest and newest[g] != inc
             for a in actors]  # fmt: skip
    others = {k: v for k, v in found.items() if k[0] not in newest}  # the rules stop them
    # All asked at once, each behind a load it may still run: one bound for all of them.
    epoch = rt.launcher.epoch
    asked = {g: [a.assume.remote(g, 1, epoch=epoch) for a in found[(g, inc)]]
             for g, inc in newest.items()}  # fmt: skip
    refs = [r for rs in asked.values() for r in rs]
    done = ray.wait(refs, num_returns=len(refs), timeout=rt.call_timeout_s)[0] if refs else []
    renamed: dict[tuple[str, int], list[Any]] = dict(others)
    for g, rs in asked.items():
        actors = found[(g, newest[g])]
        try:
            if not set(rs) <= set(done):
                raise TimeoutError(f"no answer in {rt.call_timeout_s} s")
            ray.get(rs, timeout=0)
        except Exception:
            log.warning("%s's surviving process did not take its new number", g, exc_info=True)
            older += actors
            continue
        renamed[(g, 1)] = actors
    return renamed, older


def _removed_checkpoints(rt: RecoveryRuntime, version: int, store_pins: frozenset[int] | None
                         ) -> list[str]:  # fmt: skip
    """Orphaned temporaries, and committed checkpoints the controller does not track that
    belong to the future not followed (from the store: also older ones nobody pinned). A
    commit whose report died with the trainer is reported now; the rules decide it."""
    scan = rt.store.scan()  # removes orphaned temporaries
    tracked = rt.controller.checkpoints()
    removed = [str(p) for p in scan.removed_temp]
    for v, p in sorted(scan.committed.items()):
        ck = tracked.get(v)
        if ck is not None and ck.state in {CheckpointState.EXPORTING, CheckpointState.ABANDONED}:
            rt.reporter.report(ev.ExportCommitted, version=v, path=str(p))
        elif ck is None and (
            v > version or (store_pins is not None and v < version and v not in store_pins)
        ):
            rt.store.delete(p)
            removed.append(str(p))
    return removed


def resume(
    cls: type[RecoveryRuntime],
    root: str | Path,
    run: str,
    version: int,
    journal: str | Path | None,
    from_store: bool,
    pinned: Collection[int],
    discover_s: float,
    settle_s: float,
    options: dict[str, Any],
) -> tuple[RecoveryRuntime, Resumption]:
    """``RecoveryRuntime.resume``: a runtime opened by a ``Takeover`` (steps 1 to 3), then
    ``take_over``; whatever raises closes what was opened, and a staged journal goes."""
    path, pins = checked_arguments(version, from_store, pinned, journal, options)
    opening = _open_from_store if from_store else _open_from_journal
    rt, staging = opening(cls, root, run, version, path, options)
    try:
        found = take_over(
            rt, version, discover_s, settle_s, store_pins=pins if from_store else None,
            published=None if staging is None else (lambda: rt.publish_journal(path)),
        )  # fmt: skip
    except BaseException:
        rt.close(drain_timeout_s=5.0)
        if staging is not None:
            staging.unlink(missing_ok=True)  # not published: nobody resumes from it
        raise
    return rt, found


def _open_from_journal(
    cls: type[RecoveryRuntime], root: str | Path, run: str, version: int, path: Path | None,
    options: dict[str, Any],
) -> tuple[RecoveryRuntime, None]:  # fmt: skip
    assert path is not None  # checked_arguments: a resume reads the run's journal
    return _open(cls, root, run, path, claim_journal(path, version), options), None


def _open_from_store(
    cls: type[RecoveryRuntime], root: str | Path, run: str, version: int, path: Path | None,
    options: dict[str, Any],
) -> tuple[RecoveryRuntime, Path | None]:  # fmt: skip
    """The controller starts at the trainer's version and is told the rest; its journal is
    written beside ``path`` and moved there once ``Resumed`` is in it (a resume that dies
    before leaves no journal a second resume would trust)."""
    if options.get("controller_actor") is not None:
        raise BadRuntimeInput("resume runs the controller in this process: no controller_actor")
    log.warning("resuming from the checkpoint store %s: the history is not known", root)
    staging = None if path is None else path.with_name(path.name + ".resuming")
    if staging is not None:
        staging.unlink(missing_ok=True)  # a resume that died before it finished
    options = {**options, "initial_version": version}
    return _open(cls, root, run, staging, claim_store(path), options), staging


def _open(
    cls: type[RecoveryRuntime], root: str | Path, run: str, journal: Path | None,
    takeover: Takeover, options: dict[str, Any],
) -> RecoveryRuntime:  # fmt: skip
    try:
        return cls(root, run=run, journal=journal, takeover=takeover, **options)
    except BaseException:
        if takeover.owner is not None:
            takeover.owner.close()
        raise


def take_over(
    rt: RecoveryRuntime,
    version: int,
    discover_s: float,
    settle_s: float,
    *,
    store_pins: frozenset[int] | None = None,
    published: Callable[[], None] | None = None,
) -> Resumption:
    """Steps 4 to 6 on a runtime opened by a ``Takeover``."""
    check_shared_root(rt.store.root, rt.launcher.actor_options)
    found, silent = rt.launcher.survivors(discover_s)  # each told the new epoch
    if store_pins is not None:
        found, older = reconstruct(rt, version, store_pins, found)
        kill(older)
    rt.actors_table.hold_found({**silent, **found})
    removed = _removed_checkpoints(rt, version, store_pins)
    rt.reporter.send(
        ev.Resumed, version=version, epoch=rt.launcher.epoch,
        found=[f"{g}#{i}" for g, i in found], silent=[f"{g}#{i}" for g, i in silent],
    )  # fmt: skip
    if published is not None:
        published()  # a journal rebuilt from the store is complete from here on
    rt.monitor.start()
    settled = rt.reporter.wait(lambda: _at_rest(rt, version), settle_s)
    return _describe(rt, version, found, silent, removed, settled, store_pins is None)


_MOVING = frozenset({
    GroupState.RESUMING, GroupState.FAILED, GroupState.AWAITING_CHECKPOINT, GroupState.LOADING,
    GroupState.CLAIMING, GroupState.RELAUNCHING,
})  # fmt: skip


def _at_rest(rt: RecoveryRuntime, version: int) -> bool:
    """Every group and standby answered and came to rest, traffic reaches those serving, the
    future's checkpoints are gone."""
    views = rt.controller.groups().values()
    routes = rt.router.routes
    return (
        all(v.state not in _MOVING for v in views)
        and all(routes.get(v.name) is not None for v in views if v.serving)
        and all(c <= version for c in rt.controller.checkpoints())
        and all(s.state != StandbyState.RESUMING for s in rt.controller.standbys().values())
    )


def _describe(
    rt: RecoveryRuntime,
    version: int,
    found: Mapping[tuple[str, int], list[Any]],
    silent: Mapping[tuple[str, int], list[Any]],
    removed: list[str],
    settled: bool,
    from_journal: bool,
) -> Resumption:
    """Which group kept its process (adopted: its number too; reloaded: renumbered by a
    load in place), which got a new one, which standbys survived, what was stopped."""
    after = rt.controller.groups()
    survived = {_actor_id(a): g for (g, _), actors in found.items() for a in actors}
    adopted: list[str] = []
    reloaded: list[str] = []
    restarted: list[str] = []
    for g, view in sorted(after.items()):
        if view.state in {GroupState.RETIRED, GroupState.STOPPED}:
            continue
        now = [_actor_id(a) for a in rt.actors_table.of(g, view.incarnation)]
        if not now or any(survived.get(a) != g for a in now):
            restarted.append(g)  # a new process (or one still starting)
        elif (g, view.incarnation) in found:
            adopted.append(g)  # the same process, the same number: it held v
        else:
            reloaded.append(g)  # the same process, renumbered by a load in place
    standbys = tuple(
        s for s in sorted(rt.controller.standbys())
        if (s, 1) in found and {_actor_id(a) for a in rt.actors_table.of(s, 1)}
        == {_actor_id(a) for a in found[(s, 1)]}
    )  # fmt: skip
    kept = {_actor_id(a) for g in after for a in rt.actors_table.of(g, after[g].incarnation)}
    kept |= {_actor_id(a) for s in standbys for a in rt.actors_table.of(s, 1)}
    killed = sum(1 for actors in [*found.values(), *silent.values()] for a in actors
                 if _actor_id(a) not in kept)  # fmt: skip
    takeover = rt.takeover
    assert takeover is not None
    return Resumption(version, takeover.torn, takeover.replayed, tuple(adopted),
                      tuple(reloaded), tuple(restarted), killed, tuple(removed), settled,
                      "journal" if from_journal else "store", standbys,
                      rt.launcher.epoch)  # fmt: skip


def _actor_id(actor: Any) -> str:
    return str(actor._actor_id.hex())


def open_journal(journal: str | Path, takeover: Takeover | None) -> JsonlJournal:
    """The journal file, written only while this run's epoch owns it: a resume claimed it
    already; a new run takes epoch 1, on a journal that holds no run (else it would mix two)."""
    if takeover is not None:
        return JsonlJournal(journal, owner=takeover.owner, epoch=takeover.epoch)
    path = Path(journal)
    if path.is_file() and path.stat().st_size:
        holder = JournalOwner(path)
        try:
            who = holder.holder()
        finally:
            holder.close()
        raise JournalHeld(
            f"the journal {path} holds a run already"
            + (f" (held by epoch {who['epoch']}, pid {who.get('pid')} on {who.get('host')})"
               if who.get("epoch") else "")
            + ": resume it (RecoveryRuntime.resume), or give this run a journal of its own"
        )  # fmt: skip
    owner = JournalOwner(path)
    try:
        owner.claim(1, fresh=True)
    except BaseException:
        owner.close()
        raise
    return JsonlJournal(path, owner=owner, epoch=1)
