"""The command shell: run a command's body and turn what it raises into an exit status.

Every way to run a command goes through :func:`run_command`, so ``fsm-cache
audit``, ``python -m fsm_cache audit`` and ``python -m fsm_cache.audit`` end the
same way: bad input (any :class:`~fsm_cache.errors.FsmCacheError`, OSError
for unreadable files, and a package of an extra that is not installed)
becomes ``error: ...`` lines and exit 2, never a traceback; Ctrl-C one line
and :data:`INTERRUPTED` (a SIGTERM, where a command takes it
(:func:`terminating`), one line and :data:`TERMINATED`); a reader that leaves early (``... | head -1``) a
quiet :data:`OUTPUT_CLOSED`; a stdout that cannot be
written (``> /dev/full``) one ``error: cannot write to stdout`` line and exit
2. It sits below every layer that has a command (the CLI imports the audit,
never the reverse), with the argparse types their path arguments share
(:func:`path_text`, :func:`path_argument`, and :func:`spec_path` for a SPEC, read
as the spec layer names shipped specs) and how they drop a file named
twice (:func:`named_once`), and where a command finds a file's settings
(:func:`find_pyproject`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO, TypeVar, cast

from fsm_cache.errors import FsmCacheError, SpecError
from fsm_cache.spec.shipped import shipped_file


if TYPE_CHECKING:
    from sys import UnraisableHookArgs

    from _typeshed import SupportsWrite


INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT (2), as a shell reports it."""

TERMINATED = 143
"""Exit status after a SIGTERM a command took (:func:`terminating`): 128 + SIGTERM (15)."""


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised as SIGINT raises :class:`KeyboardInterrupt` (:func:`terminating`).

    A :class:`KeyboardInterrupt`, so whatever stops its work on Ctrl-C
    (killing its processes, ending its workers) stops it the same way.
    """


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """Let a SIGTERM raise :class:`Terminated` while the block runs, as SIGINT raises KeyboardInterrupt.

    Python leaves SIGTERM to the system, which ends the process at once: no
    ``finally`` runs, so the processes a command started (``verify``'s
    CrossHair) ran on, orphaned, where Ctrl-C stopped them. The signal
    raises once: one sent again while the command stops is ignored, so
    stopping is not cut short. A SIGTERM a caller handles or ignores is
    left as it is, and off the main thread, where no handler can be set,
    so is the system's.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    raised = False

    def terminate(_signal: int, _frame: object) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


OUTPUT_CLOSED = 141
"""Exit status when the reader of stdout or stderr has gone (``| head -1``).

128 + SIGPIPE (13), as a shell reports a command that signal ended. Python
ignores SIGPIPE and raises BrokenPipeError at the next write instead, which
is no error of the input: nothing more is written, not even an ``error:`` line.
"""


_Named = TypeVar("_Named", str, Path)
"""A path as a command line names it: the text, or the :class:`Path` of it."""

EMPTY_PATH = "an empty path names no file"
"""Why an empty path argument is refused: ``Path("")`` would be the working directory."""


STDIO = "-"
"""How a command line names stdin or stdout instead of a file."""

DASH_PATH = (
    f"'{STDIO}' (stdin or stdout) names no file here; give a path (./{STDIO} for one named {STDIO})"
)
"""Why a path argument ``-`` is refused where the command reads or writes no stream for it."""


def path_text(text: str) -> str:
    """Return ``text``, an argparse ``type`` for path arguments that refuses an empty one or ``-``.

    An empty argument (``--write ''``, an unset shell variable) would otherwise
    name the working directory or mean "no file given", and the command would
    print or write somewhere the user did not ask for. ``-`` means stdin or
    stdout to most tools: ``cat d.toml | fsm-cache validate -`` said ``-:
    cannot read: No such file or directory``, and read a file named ``-``
    where there was one. An argument that takes ``-`` for stdout
    (:func:`fsm_cache.cli.files.output_argument`) tells it first.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or ``-``; argparse reports it and exits 2.
    """
    if not text:
        raise argparse.ArgumentTypeError(EMPTY_PATH)
    if text == STDIO:
        raise argparse.ArgumentTypeError(DASH_PATH)
    return text


def path_argument(text: str) -> Path:
    """Return ``text`` as a :class:`Path`, refusing an empty one or ``-`` as :func:`path_text` does.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or ``-``.
    """
    return Path(path_text(text))


