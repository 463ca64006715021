"""Inputs to the controller: frozen records sent by the trainer, health manager and adapters.

Every event carries ``at`` (keyword-only), the sender's clock in seconds; the controller never
reads a clock. Field validation happens here, at construction, so a malformed event never
reaches a machine. An event is a value all the way down: every field holds an immutable
value of an exact built-in type (or ``Incarnations``, a read-only mapping), so nothing can
change it between the checks and the rules. Events about a process name the
``incarnation`` they are about: the number the controller gave that start of the group's
process (1 at registration, then one per restart, carried by the effect that asked for
the restart).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from . import validators as valid
from .errors import MalformedEvent


class Incarnations(dict[str, int]):
    """A read-only map group name -> incarnation, sorted by name and validated when built.

    A ``dict`` subclass so that it journals (``json``) exactly as the plain dict did; every
    method that would change it raises ``TypeError``. It pickles and deep-copies as itself,
    compares equal to a dict with the same items and, unlike a dict, is hashable."""

    __slots__ = ()

    def __new__(cls, value: Mapping[str, int]) -> Incarnations:
        """A mapping group -> incarnation; a set of names cannot say which process got the
        weights, so it is refused rather than guessed."""
        items = _incarnation_items(value)
        self = super().__new__(cls)
        dict.update(self, items)  # the only write, before anyone holds it
        return self

    def __init__(self, value: Mapping[str, int]) -> None:
        """Filled by ``__new__``; ``dict.__init__`` would add the items a second time."""

    def _read_only(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise TypeError("an event's groups are read-only: build a new event instead")

    __setitem__ = __delitem__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __ior__(self, _other: Any) -> NoReturn:  # type: ignore[misc]
        self._read_only()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[type[Incarnations], tuple[dict[str, int]]]:
        return (type(self), (dict(self),))

    def __copy__(self) -> Incarnations:
        return self

    def __deepcopy__(self, _memo: dict[int, object]) -> Incarnations:
        return self  # nothing in it can change


def _incarnation_items(value: Any) -> list[tuple[str, int]]:
    """The items of a sync's groups, checked, as plain values sorted by name."""
    if not isinstance(value, Mapping):
        raise MalformedEvent(
            f"groups must map each group name to the incarnation that received the "
            f"weights, got {value!r:.80}"
        )
    items: dict[str, int] = {}
    for name, incarnation in dict.items(value) if isinstance(value, dict) else value.items():
        if not isinstance(name, str) or not name or name != name.strip():
            raise MalformedEvent(f"groups must be keyed by group names, got {name!r}")
        if type(incarnation) is not int or incarnation < 1:
            raise MalformedEvent(
                f"groups[{name!r}] must be an incarnation (int >= 1), got {incarnation!r}"
            )
        items[str.__str__(name)] = incarnation
    return sorted(items.items())


def _to_incarnations(value: Mapping[str, int]) -> Incarnations:
    return value if type(value) is Incarnations else Incarnations(value)


def _incarnations(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    """Checked again at admission: an ``Incarnations`` written to behind its back (with
    ``dict.__setitem__``) or a plain mapping put in its place is refused."""
    items = _incarnation_items(value)  # first: it names a bad item
    if type(value) is not Incarnations:
        raise MalformedEvent(f"groups must be an Incarnations mapping, got {type(value).__name__}")
    if list(dict.items(value)) != items or any(type(k) is not str for k in dict.keys(value)):
        raise MalformedEvent(f"groups was changed after the event was built: {dict(value)!r:.80}")


@attrs.frozen
class Event:
    """Base class; ``kind`` names the event in the journal."""

    if TYPE_CHECKING:  # every event has it, keyword-only; declared per class
        at: float

    @property
    def kind(self) -> str:
        return type(self).__name__


# -- from the trainer ------------------------------------------------------------------------


@attrs.frozen
class WeightsSynced(Event):
    """The trainer pushed weight ``version`` to exactly the processes in ``groups``
    (group name -> incarnation). An entry for an older incarnation does not count: that
    process is gone, and its successor never received the weights."""

    version: int = attrs.field(validator=valid.version)
    groups: Mapping[str, int] = attrs.field(converter=_to_incarnations, validator=_incarnations)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    # What the runtime's admission check held the process to (digest, canary), journaled so
    # that a sample certified by this step can be traced to it; empty: nothing was checked.
    evidence: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text,
                                kw_only=True)  # fmt: skip


@attrs.frozen
class ExportStarted(Event):
    """The exporter began writing the recovery checkpoint of ``version``."""

    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    pinned: bool = attrs.field(default=False, validator=valid.flag)


@attrs.frozen
class ExportCommitted(Event):
    """The checkpoint of ``version`` was renamed into place at ``path``."""

    version: int = attrs.field(validator=valid.version)
    path: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class ExportFailed(Event):
    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    error: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text)


