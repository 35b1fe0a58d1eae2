"""Negative controls: deliberately broken specs and modules, each with its expected finding.

``specs/bugs_detected/`` holds broken variants of the shipped machines. A
control is a ``NAME.toml`` (or ``NAME.py``) beside a ``NAME.expected`` file
whose one line reads ``TOOL: FINDING``: the tool that must find the bug
(``validate`` at load time, ``verify`` with CrossHair, or ``check``, the model
checker) and the first line of what it reports. Files without an
``.expected`` are parts of a control (a broken machine a composition uses).
A control that stops yielding its finding means a checker lost its teeth.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm_cache.errors import SpecError
from fsm_cache.spec.loader import load_snapshot
from fsm_cache.spec.machine import Spec
from fsm_cache.spec.shipped import spec_dir


TOOLS = ("validate", "verify", "check")
_COUNTEREXAMPLE = ": counterexample: "


@dataclass(frozen=True)
class Control:
    """One negative control.

    Attributes:
        path: The broken spec (``.toml``) or contracts module (``.py``).
        tool: Which checker must find the bug.
        finding: The expected first line of its report.
    """

    path: Path
    tool: str
    finding: str

    @property
    def name(self) -> str:
        """The control's file name."""
        return self.path.name

    @property
    def expected(self) -> str:
        """The finding as a report line: ``TOOL: FINDING``."""
        return f"{self.tool}: {self.finding}"

    def matches(self, found: str) -> bool:
        """Whether ``found`` (a checker's first report line) is this control's finding.

        The arguments of a CrossHair counterexample depend on the order its
        search takes, which differs between machines and versions; what must
        not change is which function broke which contract. So a finding
        ``...: counterexample: ARGS`` matches on the text before ``ARGS``;
        every other finding must match exactly.
        """
        head, sep, _ = self.expected.partition(_COUNTEREXAMPLE)
        return found == self.expected or (bool(sep) and found.startswith(head + sep))


def control_dir() -> Path:
    """Return the folder of the shipped negative controls."""
    return spec_dir() / "bugs_detected"


def controls(folder: Path | None = None, tools: tuple[str, ...] = TOOLS) -> list[Control]:
    """Return the controls in ``folder`` whose tool is one of ``tools``, sorted by name.

    Raises:
        SpecError: An ``.expected`` file is malformed or has no control beside it.
    """
    found = []
    for expected in sorted((folder or control_dir()).glob("*.expected")):
        control = _control(expected)
        if control.tool in tools:
            found.append(control)
    return found


def load_finding(path: Path) -> tuple[tuple[Spec, dict[str, bytes]] | None, str]:
    """Load a spec; return it, or None and the validator's first problem (paths made relative).

    What loaded comes with the bytes it was built from
    (:func:`~fsm_cache.spec.loader.load_snapshot`), so a checker of the
    control builds that version again rather than read the files anew.
    """
    try:
        return load_snapshot(path), ""
    except SpecError as exc:
        return None, relative(exc.problems[0], path.parent)


def relative(text: str, folder: Path) -> str:
    """Drop ``folder``'s path from ``text`` so findings read the same from any directory."""
    for prefix in (f"{folder.resolve()}/", f"{folder}/"):
        text = text.replace(prefix, "")
    return text


def _control(expected: Path) -> Control:
    lines = expected.read_text(encoding="utf-8").strip().splitlines()
    tool, _, finding = (lines[0] if lines else "").partition(": ")
    if tool not in TOOLS or not finding:
        raise SpecError([f"{expected}: expected 'TOOL: FINDING' with TOOL one of {TOOLS}"])
    for suffix in (".toml", ".py"):
        path = expected.with_suffix(suffix)
        if path.is_file():
            return Control(path, tool, finding)
    raise SpecError([f"{expected}: no {expected.stem}.toml or {expected.stem}.py beside it"])


def render_controls(checked: list[dict[str, Any]]) -> list[str]:
    """Return one line per negative control: found as expected (``ok``) or ``LOST``."""
    lines = []
    for c in checked:
        mark = "ok  " if c["ok"] else "LOST"
        lines.append(f"control {mark} {c['control']}: {c['found'] or 'no finding'}")
        if not c["ok"]:
            lines.append(f"     expected {c['expected']}")
    return lines
