"""``fsm-cache diagram``: draw specs, and keep the committed diagrams in step with them.

Usage::

    fsm-cache diagram SPEC... [--format mermaid|dot|svg|md] [-o PATH] [--highlight [REGION=]STATE]
    fsm-cache diagram SPEC --format md -o PATH --check     # exit 1 if PATH is stale
    fsm-cache diagram [SPEC...] --write [--dir docs/diagrams]
    fsm-cache diagram [SPEC...] --check [--dir docs/diagrams]

``--write`` and ``--check`` without ``-o`` work on a set of files per spec,
``<dir>/<name>.mmd``, ``.dot`` and ``.md``. SVG is left out of the set: its
bytes depend on the Graphviz version. With no SPEC they work on the shipped
specs, and only where their diagrams live, fsm_cache's own ``docs/diagrams``
(:func:`home`): in a user's project, ``fsm-cache diagram --check`` would
otherwise check, and ``--write`` write, fsm_cache's diagrams among the
user's, so there it is refused and asks for the user's specs.
Two specs whose sets would be the same files (``a/d.toml`` and ``b/d.toml``
both draw ``<dir>/d.*``) are refused, naming both. ``--format`` is the format
of one rendering and ``--dir`` the folder of the set: either given to the
other mode is refused, never silently ignored.

Every write goes through :func:`fsm_cache.cli.files.write_files`: all files or
none, never over a spec file the command reads, and never to a ``.toml`` file.
An existing file is replaced, or checked, only when it is empty or a diagram
this command drew (of any spec, in any format): each format carries a mark in
a comment (:func:`fsm_cache.diagram.is_diagram`), so ``-o README.md`` refuses a
user's README instead of overwriting it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from fsm_cache.cli.files import STDOUT, current_text, output_argument, write_files
from fsm_cache.diagram import (
    FORMATS,
    DiagramError,
    is_diagram,
    normalised,
    render,
    render_sections,
)
from fsm_cache.shell import named_once, path_argument, spec_path
from fsm_cache.spec.loader import load_spec, spec_files
from fsm_cache.spec.shipped import shipped_spec_paths, spec_dir


DEFAULT_DIR = Path("docs/diagrams")
DEFAULT_FORMAT = "mermaid"
SET_SUFFIXES = {"mermaid": ".mmd", "dot": ".dot", "md": ".md"}
# Formats whose documents can hold several specs; the others are one picture each.
SECTIONED = ("md",)
EPILOG = """\
One document goes to stdout, or to PATH with -o (-o - is stdout). A mermaid,
dot or svg document draws one SPEC, so several SPECs are refused there: draw
them one at a time, or --write each spec's .mmd, .dot and .md files into --dir.
With --format md, several SPECs make one Markdown document, a '## NAME' section
per spec.

--highlight marks a state of one SPEC, e.g. where a node was when an error was
reported: filled in mermaid, dot and svg; bold, and '(here)', in md's tables.

--check and --write without -o work on each SPEC's .mmd, .dot and .md files in
--dir (default: docs/diagrams). With no SPEC they work on fsm_cache's own specs,
and only in its checkout's docs/diagrams: in your project, name your specs.

