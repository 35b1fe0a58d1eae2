"""Diagrams generated from specs: an IR built from the spec, and renderers of it.

:func:`~fsm_cache.diagram.builder.build` reads a spec into a :class:`Diagram`
(:mod:`fsm_cache.diagram.ir`); each renderer is a function of that diagram
alone, and :data:`RENDERERS` names them by format. :func:`render` is the one
entry point that joins the two, so the command line and the docs draw every
format the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from fsm_cache.diagram import dot, markdown, mermaid
from fsm_cache.diagram.builder import build
from fsm_cache.diagram.ir import (
    Diagram,
    DiagramBirth,
    DiagramEdge,
    DiagramError,
    DiagramRefusal,
    DiagramState,
    Region,
    highlight,
    is_diagram,
    normalised,
    one_line,
)


if TYPE_CHECKING:
    from fsm_cache.spec.machine import Spec


__all__ = [
    "FORMATS",
    "RENDERERS",
    "Diagram",
    "DiagramBirth",
    "DiagramEdge",
    "DiagramError",
    "DiagramRefusal",
    "DiagramState",
    "Region",
    "build",
    "highlight",
    "is_diagram",
    "normalised",
    "one_line",
    "render",
    "render_sections",
]

RENDERERS: Mapping[str, Callable[[Diagram], str]] = MappingProxyType(
    {
        "mermaid": mermaid.mermaid,
        "dot": dot.dot,
        "svg": dot.svg,
        "md": markdown.markdown_tables,
    }
)
"""Each format's renderer, by the name ``--format`` takes; read-only."""

FORMATS = tuple(RENDERERS)
"""The format names, in the order the command line lists them."""


def render(spec: Spec, fmt: str, *, mark: tuple[str, ...] = ()) -> str:
    """Render ``spec`` in ``fmt`` (one of :data:`FORMATS`), highlighting the states in ``mark``.

    Args:
        spec: The machine or composition to draw.
        fmt: The format's name, a key of :data:`RENDERERS`.
        mark: States to highlight, each ``STATE`` or ``REGION=STATE``.

    Raises:
        DiagramError: Unknown format or highlighted state, or no Graphviz for SVG.
    """
    renderer = RENDERERS.get(fmt)
    if renderer is None:
        msg = f"unknown diagram format {fmt!r} (known: {', '.join(FORMATS)})"
        raise DiagramError(msg)
    diagram = build(spec)
    for where in mark:
        diagram = highlight(diagram, where)
    return renderer(diagram)


def render_sections(specs: Sequence[Spec]) -> str:
    """Render several specs as one Markdown document, a ``## NAME`` section of tables each.

    Markdown is the one format whose document holds several specs; the others draw one picture.
    """
    return markdown.markdown_sections([build(spec) for spec in specs])
