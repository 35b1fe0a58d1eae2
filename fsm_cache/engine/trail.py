"""Trails: the call sites of an instance's last few events.

In trail mode each record keeps a bounded deque of ``(event, site)`` entries.
A refusal then says what happened before and where the refused call itself
came from, e.g. ``pinned at a.py:10 in backup; released at b.py:20 in drain;
refused at c.py:31 in abort``: both cleanup paths of a double release, which is
the information SGLang's ``Host reference counter is already zero.`` never had.

Sites are the first frame outside fsm_cache's own dispatch modules, so they
point at the user's code, not at the engine. A verb that code outside fsm_cache
asked for (:meth:`~fsm_cache.engine.core.Engine.verb`) is called by that code,
so it notes its immediate caller and skips the walk; verbs fsm_cache's own
dispatch code asked for walk past it.

Trail mode was called audit mode up to fsm_cache 0.1; the ``audit=`` keyword
and the ``FSM_CACHE_AUDIT`` variable still work for one release, with a
:class:`DeprecationWarning`. "Audit" now means only the static checker,
``fsm-cache audit`` (:mod:`fsm_cache.audit`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType

from fsm_cache.engine.runtime import caller_frame
from fsm_cache.errors import BadArgument, ConfigError


_INTERNAL: set[str] = set()
ENV_FLAG = "FSM_CACHE_TRAIL"
"""The environment variable that turns trail mode on for the process (``1``, ``yes``)."""
OLD_ENV_FLAG = "FSM_CACHE_AUDIT"
"""The deprecated name of :data:`ENV_FLAG`, read (with a warning) when it is set."""
_OFF = ("0", "false", "no")


def is_internal(filename: str) -> bool:
    """Return whether ``filename`` is dispatch code that call sites skip over."""
    return filename in _INTERNAL


def internal(filename: str) -> None:
    """Mark a module file as dispatch code that call sites skip over."""
    _INTERNAL.add(filename)


def forget(filename: str) -> None:
    """Stop treating ``filename`` as dispatch code (generated code no function runs any more)."""
    _INTERNAL.discard(filename)


def internal_files() -> set[str]:
    """Return the live set of dispatch files (generated code checks it directly)."""
    return _INTERNAL


def from_environment(stacklevel: int = 1) -> bool:
    """Return whether trail mode is on by default: ``FSM_CACHE_TRAIL=1``.

    An empty value counts as unset; ``0``, ``false`` and ``no`` (any case) are
    off, anything else on. The deprecated ``FSM_CACHE_AUDIT`` is read when set,
    with a :class:`DeprecationWarning` attributed ``stacklevel`` frames above
    the caller.

    Raises:
        ConfigError: Both variables are set and one turns trail mode on, the
            other off.
    """
    new, old = os.environ.get(ENV_FLAG, ""), os.environ.get(OLD_ENV_FLAG, "")
    if not old:
        return _on(new)
    if new and _on(new) != _on(old):
        raise ConfigError(
            f"{ENV_FLAG}={new} and {OLD_ENV_FLAG}={old} disagree; "
            f"set {ENV_FLAG} only ({OLD_ENV_FLAG} is its deprecated name)"
        )
    warnings.warn(
        f"{OLD_ENV_FLAG} is deprecated; set {ENV_FLAG}={old} instead",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return _on(old)


def check_flags(where: str, trail: object, audit: object) -> None:
    """Raise BadArgument unless ``trail`` and ``audit`` are each a bool or None.

    :func:`choose` passes any value through; a caller whose arguments they are
    checks them first (the cache's configuration raises its own ConfigError).

    Args:
        where: The callable the arguments were passed to (``Engine``), for messages.
        trail: The ``trail=`` argument.
        audit: The ``audit=`` argument.
    """
    for name, value in (("trail", trail), ("audit", audit)):
        if value is not None and not isinstance(value, bool):
            raise BadArgument(f"{where}: {name} must be a bool or None, got {value!r}")


def choose(trail: bool | None, audit: bool | None, where: str, stacklevel: int = 1) -> bool | None:
    """Return the trail mode asked for by ``trail=`` or by its deprecated spelling ``audit=``.

    Args:
        trail: The ``trail=`` argument; None when not given.
        audit: The ``audit=`` argument; None when not given. Given, it warns
            with a :class:`DeprecationWarning` naming ``trail=``.
        where: The callable the arguments were passed to (``Engine``), for messages.
        stacklevel: Which frame above the caller the warning is attributed to.

    Returns:
        The mode, or None when neither argument was given (the caller falls
        back on :func:`from_environment`).

    Raises:
        ConfigError: Both spellings were given, with different values.
    """
    if audit is None:
        return trail
    if trail is not None and trail != audit:
        raise ConfigError(
            f"{where}: trail={trail} and audit={audit} disagree; "
            "pass trail= only (audit= is its deprecated spelling)"
        )
    warnings.warn(
        f"{where}(audit=...) is deprecated; pass {where}(trail={audit}) instead",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return audit


def _on(value: str) -> bool:
    return value.lower() not in ("", *_OFF)


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
    frame = caller_frame(1)
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
    frame = caller_frame(1)
    while frame.f_back is not None and frame.f_code.co_filename in _INTERNAL:
        frame = frame.f_back
    trail.append((event, frame.f_code, frame.f_lasti))
    return trail


Spot = tuple[CodeType, int]
"""A call site as it is kept: the code object and instruction offset (see :func:`spot_site`)."""


def caller_spot() -> Spot:
    """Return the code and offset of the first frame outside fsm_cache's dispatch modules.

    :func:`caller_site` without its cost: the line and the :class:`Site` are
    made only when :func:`spot_site` renders it.
    """
    frame = caller_frame(1)
    while frame.f_back is not None and frame.f_code.co_filename in _INTERNAL:
        frame = frame.f_back
    return frame.f_code, frame.f_lasti


def site_of(entry: Entry) -> Site:
    """Return the :class:`Site` of a trail entry, mapping its instruction offset to a line."""
    return spot_site(entry[1:])


@functools.lru_cache(maxsize=4096)
def spot_site(spot: Spot) -> Site:
    """Return the :class:`Site` of a kept call site, mapping its instruction offset to a line.

    Kept per spot: the mapping scans the code's whole line table, and a
    refusal in trail mode maps every entry of the record's trail, most of
    them the same few call sites.
    """
    code, lasti = spot
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


def account(
    recent: Sequence[tuple[str, Site]], past: dict[str, str], refused: Site | None = None
) -> str:
    """Render ``pinned at a.py:10 in f; released at b.py:2 in g and at ...; refused at ...``.

    The events are named in the order they fired, so a double release across
    repeated cycles (pin, release, pin, release, release) reads as it
    happened; only a run of the same event in a row shares its name
    (``released at b.py:2 in g and at c.py:5 in h``). The message is bounded
    as the trail is: one site per entry, at most ``history`` of them.

    Args:
        recent: The record's earlier events and their sites, oldest first.
        past: Past-tense names declared by the spec, by event.
        refused: The site of the refused call itself, named last; None omits it.
    """
    runs: list[tuple[str, list[Site]]] = []
    for event, site in recent:
        if runs and runs[-1][0] == event:
            runs[-1][1].append(site)
        else:
            runs.append((event, [site]))
    parts = []
    for event, where in runs:
        joined = " and ".join(f"at {site}" for site in where)
        parts.append(f"{past.get(event) or past_tense(event)} {joined}")
    if refused is not None:
        parts.append(f"refused at {refused}")
    return "; ".join(parts)