An existing file is replaced or checked only when it is empty or a diagram
fsm-cache drew (each format marks it in a comment): -o README.md is refused.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``diagram`` subcommand."""
    parser = subparsers.add_parser(
        "diagram",
        help="draw specs as Mermaid, DOT, SVG or Markdown tables",
        description="Render state machine specs; --check fails when committed diagrams are stale.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "specs",
        nargs="*",
        type=spec_path,
        metavar="SPEC",
        help="spec TOML files, or fsm_cache:NAME for a shipped spec (none: fsm_cache's own "
        "specs, for --check/--write in its checkout)",
    )
    # --format and --dir default to None, so one given where it is not used is told and refused
    parser.add_argument("--format", choices=FORMATS, help=f"default: {DEFAULT_FORMAT}")
    parser.add_argument(
        "-o", "--output", type=output_argument, metavar="PATH", help="write here (-: stdout)"
    )
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
        "--dir",
        type=path_argument,
        help=f"diagram folder of --check/--write without -o (default: {DEFAULT_DIR})",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Render, write or check diagrams as the arguments ask; return the exit status.

    Raises:
        DiagramError: The arguments do not name what to render, ask for one
            document of several specs in a format that draws one, name
            specs whose diagram files would be the same, or give an option
            the mode does not use (``--format`` to the set of files,
            ``--dir`` to one rendering).
        OutputError: A file to write is a spec the command reads or a
            ``.toml`` file, is no regular file, is not a diagram this command
            wrote, or cannot be written (nothing was changed), or a file to
            check is no regular file or not a diagram this command wrote.
    """
    if args.output is STDOUT and args.check:
        raise DiagramError("-o - is stdout: --check compares a file; give the file to check")
    if args.output is None and (args.check or args.write):
        if args.highlight:
            msg = "--highlight marks one rendering; use it with -o or stdout, not --check/--write"
            raise DiagramError(msg)
        if args.format is not None:
            suffixes = list(SET_SUFFIXES.values())
            msg = (
                "--format is the format of one rendering, to -o or stdout; --check/--write "
                f"without -o work on each spec's {', '.join(suffixes[:-1])} and {suffixes[-1]} files"
            )
            raise DiagramError(msg)
        folder = DEFAULT_DIR if args.dir is None else args.dir
        specs = args.specs or _shipped(folder, "--check" if args.check else "--write")
        wanted = expected(specs, folder)
        return _check(wanted, _rewrite(args)) if args.check else _write(wanted, specs)
    if args.dir is not None:
        msg = (
            "--dir is the folder of --check/--write without -o; a rendering to -o or "
            "stdout does not use it"
        )
        raise DiagramError(msg)
    text = document(args.specs, args.format or DEFAULT_FORMAT, tuple(args.highlight))
    if args.output is None or args.output is STDOUT:
        sys.stdout.write(text)
        return 0
    wanted = {args.output: text}
    return _check(wanted, _rewrite(args)) if args.check else _write(wanted, args.specs)


def home() -> Path:
    """Return the folder of the shipped specs' diagrams: ``docs/diagrams`` beside their ``specs/``."""
    return spec_dir().parent / DEFAULT_DIR


def _shipped(folder: Path, mode: str) -> list[str]:
    """Return the shipped specs, whose diagram files ``mode`` with no SPEC works on in ``folder``.

    Raises:
        DiagramError: ``folder`` is not :func:`home`: no SPEC there means the
            user forgot theirs, not that fsm_cache's own diagrams belong there.
    """
    if os.path.realpath(folder) != os.path.realpath(home()):
        msg = (
            f"{mode} with no SPEC is for fsm_cache's own diagrams, in {home()}, not {folder}; "
            f"name the specs whose diagrams to {mode[2:]}: fsm-cache diagram SPEC... {mode}"
        )
        raise DiagramError(msg)
    return [str(path) for path in shipped_spec_paths()]


def _rewrite(args: argparse.Namespace) -> str:
    """Return the command that rewrites what ``args`` checks, quoted for a shell.

    ``fsm-cache diagram --write`` alone would rewrite the shipped specs'
    files in ``docs/diagrams``, not the user's: the command repeats the specs,
    and the folder, or the file with its format and highlights.
    """
    words = ["fsm-cache", "diagram", *args.specs]
    if args.output is None:
        words.append("--write")
        words += [] if args.dir is None else ["--dir", str(args.dir)]
        return shlex.join(words)
    words += [] if args.format is None else ["--format", args.format]
    for mark in args.highlight:
        words += ["--highlight", mark]
    return shlex.join([*words, "-o", str(args.output)])


