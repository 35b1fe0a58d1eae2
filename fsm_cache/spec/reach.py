"""The records one spec's runs reach from its births, each with a shortest run to it.

One search serves two readers: the engine, which asks whether a caller's
record is one some run reaches (:mod:`fsm_cache.engine.legal`), and
validation, which asks whether a reached record is stuck or a region state is
never reached (:mod:`fsm_cache.spec.validate`). Both ask :func:`runs`, which
searches each spec once however often it is validated or run, and both read
the spec's own reference semantics (:func:`~fsm_cache.spec.meaning.step`), so
the rule of what a step does lives in one place.

Counters are capped one above the largest constant they are compared with
(:func:`ceilings`) and tree rules are read for a record with no parent and no
children, where none of them refuses. Both keep the search finite and only
add records, so a record left out is reached by no run in any tree.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fsm_cache.spec.machine import System, compared
from fsm_cache.spec.meaning import step


States = tuple[str, ...]
"""One state per region, in region order."""
Point = tuple[States, tuple[int, ...]]
"""A record as reachability sees it: its states, then its counters in declaration order,
each capped at its :func:`ceilings` value."""
Record = tuple[dict[str, str], dict[str, int]]
"""A record as a run leaves it: its state by region, and its counters by name, uncapped."""
Way = tuple["Point | None", str]
"""How a point was first reached: the point before and the event fired there, or
``None`` and the birth's name (``""`` for the initial states) for a point a birth makes."""


def ceilings(system: System) -> dict[str, int]:
    """Return, per counter, a value from which up every comparison the spec makes answers alike.

    One more than the largest constant the counter is compared with (or starts
    at): every guard, invariant and refusal then holds of all values from the
    ceiling up or of none, so the ceiling stands for all of them. The constants
    are :func:`~fsm_cache.spec.machine.compared`'s, the composition's refusals
    included.
    """
    machines = (machine for _, machine in system.regions)
    constants = compared(machines, *(forbid.guard for forbid in system.forbids))
    return {name: max(value, 0, *constants[name]) + 1 for name, value in system.counters}


@dataclass(frozen=True)
class Runs:
    """Every record some run of a system reaches, and how each was first reached.

    Attributes:
        system: The system searched.
        ways: Each reached point and how a shortest run first reached it
            (breadth first, events in the system's order).
        stuck: The reached points where the system refuses every event.
        top: Each counter's cap (:func:`ceilings`), which the points' counters
            are capped at.
        complete: False when the search stopped at its limit: ``ways`` then
            holds only some of the records runs reach.
    """

    system: System
    ways: Mapping[Point, Way]
    stuck: frozenset[Point]
    top: Mapping[str, int]
    complete: bool = True

    @property
    def points(self) -> frozenset[Point]:
        """Every reached point."""
        return frozenset(self.ways)

    def run_to(self, point: Point) -> tuple[str, list[str]]:
        """Return the birth (``""``: the initial states) and the events of a shortest run to ``point``."""
        events: list[str] = []
        before, label = self.ways[point]
        while before is not None:
            events.append(label)
            before, label = self.ways[before]
        return label, events[::-1]


RECORD_LIMIT = 10_000
"""The most records (states and capped counters) a search of a spec's runs visits, for
validation and for the engine's record checks: past it, a spec whose counters are compared
with large constants is searched no further, and no state is called unreachable."""

KEPT = 32
"""How many systems' runs :func:`runs` keeps; past it, the one asked least recently goes."""


def runs(system: System) -> Runs:
    """Return :func:`search` of ``system`` to :data:`RECORD_LIMIT`, searching each system once.

    Validation and the engine's record checks both ask this, so a spec that
    is loaded, validated and run by any number of engines is searched once.
    Systems are frozen dataclasses, compared and hashed by content: an equal
    system built anew (:func:`~fsm_cache.spec.machine.as_system` wraps a
    machine in a new one each time) shares the search, and a spec whose frozen
    fields are forced after its search no longer matches it and is searched
    as it now is. The last :data:`KEPT` systems asked are kept.
    """
    try:
        hash(system)
    except TypeError:  # a spec built in code with a list where a tuple belongs
        return search(system, RECORD_LIMIT)
    return _kept(system)


@functools.lru_cache(maxsize=KEPT)
def _kept(system: System) -> Runs:
    return search(system, RECORD_LIMIT)


