"""``recovery-fsm``: the chaos demo, timelines, diagrams, replay, search."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _diagrams(args: argparse.Namespace) -> int:
    from . import diagrams

    out = Path(args.out)
    if args.check:
        problems, notes = diagrams.check(out)
        for note in notes:
            print(f"note: {note}")
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if problems:
            print("run `recovery-fsm diagrams` and commit the result", file=sys.stderr)
            return 1
        print(f"diagrams in {out} match the code")
        return 0
    for note in diagrams.write(out):
        print(f"note: {note}")
    print(f"wrote diagrams to {out}")
    return 0


def _scenario(_args: argparse.Namespace) -> int:
    from .scenario import seed_race

    seed_race()
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        from .demo import DemoOptions, Display, main
    except ImportError as err:
        print(f"error: the demo needs the extras [torch,ray,demo]: {err}", file=sys.stderr)
        return 2
    options = DemoOptions(
        steps=args.steps, groups=args.groups, model=args.model, step_s=args.step_s,
        chaos_rate=args.chaos_rate, seed=args.seed, out=Path(args.out),
        hf_interval=args.hf_interval,
    )  # fmt: skip
    live = {"auto": None, "on": True, "off": False}[args.live]
    from .demo import OutputInUse

    try:
        outcome = main(options, baseline=args.baseline, display=Display(live=live),
                       timeline=not args.no_timeline)  # fmt: skip
    except OutputInUse as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not outcome.ok:
        print("error: a safety counter is not 0 or the journal did not replay clean",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from .errors import RecoveryError
    from .timeline import draw

    try:
        info = draw(args.journal, args.out, title=args.title)
    except (RecoveryError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {info.path} ({info.size[0]}x{info.size[1]} px, rows: {', '.join(info.rows)})")
    return 0


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
        return value

    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text}")
    return value


def _replay(args: argparse.Namespace) -> int:
    from .errors import RecoveryError
    from .replay import replay, rules_class

    try:
        cls = rules_class(args.controller) if args.controller else None
        report = replay(args.journal, cls)
    except (RecoveryError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.render())
    return 0 if report.ok else 1


def _explore(args: argparse.Namespace) -> int:
    from .errors import RecoveryError
    from .replay import rules_class
    from .search import explore

    try:
        cls = rules_class(args.controller)
    except RecoveryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = explore(
        args.depth,
        rules=cls,
        liveness=args.liveness,
        journal_dir=args.journal_dir,
    )
    print(result.report())
    return 1 if result.found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recovery-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diagrams", help="write the state diagrams (Mermaid, DOT, SVG)")
    d.add_argument("--out", default="diagrams", help="directory (default: diagrams)")
    d.add_argument("--check", action="store_true", help="fail if the files differ from the code")
    d.set_defaults(func=_diagrams)
    m = sub.add_parser(
        "demo", help="the chaos demo: kill rollout groups on a local Ray cluster and recover"
    )
    m.add_argument("--steps", type=_positive(int), default=10, help="weight syncs (default 10)")
    m.add_argument("--groups", type=_positive(int), default=3, help="rollout groups (default 3)")
    m.add_argument("--model", choices=["tiny", "small", "medium"], default="small",
                   help="the Llama built from a config (default small, ~3M params)")  # fmt: skip
    m.add_argument("--step-s", type=_positive(float), default=4.0,
                   help="seconds of rollout per step (default 4)")  # fmt: skip
    m.add_argument("--chaos-rate", type=_fraction, default=0.7,
                   help="chance of an incident in each eligible step (default 0.7)")  # fmt: skip
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--hf-interval", type=int, default=4,
                   help="every N versions the export is also the HF save (0: never)")  # fmt: skip
    m.add_argument("--out", default="demo-out",
                   help="where the run's journals, checkpoints and timelines go (OUT/immediate, "
                        "OUT/cold); a run replaces the previous run's files there, and refuses "
                        "a directory holding anything else (default demo-out)")  # fmt: skip
    m.add_argument("--baseline", action="store_true",
                   help="also run the same scenario on the cold path and compare")  # fmt: skip
    m.add_argument("--live", choices=["auto", "on", "off"], default="auto",
                   help="live table (auto: only on a terminal)")  # fmt: skip
    m.add_argument("--no-timeline", action="store_true", help="do not draw the PNG")
    m.set_defaults(func=_demo)
    t = sub.add_parser("timeline", help="draw a journal as a PNG timeline (matplotlib)")
    t.add_argument("journal")
    t.add_argument("--out", default="timeline.png")
    t.add_argument("--title", default=None)
    t.set_defaults(func=_timeline)
    s = sub.add_parser("scenario", help="run the scripted recovery scenario, print transitions")
    s.set_defaults(func=_scenario)
    r = sub.add_parser("replay", help="re-run a journal through a fresh controller, checking")
    r.add_argument("journal", help="a JSON-lines journal (JsonlJournal, or a search's trace)")
    r.add_argument(
        "--controller",
        default=None,
        help="'real' or a broken variant's name (default: the one the journal names)",
    )
    r.set_defaults(func=_replay)
    x = sub.add_parser("explore", help="search every event ordering up to a depth")
    x.add_argument("--depth", type=int, default=6)
    x.add_argument("--controller", default="real", help="'real' or a broken variant's name")
    x.add_argument("--liveness", action="store_true", help="also settle every state fairly")
    x.add_argument("--journal-dir", default=None, help="write a counterexample journal here")
    x.set_defaults(func=_explore)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