@attrs.frozen
class ExportCancelled(Event):
    """The exporter confirmed that it stopped writing ``version`` and removed its files."""

    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class CheckpointPinned(Event):
    """The user keeps checkpoint ``version`` (e.g. it is a regular HF save): never delete it."""

    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class CheckpointUnpinned(Event):
    """The user no longer keeps checkpoint ``version`` (its trainer checkpoint was rotated
    out): once it is no recovery source and no start reads it, it is deleted."""

    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class CheckpointDeleted(Event):
    """The adapter removed checkpoint ``version`` from disk."""

    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


def _to_processes(value: Any) -> tuple[str, ...]:
    """Processes named ``<name>#<incarnation>``, as a sorted tuple without repeats."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, frozenset, set)):
        raise MalformedEvent(
            f"expected a list of processes named '<name>#<incarnation>', got {value!r:.80}"
        )
    out: set[str] = set()
    for item in value:
        valid.process_name(item)
        out.add(str.__str__(item))
    if len(out) != len(value):
        raise MalformedEvent(f"a process is listed twice in {sorted(out)}")
    return tuple(sorted(out))


def _processes(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    """Checked again at admission: a list, or a tuple of unchecked names, put in place of
    the sorted tuple of plain names the event was built with, is refused."""
    if type(value) is not tuple or any(type(p) is not str for p in value):
        raise MalformedEvent(f"{attr.name} must be a tuple of process names, got {value!r:.80}")
    if _to_processes(value) != value:
        raise MalformedEvent(f"{attr.name} was changed after the event was built: {value!r:.80}")


@attrs.frozen
class Resumed(Event):
    """The trainer restarted from its own checkpoint of ``version`` and a new runtime took
    over this controller (rebuilt from its journal) as run ``epoch``, above every epoch
    before it: the engines it found learned that epoch and refuse every older one's
    command, so the run it replaces can no longer act. What the old runtime had in flight
    died with it: exports, starts' reports, deletes. ``found`` names every process of the
    run that answered who it is (``<group or standby>#<incarnation>``), ``silent`` those
    listed in the run's namespace that did not answer in time; the rules decide which to
    keep (and ask what each holds before trusting it) and which to stop."""

    version: int = attrs.field(validator=valid.version)
    epoch: int = attrs.field(validator=valid.incarnation, kw_only=True)
    found: tuple[str, ...] = attrs.field(converter=_to_processes, validator=_processes,
                                         kw_only=True)  # fmt: skip
    silent: tuple[str, ...] = attrs.field(converter=_to_processes, validator=_processes,
                                          kw_only=True)  # fmt: skip
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)

    @found.validator  # runs after _processes
    def _apart(self, _attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        if both := sorted(set(value) & set(self.silent)):
            raise MalformedEvent(f"processes {both} are listed as found and as silent")


@attrs.frozen
class Shutdown(Event):
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class Tick(Event):
    """Time passes: deadlines (waiting for an export, a load, a relaunch) fire on it. The
    runtime sends it on an interval well under the shortest deadline (e.g. every second)."""

    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


# -- from the health manager and the runtime, about one incarnation of a group --------------


@attrs.frozen
class GroupRegistered(Event):
    """Group ``group`` is up (incarnation 1) and holds weight ``version``."""

    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    # What the runtime's admission check held the process to (digest, canary), journaled so
    # that a sample certified by this step can be traced to it; empty: nothing was checked.
    evidence: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text,
                                kw_only=True)  # fmt: skip


@attrs.frozen
class ProbeFailed(Event):
    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class ProbeOk(Event):
    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class GroupFailed(Event):
    """That process is dead (actor died, the health manager gave up on it, or it was killed
    after a deadline)."""

    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    reason: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text)


@attrs.frozen
class GroupVerified(Event):
    """After a resume, incarnation ``incarnation`` of ``group`` answered: it holds weight
    ``version`` (None: none) and passed the admission check against it (the canary of that
    version's push or checkpoint). A process that did not answer, or answered for another
    incarnation, is reported with ``GroupFailed`` instead."""

    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    version: int | None = attrs.field(validator=valid.optional_version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    # What the runtime's admission check held the process to (digest, canary), journaled so
    # that a sample certified by this step can be traced to it; empty: nothing was checked.
    evidence: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text,
                                kw_only=True)  # fmt: skip


@attrs.frozen
class RestartLoaded(Event):
    """The process started by RestartFromCheckpoint finished loading its checkpoint (or a
    claimed standby passed its check). ``version``: a standby claimed as it is was found
    holding this version, above the one the claim asked, and admitted against the record of
    the push in flight that brought it (None: it holds what was asked)."""

    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    version: int | None = attrs.field(default=None, validator=valid.optional_version,
                                      kw_only=True)  # fmt: skip
    # What the runtime's admission check held the process to (digest, canary), journaled so
    # that a sample certified by this step can be traced to it; empty: nothing was checked.
    evidence: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text,
                                kw_only=True)  # fmt: skip


@attrs.frozen
class RestartLoadFailed(Event):
    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    error: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text)


@attrs.frozen
class Relaunched(Event):
    """A cold restart finished: that process is up with no current weights."""

    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class RelaunchFailed(Event):
    group: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    incarnation: int = attrs.field(validator=valid.incarnation)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    error: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text)


# -- from the runtime, about one standby engine ----------------------------------------------
# A standby is one process under a name the controller chose (``StartStandby``); once a group
# claims it, reports about that process name the group and its new incarnation instead.


@attrs.frozen
class StandbyBooted(Event):
    """Standby ``standby``'s engine is up, holding no weights yet."""

    standby: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class StandbyLoaded(Event):
    """Standby ``standby`` finished the load of ``LoadStandby`` in place: it holds ``version``
    (each load of a standby is of a newer version, so a repeated report is told apart)."""

    standby: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    version: int = attrs.field(validator=valid.version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


@attrs.frozen
class StandbyFailed(Event):
    """Standby ``standby`` is gone: its boot or its load failed, or its process died."""

    standby: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)
    reason: str = attrs.field(default="", converter=valid.plain_str, validator=valid.text)


@attrs.frozen
class StandbyVerified(Event):
    """After a resume, standby ``standby`` answered: it holds weight ``version`` (None: none)
    and passed the admission check against it. One that did not answer or failed the check
    is reported with ``StandbyFailed`` instead."""

    standby: str = attrs.field(converter=valid.plain_str, validator=valid.name)
    version: int | None = attrs.field(validator=valid.optional_version)
    at: float = attrs.field(converter=valid.plain_seconds, validator=valid.time, kw_only=True)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        WeightsSynced,
        ExportStarted,
        ExportCommitted,
        ExportFailed,
        ExportCancelled,
        CheckpointPinned,
        CheckpointUnpinned,
        CheckpointDeleted,
        Resumed,
        Shutdown,
        Tick,
        GroupRegistered,
        ProbeFailed,
        ProbeOk,
        GroupFailed,
        GroupVerified,
        RestartLoaded,
        RestartLoadFailed,
        Relaunched,
        RelaunchFailed,
        StandbyBooted,
        StandbyLoaded,
        StandbyFailed,
        StandbyVerified,
    )
}

