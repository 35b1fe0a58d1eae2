"""The ``fsm-cache`` command line: one console script, one subcommand per tool.

Each tool module exposes ``register(subparsers)``, which adds its subparser and
sets ``handler`` to a function taking the parsed namespace and returning the
exit status. :func:`fsm_cache.shell.run_command` runs it: bad input never shows
a traceback (any :class:`~fsm_cache.errors.FsmCacheError`, and OSError for
unreadable files, becomes ``error: ...`` lines and exit 2), and a reader that
leaves early (``fsm-cache ... | head -1``) ends the command quietly, with
:data:`~fsm_cache.shell.OUTPUT_CLOSED`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from functools import partial

from fsm_cache.shell import Parser, run_command


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


def build_parser() -> argparse.ArgumentParser:
    """Return the parser with every available subcommand registered."""
    parser = Parser(
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
    reader of the output has gone (:data:`~fsm_cache.shell.OUTPUT_CLOSED`).
    """
    return run_command(partial(_dispatch, argv))


def _dispatch(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its subcommand; :func:`~fsm_cache.shell.run_command` reports errors.

    The parser is built here, under the shell, so a tool module that fails
    at import is one error, no traceback.
    """
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
