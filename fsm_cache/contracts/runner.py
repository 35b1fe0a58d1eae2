"""Run CrossHair on contract modules with pinned options and read its report as rows.

CrossHair prints one line per postcondition with ``--report_all``
(``file:LINE: info: Confirmed over all paths.``, ``... Not confirmed.``,
``... error: <what> when calling <call> (which returns ...)``). Each line
is mapped back to the contract declared at that line, found by parsing the
module with :mod:`ast`, so every contract gets exactly one row, and a
contract CrossHair did not report, or could not analyse (``Unable to meet
precondition``, ``no checkable functions``), is a failure rather than a pass.

A module may set its own search budget with CrossHair's directive syntax in
a top-level comment (``# crosshair: per_condition_timeout=20``); it takes
precedence over the project's pinned options, as it would in CrossHair if
no options were given on its command line.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import heapq
import importlib.util
import itertools
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from fsm_cache.errors import FsmCacheError, SpecError
from fsm_cache.shell import terminating


CONFIRMED = "confirmed over all paths"
WITHIN_BUDGET = "no counterexample within budget"
COUNTEREXAMPLE = "counterexample"
NOT_ANALYSED = "not analysed"

_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<kind>info|error|warning): (?P<msg>.*)$")
_CALL = re.compile(r"when calling (?P<call>.*?)(?: \(which (?:returns|raises) .*\))?$")


@dataclass(frozen=True)
class Options:
    """Pinned CrossHair options (``[tool.fsm_cache.verify]`` in pyproject.toml)."""

    analysis_kind: str = "icontract"
    per_condition_timeout: float = 10.0
    per_path_timeout: float = 5.0
    jobs: int = 2

    def argv(self) -> list[str]:
        """Return the ``crosshair check`` options."""
        return [
            "--report_all",
            f"--analysis_kind={self.analysis_kind}",
            f"--per_condition_timeout={self.per_condition_timeout}",
            f"--per_path_timeout={self.per_path_timeout}",
        ]


@dataclass(frozen=True)
class Contract:
    """One postcondition declared in a module.

    Attributes:
        file: The module's path, resolved.
        line: The first line of its ``ensure`` decorator.
        end: The decorator's last line. CrossHair reports on the line of the
            condition's lambda, which is ``line`` or, in a decorator written
            over several lines, one below it.
        function: The function it is declared on.
        text: Its description.
        span: The first and last lines of that function, decorators included:
            CrossHair reports a precondition it cannot meet on the precondition's
            line, and a raise in the body on the body's line, both in there.
    """

    file: str
    line: int
    end: int
    function: str
    text: str
    span: tuple[int, int]


@dataclass(frozen=True)
class Row:
    """The verdict on one contract.

    Attributes:
        target: What was verified (a spec name or a module).
        function: The checked function.
        contract: The postcondition's description.
        status: One of the module's status constants.
        detail: The call of a counterexample, or why it was not analysed.
    """

    target: str
    function: str
    contract: str
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        """Whether the row fails a verify run: anything short of a complete check.

        A contract left at ``no counterexample within budget`` holds on the
        paths CrossHair tried before its time ran out and is unknown on the
        rest: passing the run on it would report a proof where there is none.
        """
        return self.status in (WITHIN_BUDGET, COUNTEREXAMPLE, NOT_ANALYSED)

    def verdict(self) -> str:
        """Return ``confirmed over all paths`` or ``counterexample: <call>`` etc."""
        return f"{self.status}: {self.detail}" if self.detail else self.status

    def as_dict(self) -> dict[str, str]:
        """Return the row for ``--json``."""
        return asdict(self)


def read_module(path: Path) -> str:
    """Return the text of the module at ``path``.

    Raises:
        SpecError: It cannot be read, or is not UTF-8.
    """
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"{path}: cannot read the module: {exc}"]) from None


def parse_module(path: Path) -> ast.Module:
    """Return the syntax tree of the module at ``path``.

    Raises:
        SpecError: It cannot be read, or is not valid Python.
    """
    try:
        return ast.parse(read_module(path), filename=str(path))
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise SpecError([f"{where}: not valid Python: {exc.msg}"]) from None
    except ValueError as exc:  # a null byte, on Python 3.10 (3.11 raises SyntaxError)
        raise SpecError([f"{path}: not valid Python: {exc}"]) from None
    except (RecursionError, MemoryError):  # the parser's own stack, or building the tree
        raise SpecError([f"{path}: too deeply nested to parse"]) from None


def contracts(path: Path) -> list[Contract]:
    """Return the postconditions declared in the module at ``path``, in line order."""
    tree = parse_module(path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        span = (min(d.lineno for d in (node, *node.decorator_list)), node.end_lineno or node.lineno)
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and _name(deco.func).endswith("ensure"):
                text = _description(deco)
                end = deco.end_lineno or deco.lineno
                found.append(Contract(str(path.resolve()), deco.lineno, end, node.name, text, span))
    return sorted(found, key=lambda c: c.line)


def functions(path: Path) -> list[tuple[str, int]]:
    """Return ``(name, line)`` of every function in the module that declares a postcondition."""
    seen: dict[str, int] = {}
    for c in contracts(path):
        seen.setdefault(c.function, c.line)
    return list(seen.items())


def prove(
    target: str,
    path: Path,
    options: Options,
    *,
    by_function: bool = False,
    workers: Workers | None = None,
) -> list[Row]:
    """Run CrossHair on ``path``; one row per postcondition it declares or reports on.

    The module is checked as a whole, as CrossHair finds its checkable
    functions itself, and its rows are the contracts of the files CrossHair
    reports on: a contract this module's parser does not recognise (an
    aliased ``ensure``, a class invariant, a function a harness builds) is
    still checked, and reported on a row of its own (:func:`read_report`).
    Where a postcondition was checked only if it was named as a target,
    a module of recognised contracts and some other checked function was
    exit 0 with that function never run.

    Args:
        target: What the rows are of.
        path: The module.
        options: CrossHair's options.
        by_function: Whether every checkable function of the module is a
            top-level function whose postconditions :func:`contracts` finds
            (a module the generator wrote): each is then a target of its own,
            shared among ``options.jobs`` processes.
        workers: The run's processes, which this proof's share slots with
            (:class:`Workers`); its own when None.

    Raises:
        FsmCacheError: CrossHair could not run or import the module, or a
            ``# crosshair:`` directive in it is malformed.
    """
    options = with_directives(options, path)
    found = functions(path)  # read first: a module that is no Python is refused as such
    lines = [_def_line(path, name) for name, _ in found] if by_function else []
    targets = [f"{path.resolve()}:{n}" for n in lines] if lines and all(lines) else []
    chunks = _chunks(targets, options.jobs) if targets else [[str(path.resolve())]]
    run = Workers() if workers is None else workers
    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        try:
            reports = list(
                pool.map(
                    lambda chunk: _run(chunk, options, path.parent, run, whole=not targets),
                    chunks,
                )
            )
        except BaseException:  # Ctrl-C: leaving the pool waits for its workers' CrossHair
            run.stop()
            raise
    files = {str(path.resolve())} | {f for r in reports for f in _files(r)}
    known = {(c.file, c.line): c for f in sorted(files) for c in contracts(Path(f))}
    verdicts: dict[tuple[str, int], tuple[str, str]] = {}
    extra: list[Row] = []
    for report in reports:
        own, stray = read_report(target, report, known)
        verdicts.update(own)
        extra += stray
    if not known and not extra:
        return [Row(target, "-", "-", NOT_ANALYSED, "no checkable functions")]
    silent = not any(r.strip() for r in reports)  # --report_all prints a line per contract
    rows = [
        Row(target, c.function, c.text, *verdicts.get(key, _unreported(silent=silent)))
        for key, c in sorted(known.items())
    ]
    merged: dict[tuple[str, str], Row] = {}
    for row in extra:
        key = (row.function, row.contract)
        merged[key] = worse(merged[key], row) if key in merged else row
    return rows + list(merged.values())


_CONDITION = re.compile(r'^"(?P<cond>.*)" yields false when calling ')


def read_report(
    target: str, report: str, known: dict[tuple[str, int], Contract]
) -> tuple[dict[tuple[str, int], tuple[str, str]], list[Row]]:
    """Return a status and detail for each contract a CrossHair report speaks of, and its strays.

    Each line of the report is read once.

    Args:
        target: The target the rows of strays name.
        report: CrossHair's output (``FILE:LINE: KIND: MESSAGE`` lines; others are skipped).
        known: The contracts by ``(file, line)``. A report on a line of a
            contract's decorator is on that contract; one on another line of a
            function (a precondition it cannot meet, a raise in the body) is on
            every contract of that function: CrossHair checks each contract
            alone, then prints one line for the lot.

    Returns:
        The verdicts on known contracts, and a row for each verdict on a line
        that no contract of ``known`` holds (a stray). CrossHair checks what it
        finds checkable, and :func:`contracts` knows postconditions by their
        decorator's name: one declared through an alias (``from icontract
        import ensure as post``), a class invariant (reported on the line of
        the method that broke it) or a condition given as a named function is
        on a line of no known contract, and its counterexample was dropped,
        the run passing. Each stray row names the function or class whose
        lines hold the line (``-`` if none), and as its contract the
        decorator's description, the condition CrossHair quotes, or the line.

    A contract reported twice keeps its worse verdict (a counterexample over
    ``not analysed`` over ``no counterexample within budget`` over confirmed),
    as CrossHair keeps the worse of two messages on one line.
    """
    out: dict[tuple[str, int], tuple[str, str]] = {}
    rows: list[Row] = []
    sources: dict[str, tuple[ast.Module, list[str]] | None] = {}
    for raw in report.splitlines():
        match = _LINE.match(raw.strip())
        if match is None:
            continue
        file, line, msg = match["file"], int(match["line"]), match["msg"]
        own = [k for k, c in known.items() if c.file == file and c.line <= line <= c.end]
        inner = own or _function_at(known, file, line)
        verdict = _verdict(match["kind"], msg, raised=not own)
        if verdict is None or (inner and not own and verdict[0] in (CONFIRMED, WITHIN_BUDGET)):
            continue
        for key in inner:
            if _RANK[verdict[0]] > _RANK[out.get(key, ("", ""))[0]]:
                out[key] = verdict
        if not inner:
            if file not in sources:
                sources[file] = _source(Path(file))
            function, contract = _located(sources[file], line)
            condition = _CONDITION.match(msg)
            rows.append(
                Row(
                    target,
                    function,
                    _quoted(condition["cond"]) if condition else contract,
                    *verdict,
                )
            )
    return out, rows


def _verdict(kind: str, msg: str, *, raised: bool) -> tuple[str, str] | None:
    """Return the status and detail of one CrossHair message, or None if it gives no verdict."""
    if "Unable to meet precondition" in msg:
        return NOT_ANALYSED, "unable to meet precondition"
    if kind == "error":
        return COUNTEREXAMPLE, _counterexample(msg, raised=raised)
    if msg.startswith("Confirmed over all paths"):
        return CONFIRMED, ""
    if msg.startswith("Not confirmed"):
        return WITHIN_BUDGET, ""
    return None


def _quoted(condition: str) -> str:
    """Return the description of a decorator CrossHair quotes (``@icontract.invariant(...)``), else it."""
    try:
        tree = ast.parse(condition.removeprefix("@"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return condition
    return _description(tree.body) if isinstance(tree.body, ast.Call) else condition


def _source(path: Path) -> tuple[ast.Module, list[str]] | None:
    """Return the syntax tree and lines of the module at ``path``, or None if it cannot be read."""
    try:
        return parse_module(path), read_module(path).splitlines()
    except SpecError:
        return None


def _located(source: tuple[ast.Module, list[str]] | None, line: int) -> tuple[str, str]:
    """Return the innermost function or class holding ``line`` of ``source``, and what the line declares.

    What it declares is the description of a decorator on that line, else the line itself.
    """
    if source is None or not 0 < line <= len(source[1]):
        return "-", f"line {line}"
    tree, text = source[0], source[1][line - 1].strip()
    name, contract = "-", text
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            first = min(d.lineno for d in (child, *child.decorator_list))
            if first <= line <= (child.end_lineno or child.lineno):
                name = f"{prefix}{child.name}"
                stack.append((child, f"{name}."))
                for deco in child.decorator_list:
                    if isinstance(deco, ast.Call) and deco.lineno <= line <= (deco.end_lineno or 0):
                        contract = _description(deco)
    return name, contract


EXTRA_MODULES = ("crosshair", "icontract")
"""What the ``verify`` extra installs that verification imports: CrossHair proves the
contracts, and every generated contract module imports icontract."""


def require_extra() -> None:
    """Refuse to verify without the ``verify`` extra, naming it, before anything runs.

    Without it, verification ended in a bare ``ModuleNotFoundError`` traceback
    from deep inside (the CLI) or a one-line "No module named" (the pytest items).

    Raises:
        FsmCacheError: A module of :data:`EXTRA_MODULES` is not installed.
    """
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        them = "them" if len(missing) > 1 else "it"
        raise FsmCacheError(
            f"verification needs {' and '.join(missing)}, not installed here; the verify "
            f"extra brings {them}: pip install 'fsm-cache[verify]'"
        )


def with_directives(options: Options, path: Path) -> Options:
    """Return ``options`` with the timeouts set by top-level ``# crosshair:`` comments in ``path``.

    Raises:
        FsmCacheError: A directive is malformed or names an unknown option.
    """
    from crosshair.codeconfig import InvalidDirective, get_directives, parse_directives

    top = [d for d in get_directives(read_module(path)) if d[1] == 0]
    try:
        found = parse_directives(top)
    except InvalidDirective as exc:
        what, line = exc.args
        raise FsmCacheError(f"{path}:{line}: crosshair directive: {what}") from exc
    timeouts = ("per_condition_timeout", "per_path_timeout")
    return replace(options, **{k: getattr(found, k) for k in timeouts if getattr(found, k)})


def _files(report: str) -> set[str]:
    return {m["file"] for raw in report.splitlines() if (m := _LINE.match(raw.strip()))}


def _unreported(*, silent: bool = False) -> tuple[str, str]:
    """The verdict on a contract CrossHair printed no line on; ``silent``: it printed nothing."""
    if silent:
        return NOT_ANALYSED, (
            "CrossHair did not report this contract: it printed nothing at all, as when the"
            " module exits with status 0 (sys.exit()) while it is imported"
        )
    return NOT_ANALYSED, "CrossHair did not report this contract"


class _Stopped(FsmCacheError):
    """Work refused or cut short because the run it belongs to was stopped.

    Never the cause a run fails with: another target's error, or an interrupt,
    stopped it, and :meth:`Workers.wait` raises that.
    """


_STOPPED = "verification was interrupted"


_Work = TypeVar("_Work")


@dataclass(frozen=True)
class _Job:
    """A check to run in fsm_cache's own process, on the thread that serves the run."""

    run: Callable[[], None]
    future: Future[Any]


