"""``fsm-cache verify``: prove the contracts of compiled specs and of the pool allocators.

For each spec, :mod:`fsm_cache.contracts.generate` generates a module of the engine's
own step code under icontract contracts derived from the spec; CrossHair
(options pinned in ``[tool.fsm_cache.verify]`` of pyproject.toml) searches
every path for a counterexample. One row per contract: ``confirmed over all
paths``, ``no counterexample within budget`` or ``counterexample: <call>``.
A composition of :data:`EXHAUSTIVE_REGIONS` regions or more has more paths
than CrossHair explores in its budget; its contracts are checked instead on
every representative input (:mod:`fsm_cache.contracts.exhaustive`), a complete
check of the same contracts over a finite domain.
Without arguments it verifies the shipped specs, the allocator contracts and
the negative controls of ``specs/bugs_detected`` (which must keep failing).
Exit status: 0 clean, 1 a counterexample, a contract CrossHair ran out of time on
(unknown, not proved), an unanalysed contract or a control that no longer finds its bug.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from fsm_cache.contracts import exhaustive
from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.contracts.generate import Generated, checked_name, children_needed, generate
from fsm_cache.contracts.runner import Options, Row, Workers
from fsm_cache.errors import BadArgument, SpecError
from fsm_cache.numeric import whole
from fsm_cache.shell import find_pyproject, named_once, spec_path, summary_line
from fsm_cache.spec.controls import Control, controls, load_finding, relative, render_controls
from fsm_cache.spec.loader import load_snapshot, load_spec, read_toml, unreadable
from fsm_cache.spec.machine import Spec, System, as_system
from fsm_cache.spec.shipped import shipped_spec_paths


POOL_CONTRACTS = "fsm_cache.contracts.pages"

EXHAUSTIVE_REGIONS = 3
"""Compositions with this many regions are checked on every representative input."""


_TABLE = ("tool", "fsm_cache", "verify")
"""Where in pyproject.toml the options live."""


def options_for(file: Path, jobs: int | None = None) -> Options:
    """Return the options the spec or contracts module at ``file`` is verified with.

    The one rule of ``fsm-cache verify`` and of the pytest items: the
    ``[tool.fsm_cache.verify]`` of the pyproject.toml nearest the file, in its
    folder or the first above it, whatever the working directory. One spec
    gets the same budgets from the CLI, run at the project's root or in a
    subfolder, and from pytest; a spec of another project gets that project's.

    Args:
        file: The spec's file, or the module's (:func:`target_file`).
        jobs: ``--jobs``, which replaces the table's ``jobs`` when given.

    Raises:
        SpecError: The pyproject is bad (:func:`load_options`).
    """
    options = load_options(file.parent)
    return options if jobs is None else dataclasses.replace(options, jobs=jobs)


def target_file(target: str) -> Path:
    """Return the file of a command-line target: a spec's, or a contracts module's.

    Raises:
        SpecError: The target names a module that is not found (:func:`module_path`).
    """
    return Path(target) if target.endswith(".toml") else module_path(target)


def load_options(start: Path) -> Options:
    """Read ``[tool.fsm_cache.verify]`` from the pyproject.toml nearest ``start``; defaults without one.

    The file is the first found in ``start`` or a folder above it.

    The file is read as specs are (the loader's reader), so whatever it holds
    (an integer of 5000 digits, arrays nested 5000 deep) is a finding naming
    the file, never a ``ValueError`` or ``RecursionError`` traceback.

    Raises:
        SpecError: The file cannot be read or is not TOML, or the table is not a
            table, holds an unknown key, a value of the wrong type or one out of range.
    """
    path = find_pyproject(start)
    if path is None:
        return Options()
    try:
        table: Any = read_toml(path)
    except OSError as exc:
        raise SpecError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    for depth, key in enumerate(_TABLE, 1):
        table = table.get(key, {})
        if not isinstance(table, dict):
            raise SpecError([f"{path}: {'.'.join(_TABLE[:depth])}: expected a table"])
    return _options(table, path)


_LOWEST = {"jobs": 1, "per_condition_timeout": 0.001, "per_path_timeout": 0.001}
"""The least each numeric option may be (CrossHair needs a worker and some time)."""
_HIGHEST = {"jobs": 256, "per_condition_timeout": 3600.0, "per_path_timeout": 3600.0}
"""The most each numeric option may be: a worker per core of a large machine, an hour."""
_ANALYSIS_KINDS = ("PEP316", "asserts", "deal", "hypothesis", "icontract")
"""CrossHair's ``--analysis_kind`` values; the option takes a comma-separated list of them."""


def _options(table: dict[str, Any], path: Path) -> Options:
    default = Options()
    values: dict[str, Any] = {}
    for key, value in table.items():
        expected: type[Any] = type(getattr(default, key, None))
        if not hasattr(default, key):
            raise SpecError([f"{path}: tool.fsm_cache.verify.{key}: unknown option"])
        given: Any = value
        if expected is float and whole(value, None):
            given = float(value)
        if not (whole(given, None) if expected is int else isinstance(given, expected)):
            raise SpecError([f"{path}: tool.fsm_cache.verify.{key}: expected {expected.__name__}"])
        problem = out_of_range(key, given)
        if problem:
            raise SpecError([f"{path}: tool.fsm_cache.verify.{key}: {problem}"])
        if key == "analysis_kind" and not set(given.split(",")) <= set(_ANALYSIS_KINDS):
            kinds = ", ".join(_ANALYSIS_KINDS)
            raise SpecError(
                [
                    f"{path}: tool.fsm_cache.verify.analysis_kind: must be one or more of "
                    f"{kinds}, comma-separated, got {given!r}"
                ]
            )
        values[key] = given
    return Options(**values)


def out_of_range(key: str, value: float) -> str:
    """Return why ``value`` is out of range for the numeric option ``key``; ``""`` if it is not.

    The one rule for pyproject's settings and ``--jobs``, so both refuse the
    same values with the same words.
    """
    lowest, highest = _LOWEST.get(key), _HIGHEST.get(key)
    if lowest is not None and not value >= lowest:  # NaN fails this too
        return f"must be > 0, got {value}"
    if highest is not None and not value <= highest:
        return f"must be at most {highest:g}, got {value}"
    return ""


def verify_spec(
    path: Path,
    options: Options,
    workdir: Path,
    snapshot: tuple[Spec, dict[str, bytes]] | None = None,
    workers: Workers | None = None,
) -> list[Row]:
    """Generate the contracts of the spec at ``path`` and check them.

    The spec's files are read once, here, or were read by the caller
    (``snapshot``, from :func:`~fsm_cache.spec.loader.load_snapshot`): the
    contracts module holds their bytes and builds the spec from them, so the
    code generated and the spec it is proved against are one version, though
    a file is saved over while CrossHair runs.

    Its CrossHair processes and its checks on every representative input
    each take a slot of ``workers`` (a run's, shared with its other targets;
    this spec's own when None).

    Raises:
        SpecError: The spec does not load.
        FsmCacheError: The verify extra is not installed (:func:`~fsm_cache.contracts.runner.require_extra`).
    """
    crosshair_run.require_extra()
    spec, files = load_snapshot(path) if snapshot is None else snapshot
    system = as_system(spec)
    folder = Path(tempfile.mkdtemp(dir=workdir))
    run = Workers() if workers is None else workers

    def every(without_extra: Collection[str]) -> Generated:
        return generate(system, path, files, without_extra=without_extra)

    if proved_by_crosshair(system):
        generated = generate(system, path, files, classes=True)
        module = generated.write(folder)
        proved = crosshair_run.prove(system.name, module, options, by_function=True, workers=run)
        rows = run.in_process(options.jobs, lambda: every_family(system, every, folder, proved))
    else:
        generated = every(())
        events = system.event_names
        rows = run.in_process(options.jobs, lambda: every_input(system, every, folder, events))
    return [generated.reported(row) for row in rows]


def every_input(
    system: System,
    module: Callable[[Collection[str]], Generated],
    workdir: Path,
    events: Sequence[str],
) -> list[Row]:
    """Check the functions of ``events`` on every representative input (:mod:`~fsm_cache.contracts.exhaustive`).

    Each family of children is given one child more than its rules tell
    apart (:func:`~fsm_cache.contracts.generate.children_needed`) where the
    function's inputs stay within :data:`~fsm_cache.contracts.exhaustive.MAX_INPUTS`
    with it. Where they would not, the function is checked without it, and
    each of its rows says so (:func:`without_extra_child`): the extra child
    alone never leaves a function ``not analysed`` (a failure) that is
    checked completely without it, as a user's spec whose rules read two
    regions of the children was (its ``evict_host`` at 1,555,200 inputs).

    Args:
        system: The spec.
        module: Its contracts module, every child over every state, given the
            events whose functions take no extra child (``without_extra`` of
            :func:`~fsm_cache.contracts.generate.generate`).
        workdir: The folder to write the modules under, each in a folder of its own.
        events: The events whose functions are checked.
    """
    rows, over = _every_input(system, module, workdir, events)
    return [without_extra_child(row, over) for row in rows]


def _every_input(
    system: System,
    module: Callable[[Collection[str]], Generated],
    workdir: Path,
    events: Sequence[str],
) -> tuple[list[Row], dict[str, int]]:
    """Return :func:`every_input`'s rows, unnoted, and the functions checked without their extra child.

    Each of those is given with its inputs had it been given the extra child.
    """
    domains = exhaustive.counter_domains(system)
    names = {checked_name(event): event for event in events}
    path = module(()).write(Path(tempfile.mkdtemp(dir=workdir)))
    counts = exhaustive.input_counts(path, domains, names)
    over = {
        name: n
        for name, n in counts.items()
        if n > exhaustive.MAX_INPUTS and children_needed(system, names[name])
    }
    if over:
        path = module([names[name] for name in over]).write(Path(tempfile.mkdtemp(dir=workdir)))
    return exhaustive.check_module(system.name, path, domains, functions=names), over


def without_extra_child(row: Row, over: Mapping[str, int]) -> Row:
    """Return ``row``, saying so where its function's families were checked without their extra child.

    Args:
        row: A row of a function.
        over: The functions checked without it, each with the inputs it would
            have been called with, the extra child given.
    """
    inputs = over.get(row.function)
    if inputs is None:
        return row
    most = exhaustive.MAX_INPUTS
    note = f"families without their extra child ({inputs} inputs with it, more than {most})"
    return dataclasses.replace(row, detail=f"{row.detail}; {note}" if row.detail else note)


def every_family(
    system: System,
    module: Callable[[Collection[str]], Generated],
    workdir: Path,
    rows: Sequence[Row],
) -> list[Row]:
    """Return CrossHair's ``rows`` with every family of children checked on every representative input.

    CrossHair proves a family of two children or more over one state per
    class the event's conditions tell apart (``classes`` of
    :func:`~fsm_cache.contracts.generate.generate`): every state for each
    child runs past its budget. So each function that reads children is
    also called, in ``module`` (every state for every child, and one
    child more over the classes), on every family and every representative
    input (:mod:`fsm_cache.contracts.exhaustive`), and a contract keeps the
    worse of its two verdicts: a slip that reads a later child otherwise
    than the first (``writing`` alone of ``[writing, backed, pinned]``), or
    reads only as many children as the rules tell apart, is a
    counterexample, though CrossHair's families (``unbacked``, ``writing``;
    two children) never meet it.

    A function checked without its extra child (:func:`every_input`) says
    so on each of its rows, CrossHair's verdict kept or not.

    Args:
        system: The spec.
        module: Its contracts module, every child over every state and the
            extra one over the classes, given the events whose functions
            take no extra child (:func:`every_input`).
        workdir: The folder to write the modules under, each in a folder of its own.
        rows: CrossHair's, one per contract of the module with classes.
    """
    reading = [e for e in system.event_names if children_needed(system, e)]
    if not reading:
        return list(rows)
    found, over = _every_input(system, module, workdir, reading)
    failed = {(r.function, r.contract): r for r in found if r.failed}
    return [
        without_extra_child(crosshair_run.worse(r, failed.get((r.function, r.contract), r)), over)
        for r in rows
    ]


def by_crosshair(target: str) -> bool:
    """Whether CrossHair proves ``target``: a module, or a spec of few regions.

    A spec of :data:`EXHAUSTIVE_REGIONS` regions or more is checked on every
    representative input instead, with none of CrossHair's options.

    Raises:
        SpecError: ``target`` is a spec that does not load.
    """
    return not target.endswith(".toml") or proved_by_crosshair(as_system(load_spec(target)))


def proved_by_crosshair(system: System) -> bool:
    """Whether CrossHair proves ``system``'s contracts: fewer than :data:`EXHAUSTIVE_REGIONS` regions.

    Decided by the spec loaded, not by its file's name: a spec named
    ``x.TOML`` in ``fsm_specs`` is checked as ``x.toml`` is.
    """
    return len(system.regions) < EXHAUSTIVE_REGIONS


def verify_module(name: str, options: Options, workers: Workers | None = None) -> list[Row]:
    """Check a contracts module given as a ``.py`` path or a dotted module name.

    Its one CrossHair process takes a slot of ``workers`` (:func:`verify_spec`).

    Raises:
        SpecError: No such file or module, or importing its package raised or exited.
    """
    path = module_path(name)
    return crosshair_run.prove(path.stem, path, options, workers=workers)


def module_path(name: str) -> Path:
    """Return the file of a contracts module given as a ``.py`` path or a dotted module name.

    Raises:
        SpecError: No such file or module, or importing its package raised or exited.
    """
    path = Path(name)
    if path.suffix != ".py":
        spec = _find_module(name) if _dotted(name) else None
        if spec is None or spec.origin is None:
            raise SpecError([f"{name}: not a spec file, a .py file or an importable module"])
        if not spec.has_location:  # os.path: frozen into the interpreter, no file to read
            raise SpecError([f"{name}: a {spec.origin} module, with no source file to verify"])
        path = Path(spec.origin)
    if not path.exists():
        raise SpecError([f"{name}: no such file"])
    why = unreadable(path)  # a directory, or a named pipe an import would wait on for ever
    if why is not None:
        raise SpecError([f"{name}: {why}"])
    return path


_FINDING = threading.Lock()
"""Held while :func:`_find_module` sends ``sys.stdout`` to stderr."""


def _find_module(name: str) -> ModuleSpec | None:
    """Return where the module ``name`` is, or None if it is not there.

    Finding ``a.b.c`` imports the packages ``a`` and ``a.b``: the user's code,
    which may print, raise or call ``sys.exit``. Whatever it prints goes to
    stderr, so ``--json`` output stays JSON; whatever it raises, SystemExit
    included, is a finding naming the module, not a traceback or a silent exit.
    One thread finds at a time: a run's targets are verified side by side, and
    two redirections that overlapped would leave ``sys.stdout`` on stderr.

    Raises:
        SpecError: Importing a package of ``name`` raised or exited.
    """
    try:
        with _FINDING, contextlib.redirect_stdout(sys.stderr):
            return importlib.util.find_spec(name)
    except ModuleNotFoundError as exc:
        parts = name.split(".")
        if exc.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            return None  # a package of the name itself is missing: not importable
        raise SpecError([f"{name}: cannot import: {type(exc).__name__}: {exc}"]) from None
    except (Exception, SystemExit) as exc:  # the user's package: its own raise or exit
        raise SpecError([f"{name}: cannot import: {type(exc).__name__}: {exc}"]) from None


def check_targets(targets: Sequence[str]) -> None:
    """Refuse a run before anything is verified when a target does not load or is not found.

    Verifying one target takes seconds to minutes of CrossHair, so a bad
    target found only when its turn came would throw away the work done on
    those before it; and like ``validate``, one run names every bad target.

    Raises:
        SpecError: Every fault of every target: a spec that does not load, a
            module that is not found or whose package cannot be imported, the
            bad pyproject settings it would be verified with (:func:`options_for`).
    """
    problems: list[str] = []
    for target in targets:
        try:
            if target.endswith(".toml"):
                load_spec(target)  # named as given: a Path says x.toml for ./x.toml
            options_for(target_file(target))
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError(list(dict.fromkeys(problems)))


def modules_once(targets: Sequence[str]) -> list[str]:
    """Return ``targets`` with each contracts module once, by name or by file, kept first.

    ``fsm_cache.contracts.pages`` and ``fsm_cache/contracts/pages.py`` are one
    module, proved alike: the second spelling would prove it again. Call after
    :func:`check_targets`, which has found every module.
    """
    seen: dict[str, str] = {}
    for target in targets:
        seen.setdefault(os.path.realpath(target_file(target)), target)
    return list(seen.values())


def verify_target(
    target: str, options: Options, workdir: Path, workers: Workers | None = None
) -> list[Row]:
    """Verify one command-line target: a spec file, a module file or a module name."""
    if target.endswith(".toml"):
        return verify_spec(Path(target), options, workdir, workers=workers)
    return verify_module(target, options, workers)


def verify_control(
    control: Control, options: Options, workdir: Path, workers: Workers | None = None
) -> str:
    """Return the first finding ``validate`` or ``verify`` reports on a control (``""`` if none).

    The first counterexample, if there is one, comes before any other failing
    row: a control asks whether its bug is still found, and a contract
    elsewhere that CrossHair ran out of time on (a loaded machine) does not
    answer that.
    """
    if control.path.suffix == ".toml":
        loaded, problem = load_finding(control.path)
        if loaded is None:
            return f"validate: {problem}"
        rows = verify_spec(control.path, options, workdir, loaded, workers)
    else:
        rows = verify_module(str(control.path), options, workers)
    found = [r for r in rows if r.status == crosshair_run.COUNTEREXAMPLE]
    bad = next(iter(found or [r for r in rows if r.failed]), None)
    if bad is None:
        return ""
    return relative(
        f"verify: {bad.target}.{bad.function}: {bad.contract}: {bad.verdict()}", control.path.parent
    )


def run(targets: Sequence[str], jobs: int | None, with_controls: bool) -> dict[str, Any]:
    """Verify targets (the shipped set when empty) and, if asked, the negative controls.

    Each is verified with the options of :func:`options_for`, ``jobs`` (``--jobs``)
    replacing their ``jobs`` when given. The targets and controls are verified
    side by side, sharing one :class:`~fsm_cache.contracts.runner.Workers`:
    a target checked in one process runs beside another's, and no more
    CrossHair processes or in-process checks run at once than ``jobs``. Their
    rows and findings are in the order given, whichever ends first.

    Raises:
        SpecError: A target does not load or is not found, or the pyproject its
            options come from is bad (:func:`check_targets`); nothing was verified.
        FsmCacheError: The verify extra is not installed; nothing was verified.
    """
    crosshair_run.require_extra()
    check_targets(targets)
    started = time.perf_counter()
    chosen = modules_once(targets) or [str(p) for p in shipped_spec_paths()] + [POOL_CONTRACTS]
    planned = [(target, options_for(target_file(target), jobs)) for target in chosen]
    checks = controls(tools=("validate", "verify")) if with_controls else []
    known = [(control, options_for(control.path, jobs)) for control in checks]
    with tempfile.TemporaryDirectory(prefix="fsm-verify-") as tmp, Workers() as workers:
        work = Path(tmp)
        verified = [
            workers.submit(functools.partial(verify_target, target, options, work))
            for target, options in planned
        ]
        findings = [
            workers.submit(functools.partial(verify_control, control, options, work))
            for control, options in known
        ]
        workers.wait()
    rows = [r for future in verified for r in future.result()]
    checked = [
        {
            "control": control.name,
            "expected": control.expected,
            "found": found,
            "ok": control.matches(found),
        }
        for (control, _), found in zip(known, (f.result() for f in findings), strict=True)
    ]
    return {"rows": rows, "controls": checked, "seconds": time.perf_counter() - started}


def report(result: dict[str, Any]) -> str:
    """Return the human table of a :func:`run` result."""
    rows: list[Row] = result["rows"]
    width = max((len(f"{r.target}.{r.function}") for r in rows), default=10)
    cwidth = max((len(r.contract) for r in rows), default=10)
    lines = [
        f"{r.target + '.' + r.function:<{width}}  {r.contract:<{cwidth}}  {r.verdict()}"
        for r in rows
    ]
    counts = {
        s: sum(r.status == s for r in rows)
        for s in (
            crosshair_run.CONFIRMED,
            exhaustive.CONFIRMED_EVERY_INPUT,
            crosshair_run.WITHIN_BUDGET,
            crosshair_run.COUNTEREXAMPLE,
            crosshair_run.NOT_ANALYSED,
        )
    }
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    lines.append(f"{len(rows)} contracts: {summary} ({result['seconds']:.1f} s)")
    lines += budget_note(rows)
    lines += render_controls(result["controls"])
    return "\n".join(lines)


def budget_note(rows: Sequence[Row]) -> list[str]:
    """Return the line saying what to do about contracts CrossHair ran out of time on, if any.

    Such a contract is unknown, neither proved nor refuted, and fails the run;
    a longer budget lets CrossHair exhaust its paths or find its counterexample.
    """
    unknown = sum(r.status == crosshair_run.WITHIN_BUDGET for r in rows)
    if not unknown:
        return []
    return [
        f"{unknown} contract(s) unknown: CrossHair ran out of time before exhausting their "
        "paths; raise per_condition_timeout in [tool.fsm_cache.verify] of pyproject.toml, "
        "or in the module's '# crosshair:' directive, to prove or refute them"
    ]


def failed(result: dict[str, Any]) -> bool:
    """Whether the run must exit 1."""
    return any(r.failed for r in result["rows"]) or not all(c["ok"] for c in result["controls"])


def handle(args: argparse.Namespace) -> int:
    """Run ``fsm-cache verify`` and return its exit status.

    Raises:
        BadArgument: ``--jobs`` is out of the range pyproject's ``jobs`` may
            take (1 to 256) or is given to targets none of which CrossHair
            proves (:func:`by_crosshair`), or ``--no-controls`` is given with
            targets (the controls run only without); nothing is run.
        SpecError: pyproject's settings are bad, or a target does not load.
    """
    if args.no_controls and args.targets:
        msg = (
            "verify: --no-controls skips the negative controls, which run only without "
            "SPEC_OR_MODULE arguments; this run has none to skip"
        )
        raise BadArgument(msg)
    problem = "" if args.jobs is None else out_of_range("jobs", args.jobs)
    if problem:
        raise BadArgument(f"--jobs: {problem}")
    targets = named_once(args.targets)
    if args.jobs is not None and targets:
        check_targets(targets)  # every bad target named first, as run() would
        if not any(by_crosshair(target) for target in targets):
            msg = (
                f"verify: --jobs {args.jobs} sets CrossHair's processes, and no target is "
                f"proved by CrossHair: a composition of {EXHAUSTIVE_REGIONS} or more regions "
                f"is checked on every representative input ({', '.join(targets)})"
            )
            raise BadArgument(msg)
    result = run(targets, args.jobs, with_controls=not targets and not args.no_controls)
    if args.json:
        print(json.dumps({**result, "rows": [r.as_dict() for r in result["rows"]]}, indent=2))
    else:
        print(report(result))
    return 1 if failed(result) else 0


def register(subparsers: Any) -> None:
    """Add the ``verify`` subcommand."""
    parser = subparsers.add_parser(
        "verify",
        help="prove the contracts of specs with CrossHair",
        description=summary_line(__doc__),
    )
    parser.add_argument(
        "targets",
        nargs="*",
        type=spec_path,
        metavar="SPEC_OR_MODULE",
        help="spec .toml files (fsm_cache:NAME for a shipped spec), contract modules (.py or dotted names); default: the shipped specs, pool contracts and negative controls",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="CrossHair processes in parallel, 1 to 256 (default: pyproject's jobs, else 2)",
    )
    parser.add_argument(
        "--no-controls",
        action="store_true",
        help="skip the negative controls (they run only without SPEC_OR_MODULE)",
    )
    parser.set_defaults(handler=handle)


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))
