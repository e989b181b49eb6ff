"""Mutation testing of one module against a fast test selection: do the tests notice a bug?

Each mutant changes one thing in the module's syntax tree: a comparison (``<`` and ``<=``,
``<`` and ``>``, ``==`` and ``!=``, ``in`` and ``not in``, ``is`` and ``is not``), an
arithmetic or bitwise operator, ``and`` and ``or``, a ``not`` or a unary minus dropped, a
number (``0`` and ``1`` swapped, any other ``n`` made ``n + 1``; floats doubled), ``True`` and
``False``, ``min`` and ``max``, a bare call statement removed (``timer.cancel()``), or a
``return x`` made ``return None``. Docstrings, annotations, type aliases, decorators, log
calls and the text of error messages are left alone. Each mutant is written into a copy of
the repository in a temporary folder (never the working tree), and the tests run there with
pytest (``-x -q -p no:cacheprovider``); a mutant the tests fail on, or that runs past
``--timeout-s``, is killed, one they pass with has survived.

    python scripts/mutate.py --module service/engine/batcher/queue.py --tests tests/test_batching.py

Third-party pytest plugins are not auto-loaded (schemathesis and hypothesis cost about two
seconds a run); ``--plugin`` names those the tests need (pytest-asyncio by default).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

REPOSITORY = Path(__file__).resolve().parent.parent
PYTEST_OPTIONS = ("-x", "-q", "-p", "no:cacheprovider", "--no-header")
#: Names whose method calls are logging, never mutated or removed.
LOGGERS = frozenset({"logger", "logging", "log", "warnings"})
#: Longest rendering of a changed expression in the report.
SHOWN_CHARS = 90

Transform = Callable[[ast.AST], ast.AST]


@dataclass(frozen=True)
class Variant:
    """One way to change one node: ``apply`` returns the node that replaces it."""

    description: str
    apply: Transform


@dataclass(frozen=True)
class Site:
    """A node that can be changed, where it hangs in the tree, and its variants."""

    node: ast.AST
    parent: ast.AST
    field: str
    index: int | None
    variants: tuple[Variant, ...]


@dataclass(frozen=True)
class Mutant:
    number: int
    line: int
    site: int
    variant: int
    description: str


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    killed: bool
    how: str
    """``failed``, ``timeout``, ``passed``, or pytest's exit status."""
    seconds: float
    output: str


# ----------------------------------------------------------------------------- operators

_COMPARE_SWAPS: dict[type[ast.cmpop], tuple[type[ast.cmpop], ...]] = {
    ast.Lt: (ast.LtE, ast.Gt),
    ast.LtE: (ast.Lt, ast.GtE),
    ast.Gt: (ast.GtE, ast.Lt),
    ast.GtE: (ast.Gt, ast.LtE),
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
}
_BINARY_SWAPS: dict[type[ast.operator], tuple[type[ast.operator], ...]] = {
    ast.Add: (ast.Sub,),
    ast.Sub: (ast.Add,),
    ast.Mult: (ast.Div,),
    ast.Div: (ast.Mult,),
    ast.FloorDiv: (ast.Div,),
    ast.Mod: (ast.FloorDiv,),
    ast.Pow: (ast.Mult,),
    ast.BitOr: (ast.BitAnd,),
    ast.BitAnd: (ast.BitOr,),
}
_SYMBOLS: dict[type[ast.AST], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitOr: "|",
    ast.BitAnd: "&",
    ast.And: "and",
    ast.Or: "or",
}


