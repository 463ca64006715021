"""Fuzzing the edges that read outside input: events built from arbitrary fields (as a
runtime, a CLI or a journal would hand them over), the codec, and the journal reader given
torn, garbled and doubled journals. Each input is accepted or refused with a typed
``RecoveryError``; a refusal changes nothing (the controller's snapshot, the file's bytes);
nothing else escapes."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery_fsm import RecoveryConfig, RecoveryController, RecoveryError
from recovery_fsm import events as ev
from recovery_fsm.codec import decode_event
from recovery_fsm.host import ControllerLink
from recovery_fsm.journal import JsonlJournal, read_journal
from recovery_fsm.search.replay import rebuild, replay

# JSON-ish values, and the odd ones a Python caller can pass besides.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["g0", "g1", "standby-1", "/ckpt/step-1", " g0", ""]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                         inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
FIELDS = ["group", "version", "incarnation", "path", "groups", "reason", "error", "standby",
          "pinned", "at", "kind"]  # fmt: skip
# A journal record's own keys.
RECORD_KEYS = ["step", "event", "error", "header", "config", "finding", "lost", "broke",
               "effects", "transitions", "rules", "initial_version", "type", "message"]  # fmt: skip


def _controller() -> RecoveryController:
    c = RecoveryController(RecoveryConfig(standby=1))
    c.handle(ev.GroupRegistered("g0", 0, at=0.0))
    c.handle(ev.StandbyBooted("standby-1", at=0.5))
    c.handle(ev.WeightsSynced(1, {"g0": 1, "standby-1": 1}, at=1.0))
    c.handle(ev.ExportStarted(1, at=1.5))
    return c


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(ev.EVENT_TYPES)),
    fields=st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
)
def test_events_from_arbitrary_fields_are_refused_typed_or_applied(
    kind: str, fields: dict[str, Any]
) -> None:
    c = _controller()
    before = c.snapshot()
    try:
        event = ev.EVENT_TYPES[kind](**{k: v for k, v in fields.items() if k != "kind"})
    except TypeError as err:  # a missing or unknown keyword: Python's own, before any controller
        assert "argument" in str(err), err  # not one a validator let slip
        return
    except RecoveryError:
        assert c.snapshot() == before
        return
    try:
        c.handle(event)
    except RecoveryError:
        assert c.snapshot() == before
        return
    assert c.check_invariants() == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from([*ev.EVENT_TYPES.values(), str, dict]),
    fields=st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
)
def test_a_link_refuses_bad_input_typed_and_unchanged(kind: Any, fields: dict[str, Any]) -> None:
    """What a runtime hands ``ControllerLink.send``: the class and the fields; the link
    stamps the time. Anything but an event class and its fields is a ``MalformedEvent``."""
    c = _controller()
    link = ControllerLink(c)
    before = c.snapshot()
    try:
        link.send(kind, **fields)
    except RecoveryError:
        assert c.snapshot() == before
        return
    assert kind in ev.EVENT_TYPES.values() and c.check_invariants() == []


@settings(max_examples=400, deadline=None)
@given(data=st.one_of(values, st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)))
def test_the_codec_refuses_what_is_not_an_event_with_a_typed_error(data: Any) -> None:
    try:
        event = decode_event(data)
    except RecoveryError:
        return
    assert type(event) in ev.EVENT_TYPES.values()


# -- the journal reader ----------------------------------------------------------------------


def _journal(path: Path) -> bytes:
    """A real journal: a run with a sync, an export, a failure, a restart and a refusal."""
    with JsonlJournal(path) as sink:
        c = RecoveryController(RecoveryConfig(), journal=sink)
        c.handle(ev.GroupRegistered("g0", 0, at=0.0))
        c.handle(ev.GroupRegistered("g1", 0, at=0.0))
        c.handle(ev.WeightsSynced(1, {"g0": 1, "g1": 1}, at=1.0))
        c.handle(ev.ExportStarted(1, at=1.0))
        c.handle(ev.ExportCommitted(1, "/ckpt/step-1", at=2.0))
        c.handle(ev.GroupFailed("g0", 1, at=3.0))
        with pytest.raises(RecoveryError):
            c.handle(ev.Relaunched("g0", 2, at=3.5))
        c.handle(ev.RestartLoaded("g0", 2, at=4.0))
        c.handle(ev.Tick(at=5.0))
    return path.read_bytes()


@st.composite
def damaged(draw: st.DrawFn, original: bytes) -> bytes:
    """The journal torn, garbled, doubled or rewritten: one to three damages."""
    data = original
    for _ in range(draw(st.integers(1, 3))):
        lines = data.split(b"\n")
        how = draw(st.sampled_from(["tear", "garbage", "json", "header", "flip", "field", "drop"]))
        at = draw(st.integers(0, max(0, len(lines) - 1)))
        if how == "tear":
            data = data[: draw(st.integers(0, len(data)))]
        elif how == "garbage":
            lines.insert(at, draw(st.binary(max_size=20)))
            data = b"\n".join(lines)
        elif how == "json":
            lines.insert(at, json.dumps(draw(values), allow_nan=True).encode())
            data = b"\n".join(lines)
        elif how == "header":
            lines.insert(at, original.split(b"\n")[0])
            data = b"\n".join(lines)
        elif how == "flip" and data:
            k = draw(st.integers(0, len(data) - 1))
            data = data[:k] + bytes([data[k] ^ draw(st.integers(1, 255))]) + data[k + 1 :]
        elif how == "field" and lines[at].strip():
            try:
                record = json.loads(lines[at])
            except ValueError:
                continue
            if isinstance(record, dict):
                where = draw(st.sampled_from(["event", "header", "error", "record"]))
                target = record if where == "record" else record.get(where, record)
                if isinstance(target, dict):
                    target[draw(st.sampled_from([*FIELDS, *RECORD_KEYS]))] = draw(values)
                lines[at] = json.dumps(record, allow_nan=True).encode()
                data = b"\n".join(lines)
        elif how == "drop" and len(lines) > 1:
            del lines[at]
            data = b"\n".join(lines)
    return data


with tempfile.TemporaryDirectory() as _d:
    ORIGINAL = _journal(Path(_d) / "journal.jsonl")


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=damaged(ORIGINAL))
def test_a_damaged_journal_is_read_replayed_and_rebuilt_or_refused_typed(
    data: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(data)
    for read in (lambda p: list(read_journal(p)), replay, rebuild):
        with contextlib.suppress(RecoveryError):
            read(path)
        assert path.read_bytes() == data  # reading changed nothing


def test_the_fuzzed_journal_is_whole_before_it_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(ORIGINAL)
    report = replay(path)
    assert report.ok and report.steps == 9


@pytest.mark.parametrize(
    "line",
    [
        b'{"step": 1, "finding": null}',
        b'{"step": 1, "finding": [3]}',
        b'{"step": 1, "event": {"kind": "Tick", "at": 2.0}, "error": {"type": []}}',
        b'{"step": 1, "event": {"kind": "Tick", "at": 2.0}, "error": "refused"}',
    ],
)
def test_a_record_of_the_wrong_shape_is_refused_by_replay_and_rebuild(
    line: bytes, tmp_path: Path
) -> None:
    """Shapes the fuzz found (a finding or an error's type that is not text)."""
    path = tmp_path / "journal.jsonl"
    path.write_bytes(ORIGINAL.split(b"\n")[0] + b"\n" + line + b"\n")
    for read in (replay, rebuild):
        with pytest.raises(RecoveryError):
            read(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=st.binary(max_size=300) | st.lists(st.binary(max_size=40)).map(b"\n".join))
def test_trimming_a_torn_tail_cuts_only_an_unfinished_last_line(content: bytes) -> None:
    from recovery_fsm.journal import trim_torn_tail

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.jsonl"
        path.write_bytes(content)
        torn = trim_torn_tail(path)
        kept = path.read_bytes()
        assert kept + torn == content  # nothing but the tail is cut
        assert kept == b"" or kept.endswith(b"\n")  # every whole line is kept
        assert b"\n" not in torn
        assert trim_torn_tail(path) == b""  # and a second trim finds nothing
