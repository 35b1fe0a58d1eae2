"""Markdown transition tables of a diagram: states, transitions, refusals.

The tables list what a picture cannot hold: every guard, update and effect,
and every refused (state, event) pair with its error class and reason. They
are rendered from the same :class:`~fsm_cache.diagram.ir.Diagram` as the pictures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fsm_cache.diagram.ir import (
    COMMENT_MARK,
    Diagram,
    DiagramBirth,
    DiagramEdge,
    DiagramState,
    Region,
    condition_text,
    one_line,
)


def markdown_tables(diagram: Diagram) -> str:
    """Return Markdown tables: states, transitions, refused pairs and cross-region refusals.

    The first line marks the document as generated
    (:data:`~fsm_cache.diagram.ir.COMMENT_MARK`, an HTML comment: no reader sees it).
    Each machine's tables follow its name and ``doc``; a composition's own
    ``doc``, where it has one, comes first, then its births, a row each.

    A highlighted state is bold in each row it starts and marked ``(here)`` in the
    states table, so a report can show where a node was and what it could do there.
    """
    return f"{COMMENT_MARK}\n\n{_tables(diagram)}"


def markdown_sections(diagrams: Sequence[Diagram]) -> str:
    """Return one Markdown document of several diagrams' tables, a ``## NAME`` section each.

    The mark comes once, in the document's first line, as in :func:`markdown_tables`.
    Each heading writes the name as a code span, as the tables do: it is free
    text, and ``kv <v2> *fast*`` would otherwise lose ``<v2>`` as HTML and set
    ``fast`` in italics.
    """
    sections = [f"## {_c(diagram.name)}\n\n{_tables(diagram)}" for diagram in diagrams]
    return f"{COMMENT_MARK}\n\n" + "\n".join(sections)


def _tables(diagram: Diagram) -> str:
    """Return the tables of :func:`markdown_tables`, without the mark."""
    parts: list[str] = []
    if diagram.composed and diagram.doc:
        parts.append(_heading(f"**{_c(diagram.name)}**", diagram.doc))
    if diagram.births:
        parts += _md_births(diagram.name, diagram.births)
    for region in diagram.regions:
        title = f"Region {_c(region.name)}: " if diagram.composed else ""
        here = {state for name, state in diagram.highlight if name == region.name}
        parts.append(_heading(f"**{title}{_c(region.machine)}**", region.doc))
        parts.append(_md_states(region, here))
        parts.append(_md_edges(region, here))
        if region.refusals:
            parts.append(_md_table(
                ("state", "event", "guard", "refused with", "reason"),
                [(_state(r.state, here), _c(r.event), _c(r.guard), _c(r.error), r.reason) for r in region.refusals],
            ))  # fmt: skip
    if diagram.refusals:
        parts.append(f"**Refused across regions and along the tree** ({_c(diagram.name)})")
        parts.append(_md_table(
            ("event", "when", "refused with", "reason"),
            [(_c(r.event), _c(condition_text(r)), _c(r.error), r.reason) for r in diagram.refusals],
        ))  # fmt: skip
    return "\n\n".join(parts) + "\n"


def _heading(title: str, doc: str) -> str:
    """Return ``title: doc``, or the title alone for a spec without a ``doc``."""
    return f"{title}: {doc}" if doc else title


def _md_births(name: str, births: tuple[DiagramBirth, ...]) -> list[str]:
    """Return the births' heading and table: each birth's state in every region, and its doc."""
    regions = [region for region, _ in births[0].states]
    intro = (
        f"**Births** ({_c(name)}): a record starts in each region's initial state, "
        "or in the states of one of these:"
    )
    rows = [(_c(b.name), *(_c(state) for _, state in b.states), b.doc) for b in births]
    return [intro, _md_table(("birth", *map(_c, regions), "meaning"), rows)]


def _md_states(region: Region, here: set[str]) -> str:
    def marks(state: DiagramState) -> str:
        flags = (("initial", state.initial), ("final", state.final), ("here", state.name in here))
        found = [mark for mark, on in flags if on]
        return f" ({', '.join(found)})" if found else ""

    rows = [
        (_state(s.name, here, s.label) + marks(s), _c(s.invariant), s.doc) for s in region.states
    ]
    return _md_table(("state", "invariant", "meaning"), rows)


def _md_edges(region: Region, here: set[str]) -> str:
    def effect(edge: DiagramEdge) -> str:
        also = f"to {edge.propagate} too" if edge.propagate else ""
        return ", ".join(part for part in (_c(edge.effect), also) if part)

    rows = [
        (_state(e.source, here), _c(e.event), _c(e.guard), _c(e.dest), _c(e.update), effect(e))
        for e in region.edges
    ]
    return _md_table(("state", "event", "guard", "next state", "update", "effect"), rows)


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(_cell(text) for text in row) + " |" for row in rows]
    return "\n".join(lines)


_CELL_END = re.compile(r"(\\*)(\||\r\n?|\n)")
"""A ``|`` or a line ending (a lone CR too, as in CommonMark), and the backslashes before it."""


def _cell(text: str) -> str:
    r"""Return ``text`` fit for one table cell: a ``|`` escaped, line breaks as ``<br>``.

    A cell is Markdown, but a ``|`` would end it and a line break the row. The
    backslashes right before either are escaped too, so they stay as written:
    ``C:\|`` was ``C:\\|``, whose escaped backslash left the ``|`` to end the
    cell (Python-Markdown, which draws these docs, dropped the rest), and in
    ``\<br>`` CommonMark reads an escaped ``<``, showing the tag as text.
    """

    def escaped(found: re.Match[str]) -> str:
        backslashes, end = found.groups()
        return backslashes * 2 + ("\\|" if end == "|" else "<br>")

    return _CELL_END.sub(escaped, text)


def _state(name: str, here: set[str], label: str = "") -> str:
    # A highlighted state (where a node was) is bold in every row it starts.
    text = _c(label or name)
    return f"**{text}**" if name in here else text


def _c(text: str) -> str:
    """Return ``text`` as one code span, whatever backticks or line breaks it holds."""
    if not text:
        return ""
    text = one_line(text)
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
