"""Mermaid ``stateDiagram-v2`` rendering of a :class:`~fsm_cache.diagram.ir.Diagram`.

Composed machines are drawn as composite states side by side, their
cross-region and tree refusals in a note beside the last region, and each
birth as an arrow from a region's start point labelled ``birth NAME``; parallel
edges between two states are merged into one multi-line label.
"""

from __future__ import annotations

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
    lines = ["stateDiagram-v2", f"    %% {generated(diagram.name)}"]
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
    marked = [state_id(diagram, region, state) for region, state in sorted(diagram.highlight)]
    if marked:
        style = f"fill:{HIGHLIGHT_FILL},stroke:{HIGHLIGHT_STROKE},stroke-width:3px"
        lines += [f"    classDef here {style}", f"    class {','.join(marked)} here"]
    return "\n".join(lines) + "\n"


def _mermaid_region(diagram: Diagram, region: Region) -> list[str]:
    lines = []
    for state in region.states:
        lines.append(f'state "{state.label}" as {state_id(diagram, region.name, state.name)}')
    for state in region.states:
        if state.initial:
            lines.append(f"[*] --> {state_id(diagram, region.name, state.name)}")
    # Mermaid has one start point per composite state: a birth is a labelled arrow from it.
    for birth, born in births_in(diagram, region.name):
        target = state_id(diagram, region.name, born)
        lines.append(f"[*] --> {target} : {_mermaid_text(f'birth {birth}')}")
    for (source, dest), labels in parallel(region).items():
        src, dst = state_id(diagram, region.name, source), state_id(diagram, region.name, dest)
        lines.append(f"{src} --> {dst} : {'<br/>'.join(map(_mermaid_text, labels))}")
    for state in region.states:
        if state.final:
            lines.append(f"{state_id(diagram, region.name, state.name)} --> [*]")
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
