"""A scripted run through the controller: the seed review's race and the cooldown, printed.

The adapter here is the script itself: it answers each effect with the event a real adapter
would send, at a time of its choosing, which is exactly what makes the race visible.
"""

from __future__ import annotations

from collections.abc import Callable

from . import events as ev
from .controller import RecoveryConfig, RecoveryController
from .effects import DeleteCheckpoint, Effect, RestartFromCheckpoint


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
    send(ev.GroupRegistered("g1", 0, tick()))
    send(ev.GroupRegistered("g2", 0, tick()))
    send(ev.WeightsSynced(1, frozenset({"g1", "g2"}), tick()))
    send(ev.ExportStarted(1, tick()))
    send(ev.ExportCommitted(1, "/ckpt/step-1", tick()))

    out("== g1 dies: it boots straight from C(1) under a lease")
    (restart,) = send(ev.GroupFailed("g1", tick(), reason="actor died"))
    assert isinstance(restart, RestartFromCheckpoint)

    out("== the race: v2 is synced while g1 still loads C(1); C(1) is superseded, not deleted")
    send(ev.WeightsSynced(2, frozenset({"g2"}), tick()))
    send(ev.ExportStarted(2, tick()))

    out("== g1 finishes loading C(1): stale, so it waits for weights; only now C(1) goes")
    send(ev.RestartLoaded("g1", restart.lease, tick()))
    send(ev.CheckpointDeleted(1, tick()))

    out("== the export of v2 is slow: still running at the v3 sync, recovery cools down")
    send(ev.WeightsSynced(3, frozenset({"g1", "g2"}), tick()))
    send(ev.ExportCancelled(2, tick()))

    out("== two clean syncs later immediate recovery is back")
    for v in (3, 4):
        send(ev.ExportStarted(v, tick()))
        send(ev.ExportCommitted(v, f"/ckpt/step-{v}", tick()))
        for effect in send(ev.WeightsSynced(v + 1, frozenset({"g1", "g2"}), tick())):
            if isinstance(effect, DeleteCheckpoint):
                send(ev.CheckpointDeleted(effect.version, tick()))

    out("== shutdown: groups stop, nothing in flight, the controller is drained")
    send(ev.Shutdown(tick()))
    out(f"drained: {c.drained}")
    return c
