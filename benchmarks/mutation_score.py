"""Mutation score of the property suite against ``rules.py`` and ``machines.py``.

    PYTHONPATH=src .venv/bin/python benchmarks/mutation_score.py [--sample N] [--seed S] [--jobs 2]
        [--target rules|machines|both]

Why: the property suite (the Hypothesis race search and the exhaustive explorer over the real
rules, plus random event streams) claims to catch any rule broken in isolation. This checks
that claim: it makes one-line mutants of the rule code (and, with ``--target``, of the
machines: a transition's target, a guard turned round, an alternative dropped, the records'
conditions), runs only
``tests/property/test_races.py``, ``test_explorer.py`` and ``test_random_events.py`` against each,
and counts which mutants the suite kills. ``test_mutants.py`` (hand-written broken variants)
and the unit tests are deliberately left out.

``src``, ``tests`` and ``pyproject.toml`` are copied once, at start, so edits made to the
worktree while the run goes on do not leak in; each mutant is written into its own copy of that
``src`` and the suite runs from the snapshot with ``PYTHONPATH`` pointing at the mutant's copy.
The worktree is never modified. Hypothesis gets a fixed seed and a private
database per mutant, so a run is reproducible and mutants cannot feed each other examples.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = Path("recovery_fsm") / "rules.py"
MACHINES = Path("recovery_fsm") / "machines.py"
# The classes whose constants name states: a state constant may be swapped for a sibling.
NAME_CLASSES = ("CheckpointState", "GroupState", "StandbyState", "PoolState", "SwitchState")
SUITE = [
    "tests/property/test_races.py",
    "tests/property/test_explorer.py",
    "tests/property/test_random_events.py",
]

# Methods of ``Rules`` that are plumbing, not rules: never mutated.
PLUMBING = {"__init__", "apply", "__getstate__", "__setstate__", "_fire", "_fire_ck",
            "_fire_group", "_emit"}  # fmt: skip
# The three machines' states (kept literal: the harness must not import the code it mutates).
STATE_SETS = [
    ["exporting", "ready", "superseded", "abandoned", "deletable", "deleted", "failed",
     "discarded"],
    ["active", "suspect", "failed", "awaiting_checkpoint", "loading", "relaunching",
     "pending_weights", "retired", "stopped"],
    ["enabled", "cooldown", "disabled"],
]  # fmt: skip
# Boundary shift and negation for each relational operator.
COMPARE_SWAPS = {"<": ["<=", ">="], "<=": ["<", ">"], ">": [">=", "<="], ">=": [">", "<"],
                 "==": ["!="], "!=": ["=="]}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    """One changed line of rules.py."""

    line: int  # 1-based
    op: str
    before: str  # the original line, without newline
    after: str  # the mutated line
    where: str = ""  # the method it is in: finds the line again after rules.py moves
    file: str = "rules.py"  # in src/recovery_fsm

    @property
    def label(self) -> str:
        prefix = "" if self.file == "rules.py" else f"{self.file}:"
        return f"{prefix}L{self.line} {self.where} {self.op}"

    def diff(self) -> str:
        return f"-{self.before}\n+{self.after}"


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | timeout | invalid
    seconds: float
    detail: str  # the failing test, or why the mutant is invalid


# -- finding mutation sites ------------------------------------------------------------------


def _rule_lines(tree: ast.Module) -> tuple[set[int], list[ast.FunctionDef]]:
    """Lines of rule code: bodies of the non-plumbing ``Rules`` methods, minus docstrings
    and ``raise`` statements (their operands are error messages)."""
    rules = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Rules")
    methods = [n for n in rules.body if isinstance(n, ast.FunctionDef) and n.name not in PLUMBING]
    lines: set[int] = set()
    for fn in methods:
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for stmt in body:
            lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
        for node in ast.walk(fn):
            if isinstance(node, ast.Raise):
                lines.difference_update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines, methods


def _replace(line: str, start: int, end: int, text: str) -> str:
    return line[:start] + text + line[end:]


def _token_mutants(
    source: str, scope: set[int], constants: dict[str, list[str]] | None = None
) -> Iterator[tuple[int, str, int, int, str]]:
    """(line, op, start col, end col, replacement) for every token-level mutation;
    ``constants``: each state-name class's attributes (``GroupState.LOADING`` may become a
    sibling)."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]  # fmt: skip
    states = {name: alts for alts in STATE_SETS for name in alts}
    for i, t in enumerate(toks):
        (row, col), (erow, ecol) = t.start, t.end
        if row not in scope or row != erow:
            continue
        prev = toks[i - 1] if i else None
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        s = t.string
        if t.type == tokenize.OP and s in COMPARE_SWAPS:
            for alt in COMPARE_SWAPS[s]:
                yield row, f"compare {s} -> {alt}", col, ecol, alt
        elif t.type == tokenize.NAME and s == "in":
            if prev is not None and prev.string == "not":
                yield row, "compare not in -> in", prev.start[1], ecol, "in"
            else:
                yield row, "compare in -> not in", col, ecol, "not in"
        elif t.type == tokenize.NAME and s == "is":
            if nxt is not None and nxt.string == "not":
                yield row, "compare is not -> is", col, nxt.end[1], "is"
            else:
                yield row, "compare is -> is not", col, ecol, "is not"
        elif t.type == tokenize.NAME and s in ("and", "or"):
            alt = "or" if s == "and" else "and"
            yield row, f"boolean {s} -> {alt}", col, ecol, alt
        elif t.type == tokenize.NAME and s in ("True", "False"):
            alt = "False" if s == "True" else "True"
            yield row, f"constant {s} -> {alt}", col, ecol, alt
        elif t.type == tokenize.NAME and s == "not":
            unary = (nxt is None or nxt.string != "in") and (prev is None or prev.string != "is")
            if unary and nxt is not None:
                yield row, "remove not", col, nxt.start[1], ""
        elif t.type == tokenize.NUMBER and s.isdigit():
            n = int(s)
            if prev is not None and prev.string in ("+=", "-="):
                flip = "-=" if prev.string == "+=" else "+="
                yield row, f"{prev.string} {n} -> {prev.string} 0", col, ecol, "0"
                yield row, f"{prev.string} {n} -> {flip} {n}", prev.start[1], ecol, f"{flip} {n}"
            else:
                yield row, f"int {n} -> {n + 1}", col, ecol, str(n + 1)
                yield row, f"int {n} -> {n - 1}", col, ecol, str(n - 1)
        elif (t.type == tokenize.NAME and constants and prev is not None and prev.string == "."
              and i >= 2 and toks[i - 2].string in constants):  # fmt: skip
            for alt in constants[toks[i - 2].string]:
                if alt != s:
                    yield row, f"state {toks[i - 2].string}.{s} -> {alt}", col, ecol, alt
        elif t.type == tokenize.STRING and s[0] in "\"'" and s[1:-1] in states:
            name = s[1:-1]
            alts = sorted({a for group in STATE_SETS if name in group for a in group} - {name})
            for alt in alts:
                yield row, f"state {name!r} -> {alt!r}", col, ecol, f'"{alt}"'


