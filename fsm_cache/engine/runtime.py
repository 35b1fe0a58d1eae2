"""What generated code calls at run time, defined once for every caller.

The engine (:mod:`fsm_cache.engine.codegen` compiles the spec into functions
that call these by name) and the CrossHair contract harness
(:mod:`fsm_cache.contracts.generate` runs the same generated text) share this
module, so the code CrossHair proves is the code the engine runs, down to
the tree tests and the effect wrapper. Torch-free, and cheap to import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

# NOTE: imported by name rather than read as ``sys._getframe``: it is CPython's documented
# frame accessor, not another component's private, and ``inspect.currentframe`` costs one
# Python call more (about 120 ns), which trail mode would pay on every event.
from sys import _getframe as caller_frame
from typing import Any

from fsm_cache.errors import EffectFailed, EffectReentered, ParentLoop


__all__ = [
    "WALK",
    "Effect",
    "Reentry",
    "caller_frame",
    "child_in",
    "effect_failed",
    "guarded",
    "looped",
    "meddled",
    "no_effect",
    "parent_in",
    "parent_loop",
    "run_effect",
]

Effect = Callable[[Any], None]
"""A hook bound to an effect name, called with the record before the commit."""


def parent_in(rec: Any, region: str, states: tuple[str, ...]) -> bool:
    """Return whether ``rec`` has a parent whose ``region`` is in ``states``.

    A record without a ``parent`` attribute, or with None there, is a root.
    """
    parent = getattr(rec, "parent", None)
    return parent is not None and getattr(parent, region) in states


def child_in(rec: Any, region: str, states: tuple[str, ...]) -> bool:
    """Return whether some child of ``rec`` has its ``region`` in ``states``.

    ``children`` may be a mapping (a tree's key -> child) or any iterable of
    children; a record without it has none.
    """
    children = getattr(rec, "children", None)
    if not children:
        return False
    values: Iterable[Any] = children.values() if isinstance(children, Mapping) else children
    return any(getattr(child, region) in states for child in values)


WALK = 4096
"""How many records a walk up the parents takes between checks that the chain does not loop.

The engine never sees a record's ``parent`` set (it is the caller's own
attribute), so a chain that loops (``a.parent = b``, ``b.parent = a``) would
walk for ever. Checking every walk would cost every event that propagates;
instead a walk that has taken this many records, far more than a tree of
any real cache is deep, looks for a repeated record in what it took
(:func:`looped`), and goes on if there is none.
"""


def looped(chain: Sequence[tuple[Any, ...]], label: str, event: str) -> None:
    """Raise ParentLoop if a record repeats in ``chain``, a walk's entries, each record first.

    Called by a walk that has taken :data:`WALK` records (or a multiple) and
    changed nothing yet.

    Raises:
        ParentLoop: A record is in ``chain`` twice; the message names the
            records up to the repeat.
    """
    first: dict[int, int] = {}
    for index, entry in enumerate(chain):
        if first.setdefault(id(entry[0]), index) != index:
            raise parent_loop([each[0] for each in chain[: index + 1]], label, event)


def parent_loop(walked: Sequence[Any], label: str, event: str) -> ParentLoop:
    """Return the ParentLoop of a walk that took ``walked``, the last a repeat of an earlier one.

    One message for the engine (:func:`looped`) and the reference executor
    (:mod:`fsm_cache.testing.reference`), which finds the repeat its own way.
    The records up to the repeat are named, the middle of a long walk elided.
    """
    names = [f"{label} {rec.id}" for rec in walked]
    if len(names) > 8:
        names[4:-3] = ["..."]
    return ParentLoop(
        f"{names[0]}: its parent chain loops ({' -> '.join(names)}); {event} was not applied"
    )


class Reentry(Exception):
    """Raised by a :func:`guarded` effect called on a record it is still running on.

    The engine's callers of an effect turn it into :class:`EffectReentered`
    (:func:`effect_failed`), which names the event as well.
    """


def guarded(hook: Effect, name: str) -> Effect:
    """Return ``hook`` refusing to run on a record it is already running on.

    An effect that fires its own event at its record (directly, or through an
    event whose effect fires it back) would otherwise run again and again
    until Python's recursion limit, each level wrapping the last. Other
    records, and other effects on the record, run as before.

    The usual call begins while no other call of the hook runs: it keeps its
    record in one variable, which costs about a third of keeping it in a
    dict by id. A call that begins while another runs (an effect firing at
    another record, or another thread) is kept in the dict. Both are
    cleared as each call ends, so a record is refused only while a call of
    the hook on it runs; a record is alive while its hook runs, so its id is
    its own. Two threads that begin calls at the same instant may both take
    the variable, and then a re-entry of the first to end is found one
    firing later; events at one record from two threads at once are the
    caller's to serialise in any case (:mod:`fsm_cache.engine.core`).

    Raises:
        Reentry: ``hook`` is already running on the record; it is not run again.
    """
    current: Any = None
    others: dict[int, None] = {}

    def run(rec: Any) -> None:
        nonlocal current
        if current is None and not others:
            current = rec
            try:
                hook(rec)
            finally:
                current = None
            return
        key = id(rec)
        if current is rec or key in others:
            raise Reentry(f"effect {name} is already running on the record")
        others[key] = None
        try:
            hook(rec)
        finally:
            del others[key]

    return run


def run_effect(effect: Effect, name: str, event: str, rec: Any, label: str) -> None:
    """Call ``effect`` on ``rec``, chaining whatever it raises under :class:`EffectFailed`.

    Raises:
        EffectFailed: The effect raised; the caller has written nothing yet, so
            the record is unchanged.
    """
    try:
        effect(rec)
    except Exception as exc:
        raise effect_failed(exc, name, event, rec, label) from exc


def effect_failed(exc: Exception, name: str, event: str, rec: Any, label: str) -> EffectFailed:
    """Return the :class:`EffectFailed` that reports ``exc``, raised by effect ``name`` of ``event``.

    One message for both callers: :func:`run_effect` (the plan path) and the
    fast paths generated code runs, which raise it ``from exc`` themselves.
    A :class:`Reentry` of the effect (:func:`guarded`) becomes
    :class:`EffectReentered` naming the event; an :class:`EffectReentered`
    raised by a firing inside the effect stays one, with its message, as it
    leaves each effect it passed through.
    """
    if isinstance(exc, Reentry):
        return EffectReentered(
            f"{label} {rec.id}: {event} fired while its effect {name} was already running"
            f" on the record; the re-entrant {event} was refused before {name} ran again"
        )
    if isinstance(exc, EffectReentered):
        return EffectReentered(*exc.args)
    return EffectFailed(f"{label} {rec.id}: effect {name} of {event} failed: {exc}")


def meddled(event: str) -> str:
    """Return why an effect of ``event`` that changed its record's states or counters failed.

    The engine computed its writes from the values before the effect ran:
    committing them would overwrite what the effect did (an event it fired
    at the same record, say a copy that completed at once and fired its
    acknowledgement), so the event is not applied, and the record keeps what
    the effect left. Generated code raises it as :func:`effect_failed`'s
    cause, the text emitted as a literal.
    """
    return (
        "it changed the record's states or counters (did it fire an event at the record?);"
        f" {event} was not applied"
    )


def no_effect(rec: Any) -> None:
    """Stand in for an effect when the engine runs without bound effects (a pure engine)."""
