"""Abstract path states: what one path through a function holds at a point.

A state is a small immutable value, so the analysis can keep an ordered set of
them per program point and drop duplicates; the number of distinct states is
bounded by the acquire sites and the correlated branch tests of the function.

A set of states never silently loses one: when a set reaches
:data:`MAX_STATES`, a new state joins it loosened (without its branch facts and
stores, which can only add findings, never hide one), or is covered by a state
that differs from it only in its exit line; past twice that many states the
analysis gives up with :class:`TooComplex`.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace


# A resource: the index of its pair and the canonical text of the expression.
ResourceKey = tuple[int, str]

# States kept per program point before new ones are loosened; a guard against
# pathological functions.
MAX_STATES = 256


class TooComplex(Exception):
    """The analysis of one function would exceed its bounds; the message says which."""


class Flow(enum.Enum):
    """How control leaves a statement."""

    NORMAL = "normal"
    RETURN = "return"
    BREAK = "break"
    CONTINUE = "continue"
    RAISE = "raise"


@dataclass(frozen=True, order=True)
class Acquisition:
    """One outstanding acquisition on a path.

    Attributes:
        key: The resource acquired.
        line: Line of the acquiring call.
        col: 1-based column of the acquiring call.
        handed: Whether its ownership was handed on (stored, returned, passed on).
    """

    key: ResourceKey
    line: int
    col: int
    handed: bool = False


@dataclass(frozen=True)
class State:
    """What one path holds and knows.

    Attributes:
        held: Outstanding acquisitions, sorted (a multiset).
        released: (key, line) of the latest release of each key on this path.
        stored: Canonical texts handed on before any acquire (store-then-pin).
        owners: Canonical texts of whole values handed on (``req`` of
            ``self.running.append(req)``): what is reachable from them
            (``req.last_node``, ``req.nodes[0]``) is handed on with them.
        aliases: (alias, original) texts: ``staged[*]`` stands for ``x`` once
            ``x`` was put into the local list ``staged``.
        facts: (branch test, outcome) pairs assumed on this path.
        site: Line where a return or raise left (0 on normal paths).
    """

    held: tuple[Acquisition, ...] = ()
    released: tuple[tuple[ResourceKey, int], ...] = ()
    stored: frozenset[str] = frozenset()
    owners: frozenset[str] = frozenset()
    aliases: frozenset[tuple[str, str]] = frozenset()
    facts: tuple[tuple[str, bool], ...] = ()
    site: int = 0

    def acquire(self, key: ResourceKey, line: int, col: int) -> State:
        """Return the state after acquiring ``key`` at ``line``."""
        handed = key[1] in self.stored or _reachable(key[1], self.owners)
        entry = Acquisition(key, line, col, handed=handed)
        return replace(self, held=tuple(sorted((*self.held, entry))))

    def release(self, key: ResourceKey, line: int) -> tuple[State, int | None, bool]:
        """Return the state after releasing ``key``, the earlier release line, and a match flag.

        The earlier release line is set when nothing was held but this path
        already released the key (a double release); the flag says whether a
        held entry was consumed.
        """
        released = tuple(sorted({**dict(self.released), key: line}.items()))
        entry = _pick(self.held, key, self.aliases)
        if entry is None:
            return replace(self, released=released), self._released_before(key), False
        held = list(self.held)
        held.remove(entry)
        return replace(self, held=tuple(held), released=released), None, True

    def _released_before(self, key: ResourceKey) -> int | None:
        """Return the line of this path's latest release of ``key``, or of what stands for it.

        A receipt and what it acquired are one resource: after ``with
        cache.lock(node) as lease:`` has released ``node``, ``cache.unlock(lease)``
        releases it again, as ``cache.unlock(node)`` does after ``with lease:``.
        """
        released = dict(self.released)
        if key in released:
            return released[key]
        related = {original for alias, original in self.aliases if alias == key[1]}
        related |= {alias for alias, original in self.aliases if original == key[1]}
        lines = [released[(key[0], text)] for text in related if (key[0], text) in released]
        return max(lines, default=None)

    def retract(self, key: ResourceKey) -> State:
        """Return the state where the latest acquire of ``key`` took nothing after all.

        ``if not lock.acquire(False): return``: on the path where it returned
        false, the acquire did not acquire. Nothing is released, so no later
        release is a double one.
        """
        entry = _pick(self.held, key, self.aliases)
        if entry is None:
            return self
        held = list(self.held)
        held.remove(entry)
        return replace(self, held=tuple(held))

    def last_release(self, key: ResourceKey) -> int | None:
        """Return the line of this path's latest release of ``key``, if any."""
        return dict(self.released).get(key)

    def hand_on(
        self,
        texts: frozenset[str],
        owners: frozenset[str] = frozenset(),
        reads: frozenset[str] = frozenset(),
    ) -> State:
        """Return the state after the resources named by ``texts`` were handed on.

        Args:
            texts: The resources handed on, or what stands for them (a
                receipt, a local container).
            owners: The texts of the whole values handed on; a resource
                reachable from one of them (an attribute or element) is
                handed on too.
            reads: Names that the values handed on were read from
                (``handle`` of ``handle.params``, ``staged`` of
                ``staged.copy()``): a receipt or local container among them
                hands on what it stands for; a resource among them is not
                handed on.
        """
        held = tuple(
            replace(entry, handed=True)
            if self._named(entry.key, texts)
            or _reachable(entry.key[1], owners)
            or self._receipt_read(entry.key, reads)
            else entry
            for entry in self.held
        )
        return replace(
            self,
            held=tuple(sorted(held)),
            stored=self.stored | texts,
            owners=self.owners | owners,
        )

    def alias(self, alias: str, texts: frozenset[str]) -> State:
        """Return the state where ``alias`` (a local container's elements) stands for ``texts``."""
        pairs = frozenset((alias, text) for text in texts)
        return replace(self, aliases=self.aliases | pairs)

    def _named(self, key: ResourceKey, texts: frozenset[str]) -> bool:
        """Return whether ``texts`` names ``key``, directly or through an alias."""
        names = {key[1]} | {alias for alias, original in self.aliases if original == key[1]}
        return any(_names(name, texts) for name in names)

    def _receipt_read(self, key: ResourceKey, reads: frozenset[str]) -> bool:
        """Return whether ``reads`` names what stands for ``key``: a receipt, a local container."""
        return any(_names(alias, reads) for alias, original in self.aliases if original == key[1])

    def assume(self, test: str, outcome: bool) -> State:
        """Return the state that assumes branch ``test`` evaluated to ``outcome``."""
        return replace(self, facts=tuple(sorted({*self.facts, (test, outcome)})))

    def forget(self, names: frozenset[str], mentions: dict[str, frozenset[str]]) -> State:
        """Drop the facts whose test mentions any of ``names`` (they were reassigned)."""
        facts = tuple(fact for fact in self.facts if not mentions.get(fact[0], set()) & names)
        return self if facts == self.facts else replace(self, facts=facts)

    def fact(self, test: str) -> bool | None:
        """Return the assumed outcome of ``test`` on this path, if any."""
        return dict(self.facts).get(test)

    def at(self, site: int) -> State:
        """Return this state marked as leaving at line ``site``."""
        return replace(self, site=site)