def _deletable(stmt: ast.stmt) -> bool:
    """A call of one of the rules' helpers, or a write to a record field / rules' table."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "self" and f.attr.startswith("_"))  # fmt: skip
    if isinstance(stmt, (ast.Assign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in targets)
    return isinstance(stmt, ast.Delete)


def state_constants(machines_source: str) -> dict[str, list[str]]:
    """Each state-name class of machines.py and its attribute names, read from its text."""
    out: dict[str, list[str]] = {}
    for node in ast.parse(machines_source).body:
        if isinstance(node, ast.ClassDef) and node.name in NAME_CLASSES:
            out[node.name] = [
                t.target.id for t in node.body
                if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
            ]  # fmt: skip
    return out


def enumerate_mutants(source: str, constants: dict[str, list[str]] | None = None) -> list[Mutant]:
    """Every one-line mutant of the rule code that parses and differs from the original."""
    tree = ast.parse(source)
    original = ast.dump(tree)
    lines = source.splitlines()
    scope, methods = _rule_lines(tree)
    raw: list[tuple[int, str, str]] = []
    for row, op, start, end, text in _token_mutants(source, scope, constants):
        raw.append((row, op, _replace(lines[row - 1], start, end, text)))
    for fn in methods:
        for node in ast.walk(fn):
            if isinstance(node, ast.If) and node.lineno in scope:
                test = node.test
                if test.lineno == test.end_lineno == node.lineno and test.end_col_offset:
                    line = lines[node.lineno - 1]
                    cond = line[test.col_offset : test.end_col_offset]
                    raw.append((node.lineno, "insert not",
                                _replace(line, test.col_offset, test.end_col_offset,
                                         f"not ({cond})")))  # fmt: skip
            if (isinstance(node, ast.stmt) and node.lineno in scope
                    and node.lineno == node.end_lineno and _deletable(node)):  # fmt: skip
                line = lines[node.lineno - 1]
                indent = line[: len(line) - len(line.lstrip())]
                raw.append((node.lineno, "delete statement", indent + "pass"))
    found = [(row, op, after, _method_at(methods, row)) for row, op, after in raw]
    return _distinct(found, lines, original, "rules.py")


def _distinct(
    raw: list[tuple[int, str, str, str]], lines: list[str], original: str, file: str
) -> list[Mutant]:
    """The mutants (line, op, mutated line, where) that parse, differ from the original and
    from each other."""
    out: list[Mutant] = []
    seen: set[tuple[int, str]] = set()
    for row, op, after, where in sorted(raw):
        if (row, after) in seen or after == lines[row - 1]:
            continue
        seen.add((row, after))
        mutated = "\n".join([*lines[: row - 1], after, *lines[row:]]) + "\n"
        try:
            if ast.dump(ast.parse(mutated)) == original:
                continue
        except SyntaxError:
            continue  # e.g. ``for x not in``: not a mutant at all
        out.append(Mutant(row, op, lines[row - 1], after, where, file=file))
    return out


def _method_at(methods: list[ast.FunctionDef], line: int) -> str:
    return next((f.name for f in methods if f.lineno <= line <= (f.end_lineno or 0)), "")


def enumerate_machine_mutants(source: str) -> list[Mutant]:
    """One-line mutants of machines.py: in a state machine, a transition's target swapped
    for another state of the machine, ``cond=`` and ``unless=`` swapped, one alternative of
    an event dropped; in the records, the token mutations of their methods' conditions."""
    tree = ast.parse(source)
    original = ast.dump(tree)
    lines = source.splitlines()
    raw: list[tuple[int, str, str, str]] = []  # line, op, mutated line, class
    methods: list[ast.FunctionDef] = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        machine = any(isinstance(b, ast.Name) and b.id == "StateMachine" for b in cls.bases)
        if not machine:
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                methods.append(fn)
                body = fn.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                       ast.Constant):
                    body = body[1:]  # fmt: skip
                scope = {ln for st in body for ln in range(st.lineno, (st.end_lineno or 0) + 1)}
                for row, op, start, end, text in _token_mutants(source, scope):
                    raw.append((row, op, _replace(lines[row - 1], start, end, text), cls.name))
            continue
        states = [
            t.targets[0].id for t in cls.body
            if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)
            and isinstance(t.value, ast.Call) and getattr(t.value.func, "id", "") == "State"
        ]  # fmt: skip
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "to" and node.lineno == node.end_lineno):  # fmt: skip
                continue
            line = lines[node.lineno - 1]
            if node.args and isinstance(node.args[0], ast.Name):
                target = node.args[0]
                for alt in states:
                    if alt != target.id:
                        raw.append((node.lineno, f"target {target.id} -> {alt}",
                                    _replace(line, target.col_offset, target.end_col_offset
                                             or 0, alt), cls.name))  # fmt: skip
            for kw in node.keywords:
                if kw.arg in ("cond", "unless"):
                    other = "unless" if kw.arg == "cond" else "cond"
                    col = line.index(f"{kw.arg}=", node.col_offset)
                    raw.append((node.lineno, f"guard {kw.arg} -> {other}",
                                _replace(line, col, col + len(kw.arg), other), cls.name))
            # Drop this alternative: "| a.to(b)" after it, or "a.to(b) |" before the next.
            seg = line[node.func.value.col_offset : node.end_col_offset]
            for alt_text in (f" | {seg}", f"| {seg}", f"{seg} | "):
                if alt_text in line:
                    raw.append((node.lineno, "drop alternative", line.replace(alt_text, "", 1),
                                cls.name))  # fmt: skip
                    break
    return _distinct(raw, lines, original, "machines.py")


