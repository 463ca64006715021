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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recovery-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diagrams", help="write the state diagrams (Mermaid, DOT, SVG)")
    d.add_argument("--out", default="diagrams", help="directory (default: diagrams)")
    d.add_argument("--check", action="store_true", help="fail if the files differ from the code")
    d.set_defaults(func=_diagrams)
    s = sub.add_parser("demo", help="run the scripted recovery scenario and print transitions")
    s.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