def _shown(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _changed(node: ast.AST, replacement: ast.AST) -> str:
    return f"`{_shown(node)}` -> `{_shown(replacement)}`"


def _compare_variants(node: ast.Compare) -> list[Variant]:
    variants = []
    for position, op in enumerate(node.ops):
        for swap in _COMPARE_SWAPS.get(type(op), ()):

            def apply(target: ast.AST, position: int = position, swap: type = swap) -> ast.AST:
                assert isinstance(target, ast.Compare)
                mutated = copy.deepcopy(target)
                mutated.ops[position] = swap()
                return mutated

            variants.append(Variant(_changed(node, apply(node)), apply))
    return variants


def _binary_variants(node: ast.BinOp | ast.AugAssign) -> list[Variant]:
    variants = []
    for swap in _BINARY_SWAPS.get(type(node.op), ()):

        def apply(target: ast.AST, swap: type = swap) -> ast.AST:
            assert isinstance(target, ast.BinOp | ast.AugAssign)
            mutated = copy.deepcopy(target)
            mutated.op = swap()
            return mutated

        if isinstance(node, ast.AugAssign):
            description = f"`{_SYMBOLS[type(node.op)]}=` -> `{_SYMBOLS[swap]}=` in `{_shown(node)}`"
        else:
            description = _changed(node, apply(node))
        variants.append(Variant(description, apply))
    return variants


def _bool_variants(node: ast.BoolOp) -> list[Variant]:
    swap = ast.Or if isinstance(node.op, ast.And) else ast.And

    def apply(target: ast.AST) -> ast.AST:
        assert isinstance(target, ast.BoolOp)
        mutated = copy.deepcopy(target)
        mutated.op = swap()
        return mutated

    description = f"`{_SYMBOLS[type(node.op)]}` -> `{_SYMBOLS[swap]}` in `{_shown(node)}`"
    return [Variant(description, apply)]


def _unary_variants(node: ast.UnaryOp) -> list[Variant]:
    if not isinstance(node.op, ast.Not | ast.USub):
        return []

    def apply(target: ast.AST) -> ast.AST:
        assert isinstance(target, ast.UnaryOp)
        return copy.deepcopy(target.operand)

    return [Variant(_changed(node, node.operand), apply)]


def _constant_variants(node: ast.Constant) -> list[Variant]:
    value = node.value
    new: object
    if isinstance(value, bool):
        new = not value
    elif isinstance(value, int):
        new = {0: 1, 1: 0}.get(value, value + 1)
    elif isinstance(value, float):
        new = 1.0 if value == 0.0 else value * 2
    else:
        return []

    def apply(target: ast.AST) -> ast.AST:
        return ast.Constant(value=new)

    return [Variant(f"`{value!r}` -> `{new!r}`", apply)]


def _call_variants(node: ast.Call) -> list[Variant]:
    if not (isinstance(node.func, ast.Name) and node.func.id in ("min", "max")):
        return []
    swap = "max" if node.func.id == "min" else "min"

    def apply(target: ast.AST) -> ast.AST:
        assert isinstance(target, ast.Call)
        mutated = copy.deepcopy(target)
        mutated.func = ast.Name(id=swap, ctx=ast.Load())
        return mutated

    return [Variant(_changed(node, apply(node)), apply)]


def _removal_variants(node: ast.Expr) -> list[Variant]:
    value = node.value.value if isinstance(node.value, ast.Await) else node.value
    if not isinstance(value, ast.Call) or _is_log_call(value):
        return []

    def apply(target: ast.AST) -> ast.AST:
        return ast.Pass()

    return [Variant(f"removed `{_shown(node)}`", apply)]


def _return_variants(node: ast.Return) -> list[Variant]:
    if node.value is None or isinstance(node.value, ast.Constant):
        return []  # constants are mutated as constants

    def apply(target: ast.AST) -> ast.AST:
        return ast.Return(value=ast.Constant(value=None))

    return [Variant(f"`{_shown(node)}` -> `return None`", apply)]


def _variants(node: ast.AST) -> list[Variant]:
    if isinstance(node, ast.Compare):
        return _compare_variants(node)
    if isinstance(node, ast.BinOp | ast.AugAssign):
        return _binary_variants(node)
    if isinstance(node, ast.BoolOp):
        return _bool_variants(node)
    if isinstance(node, ast.UnaryOp):
        return _unary_variants(node)
    if isinstance(node, ast.Constant):
        return _constant_variants(node)
    if isinstance(node, ast.Call):
        return _call_variants(node)
    if isinstance(node, ast.Expr):
        return _removal_variants(node)
    if isinstance(node, ast.Return):
        return _return_variants(node)
    return []


# ----------------------------------------------------------------------------- where


def _is_log_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id in LOGGERS


def _skipped_fields(node: ast.AST) -> set[str]:
    """Fields of ``node`` whose subtrees are never mutated: annotations, decorators, and
    the message of a raised error."""
    skipped = {"annotation", "returns", "decorator_list", "type_comment"}
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        skipped.add("exc")
    return skipped


def _children(node: ast.AST) -> Iterator[tuple[str, int | None, ast.AST]]:
    skipped = _skipped_fields(node)
    for name, value in ast.iter_fields(node):
        if name in skipped:
            continue
        if isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield name, index, item
        elif isinstance(value, ast.AST):
            yield name, None, value


def sites(tree: ast.Module) -> list[Site]:
    """Every mutable node of ``tree``, in a fixed (depth-first) order."""
    found: list[Site] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            # The error's type and keywords (a Retry-After) matter; its message is text.
            for keyword in node.exc.keywords:
                visit(keyword)
        for name, index, child in _children(node):
            if isinstance(child, ast.JoinedStr) or _is_log_call(child):
                continue
            if isinstance(node, ast.Module) and _is_type_alias(child):
                continue
            if _is_docstring(node, name, index):
                continue
            variants = _variants(child)
            if variants:
                found.append(Site(child, node, name, index, tuple(variants)))
            visit(child)

    visit(tree)
    return found


def _is_type_alias(node: ast.AST) -> bool:
    """``Alias = Callable[[int], str | None]`` (at module level): typing, not behaviour."""
    return isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)


