"""The safety rules, as code. Each returns a sentence per violation; empty means it holds.

They read the rules' state directly on purpose: they are the controller's own contract,
checked after every step by the property tests and by ``recovery-fsm replay``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .machines import (
    COMMITTED,
    LOADING,
    RELAUNCHING,
    SERVING,
    STANDBY_FINAL,
    UP,
    CheckpointState,
    GroupState,
    PoolState,
    StandbyState,
    SwitchState,
)
from .state import StartKind

if TYPE_CHECKING:
    from .rules import Rules


def violations(rules: Rules) -> list[str]:
    out: list[str] = []
    cks = rules.checkpoints
    fleet = rules.fleet.version

    # Never delete a leased or pinned checkpoint.
    for v, ck in cks.items():
        if ck.record.state == CheckpointState.DELETABLE and (ck.record.leases or ck.record.pinned):
            out.append(
                f"checkpoint {v} is deletable with {ck.record.leases} leases, "
                f"pinned={ck.record.pinned}"
            )

    # Leases only on a committed checkpoint of the then-current version; counts match.
    leases = [s.lease for s in rules.starts.values() if s.lease is not None]
    live = Counter(lease.version for lease in leases)
    for lease in leases:
        held = cks.get(lease.version)
        if held is None or held.record.state not in {
            CheckpointState.READY,
            CheckpointState.SUPERSEDED,
        }:
            state = held.record.state if held else rules.finished.get(lease.version, "missing")
            out.append(f"lease {lease.id} holds checkpoint {lease.version}, which is {state}")
        if lease.version != lease.granted_at_version:
            out.append(
                f"lease {lease.id} on version {lease.version} granted while the fleet "
                f"served {lease.granted_at_version}"
            )
    for v, ck in cks.items():
        if ck.record.leases != live.get(v, 0):
            out.append(
                f"checkpoint {v} counts {ck.record.leases} leases, {live.get(v, 0)} are live"
            )
        if ck.record.state in COMMITTED and ck.record.path is None:
            out.append(f"checkpoint {v} is {ck.record.state} without a path")

    for name, g in rules.groups.items():
        r = g.record
        state = r.state
        # No group serves a stale version.
        if state in SERVING and r.version != fleet:
            out.append(f"group {name!r} is {state} on version {r.version}, fleet is {fleet}")
        # A loading (relaunching) group's current incarnation has a load (cold start) in
        # flight; an up group's has none. Killed or stopped starts wait for their outcome.
        start = rules.starts.get((name, r.incarnation))
        kind = (
            StartKind.CLAIM
            if state == GroupState.CLAIMING
            else StartKind.LOAD
            if state in LOADING
            else StartKind.RELAUNCH
            if state in RELAUNCHING
            else StartKind.VERIFY
            if state == GroupState.RESUMING
            else None
        )
        if kind is not None and (start is None or start.kind != kind):
            out.append(f"group {name!r} is {state} but incarnation {r.incarnation} has no {kind}")
        if kind is None and start is not None and state in UP:
            out.append(f"group {name!r} is {state} with a {start.kind} in flight")
        if g.built is not None and g.built.current_state_value != state:
            out.append(f"group {name!r} machine and record disagree")
        # Cooldown always ends after N clean syncs.
        rec = g.recovery
        if rec.state == SwitchState.COOLDOWN and rec.clean_streak >= rec.required_clean_syncs:
            out.append(f"group {name!r} still in cooldown after {rec.clean_streak} clean syncs")
        # Immediate recovery off by configuration stays off, whatever the syncs did.
        if not rules.config.immediate_recovery and rec.state != SwitchState.DISABLED:
            out.append(f"group {name!r}: immediate recovery {rec.state}, configured off")
    for (name, incarnation), start in rules.starts.items():
        if name in rules.standbys:
            continue
        owner = rules.groups.get(name)
        if owner is None or incarnation > owner.record.incarnation:
            out.append(f"a {start.kind} of {name!r} incarnation {incarnation} never started")

    # Standbys: never more alive than the pool's size; a booting (loading, resuming) standby
    # has a boot (load, verification) in flight, an idle one none; a ready one holds the
    # fleet's version.
    alive = [s for s in rules.standbys.values() if s.record.state not in STANDBY_FINAL]
    if len(alive) > rules.pool.record.size:
        out.append(f"{len(alive)} standbys alive; the pool's size is {rules.pool.record.size}")
    # After Shutdown the pool is closed: nothing refills it, and pool_state says so.
    if rules.closed and rules.pool.record.state != PoolState.CLOSED:
        out.append(f"the controller is shut down and the pool is {rules.pool.record.state}")
    for name, s in rules.standbys.items():
        sr = s.record
        start = rules.starts.get((name, 1))
        want = {
            StandbyState.BOOTING: StartKind.BOOT,
            StandbyState.LOADING: StartKind.LOAD,
            StandbyState.RESUMING: StartKind.VERIFY,
        }.get(str(sr.state))
        if want is not None and (start is None or start.kind != want):
            out.append(f"standby {name!r} is {sr.state} without its {want} in flight")
        if sr.state in {StandbyState.STALE, StandbyState.READY} and start is not None:
            out.append(f"standby {name!r} is {sr.state} with a {start.kind} in flight")
        if sr.state in STANDBY_FINAL and start is None:
            out.append(f"standby {name!r} is {sr.state} and still kept")
        if sr.state == StandbyState.READY and sr.version != fleet:
            out.append(f"standby {name!r} is ready on version {sr.version}, fleet is {fleet}")
    for (name, _), start in rules.starts.items():
        if start.kind == StartKind.BOOT and name not in rules.standbys:
            out.append(f"a boot of {name!r} is in flight for no standby")
        orphan = name not in rules.standbys and name not in rules.groups
        if start.kind == StartKind.VERIFY and orphan:
            out.append(f"a verification of {name!r} is in flight for no process")

    # At most one export in flight, of the current version.
    exporting = sorted(v for v, ck in cks.items() if ck.record.state == CheckpointState.EXPORTING)
    if len(exporting) > 1:
        out.append(f"exports in flight for versions {exporting}")
    if exporting and exporting[0] != fleet:
        out.append(f"export of version {exporting[0]} in flight while the fleet serves {fleet}")

    # With nothing outstanding at most one unpinned recovery checkpoint is on disk.
    if not rules.outstanding():
        kept = sorted(
            v for v, ck in cks.items() if ck.record.state in COMMITTED and not ck.record.pinned
        )
        if len(kept) > 1:
            out.append(f"quiescent with unpinned checkpoints {kept} on disk")
    return out