class _Slots:
    """What the :class:`Workers` of one run share: its slots, its processes, its queue of checks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: list[subprocess.Popen[str]] = []
        self._held: list[int] = []
        self._asking: list[tuple[bool, int, int]] = []
        self._tickets = itertools.count()
        self._stopped = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.server: threading.Thread | None = None
        """The thread that runs the in-process checks; the asker's own when None."""

    @property
    def stopped(self) -> bool:
        """Whether the run was stopped."""
        return self._stopped

    @contextlib.contextmanager
    def held(self, jobs: int, rank: int, *, whole: bool = False) -> Iterator[None]:
        """Hold a slot while the block runs.

        The first asker is served first: one for a ``whole`` module, then the
        lowest ``rank``, then the earliest.

        Raises:
            FsmCacheError: The run was stopped.
        """
        ticket = (not whole, rank, next(self._tickets))
        with self._cond:
            heapq.heappush(self._asking, ticket)
            try:
                while not self._stopped and not (self._asking[0] == ticket and self._free(jobs)):
                    self._cond.wait()
            finally:
                self._asking.remove(ticket)
                heapq.heapify(self._asking)
                self._cond.notify_all()
            if self._stopped:
                raise _Stopped(_STOPPED)
            self._held.append(jobs)
        try:
            yield
        finally:
            with self._cond:
                self._held.remove(jobs)
                self._cond.notify_all()

    def start(self, argv: Sequence[str], cwd: Path) -> subprocess.Popen[str]:
        """Start ``argv`` in ``cwd``, its output piped, unless the run is stopped.

        Raises:
            FsmCacheError: The run was stopped, or the process cannot start.
        """
        with self._cond:
            if self._stopped:
                raise _Stopped(_STOPPED)
            try:
                child = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
                )
            except OSError as exc:
                raise FsmCacheError(f"cannot run CrossHair: {exc}") from exc
            self._running.append(child)
            return child

    def ended(self, child: subprocess.Popen[str]) -> None:
        """Forget ``child``, killed first if it still runs."""
        if child.poll() is None:
            child.kill()
            child.wait()
        with self._cond:
            self._running.remove(child)

    def ask(self, job: _Job) -> None:
        """Queue ``job`` for the serving thread.

        Raises:
            FsmCacheError: The run was stopped.
        """
        with self._cond:
            if self._stopped:
                raise _Stopped(_STOPPED)
            self._jobs.put(job)

    def wake(self) -> None:
        """Wake the serving thread (a target ended)."""
        self._jobs.put(None)

    def next_job(self) -> _Job | None:
        """Return the next check queued, or None for a wake-up; waits for one."""
        return self._jobs.get()

    def stop(self) -> None:
        """Kill every process started, refuse every check queued, and start nothing more."""
        with self._cond:
            self._stopped = True
            for child in self._running:
                child.kill()
            self._cond.notify_all()
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(_Stopped(_STOPPED))
            self._jobs.put(None)  # the wake-ups taken wake the serving thread all the same

    def _free(self, jobs: int) -> bool:
        """Whether one more slot leaves every holder, and an asker of ``jobs``, within its jobs."""
        return len(self._held) < min([jobs, *self._held])


