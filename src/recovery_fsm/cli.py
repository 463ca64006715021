"""``recovery-fsm``: render and check the diagrams, run the scripted scenario."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def _demo(_args: argparse.Namespace) -> int:
    from .scenario import seed_race

    seed_race()
    return 0


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
    s = sub.add_parser("demo", help="run the scripted recovery scenario and print transitions")
    s.set_defaults(func=_demo)
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
