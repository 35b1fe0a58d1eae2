"""``fsm-cache diagram``: draw specs, and keep the committed diagrams in step with them.

Usage::

    fsm-cache diagram SPEC... [--format mermaid|dot|svg|md] [-o PATH] [--highlight [REGION=]STATE]
    fsm-cache diagram SPEC --format md -o PATH --check     # exit 1 if PATH is stale
    fsm-cache diagram [SPEC...] --write [--dir docs/diagrams]
    fsm-cache diagram [SPEC...] --check [--dir docs/diagrams]

``--write`` and ``--check`` without ``-o`` work on a set of files per spec,
``<dir>/<name>.mmd``, ``.dot`` and ``.md`` (every shipped spec when no SPEC is
given). SVG is left out of the set: its bytes depend on the Graphviz version.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsm_cache.diagram import FORMATS, DiagramError, render
from fsm_cache.loader import load_spec
from fsm_cache.shipped import shipped_spec_paths


DEFAULT_DIR = Path("docs/diagrams")
SET_SUFFIXES = {"mermaid": ".mmd", "dot": ".dot", "md": ".md"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``diagram`` subcommand."""
    parser = subparsers.add_parser(
        "diagram",
        help="draw specs as Mermaid, DOT, SVG or Markdown tables",
        description="Render state machine specs; --check fails when committed diagrams are stale.",
    )
    parser.add_argument("specs", nargs="*", type=Path, metavar="SPEC", help="spec TOML files")
    parser.add_argument("--format", choices=FORMATS, default="mermaid", help="default: mermaid")
    parser.add_argument("-o", "--output", type=Path, metavar="PATH", help="write here, not stdout")
    parser.add_argument(
        "--highlight",
        action="append",
        default=[],
        metavar="[REGION=]STATE",
        help="mark a state, e.g. where a node was when an error was reported",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    mode.add_argument("--write", action="store_true", help="regenerate the diagram files")
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"diagram folder (default: {DEFAULT_DIR})"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Render, write or check diagrams as the arguments ask; return the exit status.

    Raises:
        DiagramError: The arguments do not name what to render.
    """
    if args.output is not None:
        if len(args.specs) != 1:
            msg = f"-o writes one rendering; give exactly one SPEC (got {len(args.specs)})"
            raise DiagramError(msg)
        text = _render(args.specs[0], args.format, args.highlight)
        return _check({args.output: text}) if args.check else _write({args.output: text})
    if args.check or args.write:
        if args.highlight:
            msg = "--highlight marks one rendering; use it with -o or stdout, not --check/--write"
            raise DiagramError(msg)
        wanted = expected(args.specs or shipped_spec_paths(), args.dir)
        return _check(wanted) if args.check else _write(wanted)
    if not args.specs:
        msg = "give SPEC files to draw, or --check/--write for the shipped specs"
        raise DiagramError(msg)
    sys.stdout.write("\n".join(_render(p, args.format, args.highlight) for p in args.specs))
    return 0


def expected(specs: list[Path], folder: Path) -> dict[Path, str]:
    """Return the fresh rendering of each spec's diagram files in ``folder``, by path."""
    wanted: dict[Path, str] = {}
    for path in specs:
        spec = load_spec(path)
        for fmt, suffix in SET_SUFFIXES.items():
            wanted[folder / f"{path.stem}{suffix}"] = render(spec, fmt)
    return wanted


def _render(path: Path, fmt: str, highlight: list[str]) -> str:
    return render(load_spec(path), fmt, mark=tuple(highlight))


def _check(wanted: dict[Path, str]) -> int:
    stale = 0
    for path, text in wanted.items():
        if not path.is_file():
            print(f"{path}: missing")
            stale += 1
        elif path.read_text(encoding="utf-8") != text:
            print(f"{path}: differs from a fresh rendering")
            stale += 1
    if stale:
        print(f"{stale} of {len(wanted)} diagram files are stale; run: fsm-cache diagram --write")
        return 1
    print(f"{len(wanted)} diagram files match their specs")
    return 0


def _write(wanted: dict[Path, str]) -> int:
    for path, text in wanted.items():
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {path}")
    return 0