def spec_path(text: str) -> str:
    """Return a SPEC argument as the path of the spec file it names (an argparse ``type``).

    Refused as any path to read when empty or ``-`` (:func:`path_text`);
    ``fsm_cache:NAME`` is the shipped spec's file
    (:func:`~fsm_cache.spec.shipped.shipped_file`), so ``fsm-cache diagram
    fsm_cache:residency`` draws the installed copy, wherever the package is, as
    ``extends = "fsm_cache:residency"`` reads it. Any other path is kept as it
    was given, as text: a :class:`~pathlib.Path` drops a leading ``./``, and a
    spec file named ``-`` was then named ``-`` in what the command said, the
    name that means stdin.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or ``-``, or names no
            shipped spec; argparse reports it and exits 2.
    """
    try:
        path = shipped_file(path_text(text))
    except SpecError as exc:
        raise argparse.ArgumentTypeError(exc.problems[0]) from None
    return text if path is None else str(path)


class Parser(argparse.ArgumentParser):
    """An argument parser whose help, usage and version text fails loudly when it cannot be written.

    argparse drops an :class:`OSError` from writing them: with
    ``PYTHONUNBUFFERED=1`` (nothing left in a buffer to fail at the exit's
    flush), ``--help > /dev/full`` wrote nothing and exited 0, and
    ``--help | head -1`` exited 0 where every other output that lost its
    reader exits :data:`OUTPUT_CLOSED`. Raised here, :func:`run_command`
    reports the error as it does any other. Subparsers are built of the
    same class.

    An unknown option is named before a missing argument: argparse checks
    the required arguments first, so ``fsm-cache --bogus`` said ``the
    following arguments are required: COMMAND`` and never that ``--bogus``
    is no option of it. argparse itself says which are unknown
    (:meth:`unrecognized`).
    """

    _given: tuple[str, ...] = ()
    """The arguments of the latest parse, for :meth:`error` to find unrecognised ones in."""

    _intermixing: bool = False
    """Whether :meth:`parse_known_args` runs inside argparse's intermixed parse, as its passes."""

    _held: list[str] | None = None
    """The arguments after ``--``, held back from the intermixed parse's first pass (options only)."""

    _first: list[str] | None = None
    """What the intermixed parse's first pass left, once it has run: unknown options and positionals."""

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads; one signature here
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse as argparse does, options and positionals in any order; keep ``args`` for :meth:`error`.

        argparse fills a list of positionals (``SPEC...``) from one run of
        them only: ``fsm-cache check A.toml --nodes 5 B.toml`` said
        ``unrecognized arguments: B.toml``. A parser with no subcommands
        parses intermixed (:meth:`argparse.ArgumentParser.parse_known_intermixed_args`),
        so they mix freely. One with subcommands cannot (argparse refuses
        it) and needs not: it hands everything after the subcommand's name
        to that subcommand's parser.

        argparse's intermixed parse reads the options first, with the
        positionals set aside, and there it takes a ``--`` for an empty run
        of positionals and drops it: ``validate -- -x.toml`` read ``-x.toml``
        as an unknown option. What follows ``--`` holds no option, so that
        first pass is not given it (:attr:`_held`); the second, which reads
        the positionals, gets it back behind its ``--``.

        The second pass is not given the first's unknown options either: it
        reads the positionals as one run again, and one of them cut it, so
        ``validate A --bogus B`` said ``unrecognized arguments: --bogus B``
        though ``B`` is a SPEC. They are named with what it leaves, in the
        order given (:func:`_in_order`).
        """
        given = list(sys.argv[1:] if args is None else args)
        if self._intermixing:  # one of the intermixed parse's passes
            parsed, extras = super().parse_known_args(given, namespace)
            if self._first is not None:  # the second pass: the positionals
                return parsed, _in_order(self._first, extras, self._is_option)
            self._first = extras
            values = [arg for arg in extras if not self._is_option(arg)]
            held, self._held = self._held, None
            return parsed, values if held is None else [*values, "--", *held]
        self._given = tuple(given)
        if self._subcommands():
            return super().parse_known_args(given, namespace)
        if "--" in given:
            cut = given.index("--")
            given, self._held = given[:cut], given[cut + 1 :]
        self._intermixing = True
        try:
            return super().parse_known_intermixed_args(given, namespace)
        except _Missing as missing:  # the passes are over: the parser is as it was
            self._intermixing, self._first = False, None
            self.error(missing.message)
        finally:
            self._intermixing, self._held, self._first = False, None, None

    def _is_option(self, arg: str) -> bool:
        """Whether argparse reads ``arg`` as an option (``--name=value``, not ``-5`` or ``a b``)."""
        return self._parse_optional(arg) is not None

    def _subcommands(self) -> bool:
        """Whether this parser has a positional intermixed parsing refuses (subcommands, a remainder)."""
        return any(
            action.nargs in (argparse.PARSER, argparse.REMAINDER)
            for action in self._get_positional_actions()
        )

    def error(self, message: str) -> NoReturn:
        """Report ``message`` as argparse does, led by the arguments it does not recognise, if any.

        Raises:
            _Missing: ``message`` says arguments are missing, in a pass of
                the intermixed parse: :meth:`parse_known_args` reports it
                once the pass has put the parser back as it was.
        """
        if message.startswith(_REQUIRED):
            if self._intermixing:
                raise _Missing(message)
            unknown = self.unrecognized(self._given)
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}; {message}"
        super().error(message)

    def unrecognized(self, args: Sequence[str]) -> list[str]:
        """Return the arguments of ``args`` this parser does not recognise, as argparse reads them.

        argparse matches them itself (prefixes of options, ``--name=value``,
        ``-xVALUE``, negative numbers, ``--``), but it checks the required
        arguments before it reports them, and stops there: parsed again with
        none required, :meth:`parse_known_args` returns them. ``args`` are
        those of a parse that reached that check, so nothing stops this one
        earlier (``--help``, a bad value).
        """
        required: list[argparse.Action | argparse._MutuallyExclusiveGroup] = [
            *(action for action in self._actions if action.required),
            *(group for group in self._mutually_exclusive_groups if group.required),
        ]
        for item in required:
            item.required = False
        given = self._given
        try:
            return self.parse_known_args(list(args))[1]
        finally:
            self._given = given
            for item in required:
                item.required = True

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """Write ``message`` to ``file`` (stdout by default), letting a failed write raise.

        Raises:
            OSError: ``file`` cannot take ``message``.
        """
        if message:
            (file or sys.stdout).write(message)


def _in_order(first: list[str], second: list[str], is_option: Callable[[str], bool]) -> list[str]:
    """Return the arguments neither intermixed pass recognised, in the order ``first`` has them.

    ``first`` is what the first pass left (unknown options, positionals),
    ``second`` what the second left of its positionals, then of any held
    behind ``--``; the options of ``first`` go where they stood among them.
    """
    named: list[str] = []
    rest = iter(second)
    waiting = next(rest, None)
    for arg in first:
        if is_option(arg):
            named.append(arg)
        elif arg == waiting:
            named.append(arg)
            waiting = next(rest, None)
    return named if waiting is None else [*named, waiting, *rest]


_REQUIRED = "the following arguments are required"
"""How argparse's message on missing arguments begins (its English text: fsm_cache sets no locale)."""