class Workers:
    """The CrossHair processes and in-process checks of a verify run: at most ``jobs`` at once.

    A run verifies its targets side by side (:meth:`submit`), each with a
    :class:`Workers` of its own sharing the run's slots, so a target checked
    in one process (a user's module, proved whole) runs beside another's
    chunks rather than alone, one core idle. Each CrossHair process
    (:meth:`process`) and each check run in this process (:meth:`in_process`,
    every representative input) holds a slot while it runs. A slot is given
    only while fewer than the ``jobs`` of the asker and of every holder are
    held: CrossHair's budgets are wall-clock, so no target's contracts run
    beside more processes than its ``jobs`` allow. Free slots go first to
    a process that proves a whole module (it cannot be split: started last,
    it would run alone), then to the targets in the order submitted (the
    order a run reports them in, and took in turn before).

    Checks in this process run on the thread that entered the run (``with
    Workers() as workers``), one at a time (they hold the interpreter's lock),
    so an interrupt (delivered to that thread) stops one at once; without a
    run (a proof of one target), on the caller's thread.

    A SIGINT sent to fsm_cache alone (an IDE's stop button, ``kill -INT``,
    ``timeout -s INT``), not to its process group as a terminal's Ctrl-C is,
    reached the main thread only: leaving the thread pool then waited for each
    worker's CrossHair to finish its contracts, minutes, before the run said
    ``interrupted``. Once stopped (:meth:`stop`: an interrupt, or an error in
    any target), every process of every target is killed and nothing starts.
    A SIGTERM (a supervisor, ``kill``, ``timeout``) ended fsm_cache alone, at
    once, its CrossHair processes left running; while a run is entered it
    stops the run as SIGINT does (:func:`~fsm_cache.shell.terminating`).
    """

    def __init__(self, slots: _Slots | None = None, rank: int = 0) -> None:
        """Start a run of its own, or, given ``slots``, join one as its ``rank``-th target."""
        self._slots = _Slots() if slots is None else slots
        self._rank = rank
        self._threads: list[threading.Thread] = []
        self._futures: list[Future[Any]] = []
        self._signals = contextlib.ExitStack()

    def __enter__(self) -> Workers:
        """Serve the run's in-process checks on this thread (:meth:`wait`); a SIGTERM interrupts it."""
        self._signals.enter_context(terminating())
        self._slots.server = threading.current_thread()
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        """Stop everything if the run failed or was interrupted; wait for every target's thread."""
        with self._signals:  # a SIGTERM while the run stops is ignored, not the end of it
            try:
                if exc is not None:
                    self.stop()
                for thread in self._threads:
                    thread.join()
            except KeyboardInterrupt:  # a SIGTERM or Ctrl-C while the targets ended
                self.stop()
                # not join() again: the one interrupted marked its thread ended (CPython's
                # bpo-45274 fix), and would return at once; each target's future says
                concurrent.futures.wait(self._futures)
                raise

    @property
    def stopped(self) -> bool:
        """Whether the run was stopped."""
        return self._slots.stopped

    def submit(self, work: Callable[[Workers], _Work]) -> Future[_Work]:
        """Start ``work`` (one target) on a thread of its own, given its share of the run.

        Its result, or its error, comes with :meth:`wait`.
        """
        future: Future[_Work] = Future()
        share = Workers(self._slots, rank=len(self._futures))

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(work(share))
            except BaseException as exc:  # the target's error, raised by wait()
                future.set_exception(exc)
            finally:
                self._slots.wake()

        thread = threading.Thread(target=run, name="fsm-verify-target")
        self._threads.append(thread)
        self._futures.append(future)
        thread.start()
        return future

    def wait(self) -> None:
        """Run the in-process checks the targets ask for until every target is done.

        Raises:
            BaseException: The first target to fail stops the run; once every
                target has ended, the error of the first in submission order
                that the stop did not cause is raised.
        """
        futures = list(self._futures)
        while not any(f.done() and f.exception() is not None for f in futures):
            if all(f.done() for f in futures):
                return
            job = self._slots.next_job()
            if job is not None:
                job.run()
        self.stop()
        concurrent.futures.wait(futures)
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])

    def in_process(self, jobs: int, check: Callable[[], _Work]) -> _Work:
        """Return what ``check`` returns, run in this process while it holds a slot.

        Raises:
            FsmCacheError: The run was stopped before it ran.
        """
        server = self._slots.server
        if server is None or server is threading.current_thread():
            with self._slots.held(jobs, self._rank):
                return check()
        future: Future[_Work] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                with self._slots.held(jobs, self._rank):
                    result = check()
            except Exception as exc:  # the check's error, raised in its target's thread
                future.set_exception(exc)
            except BaseException:  # an interrupt: the run stops, and with it this target
                future.set_exception(_Stopped(_STOPPED))
                raise
            else:
                future.set_result(result)

        self._slots.ask(_Job(run, future))
        return future.result()

    @contextlib.contextmanager
    def process(
        self, argv: Sequence[str], cwd: Path, jobs: int, *, whole: bool = False
    ) -> Iterator[subprocess.Popen[str]]:
        """Start ``argv`` in ``cwd``, its output piped, once a slot is free; killed if left running.

        Args:
            argv: The command.
            cwd: Where it runs.
            jobs: The most processes its target runs beside (its ``jobs``).
            whole: Whether it proves a whole module (served first).

        Raises:
            FsmCacheError: The run was stopped, or the process cannot start.
        """
        with self._slots.held(jobs, self._rank, whole=whole):
            child = self._slots.start(argv, cwd)
            try:
                yield child
            finally:
                self._slots.ended(child)

    def stop(self) -> None:
        """Kill every process of the run, refuse every check asked for, and start nothing more."""
        self._slots.stop()


