"""``recovery-fsm``: the chaos demo, timelines, diagrams, replay, search, an HTTP front."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..errors import RecoveryError

USAGE, FAILED, INTERRUPTED = 2, 1, 130
# A journal this program did not write fails deep in a reader as one of these (a record that
# is a list, a field of the wrong type); on a journal command they mean "not a journal".
_UNREADABLE = (RecoveryError, ValueError, TypeError, KeyError, AttributeError)


class Failed(Exception):
    """A mistake the user can fix: printed as one line (what to do), exit ``code``."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, not the whole usage block: what was wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _os_error(err: OSError) -> str:
    """``[Errno 2] No such file or directory: 'x'`` as ``x: no such file or directory``."""
    if err.filename is None or not err.strerror:
        return str(err)
    return f"{err.filename}: {err.strerror[0].lower()}{err.strerror[1:]}"


def _read_journal(path: str) -> list[dict[str, Any]]:
    """A journal's records, checked for the shape every reader assumes (objects; one
    header, first: ``read_journal`` refuses a second), so that what is not a journal is
    named as such."""
    from ..journal import MixedJournal, read_journal

    if Path(path).is_dir():
        raise Failed(f"{path} is a directory; pass the journal file in it (journal.jsonl)")
    try:
        records = list(read_journal(path))
    except OSError as err:
        raise Failed(f"{_os_error(err)}; pass a journal file (a run's journal.jsonl)") from err
    except MixedJournal:
        raise  # a journal, of two runs: its own message says where to split it
    except RecoveryError as err:
        raise Failed(f"{err}; pass a journal file (a run's journal.jsonl)") from err
    if not records:
        raise Failed(f"{path} is empty, not a journal; pass a run's journal.jsonl")
    for n, record in enumerate(records, 1):
        what = None
        if not isinstance(record, dict):
            what = f"line {n} is {json.dumps(record)[:40]}, not a JSON object"
        elif "header" in record and not isinstance(record["header"], dict):
            what = "its header is not a JSON object"
        elif "event" in record and not isinstance(record["event"], dict):
            what = f"line {n}'s event is not a JSON object"
        if what:
            raise Failed(f"{path} is not a journal: {what}; pass a run's journal.jsonl")
    return records


def _diagrams(args: argparse.Namespace) -> int:
    from . import diagrams

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise Failed(f"--out {out} is a file; give a directory for the diagrams", USAGE)
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
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise Failed(f"--out {out} is a file; give a directory for the demo's runs", USAGE)
    try:
        from ..demo import DemoOptions, Display, main
    except ImportError as err:
        raise Failed(f"the demo needs the extras [torch,ray,demo] ({err}); run ./scripts/demo "
                     "or pip install -e '.[torch,ray,demo]'") from err  # fmt: skip
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise Failed(f"--engine vllm needs the extra [vllm] ({err}); ./scripts/test installs "
                         "it, or pip install -e '.[vllm]'") from err  # fmt: skip
    options = DemoOptions(
        steps=args.steps, groups=args.groups, model=args.model, step_s=args.step_s,
        chaos_rate=args.chaos_rate, seed=args.seed, out=out, hf_interval=args.hf_interval,
        engine=args.engine, standby=args.standby,
    )  # fmt: skip
    live = {"auto": None, "on": True, "off": False}[args.live]
    outcome = main(options, runs=args.runs, display=Display(live=live),
                   timeline=not args.no_timeline)  # fmt: skip
    if not outcome.ok:
        print("error: a safety counter is not 0 or the journal did not replay clean",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from ..journal.ledger import Ledger
    from ..journal.timeline import draw

    records = _read_journal(args.journal)
    try:
        ledger = Ledger(records)
    except _UNREADABLE as err:
        raise Failed(f"{args.journal} is not a journal ({type(err).__name__}: {err}); "
                     "pass a run's journal.jsonl") from err  # fmt: skip
    try:
        info = draw(ledger, args.out, title=args.title)
    except OSError as err:
        raise Failed(f"cannot write the timeline: {_os_error(err)}; check --out") from err
    except RecoveryError as err:  # nothing to draw
        raise Failed(f"{args.journal}: {err}") from err
    print(f"wrote {info.path} ({info.size[0]}x{info.size[1]} px, rows: {', '.join(info.rows)})")
    return 0


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
        return value

    return parse


def _at_least_0(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text}")
    return value


def _runs(text: str) -> tuple[str, ...]:
    known = ("standby", "immediate", "cold", "free")
    runs = tuple(r.strip() for r in text.split(",") if r.strip())
    wrong = [r for r in runs if r not in known]
    if wrong or not runs:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(known)}; got {text!r}"
        )
    return runs


