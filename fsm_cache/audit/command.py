"""The ``fsm-cache audit`` subcommand: read sources, audit them, print a report.

Exit status: 0 when clean, 1 when there are findings, 2 on bad input (an
unreadable file, a syntax error, a bad option or config), which the command
shell (:mod:`fsm_cache.shell`) prints as ``error: ...`` from the
:class:`AuditError` raised here.

Each file is audited under the config of its own project (see
:class:`~fsm_cache.audit.config.ConfigFinder`), not that of the working directory.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tokenize
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from fsm_cache.audit.checker import check_source
from fsm_cache.audit.config import ConfigFinder
from fsm_cache.audit.model import DEFAULT_PAIRS, AuditConfig, AuditError, Finding
from fsm_cache.audit.report import REPORT_FORMATS, render_report
from fsm_cache.shell import Parser, named_once, one_line, path_argument, path_text, run_command
from fsm_cache.spec.loader import unreadable


_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``audit`` subparser; its handler returns the exit status."""
    defaults = " ".join(f"--pair {pair}" for pair in DEFAULT_PAIRS)
    parser = subparsers.add_parser(
        "audit",
        help="find unpaired acquire/release call sites in Python sources",
        description=(
            "Pair acquires with releases along every path of every function and report "
            "leaks, double releases, unmatched releases and exception-unsafe pairs."
        ),
    )
    parser.add_argument(
        "paths", nargs="+", type=path_text, metavar="PATH", help="files or folders to audit"
    )
    parser.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="ACQUIRE:RELEASE",
        help=(
            "call names to pair, each optionally with its arguments up to the resource "
            "('acquire_layout(key):release_layout(event, key)') or (self) for the receiver; "
            f"replaces the configured pairs (default: {defaults})"
        ),
    )
    parser.add_argument("--format", choices=REPORT_FORMATS, default="text", help="report format")
    parser.add_argument(
        "--config",
        type=path_argument,
        metavar="PYPROJECT",
        help=(
            "pyproject.toml to read [tool.fsm_cache.audit] from, for every file "
            "(default: the nearest one at or above each file)"
        ),
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Audit ``args.paths``, print the report, and return the exit status.

    Folders with no Python file under them are named on stderr: a CI step
    pointed at the wrong folder would otherwise pass, having read nothing.
    """
    files = _python_files(args.paths)
    if not files:
        named = ", ".join(args.paths)
        sys.stderr.write(
            one_line(f"warning: no Python files under {named}: nothing was audited") + "\n"
        )
    findings = _findings(files, ConfigFinder(args.config, args.pair))
    sys.stdout.write(render_report(findings, args.format))
    return 1 if findings else 0


def audit_paths(
    paths: Sequence[str], config: AuditConfig | ConfigFinder | None = None
) -> list[Finding]:
    """Return the findings of every Python file under ``paths``, sorted by place.

    ``config`` applies to every file when it is an :class:`AuditConfig`; by
    default each file gets the config of the nearest pyproject.toml above it.
    """
    return _findings(_python_files(paths), ConfigFinder() if config is None else config)


def _findings(files: Sequence[str], configs: AuditConfig | ConfigFinder) -> list[Finding]:
    """Return the findings of ``files``, sorted by place."""
    sources = [(path, _read(path)) for path in files]
    return sorted(
        finding
        for path, source in sources
        for finding in check_source(source, path, _config_of(configs, path))
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``audit`` as a standalone program (``python -m fsm_cache.audit``).

    It ends as ``fsm-cache audit`` does: both run under
    :func:`~fsm_cache.shell.run_command` (the audit cannot import the CLI).
    """
    return run_command(partial(_standalone, sys.argv[1:] if argv is None else argv))


def _standalone(argv: Sequence[str]) -> int:
    """Parse ``argv`` as ``fsm-cache audit``'s arguments and run the audit."""
    parser: argparse.ArgumentParser = Parser(prog="fsm-cache")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", *argv])
    status: int = args.handler(args)
    return status


def _config_of(config: AuditConfig | ConfigFinder, path: str) -> AuditConfig:
    return config.for_file(path) if isinstance(config, ConfigFinder) else config


def _python_files(paths: Sequence[str]) -> list[str]:
    """Return the files named, and the ``.py`` files under the folders named, in order.

    A file reached twice (named twice, or named and under a folder named) is
    kept once, as first reached (:func:`~fsm_cache.shell.named_once`). A
    file named is a Python source by the rule a folder's files are: its name
    ends in ``.py``. ``audit pyproject.toml`` read the TOML as Python and
    reported its syntax error, or passed in silence on a file that parsed.

    Raises:
        AuditError: A path is missing, not a regular file or folder, or not
            named ``*.py``; or a folder cannot be listed or holds a ``.py``
            entry that cannot be read (:func:`_walk`).
    """
    found: list[str] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += [str(file) for file in _walk(path)]
        elif not path.exists() and not path.is_symlink():
            raise AuditError(f"{name}: no such file or directory")
        else:
            found.append(_source(path, name))
    return named_once(found)


def _source(path: Path, name: str) -> str:
    """Return ``name`` if it is a ``.py`` file one can read.

    Raises:
        AuditError: It is not named ``*.py``, or is not a regular file (a
            named pipe, a dangling link, a link loop).
    """
    why = unreadable(path)
    if why is not None:
        raise AuditError(f"{name}: cannot read: {why}")
    if not _is_python(path.name):
        raise AuditError(f"{name}: not a Python source: its name does not end in .py")
    return name


def _is_python(name: str) -> bool:
    """Return whether a file of this name is a Python source to audit."""
    return name.endswith(".py")


def _walk(root: Path) -> list[Path]:
    """Return the ``.py`` files under ``root``, sorted, skipping hidden and vendored folders.

    A ``.py`` entry that is not a regular file one can read (a named pipe, a
    dangling link, a link loop) is bad input, as it is when named: skipped,
    its code would pass the audit unread. Links to folders are not followed,
    so a link loop between folders ends the walk rather than repeating it.

    Raises:
        AuditError: A folder under ``root`` cannot be listed, or a ``.py``
            entry cannot be read.
    """

    def refuse(exc: OSError) -> None:
        raise AuditError(f"{exc.filename}: cannot list: {exc.strerror or exc}")

    files: list[Path] = []
    for folder, dirs, names in os.walk(root, onerror=refuse):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in _SKIPPED_DIRS)]
        here = Path(folder)
        files.extend(Path(_source(here / n, str(here / n))) for n in names if _is_python(n))
    return sorted(files)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except OSError as exc:
        raise AuditError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except SyntaxError as exc:  # a bad or missing coding cookie
        raise AuditError(f"{path}: cannot decode: {exc.msg}") from None
    except (UnicodeDecodeError, LookupError) as exc:
        raise AuditError(f"{path}: cannot decode: {exc}") from None