def _run(
    targets: Sequence[str], options: Options, cwd: Path, workers: Workers, *, whole: bool
) -> str:
    argv = [sys.executable, "-m", "crosshair", "check", *options.argv(), *targets]
    with workers.process(argv, cwd, options.jobs, whole=whole) as child:
        stdout, stderr = child.communicate()
    if child.returncode not in (0, 1):
        if workers.stopped:  # killed by the stop, not failed
            raise _Stopped(_STOPPED)
        tail = (stderr or stdout).strip().splitlines()[-1:] or [_silent_end(child.returncode)]
        raise FsmCacheError(f"CrossHair failed on {' '.join(targets)}: {tail[0]}")
    return stdout + stderr


def _silent_end(status: int) -> str:
    """Say how a CrossHair process that printed nothing ended: a signal, or an exit at import."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return (
            f"it was killed by {name} and printed nothing (out of memory, or stopped from outside)"
        )
    return (
        f"it exited with status {status} and printed nothing, as when the module calls"
        " sys.exit() while it is imported"
    )


_RANK = {"": -1, CONFIRMED: 0, WITHIN_BUDGET: 1, NOT_ANALYSED: 2, COUNTEREXAMPLE: 3}
"""Which of two verdicts on one contract is kept: the higher."""


def worse(first: Row, second: Row) -> Row:
    """Return whichever of two rows on one contract has the worse verdict, ``first`` on a tie.

    The rule :func:`read_report` keeps for a contract reported twice: a
    counterexample over ``not analysed`` over ``no counterexample within
    budget`` over a confirmation, of either kind.
    """
    return second if _RANK.get(second.status, 0) > _RANK.get(first.status, 0) else first


def _counterexample(msg: str, *, raised: bool) -> str:
    """Return the call of an error message, followed, for a raise in a body, by what it raised.

    A contract's own line says ``false when calling f(1)`` (the contract did not
    hold); a body's line says ``ValueError: seven when calling f(7)``, and every
    contract of ``f`` gets ``f(7) raises ValueError: seven``: none was false, the
    call raised.
    """
    call = _CALL.search(msg)
    if call is None:
        return msg
    what = msg[: call.start()].strip()
    if what == "false" or what.endswith(" yields false"):  # a condition, not a raise
        return call["call"]
    return f"{call['call']} raises {what}" if raised and what else call["call"]


def _function_at(
    known: dict[tuple[str, int], Contract], file: str, line: int
) -> list[tuple[str, int]]:
    """Return the contracts of the function whose lines hold ``line`` in ``file`` (none if none)."""
    return [key for key, c in known.items() if c.file == file and c.span[0] <= line <= c.span[1]]


def _def_line(path: Path, name: str) -> int:
    """Return the line of the module-level function ``name``, or 0 if it is built elsewhere."""
    tree = parse_module(path)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.lineno
    return 0


def _chunks(items: list[str], jobs: int) -> list[list[str]]:
    count = max(1, min(jobs, len(items)))
    return [items[i::count] for i in range(count)]


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _description(deco: ast.Call) -> str:
    for arg in (*deco.args[1:], *(k.value for k in deco.keywords if k.arg == "description")):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return ast.unparse(deco.args[0]) if deco.args else "postcondition"
