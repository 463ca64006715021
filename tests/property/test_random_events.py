"""Random event streams: every event is either accepted with the invariants still holding, or
refused with a typed error and no change at all."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery_fsm import RecoveryConfig, RecoveryController, RecoveryError
from recovery_fsm import events as ev

GROUPS = ["g0", "g1", "g2"]
group = st.sampled_from(GROUPS)
version = st.integers(0, 4)
incarnation = st.integers(1, 4)


def _event(kind: str, draw: st.DrawFn, at: float) -> ev.Event:
    if kind == "sync":
        return ev.WeightsSynced(draw(version), draw(st.dictionaries(group, incarnation)), at=at)
    if kind == "start":
        return ev.ExportStarted(draw(version), pinned=draw(st.booleans()), at=at)
    if kind == "commit":
        v = draw(version)
        return ev.ExportCommitted(v, f"/ckpt/step-{v}", at=at)
    if kind == "export_failed":
        return ev.ExportFailed(draw(version), "boom", at=at)
    if kind == "cancelled":
        return ev.ExportCancelled(draw(version), at=at)
    if kind == "pin":
        return ev.CheckpointPinned(draw(version), at=at)
    if kind == "unpin":
        return ev.CheckpointUnpinned(draw(version), at=at)
    if kind == "deleted":
        return ev.CheckpointDeleted(draw(version), at=at)
    if kind == "register":
        return ev.GroupRegistered(draw(group), draw(version), at=at)
    if kind == "tick":
        return ev.Tick(at=at)
    if kind == "shutdown":
        return ev.Shutdown(at=at)
    cls = PROCESS_EVENTS[kind]
    return cls(draw(group), draw(incarnation), at=at)  # type: ignore[call-arg]


PROCESS_EVENTS: dict[str, type[ev.Event]] = {
    "probe_failed": ev.ProbeFailed,
    "probe_ok": ev.ProbeOk,
    "group_failed": ev.GroupFailed,
    "loaded": ev.RestartLoaded,
    "load_failed": ev.RestartLoadFailed,
    "relaunched": ev.Relaunched,
    "relaunch_failed": ev.RelaunchFailed,
}


KINDS = [
    "sync", "start", "commit", "export_failed", "cancelled", "pin", "unpin", "deleted", "register",
    "probe_failed", "probe_ok", "group_failed", "loaded", "load_failed", "relaunched",
    "relaunch_failed", "tick", "shutdown",
]  # fmt: skip


@st.composite
def streams(draw: st.DrawFn) -> list[ev.Event]:
    out: list[ev.Event] = [ev.GroupRegistered(g, 0, at=0.0) for g in GROUPS]
    at = 0.0
    for _ in range(draw(st.integers(1, 60))):
        at += draw(st.sampled_from([0.0, 1.0, 50.0]))
        out.append(_event(draw(st.sampled_from(KINDS)), draw, at))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.booleans())
def test_accepted_or_refused_without_change(stream: list[ev.Event], immediate: bool) -> None:
    c = RecoveryController(
        RecoveryConfig(
            immediate_recovery=immediate,  # off: every switch starts, and stays, disabled
            clean_syncs_to_reenable=2,
            restart_budget=3,
            await_checkpoint_timeout_s=100.0,
            load_timeout_s=120.0,
            relaunch_timeout_s=60.0,
        )
    )
    for event in stream:
        before = c.snapshot()
        try:
            c.handle(event)
        except RecoveryError:
            assert c.snapshot() == before
        assert c.broken is None
        assert c.check_invariants() == []
