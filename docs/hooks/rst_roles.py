"""Sphinx cross-reference roles in docstrings, made Markdown for the API reference.

The docstrings are Google style but cross-reference the Sphinx way
(``:class:`~fsm_cache.engine.core.Engine```), and a paragraph ends in ``::`` before a
literal block. mkdocstrings renders neither, so the site would show the raw
markup. Two parts, both named in ``mkdocs.yml``:

- :class:`RstRoles`, a Griffe extension, rewrites each docstring of the loaded
  package before mkdocstrings renders it: a role becomes a code span linked to
  the object's API anchor (resolved as Python would, from the docstring's own
  scope), or a plain code span when the target is not documented; ``text::``
  becomes ``text:``.
- :func:`on_page_content`, a MkDocs hook, warns about any role or ``::`` left
  in a rendered page, which fails the strict build.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import griffe
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.pages import Page


ROLE = re.compile(r"(?<![\w:`]):(?:[a-z]+:)?(?P<role>[a-z]+):`(?P<short>~?)(?P<target>[^`]+)`")
# A Python-domain role names an object, so it can link to the object's anchor.
LINKED_ROLES = frozenset(("attr", "class", "const", "data", "exc", "func", "meth", "mod", "obj"))
LITERAL_MARKER = re.compile(r"^(?P<text>.*?)(?P<space>[ \t]*)::[ \t]*$(?=\n[ \t]*\n)", re.MULTILINE)
LEFT_OVER = re.compile(r":(?:[a-z]+:)?[a-z]+:<code>|::</p>")
# A role's explicit title, ``:meth:`the split <fsm_cache.cache.tree.RadixTree.split>```,
# which a docstring may break over lines like any other text.
TITLED = re.compile(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", re.DOTALL)

log = get_plugin_logger(__name__)


def rewrite(text: str, resolve: Callable[[str], str | None]) -> str:
    """Return ``text`` with its roles as code spans or autorefs and its ``::`` as ``:``.

    Args:
        text: A docstring.
        resolve: Maps a role's target as written to the dotted path of the object
            it names, or None when it names nothing known.
    """

    def role(match: re.Match[str]) -> str:
        target = match["target"]
        titled = TITLED.fullmatch(target)
        if titled is not None:
            target = titled["target"]
            shown = f"`{' '.join(titled['title'].split())}`"
        else:
            shown = f"`{target.rpartition('.')[2] if match['short'] else target}`"
        path = resolve(target) if match["role"] in LINKED_ROLES else None
        # NOTE: `optional` makes autorefs show a plain code span, not fail the build,
        # when the object is not rendered anywhere (private, or on no page).
        return f'<autoref identifier="{path}" optional>{shown}</autoref>' if path else shown

    def literal(match: re.Match[str]) -> str:
        # reStructuredText: "text::" reads "text:", "text ::" reads "text", "::" vanishes.
        return match["text"] if match["space"] or not match["text"] else f"{match['text']}:"

    return LITERAL_MARKER.sub(literal, ROLE.sub(role, text))


def resolver(obj: griffe.Object) -> Callable[[str], str | None]:
    """Return a function resolving role targets as written in ``obj``'s docstring.

    A dotted target is absolute when it starts with a loaded package
    (``fsm_cache.errors.LeaseError``); otherwise its first name is looked up in
    the docstring's scope (``Engine.verb`` in ``fsm_cache.engine.core``, ``fire`` in
    a method of ``Engine``).
    """

    def resolve(target: str) -> str | None:
        head, dot, rest = target.partition(".")
        try:
            return obj.resolve(head) + dot + rest
        except griffe.NameResolutionError:
            return target if dot and head in obj.modules_collection.members else None

    return resolve


def _documented(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):  # imports are aliases, documented where defined
            yield from _documented(member)


class RstRoles(griffe.Extension):
    """Rewrite the docstrings of each loaded package (see :func:`rewrite`)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite every docstring in ``pkg`` once the package is fully loaded."""
        del loader, kwargs
        for obj in _documented(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, resolver(obj))
                obj.docstring.__dict__.pop("parsed", None)  # drop a parse of the old text


def on_page_content(html: str, page: Page, **kwargs: Any) -> str:
    """Warn about reStructuredText markup left in a page; ``--strict`` makes that fatal."""
    del kwargs
    for found in LEFT_OVER.finditer(html):
        context = html[max(0, found.start() - 60) : found.end() + 40].replace("\n", " ")
        path = page.file.src_path
        log.warning("%s: reStructuredText %r left in the page: %s", path, found[0], context)
    return html