# The outcomes that end a process start (RestartFromCheckpoint or RestartCold).
LOAD_OUTCOMES = (RestartLoaded, RestartLoadFailed)
RELAUNCH_OUTCOMES = (Relaunched, RelaunchFailed)


def admit(event: Event) -> None:
    """Check every field of an event again as the controller receives it. Frozen fields
    stop honest code only: ``object.__setattr__``, a tampered pickle or a write into a
    container behind its back can change an event after it was built. Each field must
    still hold what its converter makes of it (the exact plain type) and pass its validator,
    containers' contents included."""
    attrs.validate(event)  # first: it names what each field expects
    for field in attrs.fields(type(event)):
        value = getattr(event, field.name)
        if field.converter is None:
            continue
        try:
            again = field.converter(value)
        except MalformedEvent:
            raise
        except Exception as err:
            raise MalformedEvent(f"{event.kind}.{field.name} holds {value!r:.80}: {err}") from err
        if type(again) is not type(value) or again != value:
            raise MalformedEvent(
                f"{event.kind}.{field.name} must hold a plain {type(again).__name__}, got "
                f"{type(value).__name__} {value!r:.80} (changed after the event was built?)"
            )


def build(cls: type[Event], fields: Mapping[str, Any], at: float) -> Event:
    """``cls(**fields, at=at)`` for a link that stamps the time, with a typed refusal for
    what is not an event class or not its fields (Python's own ``TypeError`` would not say
    what was expected, and through a Ray actor would not arrive typed)."""
    if not (isinstance(cls, type) and cls in _CLASSES):
        raise MalformedEvent(f"expected an event class, one of {sorted(EVENT_TYPES)}; got {cls!r}")
    if "at" in fields:
        raise MalformedEvent(f"{cls.__name__}: the link stamps 'at'; do not pass it")
    try:
        return cls(**fields, at=at)  # type: ignore[call-arg]
    except TypeError as err:
        expected = [a.name for a in attrs.fields(cls) if a.name != "at"]
        raise MalformedEvent(f"bad fields for {cls.__name__} (expected {expected}): {err}") from err


_CLASSES = frozenset(EVENT_TYPES.values())
