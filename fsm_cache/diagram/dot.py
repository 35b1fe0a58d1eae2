"""Graphviz rendering of a :class:`~fsm_cache.diagram.ir.Diagram`: DOT source, and SVG via ``dot``.

Regions of a composed machine become side-by-side clusters; cross-region
refusals are listed in a note; each birth is a start point of its own in every
region, its dashed arrow labelled ``birth NAME``.
"""

from __future__ import annotations

import shutil
import subprocess

from fsm_cache.diagram.ir import (
    COMMENT_MARK,
    HIGHLIGHT_FILL,
    Diagram,
    DiagramError,
    Region,
    birth_id,
    births_in,
    generated,
    one_line,
    parallel,
    refusal_line,
    start_id,
    state_id,
)


def dot(diagram: Diagram) -> str:
    """Return a Graphviz DOT digraph of the diagram (regions as side-by-side clusters).

    Its first line is a ``//`` comment that marks it as generated
    (:func:`~fsm_cache.diagram.ir.is_diagram`).
    """
    lines = [
        f"// {generated(diagram.name)}",
        f"digraph {_q(diagram.name)} {{",
        '    graph [fontname="Helvetica", labeljust=l];',
        '    node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
    ]
    for region in diagram.regions:
        body = _dot_region(diagram, region)
        if diagram.composed:
            title = f"{region.name}: {region.machine}"
            body = [f"subgraph {_q('cluster_' + region.name)} {{", f"    label={_q(title)};"] + [
                "    " + line for line in body
            ]
            body.append("}")
        lines += ["    " + line for line in body]
    if diagram.refusals:
        note = "".join(f"{refusal_line(r)}\\l" for r in diagram.refusals)
        lines.append(f'    "refusals" [shape=note, label="refused across regions:\\l{note}"];')
    return "\n".join([*lines, "}"]) + "\n"


def _dot_region(diagram: Diagram, region: Region) -> list[str]:
    def ident(state: str) -> str:
        return _q(state_id(diagram, region.name, state))

    lines = []
    for state in region.states:
        attrs = [f"label={_q(state.label)}"]
        if state.final:
            attrs.append("peripheries=2")
        if (region.name, state.name) in diagram.highlight:
            attrs.append(f'style="rounded,filled,bold", fillcolor="{HIGHLIGHT_FILL}"')
        lines.append(f"{ident(state.name)} [{', '.join(attrs)}];")
    for state in region.states:
        if state.initial:
            start = _q(start_id(diagram, region.name))
            lines += [f'{start} [shape=point, label=""];', f"{start} -> {ident(state.name)};"]
    for birth, born in births_in(diagram, region.name):
        start = _q(birth_id(diagram, region.name, birth))
        lines += [
            f'{start} [shape=point, label=""];',
            f"{start} -> {ident(born)} [label={_q(f'birth {birth}')}, style=dashed];",
        ]
    lines += [
        f"{ident(src)} -> {ident(dst)} [label={_q(*labels)}];"
        for (src, dst), labels in parallel(region).items()
    ]
    return lines


def _q(*lines: str) -> str:
    """Quote text for DOT, one line per argument; unprintable characters are escaped."""
    escaped = (one_line(line).replace("\\", "\\\\").replace('"', '\\"') for line in lines)
    return '"' + "\\n".join(escaped) + '"'


DOT_SECONDS = 60.0
"""How long ``dot`` may draw one diagram: a spec's pictures take well under a second."""


def svg(diagram: Diagram) -> str:
    """Return the diagram as SVG, drawn by Graphviz's ``dot``, marked as generated.

    The mark (:data:`~fsm_cache.diagram.ir.COMMENT_MARK`) is an XML comment
    after the XML declaration, so ``fsm-cache diagram`` knows the file for its own.

    Raises:
        DiagramError: ``dot`` is not on PATH, or it failed, took longer than
            :data:`DOT_SECONDS`, or wrote something that is not UTF-8.
    """
    program = shutil.which("dot")
    if program is None:
        msg = "svg output needs Graphviz's 'dot' on PATH (Debian: apt-get install graphviz); --format dot writes the source without it"
        raise DiagramError(msg)
    try:
        done = subprocess.run(
            [program, "-Tsvg"],
            input=dot(diagram).encode(),
            capture_output=True,
            check=False,
            timeout=DOT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise DiagramError(f"dot -Tsvg ({program}) ran past {DOT_SECONDS:g} s; stopped") from None
    except OSError as exc:  # not executable, say
        raise DiagramError(f"dot -Tsvg ({program}) could not run: {exc.strerror}") from None
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip()
        raise DiagramError(f"dot -Tsvg failed with exit status {done.returncode}: {reason}")
    try:
        drawn = str(done.stdout.decode())
    except UnicodeDecodeError as exc:
        raise DiagramError(
            f"dot -Tsvg ({program}) wrote bytes that are not UTF-8 (at byte {exc.start})"
        ) from None
    # The mark goes after the XML declaration, which nothing may precede.
    declaration, _, rest = drawn.partition("\n")
    if declaration.startswith("<?xml"):
        return f"{declaration}\n{COMMENT_MARK}\n{rest}"
    return f"{COMMENT_MARK}\n{drawn}"