def _pick(
    held: tuple[Acquisition, ...], key: ResourceKey, aliases: frozenset[tuple[str, str]]
) -> Acquisition | None:
    """Choose the entry a release consumes: the latest acquire not handed on, if any."""
    matching = [entry for entry in held if entry.key == key]
    if not matching:
        originals = {original for alias, original in aliases if alias == key[1]}
        matching = [e for e in held if e.key[0] == key[0] and e.key[1] in originals]
    own = [entry for entry in matching if not entry.handed]
    chosen = own or matching
    return chosen[-1] if chosen else None


def _reachable(text: str, owners: frozenset[str]) -> bool:
    """Return whether ``text`` is an attribute or element of one of ``owners``.

    ``req.last_node`` and ``req[0]`` are reachable from ``req``; ``request``
    is not.
    """
    return any(text.startswith((owner + ".", owner + "[")) for owner in owners)


def _names(text: str, texts: frozenset[str]) -> bool:
    """Return whether ``texts`` names the resource ``text`` (or its whole collection)."""
    return text in texts or (text.endswith("[*]") and text[:-3] in texts)


States = dict[State, None]
FlowOutcome = dict[Flow, States]


def states_of(*states: State) -> States:
    """Return an ordered set of ``states``."""
    return dict.fromkeys(states)


def add(outcome: FlowOutcome, flow: Flow, states: States) -> None:
    """Merge ``states`` into ``outcome[flow]``, loosening new ones once it holds :data:`MAX_STATES`.

    Raises:
        TooComplex: A state fits neither as it is nor loosened.
    """
    bucket = outcome.setdefault(flow, {})
    covered: set[State] | None = None  # the bucket's states without their exit lines
    for state in states:
        if state in bucket:
            continue
        if len(bucket) < MAX_STATES:
            bucket[state] = None
            continue
        if covered is None:
            covered = {_sans_site(other) for other in bucket}
        _add_loosened(bucket, covered, state)


def _add_loosened(bucket: States, covered: set[State], state: State) -> None:
    """Add ``state`` to a full ``bucket`` loosened, unless a state there covers it.

    The loosened state forgets its branch facts, so it takes both sides of
    every repeated test; what it stored before any acquire, so a later acquire
    of it is not taken as handed on; and the aliases of what it does not hold,
    so a later release through them matches nothing. It stands for more paths
    than ``state``: loosening can add a finding, never hide one. A state
    differing from it only in its exit line leaks the same acquisitions, so it
    covers it: ``covered`` holds the bucket's states without their exit lines,
    to look that up in one step, not one per state of the bucket.

    Raises:
        TooComplex: The bucket holds twice :data:`MAX_STATES` and ``state`` is new.
    """
    held = {entry.key[1] for entry in state.held}
    aliases = frozenset(pair for pair in state.aliases if pair[1] in held)
    loose = replace(state, facts=(), stored=frozenset(), owners=frozenset(), aliases=aliases)
    if loose in bucket or _sans_site(loose) in covered:
        return
    if len(bucket) >= 2 * MAX_STATES:
        raise TooComplex(f"more than {2 * MAX_STATES} distinct path states")
    bucket[loose] = None
    covered.add(_sans_site(loose))


@functools.lru_cache(maxsize=4096)
def _sans_site(state: State) -> State:
    """Return ``state`` with its exit line cleared."""
    return replace(state, site=0)


def merge(into: FlowOutcome, other: FlowOutcome) -> None:
    """Merge every flow of ``other`` into ``into``."""
    for flow, states in other.items():
        add(into, flow, states)
