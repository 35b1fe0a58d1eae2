"""The ``fsm-cache`` command line: one console script, one subcommand per tool.

Each tool module exposes ``register(subparsers)``, which adds its subparser and
sets ``handler`` to a function taking the parsed namespace and returning the
exit status. Bad input never shows a traceback: any :class:`FsmCacheError`
(and OSError for unreadable files) becomes ``error: ...`` lines and exit 2.
A reader that leaves early (``fsm-cache ... | head -1``) ends the command
quietly, with :data:`OUTPUT_CLOSED`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

from fsm_cache.errors import FsmCacheError, SpecError


# NOTE: modules are imported when the parser is built; none of them imports torch at import time.
_TOOLS = (
    "fsm_cache.cli.demo",
    "fsm_cache.cli.validate",
    "fsm_cache.cli.diagram",
    "fsm_cache.cli.types",
    "fsm_cache.cli.bench",
    "fsm_cache.contracts.verify",
    "fsm_cache.modelcheck.check",
    "fsm_cache.audit",
)


INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT (2), as a shell reports it."""

OUTPUT_CLOSED = 141
"""Exit status when the reader of stdout or stderr has gone (``| head -1``).

128 + SIGPIPE (13), as a shell reports a command that signal ended. Python
ignores SIGPIPE and raises BrokenPipeError at the next write instead, which
is no error of the input: nothing more is written, not even an ``error:`` line.
"""


def build_parser() -> argparse.ArgumentParser:
    """Return the parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fsm-cache",
        description="Typed, formally checked state machines for KV-cache residency.",
    )
    parser.add_argument("--version", action="version", version=f"fsm-cache {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _TOOLS:
        importlib.import_module(name).register(subparsers)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsm-cache")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status.

    0 ok, 1 findings, 2 bad input, 3 a check stopped short, 130 interrupted
    (Ctrl-C: one line, as a shell reports SIGINT, never a traceback), 141 the
    reader of the output has gone (:data:`OUTPUT_CLOSED`).
    """
    with _escaping_output():
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv``, run its subcommand and return the exit status, reporting any error."""
    try:
        try:  # the parser too: a tool module that fails at import is one error, no traceback
            args = build_parser().parse_args(argv)
            status: int = args.handler(args)
        finally:
            sys.stdout.flush()  # a reader that has gone is met here, not in the exit's flush
    except BrokenPipeError:
        return _output_closed()
    except KeyboardInterrupt:
        return _report(["interrupted"], INTERRUPTED)
    except SpecError as exc:
        return _report([f"error: {problem}" for problem in exc.problems], 2)
    except (FsmCacheError, OSError) as exc:
        return _report([f"error: {exc}"], 2)
    return status


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
    """Write ``lines`` to stderr and return ``status``, or :data:`OUTPUT_CLOSED` if stderr has gone."""
    try:
        for line in lines:
            print(line, file=sys.stderr)
    except BrokenPipeError:
        return _output_closed()
    return status


def _output_closed() -> int:
    """Return :data:`OUTPUT_CLOSED`, with stdout's unwritten text dropped if its reader has gone.

    Text still buffered for a closed stdout would fail again in the
    interpreter's flush at exit (``Exception ignored ... BrokenPipeError``,
    exit 120), so stdout's descriptor is pointed at the null device, as the
    Python documentation's note on SIGPIPE does. Where stdout can still be
    flushed, only stderr has gone and stdout's text is kept.
    """
    try:
        sys.stdout.flush()
    except OSError:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return OUTPUT_CLOSED
        try:
            os.dup2(null, sys.stdout.fileno())
        except (OSError, ValueError):  # no descriptor (a stream in memory): nothing flushes it
            pass
        finally:
            os.close(null)
    return OUTPUT_CLOSED


if __name__ == "__main__":
    raise SystemExit(main())
