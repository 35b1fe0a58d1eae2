"""The audit as a flake8 plugin: codes ``FSM1xx``, registered under the ``FSM`` prefix.

flake8 hands the plugin a parsed tree and the file name; the comment markers
come from ``lines`` when flake8 passes them, else from the file itself. The
``[tool.fsm_cache.audit]`` table is found as the CLI finds it: in the nearest
pyproject.toml at or above each file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

from fsm_cache.audit.checker import check_tree
from fsm_cache.audit.config import ConfigFinder
from fsm_cache.audit.markers import Markers, read_markers
from fsm_cache.audit.model import VERSION, AuditError


# One flake8 process is one run: each pyproject.toml is read once for all its files.
_CONFIGS = ConfigFinder()


class AuditPlugin:
    """flake8 entry point: ``run()`` yields ``(line, col, "FSM1xx message", type)``."""

    name = "fsm-cache-audit"
    version = VERSION

    def __init__(self, tree: ast.AST, filename: str, lines: Sequence[str] | None = None) -> None:
        self.tree = tree
        self.filename = filename
        self.lines = lines

    def run(self) -> Iterator[tuple[int, int, str, type[AuditPlugin]]]:
        """Yield one flake8 result per finding; columns are 0-based, as flake8 expects.

        What the CLI reports as bad input (an unusable config, a function too
        deeply nested or too complex to analyze) becomes one FSM100 result at line 1.
        """
        if not isinstance(self.tree, ast.Module):
            return
        source = self._source()
        markers = read_markers(source) if source is not None else Markers()
        try:
            config = _CONFIGS.for_file(self.filename)
            findings = check_tree(self.tree, self.filename, config, markers, source)
        except AuditError as exc:
            yield 1, 0, f"FSM100 {exc}", type(self)
            return
        for finding in findings:
            where = f" [{finding.function}]" if finding.function else ""
            message = f"{finding.code} {finding.message}{where}"
            yield finding.line, finding.col - 1, message, type(self)

    def _source(self) -> str | None:
        """Return the source text from ``lines`` or the file; None when unreadable."""
        if self.lines is not None:
            return "".join(self.lines)
        try:
            return Path(self.filename).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