def document(specs: list[str], fmt: str, highlight: tuple[str, ...] = ()) -> str:
    """Return one ``fmt`` document of ``specs``: the rendering of one, or md sections of several.

    A spec named twice, in any spelling, is drawn once.

    Raises:
        DiagramError: No spec, or several in a one-picture format or with a highlight.
    """
    specs = named_once(specs)
    if not specs:
        msg = "give SPEC files to draw, or --check/--write without -o for the shipped specs"
        raise DiagramError(msg)
    if len(specs) == 1:
        return render(load_spec(specs[0]), fmt, mark=highlight)
    if fmt not in SECTIONED:
        msg = (
            f"--format {fmt} draws one SPEC per document (got {len(specs)}); "
            "draw them one at a time, or --write their files into --dir"
        )
        raise DiagramError(msg)
    if highlight:
        msg = f"--highlight marks a state of one SPEC (got {len(specs)})"
        raise DiagramError(msg)
    return render_sections([load_spec(path) for path in specs])


def expected(specs: list[str], folder: Path) -> dict[Path, str]:
    """Return the fresh rendering of each spec's diagram files in ``folder``, by path.

    A spec named twice (in any spelling) is drawn once.

    Raises:
        DiagramError: Two different specs have the same file name, ignoring
            case, so their files in ``folder`` would be the same (on a
            case-insensitive filesystem): one would silently replace the other's.
    """
    wanted: dict[Path, str] = {}
    drawn: dict[str, tuple[str, Path]] = {}
    for name in specs:
        spec, path = load_spec(name), Path(name)
        # by the name folded to one case: Door.toml and door.toml would be one file on
        # macOS's and Windows' filesystems, and in every checkout of a repository there
        first_name, first = drawn.setdefault(path.stem.casefold(), (name, path))
        if first is not path:
            if _same_file(first, path):
                continue
            where = f"{folder / path.stem}{{{','.join(SET_SUFFIXES.values())}}}"
            if first.stem != path.stem:
                where += f" (and {folder / first.stem}, the same on a case-insensitive filesystem)"
            msg = (
                f"{first_name} and {name} would both be drawn to {where}: give them different "
                "file names, or draw each into its own --dir"
            )
            raise DiagramError(msg)
        for fmt, suffix in SET_SUFFIXES.items():
            wanted[folder / f"{path.stem}{suffix}"] = render(spec, fmt)
    return wanted


def _same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file (through links and other spellings)."""
    try:
        return first.samefile(second)
    except OSError:
        return False


def _check(wanted: dict[Path, str], rewrite: str) -> int:
    """Print each file that is missing or stale, and the command ``rewrite`` if any is; return 1 then.

    A file that differs from its fresh rendering only by CRLF line ends or a
    byte order mark (:func:`~fsm_cache.diagram.normalised`) is current.

    Raises:
        OutputError: A file to check is a ``.toml`` file, is there but is no
            regular file or not a diagram this command wrote (nor empty), or
            cannot be read.
    """
    stale = 0
    currents = {path: current_text(path, "diagram", is_diagram) for path in wanted}  # errors first
    for path, text in wanted.items():
        current = currents[path]
        if current is None:
            print(f"{path}: missing")
            stale += 1
        elif normalised(current) != normalised(text):  # a Windows checkout is no drift
            print(f"{path}: differs from a fresh rendering")
            stale += 1
    if stale:
        print(f"{stale} of {len(wanted)} diagram files are stale; run: {rewrite}")
        return 1
    print(f"{len(wanted)} diagram files match their specs")
    return 0


def _write(wanted: dict[Path, str], specs: list[str]) -> int:
    """Write each file whose text changed, all or none (:func:`~fsm_cache.cli.files.write_files`).

    Raises:
        OutputError: A target is a file one of ``specs`` is read from or a
            ``.toml`` file, is not a regular file, is neither empty nor a
            diagram this command wrote, sits under a path that is not a
            folder, or cannot be written; nothing was changed.
    """
    protected = [file for spec in specs for file in spec_files(Path(spec))]
    for path in write_files(wanted, "diagram", protected, ours=is_diagram):
        print(f"wrote {path}")
    return 0