def search(system: System, limit: int | None = None) -> Runs:
    """Return every record some run of ``system`` reaches, breadth first from its births.

    A run starts at a birth (every region's initial state, or a declared
    birth, with the initial counters) and fires events as
    :func:`~fsm_cache.spec.meaning.step` takes them. A counter at its cap
    stands for every value from it up: a step that subtracts from the cap
    may land anywhere between its result and the cap, and each record that
    stands for counts toward ``limit``.

    Args:
        system: The system to search.
        limit: Stop, the result marked incomplete, once more records than
            this are reached (None: search them all). :func:`runs` sets
            one, so that a spec whose counters are compared with large
            constants loads in bounded time.
    """
    regions = [region for region, _ in system.regions]
    names, top = [name for name, _ in system.counters], ceilings(system)
    initial = tuple(min(value, top[name]) for name, value in system.counters)
    ways: dict[Point, Way] = {}
    for birth in ["", *(b.name for b in system.births)]:
        born = system.born(birth or None)
        ways.setdefault((tuple(born[r] for r in regions), initial), (None, birth))
    frontier, stuck = deque(ways), set[Point]()
    while frontier:
        point = frontier.popleft()
        here = dict(zip(regions, point[0], strict=True))
        values = dict(zip(names, point[1], strict=True))
        moved = False
        for event in system.event_names:
            taken = fire(system, event, (here, values))
            if taken is None:
                continue
            moved = True
            # Counted as it is made: one step from a cap may stand for more records than any
            # limit (a counter capped at 10**12 and lowered by as much).
            for new in _spread(system, event, (here, values), taken, top):
                if new not in ways:
                    ways[new] = (point, event)
                    frontier.append(new)
                    if limit is not None and len(ways) > limit:
                        return Runs(
                            system, MappingProxyType(ways), frozenset(stuck), top, complete=False
                        )
        if not moved:
            stuck.add(point)
    return Runs(system, MappingProxyType(ways), frozenset(stuck), top)


def fire(system: System, event: str, record: Record) -> Record | None:
    """Return ``record`` after ``event``, or None if the system refuses it there.

    A record alone: no parent and no children (see the module's docstring).
    """
    outcome = step(system, event, *record)
    if outcome[0] != "":
        return None
    regions = [region for region, _ in system.regions]
    states = [str(s) for s in outcome[1 : len(regions) + 1]]
    counts = [int(str(v)) for v in outcome[len(regions) + 1 :]]
    names = [name for name, _ in system.counters]
    return dict(zip(regions, states, strict=True)), dict(zip(names, counts, strict=True))


def replay(system: System, birth: str, events: list[str]) -> Record | None:
    """Return the record ``events`` leave, fired in order on one born ``birth``; None if one is refused.

    The exact counters, where :func:`search` caps them: a run it found
    through a capped counter may not be one an exact record can take.
    """
    record: Record | None = (system.born(birth or None), dict(system.counters))
    for event in events:
        if record is None:
            return None
        record = fire(system, event, record)
    return record


def _spread(
    system: System, event: str, before: Record, after: Record, top: Mapping[str, int]
) -> Iterator[Point]:
    """Yield, lazily, the capped records a step of ``event`` from ``before`` to ``after`` stands for.

    A counter at its cap stands for every value from it up, so a step that
    subtracts from it lands anywhere from its result up to the cap; one that
    sets it (``= 0``) lands on that value alone. The two are told apart by
    the spec's own meaning: the step is fired again with each capped counter
    one higher, where every guard answers as at the cap (:func:`ceilings`),
    and a counter the step sets comes out the same. Yielded in
    :func:`itertools.product`'s order, without building any range: a spread
    may be far longer than the search's limit.
    """
    states, counts = tuple(after[0].values()), after[1]
    capped = {name: value + 1 for name, value in before[1].items() if value == top[name]}
    higher = fire(system, event, (before[0], {**before[1], **capped})) if capped else None
    choices = [
        range(value, top[name] + 1)
        if name in capped and value < top[name] and (higher is None or higher[1][name] != value)
        else range(min(value, top[name]), min(value, top[name]) + 1)
        for name, value in counts.items()
    ]
    for values in _product(choices):
        yield states, values


def _product(choices: list[range]) -> Iterator[tuple[int, ...]]:
    """Yield :func:`itertools.product` of ``choices``, in its order, without making each a tuple."""
    if not all(choices):
        return
    walks = [iter(choice) for choice in choices]
    values = [next(walk) for walk in walks]
    while True:
        yield tuple(values)
        axis = len(choices) - 1  # an odometer: the last axis turns fastest
        while axis >= 0:
            turned = next(walks[axis], None)
            if turned is not None:
                values[axis] = turned
                break
            walks[axis] = iter(choices[axis])
            values[axis] = next(walks[axis])
            axis -= 1
        if axis < 0:
            return