def sample(mutants: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """A seeded sample spread over the file: lines in random order, one mutant per line per
    round, so no single line (or operator-rich line) dominates."""
    if n >= len(mutants):
        return list(mutants)
    rng = random.Random(seed)
    by_line: dict[tuple[str, int], list[Mutant]] = defaultdict(list)
    for m in mutants:
        by_line[(m.file, m.line)].append(m)
    order = sorted(by_line)
    rng.shuffle(order)
    for line in order:
        rng.shuffle(by_line[line])
    picked: list[Mutant] = []
    while len(picked) < n:
        for line in order:
            if by_line[line] and len(picked) < n:
                picked.append(by_line[line].pop())
    return sorted(picked, key=lambda m: (m.file, m.line, m.op, m.after))


# -- running the suite -----------------------------------------------------------------------


def run_mutant(
    m: Mutant, base: Path, timeout: float, seed: int, python: str = sys.executable
) -> Outcome:
    """Copy ``base/src`` (pristine), write the mutant into the copy, import it, then run the
    property suite of ``base`` (the snapshot of the worktree) against it."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(base / "src", src)
        path = src / "recovery_fsm" / m.file
        lines = path.read_text().splitlines()
        assert lines[m.line - 1] == m.before, f"{m.label}: source drifted"
        lines[m.line - 1] = m.after
        path.write_text("\n".join(lines) + "\n")
        env = {
            **os.environ,
            "PYTHONPATH": str(src),
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing lands in the worktree's __pycache__
            "HYPOTHESIS_STORAGE_DIRECTORY": str(Path(tmp) / "hypothesis"),
            "RECOVERY_FSM_TRACES": str(Path(tmp) / "traces"),
            "COLUMNS": "400",  # keep pytest's one-line failure reason readable
        }
        probe = "import recovery_fsm.rules as r, recovery_fsm.search; print(r.__file__)"
        imported = subprocess.run(
            [python, "-c", probe], cwd=base, env=env, capture_output=True, text=True, timeout=120
        )
        if imported.returncode != 0:
            tail = (imported.stderr.strip().splitlines() or ["?"])[-1]
            return Outcome(m, "invalid", time.monotonic() - began, f"import failed: {tail}")
        if not imported.stdout.strip().startswith(str(src)):
            raise RuntimeError(f"the suite would not test the copy: {imported.stdout.strip()}")
        cmd = [python, "-m", "pytest", *SUITE, "-x", "-q", "-p", "no:cacheprovider",
               f"--hypothesis-seed={seed}"]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
            proc.communicate()
            return Outcome(m, "timeout", time.monotonic() - began, f"> {timeout:.0f} s")
    seconds = time.monotonic() - began
    if proc.returncode == 0:
        return Outcome(m, "survived", seconds, "")
    if proc.returncode == 1:
        failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
        return Outcome(m, "killed", seconds, failed[0] if failed else "")
    tail = (out.strip().splitlines() or ["?"])[-1]
    return Outcome(m, "invalid", seconds, f"pytest exit {proc.returncode}: {tail}")


def run_all(
    mutants: list[Mutant], base: Path, jobs: int, timeout: float, seed: int
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_mutant, m, base, timeout, seed) for m in mutants]
        for done, fut in enumerate(as_completed(futures), 1):
            o = fut.result()
            outcomes.append(o)
            print(f"[{done}/{len(mutants)}] {o.status:8} {o.seconds:6.1f}s {o.mutant.label}"
                  f"  {o.detail}", flush=True)  # fmt: skip
    return sorted(outcomes, key=lambda o: (o.mutant.file, o.mutant.line, o.mutant.op,
                                           o.mutant.after))  # fmt: skip


def relocate(rows: list[dict[str, object]], source: str) -> list[Mutant]:
    """An earlier run's survivors, found again by their line's text (line numbers move as
    rules.py is edited): in the same method if known, the occurrence nearest the old line; a
    line that is gone is skipped."""
    lines = source.splitlines()
    methods = _rule_lines(ast.parse(source))[1]
    out: list[Mutant] = []
    for row in rows:
        if row["status"] != "survived":
            continue
        before, after = str(row["before"]), str(row["after"])
        old = int(str(row["line"]))
        where = str(row.get("where", ""))
        at = [i + 1 for i, ln in enumerate(lines) if ln == before]
        at = [i for i in at if _method_at(methods, i) == where] if where else at
        if not at:
            print(f"skipped, line gone: L{old} {where} {before.strip()}")
            continue
        line = min(at, key=lambda i: abs(i - old))
        where = _method_at(methods, line)
        out.append(Mutant(line, f"{row['op']} (was L{old})", before, after, where))
    return out


def _known(source: str) -> list[tuple[Mutant, str]]:
    """Controls: a no-op edit must survive; dropping ``self._cool(g)`` from
    ``on_RestartLoadFailed`` must be killed."""
    lines = source.splitlines()
    start = next(i for i, ln in enumerate(lines) if "def on_RestartLoadFailed" in ln)
    cool = next(i for i in range(start, len(lines))
                if lines[i].strip().split("#")[0].strip() == "self._cool(g)")  # fmt: skip
    indent = lines[cool][: len(lines[cool]) - len(lines[cool].lstrip())]
    where = "on_RestartLoadFailed"
    noop = Mutant(cool + 1, "no-op", lines[cool], lines[cool] + "  # no-op", where)
    drop = Mutant(cool + 1, "delete statement", lines[cool], indent + "pass", where)
    return [(noop, "survived"), (drop, "killed")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=int, default=120, help="mutants to run (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling and Hypothesis seed")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    p.add_argument("--list", action="store_true", help="print the sample and exit")
    p.add_argument("--self-test", action="store_true", help="run only the two controls")
    p.add_argument("--json", type=Path, help="also write every outcome here")
    p.add_argument("--rerun", type=Path, help="rerun the survivors listed in an earlier --json")
    p.add_argument("--target", choices=("rules", "machines", "both"), default="both")
    args = p.parse_args()

    source = (ROOT / "src" / RULES).read_text()
    machines = (ROOT / "src" / MACHINES).read_text()
    every = []
    if args.target in ("rules", "both"):
        every += enumerate_mutants(source, state_constants(machines))
    if args.target in ("machines", "both"):
        every += enumerate_machine_mutants(machines)
    chosen = sample(every, args.sample or len(every), args.seed)
    if args.rerun:
        chosen = relocate(json.loads(args.rerun.read_text()), source)
    ops = Counter(m.op.split()[0] for m in every)
    digest = hashlib.sha256((source + machines).encode()).hexdigest()[:12]
    lines = len({(m.file, m.line) for m in every})
    print(f"rules.py + machines.py sha256 {digest}: {len(every)} candidate mutants ({args.target})"
          f" on {lines} lines "
          f"({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))}); "
          f"running {len(chosen)} with seed {args.seed}, {args.jobs} jobs", flush=True)  # fmt: skip
    if args.list:
        for m in chosen:
            print(f"{m.label}\n{m.diff()}")
        return 0

    with tempfile.TemporaryDirectory(prefix="mutation-base-") as tmp:
        base = Path(tmp) / "tree"  # src, tests and pytest's config, as they are now
        skip = shutil.ignore_patterns("__pycache__")
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, base / part, ignore=skip)
        shutil.copy(ROOT / "pyproject.toml", base)
        if ((base / "src" / RULES).read_text(), (base / "src" / MACHINES).read_text()) != (
            source, machines
        ):
            raise RuntimeError("the code changed while the mutants were being listed; rerun")
        controls = _known(source)
        print("controls (no-op must survive, dropping _cool must be killed):", flush=True)
        checks = run_all([m for m, _ in controls], base, args.jobs, args.timeout, args.seed)
        want = {m: status for m, status in controls}
        bad = [o for o in checks if o.status != want[o.mutant]]
        if bad:
            for o in bad:
                print(f"CONTROL FAILED: {o.mutant.label} {o.status}, want {want[o.mutant]}")
            return 2
        if args.self_test:
            return 0
        began = time.monotonic()
        outcomes = run_all(chosen, base, args.jobs, args.timeout, args.seed)
        wall = time.monotonic() - began

    counts = Counter(o.status for o in outcomes)
    valid = len(outcomes) - counts["invalid"]
    caught = counts["killed"] + counts["timeout"]
    print(f"\nmutants run: {len(outcomes)} in {wall / 60:.1f} min (of {len(every)} candidates)")
    print(f"killed {counts['killed']}, timeout {counts['timeout']}, "
          f"survived {counts['survived']}, invalid {counts['invalid']}")  # fmt: skip
    if valid:
        print(f"score: {caught}/{valid} = {100 * caught / valid:.1f}% "
              f"(killed only: {counts['killed']}/{valid})")  # fmt: skip
    for o in outcomes:
        if o.status in ("survived", "timeout", "invalid"):
            print(f"\n{o.status.upper()} {o.mutant.label}  {o.detail}\n{o.mutant.diff()}")
    if args.json:
        rows = [{**asdict(o.mutant), "status": o.status, "seconds": round(o.seconds, 1),
                 "detail": o.detail} for o in outcomes]  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
