"""A scripted run through the controller: the seed review's race and the cooldown, printed.

The adapter here is the script itself: it answers each effect with the event a real adapter
would send, at a time of its choosing, which is exactly what makes the race visible.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import DeleteCheckpoint, Effect, RecoveryConfig, RecoveryController, RestartFromCheckpoint
from .. import events as ev


def seed_race(out: Callable[[str], None] = print) -> RecoveryController:
    """Group g1 fails, boots from C(1); the trainer syncs v2 while g1 is still loading C(1)."""
    c = RecoveryController(RecoveryConfig(clean_syncs_to_reenable=2))
    t = 0.0

    def send(event: ev.Event) -> tuple[Effect, ...]:
        effects = c.handle(event)
        out(f"t={event.at:5.1f}  {event}")
        for machine, name, src, dst in c.last_transitions:
            out(f"           {machine:<22} {src or '(new)':>19} --{name}--> {dst}")
        for effect in effects:
            out(f"           effect: {effect}")
        problems = c.check_invariants()
        if problems:
            raise AssertionError(problems)
        return effects

    def tick() -> float:
        nonlocal t
        t += 1.0
        return t

    out("== two groups on version 0; the trainer syncs v1 and exports C(1)")
    send(ev.GroupRegistered("g1", 0, at=tick()))
    send(ev.GroupRegistered("g2", 0, at=tick()))
    send(ev.WeightsSynced(1, c.up_groups(), at=tick()))
    send(ev.ExportStarted(1, at=tick()))
    send(ev.ExportCommitted(1, "/ckpt/step-1", at=tick()))

    out("== g1 dies: traffic is withdrawn, it boots straight from C(1) as incarnation 2")
    _, restart = send(ev.GroupFailed("g1", 1, reason="actor died", at=tick()))
    assert isinstance(restart, RestartFromCheckpoint)

    out("== the race: v2 is synced while g1 still loads C(1); C(1) is superseded, not deleted")
    send(ev.WeightsSynced(2, c.up_groups(), at=tick()))
    send(ev.ExportStarted(2, at=tick()))

    out("== g1 finishes loading C(1): stale, so it waits for weights; only now C(1) goes")
    send(ev.RestartLoaded("g1", restart.incarnation, at=tick()))
    send(ev.CheckpointDeleted(1, at=tick()))

    out("== the export of v2 is slow: still running at the v3 sync, recovery cools down")
    send(ev.WeightsSynced(3, c.up_groups(), at=tick()))
    send(ev.ExportCancelled(2, at=tick()))

    out("== two clean syncs later immediate recovery is back")
    for v in (3, 4):
        send(ev.ExportStarted(v, at=tick()))
        send(ev.ExportCommitted(v, f"/ckpt/step-{v}", at=tick()))
        for effect in send(ev.WeightsSynced(v + 1, c.up_groups(), at=tick())):
            if isinstance(effect, DeleteCheckpoint):
                send(ev.CheckpointDeleted(effect.version, at=tick()))

    out("== shutdown: groups stop, nothing in flight, the controller is drained")
    send(ev.Shutdown(at=tick()))
    out(f"drained: {c.drained}")
    return c
