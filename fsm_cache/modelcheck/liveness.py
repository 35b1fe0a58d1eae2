"""Liveness: from every reachable state, copies and holders can always settle.

Safety invariants hold in each state; a spec can keep them all and still
stick: a copy whose acknowledgement is refused forever, a holder that can
never give back. The explorer records, for every explored state, its
*settling* steps: acknowledgements of copies (each copy completes or fails,
in any order: the environment's moves) and give-backs by the holders that
hold (``release``, ``unlock``, ``load_done``). A state is *settled* when no
node has a copy in flight or a hold. Every reachable state must reach a
settled one by settling steps alone; one that cannot is stuck.
Holds are kept only on counters that count holders
(:attr:`~fsm_cache.spec.holders.Holders.counts`: one some event gives
back or a state carries), so a counter that is only ever raised (tokens
emitted, retries) is never owed back.

A failed load the spec refuses to fail (a child is on the device below, a
request locked it) is copied again by the cache, deepest nodes failed first
(``transfers``): in the model the node stays as it is, a step that changes
nothing, so the retry adds no edge and the copy may still complete.

A copy to or from the store is not copied again when it fails (the storage
tier starts a new copy at a later lookup, if any), so its failure
acknowledgement is the only way a failed one ends. Once every state settles,
a second pass leaves out the steps that complete such a copy
(:func:`passes`): every state must also settle where those copies fail, or
a refused ``fetch_failed`` leaves a node ``fetching`` for ever while the
first pass counts on a ``fetch_done`` that a failed read never sends.

The explored graph is finite, so deciding it is linear in states and
settling steps (:func:`settles`: in order of what is left to settle, or a
backward breadth-first search from the settled states). A stuck state is reported with the shortest
trace reaching it, naming the node that cannot settle and what the engine
answers its settling events (:func:`stuck`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from fsm_cache.modelcheck.state import Layout, Nodes


Refusal = Callable[[Nodes, int, str], "str | None"]
"""The error class the engine refuses an event with at a node of a state (None: accepted)."""
Apply = Callable[[Nodes, int, str], "Nodes | None"]
"""A settling event fired at a node of a state as the model fires it (None: not fired)."""


def settles(weight: array[int], first: array[int], dst: array[int]) -> bytearray:
    """Return, per state, whether it reaches a settled state by settling steps.

    A settling step normally lowers a state's *weight* (its copies in flight
    and holds: an acknowledgement ends a copy, a give-back a hold), so states
    are decided in order of weight, each from its own steps, in about one
    look per state. Should a state that cannot settle have a step that does
    not lower its weight (a spec whose acknowledgement starts another copy),
    that order proves nothing, and the general backward search decides
    (:func:`backward`).

    Args:
        weight: Per state, its copies in flight and holds (0: settled).
        first: Per state, the index in ``dst`` of its first settling step,
            and one past the last state's last.
        dst: The state each settling step leads to.
    """
    count = len(weight)
    levels: list[list[int]] = [[] for _ in range(max(weight, default=0) + 1)]
    for state, w in enumerate(weight):
        levels[w].append(state)
    good = bytearray(count)
    for state in levels[0]:
        good[state] = 1
    for w, states in enumerate(levels[1:], start=1):
        for state in states:
            steps = range(first[state], first[state + 1])
            if any(good[dst[k]] for k in steps):
                good[state] = 1
            elif any(weight[dst[k]] >= w for k in steps):
                return backward(weight, first, dst)
    return good


def passes(
    first: array[int], dst: array[int]
) -> tuple[tuple[array[int], array[int]], tuple[array[int], array[int]]]:
    """Return the settling steps of the two passes: every one, and those a failed copy may take.

    ``dst`` holds ``~state`` for a step that completes a copy whose failure
    is final (:attr:`~fsm_cache.modelcheck.copies.Memory.final_successes`):
    the first pass takes it to ``state``, the second leaves it out, so that
    every state must also settle where those copies fail.
    """
    every = array("l", (d if d >= 0 else ~d for d in dst))
    kept_first, kept = array("l"), array("l")
    for state in range(len(first) - 1):
        kept_first.append(len(kept))
        kept.extend(d for d in dst[first[state] : first[state + 1]] if d >= 0)
    kept_first.append(len(kept))
    return (first, every), (kept_first, kept)


def backward(weight: array[int], first: array[int], dst: array[int]) -> bytearray:
    """Return, per state, whether it reaches a settled state: a backward breadth-first search.

    From the settled states (weight 0) over the reversed settling steps,
    linear in states and steps, whatever the steps do to the weight.
    """
    count = len(weight)
    starts = array("l", bytes(8 * (count + 1)))
    for d in dst:
        starts[d + 1] += 1
    for i in range(count):
        starts[i + 1] += starts[i]
    fill = array("l", starts)
    into = array("l", bytes(8 * len(dst)))
    for state in range(count):
        for k in range(first[state], first[state + 1]):
            d = dst[k]
            into[fill[d]] = state
            fill[d] += 1
    good = bytearray(count)
    queue = [i for i in range(count) if not weight[i]]
    for state in queue:
        good[state] = 1
    for state in queue:
        for k in range(starts[state], starts[state + 1]):
            before = into[k]
            if not good[before]:
                good[before] = 1
                queue.append(before)
    return good


def settling(layout: Layout) -> frozenset[str]:
    """Return the settling events: acknowledgements of copies, and give-backs of holds.

    On a spec without copies (no ``host``, ``device`` or ``storage`` region)
    the checker cannot tell an acknowledgement from other events (a
    ``query_done`` that ends a query in flight, after which a refused
    ``release`` is accepted), so every event that acquires no hold settles:
    a holder whose give-back is refused may wait for any of them, but not for
    another acquire (:attr:`~fsm_cache.modelcheck.state.Layout.at_once`).
    """
    if not layout.at_once:
        return frozenset(e for e, keys in layout.holders.acquires.items() if not keys)
    gives = {event for event, keys in layout.holders.releases.items() if keys}
    return frozenset({*layout.memory.acks, *gives})


def stuck(
    layout: Layout,
    nodes: Nodes,
    apply: Apply,
    refusal: Refusal,
    limit: int = 64,
    *,
    without: frozenset[str] = frozenset(),
) -> str:
    """Describe a stuck state: which node cannot settle, and why.

    Settling steps are taken from ``nodes`` while one is fired (all lead to
    stuck states too) and none repeats a state, at most ``limit``; then the
    first node with a copy in flight or a hold is named, with the engine's
    answer to each of its settling events. ``without``: the settling events
    left out, the success acknowledgements of copies whose failure is final
    (a state that settles only if such a copy completes): the first node
    where one is in flight is named, with the engine's answer to its failure
    acknowledgements.
    """
    events = settling(layout) - without
    seen = {nodes}
    for _ in range(limit):
        nxt = next(
            (
                after
                for i, entry in enumerate(nodes)
                if entry is not None
                for event in _pending(layout, entry, events)
                if (after := apply(nodes, i, event)) is not None and after not in seen
            ),
            None,
        )
        if nxt is None:
            break
        seen.add(nxt)
        nodes = nxt
    for i, entry in enumerate(nodes):
        if entry is None or not without:
            continue
        for copy in layout.memory.in_flight(layout.pages(entry)):
            acks = layout.memory.acknowledging(copy)
            if without.intersection(acks):
                why = _answers(nodes, i, [e for e in acks if e not in without], refusal)
                return f"liveness: node {i}: its {copy.name} copy can never fail ({why})"
    for i, entry in enumerate(nodes):
        if entry is None or not layout.unsettled(entry):
            continue
        for copy in layout.memory.in_flight(layout.pages(entry)):
            acks = layout.memory.acknowledging(copy)
            return f"liveness: node {i}: its {copy.name} copy can never finish ({_answers(nodes, i, acks, refusal)})"
        key = next(k for k in layout.holders.kinds if layout.hold(entry, k) > 0)
        gives = [e for e, keys in layout.holders.releases.items() if key in keys]
        by = layout.holders.acquirers(key)
        return f"liveness: node {i}: {by} can never give back its {key[0]} ({_answers(nodes, i, gives, refusal)})"
    return "liveness: settling steps loop without settling"


def _pending(layout: Layout, entry: tuple[int | str, ...], events: frozenset[str]) -> list[str]:
    """Return the settling events that may apply at a node: its copies' acks, its holds' give-backs."""
    flying = layout.memory.in_flight(layout.pages(entry))
    out = [
        event
        for event, acks in layout.memory.acks.items()
        if event in events and any(a.copy in flying for a in acks)
    ]
    out += [
        event
        for event, keys in layout.holders.releases.items()
        if event in events and any(layout.hold(entry, k) > 0 for k in keys)
    ]
    return out


def _answers(nodes: Nodes, i: int, events: list[str], refusal: Refusal) -> str:
    """Return ``event: Error`` for each event (``waits`` where the engine accepts it).

    With no events, say that the spec has none: a hold no event of the spec
    gives back, or a copy none acknowledges (a final state that keeps it).
    """
    if not events:
        return "no event of the spec does"
    return "; ".join(f"{e}: {refusal(nodes, i, e) or 'waits'}" for e in dict.fromkeys(events))
