"""The ``# fsm-cache:`` comment markers that document deliberate hand-offs.

Grammar, one comment per line, directives separated by commas, an optional
reason after ``--``::

    # fsm-cache: hands-off -- the ack handler releases it
    # fsm-cache: takes-ownership
    # fsm-cache: ignore[FSM104]

On a call line a directive covers that call; on a ``def`` line (any line of
the signature) it covers the whole function. A marker may follow another
comment on the line (``# noqa  # fsm-cache: hands-off``) and ends at the next
``#``. A near miss of the prefix (``# fsm_cache:``, ``# FSM-CACHE:``,
``# fsm-cache hands-off``) is a problem, not a comment: it would document nothing.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field

from fsm_cache.audit.model import RULES_BY_CODE


HANDS_OFF = "hands-off"
TAKES_OWNERSHIP = "takes-ownership"
IGNORE = "ignore"

_PREFIX = re.compile(r"#\s*fsm-cache\s*:(?P<body>[^#]*)")
# Another case, ``_`` or a space for the hyphen, or no colon before a directive.
_NEAR_MISS = re.compile(
    r"#\s*fsm[-_ ]?cache\b(?:\s*:|\s+(?:hands-off|takes-ownership|ignore)\b)[^#]*",
    re.IGNORECASE,
)
_DIRECTIVE = re.compile(r"\s*(?P<name>[a-z][a-z-]*)\s*(?:\[(?P<codes>[^\]]*)\])?\s*(?:,|$)")


@dataclass
class Markers:
    """The markers of one source file.

    Attributes:
        flags: Line -> the hand-off directives on it (``hands-off``, ``takes-ownership``).
        ignores: Line -> the codes ignored there; an empty set ignores every code.
        problems: (line, col, message) for each marker that could not be read.
    """

    flags: dict[int, set[str]] = field(default_factory=dict)
    ignores: dict[int, set[str]] = field(default_factory=dict)
    problems: list[tuple[int, int, str]] = field(default_factory=list)

    def has(self, lines: range | tuple[int, ...], flag: str) -> bool:
        """Return whether any of ``lines`` carries ``flag``."""
        return any(flag in self.flags.get(line, ()) for line in lines)

    def ignored(self, line: int, code: str) -> bool:
        """Return whether ``code`` is silenced on ``line``."""
        codes = self.ignores.get(line)
        return codes is not None and (not codes or code in codes)


def read_markers(source: str) -> Markers:
    """Collect the markers of ``source`` from its comment tokens (never from strings)."""
    markers = Markers()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    try:
        for token in tokens:
            if token.type == tokenize.COMMENT:
                _read_comment(markers, token.string, token.start)
    except (tokenize.TokenError, SyntaxError):
        pass  # the parser reports broken sources with a better message
    return markers


def _read_comment(markers: Markers, comment: str, start: tuple[int, int]) -> None:
    line, col = start
    match = _PREFIX.search(comment)
    if match is None:
        near = _NEAR_MISS.search(comment)
        if near is not None:
            text = near.group(0).strip()
            problem = f"misspelt fsm-cache marker {text!r} (expected '# fsm-cache: DIRECTIVE')"
            markers.problems.append((line, col + near.start() + 1, problem))
        return
    col += match.start()
    body = match.group("body").split("--", 1)[0].strip()
    pos = 0
    while pos < len(body):
        directive = _DIRECTIVE.match(body, pos)
        if directive is None or directive.end() == pos:
            markers.problems.append((line, col + 1, f"cannot read fsm-cache marker {body!r}"))
            return
        problem = _apply(markers, line, directive.group("name"), directive.group("codes"))
        if problem:
            markers.problems.append((line, col + 1, problem))
        pos = directive.end()
    if not body:
        markers.problems.append((line, col + 1, "empty fsm-cache marker"))


def _apply(markers: Markers, line: int, name: str, codes: str | None) -> str:
    if name == IGNORE:
        listed = {code.strip() for code in (codes or "").split(",") if code.strip()}
        unknown = sorted(listed - RULES_BY_CODE.keys())
        if unknown:
            return f"unknown code {unknown[0]!r} in fsm-cache marker"
        markers.ignores.setdefault(line, set()).update(listed)
        return ""
    if name in (HANDS_OFF, TAKES_OWNERSHIP) and codes is None:
        markers.flags.setdefault(line, set()).add(name)
        return ""
    return (
        f"unknown fsm-cache directive {name!r}"
        " (expected hands-off, takes-ownership or ignore[CODE,...])"
    )