def _controller(name: str) -> Any:
    """``--controller``: 'real' or a rules class as ``module:Class``, imported while parsing,
    so a misspelt name is a one-line usage error."""
    from ..search.replay import rules_class

    try:
        return rules_class(name)
    except RecoveryError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _replay(args: argparse.Namespace) -> int:
    from ..search.replay import replay

    _read_journal(args.journal)
    try:
        report = replay(args.journal, args.controller)
    except _UNREADABLE as err:
        detail = str(err) if args.journal in str(err) else f"{args.journal}: {err}"
        raise Failed(f"{detail} ({type(err).__name__}); pass a run's journal.jsonl") from err
    print(report.render())
    return 0 if report.ok else FAILED


def _explore(args: argparse.Namespace) -> int:
    from ..search import explore
    from ..search.stateful import small_standby, small_window

    if args.journal_dir and Path(args.journal_dir).is_file():
        raise Failed(f"--journal-dir {args.journal_dir} is a file; give a directory", USAGE)
    if args.standby and args.restart_window is not None:
        raise Failed("--standby and --restart-window each search their own small world; "
                     "give one of them", USAGE)  # fmt: skip
    scope = None
    if args.standby:  # one group beside the pool: the standby rules' small world
        scope = small_standby(args.standby)
    elif args.restart_window is not None:  # one group failing up to four times
        scope = small_window(args.restart_window)
    result = explore(
        args.depth,
        scope,
        rules=args.controller,
        liveness=args.liveness,
        journal_dir=args.journal_dir,
    )
    print(result.report())
    return FAILED if result.found else 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when all is well; 1 when a check fails or a file, a run or the library
    refuses; 2 for a usage error; 130 on Ctrl-C. Every error a user can cause is one line on
    stderr saying what to do; a traceback means a bug."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error (2), already printed
        return stop.code if isinstance(stop.code, int) else USAGE
    try:
        return int(args.func(args))
    except Failed as err:
        code, message = err.code, str(err)
    except KeyboardInterrupt:
        code, message = INTERRUPTED, "interrupted"
    except RecoveryError as err:  # refused by the library: its message says why
        code, message = FAILED, f"{err}"
    except OSError as err:
        code, message = FAILED, _os_error(err)
    prog = f"{parser.prog} {args.command}"
    print(_one_line(f"{prog}: error: {message}"), file=sys.stderr)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recovery-fsm", description=__doc__)
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
    m.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                   help="transformers (reference, the default) or vLLM (extra [vllm])")  # fmt: skip
    m.add_argument("--hf-interval", type=_at_least_0, default=4,
                   help="every N versions the export is also the HF save (0: never)")  # fmt: skip
    m.add_argument("--out", default="demo-out",
                   help="where the runs' journals, checkpoints and timelines go (OUT/<run>); "
                        "a demo replaces the previous demo's files there, and refuses a "
                        "directory holding anything else (default demo-out)")  # fmt: skip
    m.add_argument("--standby", type=_at_least_0, default=1,
                   help="warm standby engines in the standby run (default 1; 0: no such "
                        "run)")  # fmt: skip
    m.add_argument("--runs", type=_runs, default=None,
                   help="which runs, comma-separated, of standby, immediate, cold, free "
                        "(default all: the same scenario each way, and without failures for "
                        "the goodput)")  # fmt: skip
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
        type=_controller,
        default=None,
        help="'real' or a rules class as module:Class (default: the one the journal names)",
    )
    r.set_defaults(func=_replay)
    x = sub.add_parser("explore", help="search every event ordering up to a depth")
    x.add_argument("--depth", type=_positive(int), default=6)
    x.add_argument("--controller", type=_controller, default="real",
                   help="'real' or a rules class as module:Class")  # fmt: skip
    x.add_argument("--liveness", action="store_true", help="also settle every state fairly")
    x.add_argument("--standby", type=_at_least_0, default=0,
                   help="search one group beside a pool of this many standbys (default 0: "
                        "two groups, no standbys)")  # fmt: skip
    x.add_argument("--restart-window", type=_positive(float), default=None,
                   help="search one group whose restart budget of 2 refills over this many "
                        "seconds (the deadlines are 10, 15 and 20 s)")  # fmt: skip
    x.add_argument("--journal-dir", default=None, help="write a counterexample journal here")
    x.set_defaults(func=_explore)
    from .serve import add_parser

    add_parser(sub, _positive, _at_least_0)
    return parser