def _is_docstring(parent: ast.AST, field: str, index: int | None) -> bool:
    if field != "body" or index != 0:
        return False
    if not isinstance(parent, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    first = parent.body[0]
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )


def enumerate_mutants(source: str) -> list[Mutant]:
    mutants: list[Mutant] = []
    for site_number, site in enumerate(sites(ast.parse(source))):
        for variant_number, variant in enumerate(site.variants):
            mutants.append(
                Mutant(
                    number=len(mutants) + 1,
                    line=getattr(site.node, "lineno", 0),
                    site=site_number,
                    variant=variant_number,
                    description=variant.description,
                )
            )
    return mutants


def mutated_source(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant`` applied, as Python regenerated from the changed tree."""
    tree = ast.parse(source)
    site = sites(tree)[mutant.site]
    replacement = site.variants[mutant.variant].apply(site.node)
    ast.copy_location(replacement, site.node)
    if site.index is None:
        setattr(site.parent, site.field, replacement)
    else:
        getattr(site.parent, site.field)[site.index] = replacement
    return ast.unparse(ast.fix_missing_locations(tree))


# ----------------------------------------------------------------------------- running


def repository_files(root: Path) -> list[Path]:
    """Tracked and untracked files git does not ignore, relative to ``root``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return [Path(name) for name in listed.decode().split("\0") if name]


def copy_repository(root: Path, files: Sequence[Path], destination: Path) -> None:
    for relative in files:
        source = root / relative
        if not source.is_file():
            continue  # deleted in the working tree but still in the index
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


@dataclass(frozen=True)
class Runner:
    """Runs the test selection in one copy of the repository."""

    python: str
    tests: tuple[str, ...]
    plugins: tuple[str, ...]
    timeout_s: float

    def command(self) -> list[str]:
        plugin_options = [option for plugin in self.plugins for option in ("-p", plugin)]
        return [self.python, "-m", "pytest", *PYTEST_OPTIONS, *plugin_options, *self.tests]

    def environment(self, workdir: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
            # A stale .pyc of the module (same size, same second) would hide the mutant.
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONPATH=str(workdir),
        )
        return env

    def run(self, workdir: Path) -> tuple[str, float, str]:
        """(``passed``, ``failed``, ``timeout`` or pytest's exit status; seconds; output)."""
        started_s = time.monotonic()
        process = subprocess.Popen(
            self.command(),
            cwd=workdir,
            env=self.environment(workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so a timeout ends pytest and anything it started
        )
        try:
            output, _ = process.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return "timeout", time.monotonic() - started_s, output
        seconds = time.monotonic() - started_s
        status = {0: "passed", 1: "failed"}.get(process.returncode, f"exit {process.returncode}")
        return status, seconds, output


#: pytest's exit statuses that mean the mutant broke the tests (failed, interrupted by an
#: error such as an import failing, internal error) rather than a wrong command line.
_KILLING_STATUSES = {"failed", "timeout", "exit 2", "exit 3"}


def check_imports_from_copy(runner: Runner, workdir: Path, module: str) -> None:
    """Make sure the tests import the copy's module, not the working tree's (editable install)."""
    dotted = module.removesuffix(".py").replace("/", ".")
    located = subprocess.run(
        [runner.python, "-c", f"import {dotted} as m; print(m.__file__)"],
        cwd=workdir,
        env=runner.environment(workdir),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(located).resolve().is_relative_to(workdir.resolve()):
        raise SystemExit(f"the tests would import {located}, not the copy in {workdir}")


def run_mutants(
    module: str,
    source: str,
    mutants: Sequence[Mutant],
    runner: Runner,
    jobs: int,
    on_outcome: Callable[[Outcome], None],
) -> list[Outcome]:
    files = repository_files(REPOSITORY)
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        workdirs: Queue[Path] = Queue()
        for number in range(jobs):
            workdir = Path(scratch) / f"copy{number}"
            copy_repository(REPOSITORY, files, workdir)
            workdirs.put(workdir)
        first = workdirs.get()
        check_imports_from_copy(runner, first, module)
        # The mutants are regenerated from the tree, so the baseline is too.
        (first / module).write_text(ast.unparse(ast.parse(source)))
        status, seconds, output = runner.run(first)
        if status != "passed":
            raise SystemExit(f"the tests fail without any mutant ({status}):\n{output[-4000:]}")
        print(f"baseline: the tests pass in {seconds:.1f} s", flush=True)
        workdirs.put(first)
        lock = threading.Lock()

        def run_one(mutant: Mutant) -> Outcome:
            workdir = workdirs.get()
            try:
                (workdir / module).write_text(mutated_source(source, mutant))
                status, seconds, output = runner.run(workdir)
            finally:
                (workdir / module).write_text(source)
                workdirs.put(workdir)
            if status not in _KILLING_STATUSES | {"passed"}:
                raise SystemExit(f"pytest could not run ({status}):\n{output[-4000:]}")
            outcome = Outcome(mutant, status != "passed", status, seconds, output)
            with lock:
                on_outcome(outcome)
            return outcome

        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            return list(pool.map(run_one, mutants))
        finally:  # on Ctrl-C, start no other mutant
            pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- command line


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--module", required=True, help="the file to mutate, e.g. service/x.py")
    parser.add_argument("--tests", nargs="+", default=[], help="pytest paths or node ids")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--sample", type=int, help="run only this many mutants, drawn at random")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--mutant", type=int, action="append", help="run only this numbered one")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per mutant (default 60)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="copies in parallel")
    parser.add_argument(
        "--plugin",
        action="append",
        help="a pytest plugin module to load (default: pytest_asyncio.plugin)",
    )
    parser.add_argument("--fail-under", type=float, default=0.0, help="exit 1 below this score")
    parser.add_argument("--show-output", action="store_true", help="print each run's pytest tail")
    arguments = parser.parse_args(argv)
    if not arguments.list and not arguments.tests:
        parser.error("--tests is required unless --list")
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    module = Path(arguments.module).as_posix()
    source = (REPOSITORY / module).read_text()
    mutants = enumerate_mutants(source)
    if arguments.mutant:
        mutants = [mutant for mutant in mutants if mutant.number in set(arguments.mutant)]
    if arguments.sample is not None and arguments.sample < len(mutants):
        chosen = random.Random(arguments.seed).sample(mutants, arguments.sample)
        mutants = sorted(chosen, key=lambda mutant: mutant.number)
    if arguments.list:
        for mutant in mutants:
            print(f"#{mutant.number} {module}:{mutant.line}: {mutant.description}")
        print(f"{len(mutants)} mutants")
        return 0

    runner = Runner(
        python=sys.executable,
        tests=tuple(arguments.tests),
        plugins=tuple(arguments.plugin or ["pytest_asyncio.plugin"]),
        timeout_s=arguments.timeout_s,
    )
    started_s = time.monotonic()
    done = [0]

    def report(outcome: Outcome) -> None:
        done[0] += 1
        mutant = outcome.mutant
        if done[0] % 25 == 0:
            print(f"[{done[0]}/{len(mutants)}] done", flush=True)
        if not outcome.killed or arguments.show_output:
            print(
                f"[{done[0]}/{len(mutants)}] #{mutant.number} {module}:{mutant.line}: "
                f"{mutant.description}: {'killed' if outcome.killed else 'SURVIVED'} "
                f"({outcome.how}, {outcome.seconds:.1f} s)",
                flush=True,
            )
        if arguments.show_output:
            print("\n".join(outcome.output.splitlines()[-15:]), flush=True)

    jobs = max(1, min(arguments.jobs, len(mutants)))
    outcomes = run_mutants(module, source, mutants, runner, jobs, report)
    killed = sum(outcome.killed for outcome in outcomes)
    survivors = [outcome.mutant for outcome in outcomes if not outcome.killed]
    timeouts = sum(outcome.how == "timeout" for outcome in outcomes)
    score = 100.0 * killed / len(outcomes) if outcomes else 100.0
    print(f"\n{module}: survivors")
    for mutant in survivors:
        print(f"  #{mutant.number} {module}:{mutant.line}: {mutant.description}")
    print(
        f"{module}: {len(outcomes)} mutants, {killed} killed ({timeouts} by timeout), "
        f"{len(survivors)} survived: score {score:.1f} % "
        f"({time.monotonic() - started_s:.0f} s, {jobs} jobs)"
    )
    return 1 if score < arguments.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
