"""Mermaid ``stateDiagram-v2`` rendering of a :class:`~fsm_cache.diagram.ir.Diagram`.

Composed machines are drawn as composite states side by side, their
cross-region and tree refusals in a note beside the last region, and each
birth as an arrow from a region's start point labelled ``birth NAME``; parallel
edges between two states are merged into one multi-line label. A machine's
state named as a Mermaid keyword (``note``) is drawn through an id with a
trailing ``_`` (:data:`KEYWORDS`), its label unchanged; so is one named
``root``, Mermaid's id of the diagram itself.
"""

from __future__ import annotations

import re

from fsm_cache.diagram.ir import (
    HIGHLIGHT_FILL,
    HIGHLIGHT_STROKE,
    Diagram,
    Region,
    births_in,
    composite_id,
    generated,
    one_line,
    parallel,
    refusal_line,
    state_id,
)


def mermaid(diagram: Diagram) -> str:
    """Return a Mermaid ``stateDiagram-v2`` of the diagram."""
    mark = generated(_DIRECTIVE.sub("\uff05", diagram.name))
    lines = ["stateDiagram-v2", f"    %% {mark}"]
    for region in diagram.regions:
        indent = "    "
        if diagram.composed:
            title = one_line(region.name)
            lines.append(f'    state "{title}" as {composite_id(region.name)} {{')
            indent = "        "
        lines += [indent + line for line in _mermaid_region(diagram, region)]
        if diagram.composed:
            lines.append("    }")
    lines += _refusal_note(diagram)
    marked = [_id(diagram, region, state) for region, state in sorted(diagram.highlight)]
    if marked:
        style = f"fill:{HIGHLIGHT_FILL},stroke:{HIGHLIGHT_STROKE},stroke-width:3px"
        lines += [f"    classDef here {style}", f"    class {','.join(marked)} here"]
    return "\n".join(lines) + "\n"


KEYWORDS = frozenset(
    word.casefold()
    for word in (
        "accDescr", "accTitle", "class", "classDef", "click", "default", "direction",
        "end", "href", "note", "root", "scale", "state", "stateDiagram", "style",
    )
)  # fmt: skip
"""Words Mermaid's ``stateDiagram`` reads as keywords where an id stands, in any case.

Mermaid 11's lexer takes ``note``, ``state``, ``scale``, ``style``,
``class``, ``classDef``, ``click``, ``href``, ``default``, ``accTitle``,
``accDescr`` and ``stateDiagram`` before an id (``a --> note : go`` is a
parse error); ``end`` and ``direction`` close a note and set a layout, and
are kept out too. ``root`` parses, but is the id Mermaid gives the diagram's
own document: its renderer draws no state of that id, and leaves the arrows
to and from it dangling (only that spelling; any case is kept out, as for the others).
A spec name may be any of them but ``class`` (a Python keyword), ``Class``
included.
"""


def _id(diagram: Diagram, region: str, state: str) -> str:
    """Return a state's Mermaid id: :func:`~fsm_cache.diagram.ir.state_id`, kept off :data:`KEYWORDS`.

    A keyword id gets a trailing ``_`` (``note_``). It is still no other
    state's id: a machine's ids hold only even runs of underscores, and a
    composition's are never keywords (each holds a ``_``, no keyword does).
    """
    ident = state_id(diagram, region, state)
    return f"{ident}_" if ident.casefold() in KEYWORDS else ident


def _mermaid_region(diagram: Diagram, region: Region) -> list[str]:
    def ident(state: str) -> str:
        return _id(diagram, region.name, state)

    lines = []
    for state in region.states:
        lines.append(f'state "{state.label}" as {ident(state.name)}')
    for state in region.states:
        if state.initial:
            lines.append(f"[*] --> {ident(state.name)}")
    # Mermaid has one start point per composite state: a birth is a labelled arrow from it.
    for birth, born in births_in(diagram, region.name):
        lines.append(f"[*] --> {ident(born)} : {_mermaid_text(f'birth {birth}')}")
    for (source, dest), labels in parallel(region).items():
        src, dst = ident(source), ident(dest)
        lines.append(f"{src} --> {dst} : {'<br/>'.join(map(_mermaid_text, labels))}")
    for state in region.states:
        if state.final:
            lines.append(f"{ident(state.name)} --> [*]")
    return lines


def _refusal_note(diagram: Diagram) -> list[str]:
    """Return a note listing the composition's own refusals, as DOT's note and md's table do.

    Mermaid draws no floating note in a state diagram, so it hangs off the last region.
    """
    if not diagram.refusals or not diagram.regions:
        return []
    texts = ["refused across regions:", *(refusal_line(r) for r in diagram.refusals)]
    body = [f"        {_note_text(text)}" for text in texts]
    return [f"    note right of {composite_id(diagram.regions[-1].name)}", *body, "    end note"]


_DIRECTIVE = re.compile(r"%(?=\{)")
"""A ``%`` that begins a ``{``: Mermaid reads ``%%{...}%%`` as a directive anywhere in a diagram.

A spec's name is free text, and the mark's comment writes it
(``%% NAME: generated...``): ``%%{init: ...}%%`` in it would restyle the
picture, or hide its states. A ``%`` before each ``{`` is drawn fullwidth
instead (U+FF05), so the comment holds no directive and still marks the file.
"""

_MERMAID_UNSAFE = str.maketrans({":": "\uff1a", ";": "\uff1b", "#": "\uff03"})


def _mermaid_text(text: str) -> str:
    # NOTE: Mermaid ends a label at ':' or ';' and reads '#' as an entity start; the spec
    # grammar produces none of them, but a future operator must not break every diagram.
    return text.translate(_MERMAID_UNSAFE)


def _note_text(text: str) -> str:
    # A multi-line note ends only at its 'end note' line, so ':' may stay (a refusal
    # line always holds ' when ', never that alone); '#' and ';' still read as an entity.
    return one_line(text).translate(_NOTE_UNSAFE)


_NOTE_UNSAFE = str.maketrans({";": "\uff1b", "#": "\uff03"})
