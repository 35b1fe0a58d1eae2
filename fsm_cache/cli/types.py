"""``fsm-cache types SPEC``: print, write or check the typed stub of a spec.

See :mod:`fsm_cache.spec.stubs`. ``--write FILE`` writes the stub; ``--check FILE``
exits 1 when FILE differs from what the spec generates now (a spec changed
without its types), naming the file, so CI keeps the two in step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fsm_cache.cli.files import current_text
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.stubs import stub


def register(subparsers: Any) -> None:
    """Add the ``types`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "types",
        help="generate Literal types of a spec's states and events for mypy",
        description="Print the typed stub of SPEC (states and events as Literal types).",
    )
    parser.add_argument("spec", metavar="SPEC", help="a .toml spec file")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", metavar="FILE", help="write the stub to FILE")
    where.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not the current stub")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print, write or check the stub; return 1 when ``--check`` finds a stale file."""
    text = stub(load_spec(args.spec))
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
        print(f"wrote {args.write}")
        return 0
    if args.check:
        current = current_text(Path(args.check))
        if current != text:
            what = "is missing" if current is None else "differs from"
            print(f"{args.check} {what} the types of {args.spec}: run fsm-cache types --write")
            return 1
        print(f"{args.check} matches {args.spec}")
        return 0
    sys.stdout.write(text)
    return 0