class _Missing(Exception):
    """A missing-arguments message of an intermixed parse's pass, carried out of the pass."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _StdoutUnwritten(OSError):
    """Stdout could not take a write or a flush (:class:`_NamedStdout`): an OSError naming no file."""


class _NamedStdout:
    """Stdout while a command runs: an OSError from a write or flush to it says it is stdout's.

    The OS's error names no file, so :func:`run_command` could tell stdout's
    only when the final flush failed: an unbuffered stdout
    (``PYTHONUNBUFFERED=1``, common in containers and CI) or an output longer
    than its buffer fails in the write itself, and ``> /dev/full`` said
    ``error: [Errno 28] No space left on device``. Everything else is the
    stream's own (:meth:`__getattr__`); a reader that has gone stays a
    :class:`BrokenPipeError`.

    A stdout closed before the command started (``fsm-cache ... >&-``) is
    None to Python: the first write failed with an AttributeError traceback.
    Here it is a stream whose writes fail as a closed descriptor's do.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` to stdout.

        Raises:
            _StdoutUnwritten: Stdout cannot take it (not a reader that has gone).
        """
        if self.stream is None:
            raise _StdoutUnwritten(errno.EBADF, os.strerror(errno.EBADF))
        with _naming_stdout():
            return self.stream.write(text)

    def flush(self) -> None:
        """Flush stdout (a closed one holds nothing to flush).

        Raises:
            _StdoutUnwritten: Stdout cannot take what was buffered (not a reader that has gone).
        """
        if self.stream is None:
            return
        with _naming_stdout():
            self.stream.flush()

    def __getattr__(self, name: str) -> object:
        """Return the attribute ``name`` of the stream itself (``fileno``, ``isatty``, ``encoding``)."""
        return getattr(self.stream, name)


@contextlib.contextmanager
def _naming_stdout() -> Iterator[None]:
    """Raise an OSError naming no file as :class:`_StdoutUnwritten`; a broken pipe as it is."""
    try:
        yield
    except (BrokenPipeError, _StdoutUnwritten):
        raise
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise _StdoutUnwritten(exc.errno, exc.strerror) from exc


def summary_line(doc: str | None) -> str:
    """Return the first line of a command module's docstring as ``--help`` shows it.

    The docstring is reST for the documentation site; ``--help`` prints it
    as plain text, where the double backquotes of its literals would show.
    """
    return doc.splitlines()[0].replace("``", "") if doc else ""


def named_once(paths: Iterable[_Named]) -> list[_Named]:
    """Return ``paths`` in order, each once: a file named twice, in any spelling, is kept first.

    A command given one file twice (``a.toml ./a.toml``, a link) would do its
    work twice for the same answer: minutes for a check or a proof. Paths
    are compared by where they lead, so a module name (``verify``'s dotted
    names) is one only with itself.
    """
    seen: dict[str, _Named] = {}
    for path in paths:
        seen.setdefault(os.path.realpath(path), path)
    return list(seen.values())


def find_pyproject(start: Path) -> Path | None:
    """Return the nearest ``pyproject.toml`` at or above the folder ``start``.

    The one rule of every command's ``[tool.fsm_cache.*]`` settings (``audit``'s
    per file, ``verify``'s per spec or module): they belong to the project
    the file is in, so the working directory does not change them.
    """
    start = start.resolve()
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


@contextlib.contextmanager
def _dropped_interrupts() -> Iterator[list[type[KeyboardInterrupt]]]:
    """Take the Ctrl-C (or SIGTERM) Python drops where it lands; yield the kinds dropped.

    A :class:`KeyboardInterrupt` raised inside a callback Python itself calls
    (an import lock's, while a command imports torch; a ``__del__``) is
    printed as ``Exception ignored ...`` with a traceback and dropped: the
    command ran on to its end and exited 0. Here it is noted instead of
    printed, so that the command, once it ends, reports ``interrupted``
    (a second Ctrl-C stops it sooner, as any does). It is not raised again
    from here: a signal raised in the hook lands in the hook, which Python
    drops as well. Whatever else is unraisable goes to the hook there was.
    """
    dropped: list[type[KeyboardInterrupt]] = []
    previous = sys.unraisablehook

    def hook(unraisable: UnraisableHookArgs) -> None:
        kind = unraisable.exc_type
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            dropped.append(kind)  # a SIGTERM's Terminated is one too
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield dropped
    finally:
        sys.unraisablehook = previous


def run_command(command: Callable[[], int]) -> int:
    """Run ``command`` and return its exit status, or the status of what it raised.

    ``command`` parses its arguments too, so a failure there (a tool module
    that fails at import) is one error, no traceback, as is a package from
    outside fsm_cache that is not installed (an extra's). The statuses: the
    command's own (0 ok, 1 findings, 3 a check stopped short), 2 bad input,
    :data:`INTERRUPTED`, :data:`TERMINATED`, :data:`OUTPUT_CLOSED`.
    """
    with _escaping_output(), _standard_streams(), _dropped_interrupts() as dropped:
        try:
            try:
                status = command()
            finally:
                sys.stdout.flush()  # a reader that has gone is met here, not in the exit's flush
            if dropped:  # a Ctrl-C or SIGTERM Python dropped, and the command still finished
                raise dropped[0]
        except BrokenPipeError:
            return _output_closed()
        except KeyboardInterrupt as exc:  # Ctrl-C, or a SIGTERM the command took
            return _stopped(exc)
        except SpecError as exc:
            return _report([f"error: {problem}" for problem in exc.problems], 2)
        except (FsmCacheError, ModuleNotFoundError) as exc:
            if isinstance(exc, ModuleNotFoundError) and not _not_installed(exc):
                raise
            return _report([f"error: {exc}"], 2)
        except OSError as exc:
            return _report([f"error: {_unwritten(exc)}"], 2)
        except SystemExit:  # argparse's usage error: its lines may not fit in stderr either
            _drop(sys.stderr)
            raise
        return status


def _stopped(exc: KeyboardInterrupt) -> int:
    """Report a command a signal stopped, in one line: SIGTERM's (:class:`Terminated`), or SIGINT's."""
    if isinstance(exc, Terminated):
        return _report(["terminated"], TERMINATED)
    return _report(["interrupted"], INTERRUPTED)


def _not_installed(exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` says a package from outside fsm_cache is missing: the install's fault, not ours.

    An optional dependency's extra not installed (``bench engine`` without
    ``transitions``) showed a traceback under its own message, which names
    the extra to install. A module of fsm_cache's own that is missing is a
    broken install or a bug, and keeps its traceback.
    """
    top = (exc.name or "").partition(".")[0]
    return bool(top) and top != __name__.partition(".")[0]


def _unwritten(exc: OSError) -> str:
    """Return what ``exc`` says, naming stdout when it is stdout that cannot be written.

    A full disk or ``> /dev/full`` fails stdout's write or flush
    (:class:`_NamedStdout`): the text still buffered would fail again in the
    interpreter's flush at exit (``Exception ignored ... OSError``, exit
    120), so it is dropped (:func:`_drop`).
    """
    if (_drop(sys.stdout) or isinstance(exc, _StdoutUnwritten)) and exc.filename is None:
        return f"cannot write to stdout: {exc.strerror or exc}"
    return str(exc)


@contextlib.contextmanager
def _standard_streams() -> Iterator[None]:
    """Let :data:`sys.stdout` be a :class:`_NamedStdout` of itself while the command runs.

    A stderr closed before Python started (``2>&-``) is None to Python, and
    ``print(..., file=None)`` writes to stdout: the command's ``error:``
    lines went there. While the command runs it is a sink instead, as a
    closed descriptor is.
    """
    stdout: TextIO | None = sys.stdout  # None: closed before Python started (>&-)
    stderr: TextIO | None = sys.stderr
    named = cast("TextIO", _NamedStdout(stdout))
    sys.stdout = named
    if stderr is None:
        sys.stderr = io.StringIO()
    try:
        yield
    finally:
        if sys.stdout is named:  # a command that set its own stdout keeps it
            sys.stdout = stdout
        if stderr is None:
            sys.stderr = stderr


@contextlib.contextmanager
def _escaping_output() -> Iterator[None]:
    r"""Let stdout and stderr write any text while the command runs: what they cannot encode is escaped.

    A file name that is not UTF-8 (Linux names are bytes; Python carries the
    undecodable ones as lone surrogates) cannot be written by a strict UTF-8
    stdout, which is what most locales give: ``ok: NAME`` failed with a
    UnicodeEncodeError traceback after the work was done, and so did a
    spec's ``é`` on an ASCII or Latin-1 stdout. A strict stream escapes
    instead (``\udcff``, ``\xe9``), as Python's stderr always does; one
    that already handles such text (``surrogateescape`` writes a name's own
    bytes back) is left as it is, and each is put back as it was afterwards.
    """
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
            changed.append(stream)
    try:
        yield
    finally:
        for stream in changed:
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to put back
                stream.reconfigure(errors="strict")


def _report(lines: Iterable[str], status: int) -> int:
    r"""Write ``lines`` to stderr and return ``status``, or :data:`OUTPUT_CLOSED` if stderr has gone.

    Each is one line: a control character in it (a line break or a terminal
    escape in a file name the user gave) is written escaped, as ``repr``
    shows it (``\n``, ``\x1b``), so it can neither forge a line of its own
    nor colour the terminal. A stderr that cannot take them (``2> /dev/full``)
    leaves ``status`` to tell: the lines are dropped (:func:`_drop`), or the
    interpreter's flush at exit would fail on them again and exit 120.
    """
    try:
        for line in lines:
            print(one_line(line), file=sys.stderr)
        sys.stderr.flush()
    except BrokenPipeError:
        return _output_closed()
    except OSError:
        _drop(sys.stderr)
    return status


def one_line(text: str) -> str:
    """Return ``text`` with each character that is not printable escaped as ``repr`` shows it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _output_closed() -> int:
    """Return :data:`OUTPUT_CLOSED`, with stdout's unwritten text dropped if its reader has gone.

    Where stdout can still be flushed, only stderr has gone and stdout's
    text is kept (:func:`_drop`).
    """
    _drop(sys.stdout)
    return OUTPUT_CLOSED


def _drop(stream: TextIO) -> bool:
    """Drop the unwritten text of ``stream`` if it cannot be flushed; return whether it could not.

    Text still buffered for a stream that cannot take it (a reader that has
    gone, a full disk) would fail again in the interpreter's flush at exit
    (``Exception ignored ... BrokenPipeError``, exit 120), so the stream's
    descriptor is pointed at the null device, as the Python documentation's
    note on SIGPIPE does.
    """
    try:
        stream.flush()
    except OSError:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return True
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError):  # no descriptor (a stream in memory): nothing flushes it
            pass
        finally:
            os.close(null)
        return True
    return False
