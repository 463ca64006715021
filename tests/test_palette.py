"""Every state of every machine has a colour and a legend entry, read off the machines
themselves: a state added to a graph fails here until the palette draws it, instead of showing
up blank in the timeline and the live table (as "claiming" once did)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.style import Style
from statemachine import StateMachine

from recovery_fsm import Label, RecoveryConfig, RecoveryController
from recovery_fsm import events as ev
from recovery_fsm.demo.live import _checkpoints_table, _groups_table
from recovery_fsm.journal import JsonlJournal
from recovery_fsm.journal.palette import PALETTE, UNKNOWN, of, swatch
from recovery_fsm.machines import (
    CheckpointMachine,
    ImmediateRecoveryMachine,
    StandbyMachine,
    StandbyPoolMachine,
    WorkerGroupMachine,
    names,
)

MACHINES: dict[str, type[StateMachine]] = {
    Label.CHECKPOINT: CheckpointMachine,
    Label.GROUP: WorkerGroupMachine,
    Label.STANDBY: StandbyMachine,
    Label.POOL: StandbyPoolMachine,
    Label.RECOVERY: ImmediateRecoveryMachine,
}
EVERY_STATE = sorted((label, s.id) for label, m in MACHINES.items() for s in m.states)


def test_every_machine_label_is_enumerated() -> None:
    # A new machine gets a label; it must be listed above for its states to be checked.
    assert names(Label) - {Label.CREATE} == set(MACHINES)


@pytest.mark.parametrize(("label", "state"), EVERY_STATE, ids=[":".join(k) for k in EVERY_STATE])
def test_every_state_has_a_colour_and_a_legend_entry(label: str, state: str) -> None:
    s = PALETTE.get((label, state))
    assert s is not None, f"{label}:{state} has no entry in journal/palette.py"
    assert re.fullmatch(r"#[0-9a-f]{6}", s.hex), s.hex
    assert Style.parse(s.style) != Style.null()  # raises if rich cannot read it
    assert s.legend.strip()


def test_the_palette_names_no_state_a_machine_lacks() -> None:
    assert sorted(PALETTE) == EVERY_STATE


def test_states_of_one_machine_are_told_apart() -> None:
    for label in MACHINES:
        swatches = of(label).values()
        assert len({s.hex for s in swatches}) == len(swatches), label
        assert len({s.legend for s in swatches}) == len(swatches), label


def test_the_live_table_colours_and_lists_a_claiming_group() -> None:
    claiming = SimpleNamespace(state="claiming", version=1, incarnation=2, recovery="enabled",
                               restarts=1)  # fmt: skip
    active = SimpleNamespace(state="active", version=1, incarnation=1, recovery="enabled",
                             restarts=0)  # fmt: skip
    console = Console(width=200, color_system="truecolor", force_terminal=True)
    segments = list(console.render(_groups_table({"g0": claiming, "g1": active}, 1)))
    style = Style.parse(swatch(Label.GROUP, "claiming").style)
    assert style != Style.parse(UNKNOWN.style)
    assert any(x.text == "claiming" and x.style is not None and x.style.color == style.color
               for x in segments)  # fmt: skip
    text = "".join(x.text for x in segments)
    assert "■ active" in text and "■ claiming a standby" in text
    assert "■ failed" not in text  # only the states on screen

    checkpoints = {1: SimpleNamespace(state="ready", leases=0, pinned=False)}
    text = "".join(x.text for x in console.render(_checkpoints_table(checkpoints)))
    assert "■ ready" in text


def test_the_timeline_colours_and_lists_a_claiming_group(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from recovery_fsm.journal.timeline import STATE_COLORS, draw

    assert set(STATE_COLORS) == {s.id for s in WorkerGroupMachine.states}
    path = tmp_path / "journal.jsonl"
    with JsonlJournal(path) as journal:
        c = RecoveryController(RecoveryConfig(standby=1), journal=journal)
        c.handle(ev.GroupRegistered("g0", 0, at=0.0))
        c.handle(ev.StandbyBooted("standby-1", at=1.0))
        c.handle(ev.WeightsSynced(1, {"g0": 1, "standby-1": 1}, at=2.0))
        c.handle(ev.GroupFailed("g0", 1, at=3.0))
        assert c.group("g0").state == "claiming"
        c.handle(ev.RestartLoaded("g0", 2, at=5.0))
        assert c.group("g0").state == "active"
    info = draw(path, tmp_path / "timeline.png")
    assert "claiming a standby" in info.legend
    assert info.legend.index("active") < info.legend.index("claiming a standby")
