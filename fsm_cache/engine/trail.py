"""Audit trails: the call sites of an instance's last few events.

In audit mode each record keeps a bounded deque of ``(event, site)`` entries.
A refusal then says what happened before and where the refused call itself
came from, e.g. ``pinned at a.py:10 in backup; released at b.py:20 in drain;
refused at c.py:31 in abort``: both cleanup paths of a double release, which is
the information SGLang's ``Host reference counter is already zero.`` never had.

Sites are the first frame outside fsm_cache's own dispatch modules, so they
point at the user's code, not at the engine.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType


_INTERNAL: set[str] = set()
ENV_FLAG = "FSM_CACHE_AUDIT"


def is_internal(filename: str) -> bool:
    """Return whether ``filename`` is dispatch code that call sites skip over."""
    return filename in _INTERNAL


def internal(filename: str) -> None:
    """Mark a module file as dispatch code that call sites skip over."""
    _INTERNAL.add(filename)


def internal_files() -> set[str]:
    """Return the live set of dispatch files (generated code checks it directly)."""
    return _INTERNAL


def audit_default() -> bool:
    """Return whether audit mode is on by default (``FSM_CACHE_AUDIT=1``)."""
    return os.environ.get(ENV_FLAG, "") not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Site:
    """Where an event was fired: file (base name), line and function."""

    filename: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.line} in {self.function}"


def caller_site() -> Site:
    """Return the first frame outside fsm_cache's dispatch modules."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in _INTERNAL:
        frame = frame.f_back
    return Site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


# NOTE: entries keep the code object and line, not a Site: building a Site per event
# would cost more than the event itself, and so would the frame's line number: they keep
# the instruction offset and are rendered only when a refusal needs them.
Entry = tuple[str, CodeType, int]
Trail = deque[Entry]


def note(trail: Trail | None, event: str, length: int) -> Trail:
    """Append ``event`` at the caller's site to ``trail`` (creating it) and return it."""
    if trail is None:
        trail = deque(maxlen=length)
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in _INTERNAL:
        frame = frame.f_back
    trail.append((event, frame.f_code, frame.f_lasti))
    return trail


def site_of(entry: Entry) -> Site:
    """Return the :class:`Site` of a trail entry, mapping its instruction offset to a line."""
    _, code, lasti = entry
    line = next(
        (ln for start, end, ln in code.co_lines() if start <= lasti < end and ln is not None),
        code.co_firstlineno,
    )
    return Site(code.co_filename, line, code.co_name)


Sites = tuple[tuple[str, Site], ...]


def sites(trail: Trail | None) -> Sites:
    """Return a trail's ``(event, site)`` pairs, oldest first; None has none."""
    return tuple((entry[0], site_of(entry)) for entry in trail) if trail else ()


def past_tense(event: str) -> str:
    """Return a readable past tense of a one-word event (``pin`` -> ``pinned``)."""
    if "_" in event or not event.isalpha():
        return event
    if event.endswith("e"):
        return event + "d"
    vowels = "aeiou"
    # Double the final consonant of one-syllable words only (pin -> pinned, open -> opened).
    one_syllable = sum(ch in vowels for ch in event) == 1
    single_vowel = len(event) >= 3 and event[-2] in vowels and event[-3] not in vowels
    if one_syllable and single_vowel and event[-1] not in vowels + "wxy":
        return event + event[-1] + "ed"
    return event + "ed"


def render(
    recent: Sequence[tuple[str, Site]], past: dict[str, str], refused: Site | None = None
) -> str:
    """Render ``pinned at a.py:10 in f; released at b.py:2 in g and at ...; refused at ...``.

    Args:
        recent: The record's earlier events and their sites, oldest first.
        past: Past-tense names declared by the spec, by event.
        refused: The site of the refused call itself, named last; None omits it.
    """
    groups: dict[str, list[Site]] = {}
    for event, site in recent:
        groups.setdefault(event, []).append(site)
    parts = []
    for event, where in groups.items():
        joined = " and ".join(f"at {site}" for site in where)
        parts.append(f"{past.get(event) or past_tense(event)} {joined}")
    if refused is not None:
        parts.append(f"refused at {refused}")
    return "; ".join(parts)
