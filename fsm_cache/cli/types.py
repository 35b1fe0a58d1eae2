"""``fsm-cache types SPEC``: print, write or check the typed stub of a spec.

See :mod:`fsm_cache.spec.stubs`. ``--write FILE`` writes the stub (``-``: prints
it, as without ``--write``); ``--check FILE`` exits 1 when FILE differs from
what the spec generates now (a spec changed without its types), naming the
file, so CI keeps the two in step. A FILE that is there but neither empty nor a
stub this command wrote is an error (exit 2), as ``--write`` refuses it: the
rewrite ``--check`` advises would be refused.

``--write`` goes through :func:`fsm_cache.cli.files.write_files`, as the
diagrams do: the stub is written beside FILE and renamed over it, so a full
disk leaves FILE as it was, and FILE may not be the spec or one of the files
it reads (its regions, the specs it extends), nor any ``.toml`` file. An
existing FILE is replaced only when it is empty or a stub this command wrote
(:func:`~fsm_cache.spec.stubs.is_stub`), of this spec or another: a module of
the user's code named by mistake is refused, not overwritten.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from fsm_cache.cli.files import STDOUT, current_text, file_argument, output_argument, write_files
from fsm_cache.shell import spec_path
from fsm_cache.spec.loader import load_spec, spec_files
from fsm_cache.spec.stubs import is_stub, stub


def register(subparsers: Any) -> None:
    """Add the ``types`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "types",
        help="generate Literal types of a spec's states and events for mypy",
        description="Print the typed stub of SPEC (states and events as Literal types).",
    )
    parser.add_argument(
        "spec",
        type=spec_path,
        metavar="SPEC",
        help="a .toml spec file, or fsm_cache:NAME for a shipped spec",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--write", type=output_argument, metavar="FILE", help="write the stub to FILE (-: stdout)"
    )
    where.add_argument(
        "--check", type=file_argument, metavar="FILE", help="exit 1 if FILE is not the current stub"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print, write or check the stub; return 1 when ``--check`` finds a stale file.

    Raises:
        SpecError: The spec does not load.
        OutputError: FILE is not a regular file, is a file the spec is read
            from (``--write``) or a ``.toml`` file, is not a stub this command
            wrote, or cannot be read or written; nothing was changed.
    """
    spec: str = args.spec
    text = stub(load_spec(spec))
    if args.write is not None and args.write is not STDOUT:
        written = write_files({args.write: text}, "types", spec_files(Path(spec)), ours=is_stub)
        print(f"wrote {args.write}" if written else f"{args.write} matches {spec}")
        return 0
    if args.check is not None:
        current = current_text(args.check, "types", ours=is_stub)
        if current != text:
            what = "is missing" if current is None else "differs from"
            rewrite = shlex.join(["fsm-cache", "types", spec, "--write", str(args.check)])
            print(f"{args.check} {what} the types of {spec}: run {rewrite}")
            return 1
        print(f"{args.check} matches {spec}")
        return 0
    sys.stdout.write(text)
    return 0
