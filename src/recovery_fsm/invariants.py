"""The safety rules, as code. Each returns a sentence per violation; empty means it holds.

They read the controller's private state on purpose: they are the controller's own contract,
checked after every step by the property tests and by ``recovery-fsm replay``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .controller import RecoveryController

_ON_DISK = frozenset({"ready", "superseded", "deletable"})


def violations(c: RecoveryController) -> list[str]:
    out: list[str] = []
    cks = c._checkpoints
    fleet = c._fleet.version

    # Never delete a leased or pinned checkpoint.
    for v, ck in cks.items():
        if ck.record.state == "deletable" and (ck.record.leases or ck.record.pinned):
            out.append(
                f"checkpoint {v} is deletable with {ck.record.leases} leases, "
                f"pinned={ck.record.pinned}"
            )

    # Leases only on a committed checkpoint of the then-current version; counts match.
    live = Counter(lease.version for lease in c._leases.values())
    for lease in c._leases.values():
        held = cks.get(lease.version)
        if held is None or held.record.state not in {"ready", "superseded"}:
            state = held.record.state if held else c._finished.get(lease.version, "missing")
            out.append(f"lease {lease.id} holds checkpoint {lease.version}, which is {state}")
        if lease.version != lease.granted_at_version:
            out.append(
                f"lease {lease.id} on version {lease.version} granted while the fleet "
                f"served {lease.granted_at_version}"
            )
        holder = c._groups.get(lease.group)
        if holder is None or holder.record.lease != lease.id:
            out.append(f"lease {lease.id} is not held by its group {lease.group!r}")
    for v, ck in cks.items():
        if ck.record.leases != live.get(v, 0):
            out.append(
                f"checkpoint {v} counts {ck.record.leases} leases, {live.get(v, 0)} are live"
            )
    for lease_id in c._leases.keys() & c._released:
        out.append(f"lease {lease_id} is both live and released")

    # No group serves a stale version; a loading group holds a lease and nobody else does.
    for name, g in c._groups.items():
        state = g.record.state
        if state in {"active", "suspect"} and g.record.version != fleet:
            out.append(f"group {name!r} is {state} on version {g.record.version}, fleet is {fleet}")
        if (state == "loading") != (g.record.lease is not None) and state != "stopped":
            out.append(f"group {name!r} is {state} with lease {g.record.lease}")
        if g.machine.current_state_value != state:
            out.append(f"group {name!r} machine and record disagree")

        # Cooldown always ends after N clean syncs.
        rec = g.recovery
        if rec.state == "cooldown" and rec.clean_streak >= rec.required_clean_syncs:
            out.append(f"group {name!r} still in cooldown after {rec.clean_streak} clean syncs")

    # At most one export in flight.
    exporting = sorted(v for v, ck in cks.items() if ck.record.state == "exporting")
    if len(exporting) > 1:
        out.append(f"exports in flight for versions {exporting}")
    if exporting and exporting[0] != fleet:
        out.append(f"export of version {exporting[0]} in flight while the fleet serves {fleet}")

    # At quiescence at most one unpinned recovery checkpoint is on disk.
    if c._quiescent():
        kept = sorted(
            v for v, ck in cks.items() if ck.record.state in _ON_DISK and not ck.record.pinned
        )
        if len(kept) > 1:
            out.append(f"quiescent with unpinned checkpoints {kept} on disk")
    return out
