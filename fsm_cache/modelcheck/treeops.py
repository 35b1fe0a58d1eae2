"""Tree operations of the radix cache, as the model checker applies them.

Spec events change one node (and its ancestors when they propagate); these
change the tree: :func:`insert` adds a new leaf, :func:`born` a leaf born as
one of the spec's births (a node found in storage), :func:`split` cuts a
node into a prefix and a suffix, :func:`prune` deletes nodes that hold their
data nowhere. Each returns the new model state, or None when the operation does
not apply. A control module in ``specs/bugs_detected`` may replace any of
them with a broken variant to show the checker catches it.
"""

from __future__ import annotations

from typing import cast

from fsm_cache.modelcheck.copies import FREE, REMOTE
from fsm_cache.modelcheck.forest import Forest, Trees
from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes, children
from fsm_cache.residency import DeviceState, HostState, split_prefix
from fsm_cache.spec.holders import Hold


def insert(layout: Layout, nodes: Nodes, parent: int, slot: int) -> Nodes | None:
    """Add a fresh leaf in ``slot`` under ``parent`` (``-1``: under the root).

    A request inserts the tokens it computed on the device, under the last
    node it matched there, so the parent must hold its device copy.
    """
    if nodes[slot] is not None:
        return None
    entry = nodes[parent] if parent >= 0 else None
    if entry is not None and layout.has("device") and layout.state(entry, "device") != "resident":
        return None
    return _put(nodes, slot, layout.fresh(parent))


def born(layout: Layout, nodes: Nodes, parent: int, slot: int, birth: str) -> Nodes | None:
    """Add a leaf in ``slot`` under ``parent`` (``-1``: the root), born as the spec's ``birth``.

    A key query finds pages of a prefix in the store past what the cache
    holds, under any node (the last one matched, locally or in the store),
    and the cache hangs a node for them there: born ``discovered``, with no
    device or host copy.
    """
    if nodes[slot] is not None or (parent >= 0 and nodes[parent] is None):
        return None
    return _put(nodes, slot, layout.born(parent, birth))


def split(layout: Layout, nodes: Nodes, index: int, slot: int) -> Nodes | None:
    """Cut node ``index`` into a new prefix node in ``slot`` and the suffix ``index``.

    The prefix takes the node's place under its parent, with the fields of
    :func:`prefix_fields` and the holds of :func:`prefix_holds`; the suffix
    keeps everything it had. Both halves keep the node's memory: the prefix
    takes the first pages of each tier, in the same condition, and a copy in
    flight for the node now serves both (``transfers.on_split``).
    """
    entry = nodes[index]
    if entry is None or nodes[slot] is not None:
        return None
    prefix: NodeEntry = (
        int(entry[0]),
        *prefix_fields(layout, entry),
        *prefix_holds(layout, entry),
        *layout.pages(entry),
    )
    moved = _put(nodes, slot, prefix)
    return _put(moved, index, (slot, *entry[1:]))


def prefix_fields(layout: Layout, entry: NodeEntry) -> NodeEntry:
    """Return the states and counters a split gives the prefix of the node ``entry``.

    For the residency composition, the cache's own rule
    (:func:`fsm_cache.residency.split_prefix`, which :meth:`RadixTree.split
    <fsm_cache.cache.tree.RadixTree.split>` applies), so the split the cache
    performs is the one checked: it gives the prefix one pin per copy in
    flight, as each of the cache's copies holds one. Copies that one holder
    started together (a batch that loads and stores under one pin) hold
    that holder's count between them, and the same acknowledgement gives it
    back at the prefix, so they count once per count (:func:`_shared`).
    For any other spec, a copy of the node's.
    """
    fields = entry[1 : layout.base]
    if not layout.residency:
        return fields
    storage = (layout.state(entry, "storage"),) if layout.has("storage") else ()
    host, device, pins, locks = split_prefix(
        cast("HostState", layout.state(entry, "host")),
        cast("DeviceState", layout.state(entry, "device")),
        layout.counter(entry, "locks"),
        *storage,
    )
    given = {"host": host, "device": device, "pins": pins - _shared(layout, entry), "locks": locks}
    names = (*layout.regions, *layout.counters)
    return tuple(given.get(name, value) for name, value in zip(names, fields, strict=True))


def _shared(layout: Layout, entry: NodeEntry) -> int:
    """Return the pins :func:`~fsm_cache.residency.split_prefix` counts past their holders' count.

    It counts a pin per copy in flight at the node. Each pin holder kind
    held there whose acquiring event starts several copies (the spec's
    :attr:`~fsm_cache.modelcheck.state.Layout.batch_pins`) holds its count for
    all of those in flight: the ones beyond its count hold no pin of their
    own. Zero where every copy has a holder of its own (the shipped specs).
    """
    if not layout.batch_pins:  # a holder of one copy holds a pin for it
        return 0
    flying = layout.memory.in_flight(layout.pages(entry))
    out = 0
    for key, started in layout.batch_pins.items():
        held = layout.hold(entry, key)
        if held:
            out += max(0, sum(c in flying for c in started) - held)
    return out


def prefix_holds(layout: Layout, entry: NodeEntry) -> NodeEntry:
    """Return who holds the prefix of the node ``entry`` after a split: its ghost holds.

    The holds are the model's account of who holds what, kept apart from
    :func:`prefix_fields` so that invariant 6 checks one against the other.
    A propagating counter's holders stay with the suffix (the prefix's count
    is then all its child's). In the residency composition, the clients'
    holds stay with the suffix too, and only a copy between the tiers (a
    holder whose events are declared in both regions: a load) holds the
    prefix as well, since the same copy fills it. In other specs every
    holder holds both halves.
    """
    base = layout.base
    return tuple(
        entry[base + i] if _holds_prefix(layout, key) else 0
        for i, key in enumerate(layout.holders.kinds)
    )


def _holds_prefix(layout: Layout, key: Hold) -> bool:
    counter, regions = key
    if counter in layout.holders.propagating:
        return False
    return not layout.residency or len(regions) > 1


def dataless(layout: Layout, entry: NodeEntry) -> bool:
    """Whether a node holds its data nowhere: no tier's state claims pages, none are held.

    A node whose only copy is in storage (``stored``, ``reading``) holds its
    data there. A node whose ghost memory still holds pages, or a copy in
    flight, is kept: deleting it would hide a leak, or a copy into a deleted
    node, that the invariants then report
    (:func:`~fsm_cache.modelcheck.invariants.memory_claims`).
    """
    memory = layout.memory
    if not memory.tiers:
        return False
    return all(
        memory.claims(t, layout.state(entry, t)) == FREE for t in memory.tiers
    ) and not memory.holds(layout.pages(entry))


def forgettable(layout: Layout, entry: NodeEntry) -> bool:
    """Whether the cache may drop a node's record: it holds nothing of its own, no copy in flight.

    Its pages, if any, are the store's (``stored``): the store keeps them,
    and a key query finds them again. Below a node whose data is gone, such
    nodes are unreachable (their keys chain through it), and are dropped
    with it.
    """
    memory = layout.memory
    return not any(
        memory.claims(t, layout.state(entry, t)) != FREE and t not in REMOTE for t in memory.tiers
    ) and not memory.local(layout.pages(entry))


def prune(layout: Layout, nodes: Nodes) -> Nodes:
    """Delete every node that holds its data nowhere, with the store-only nodes below it.

    A dataless leaf goes, as the cache deletes a node when its last copy
    goes; so does a dataless node all of whose descendants hold nothing but
    pages in the store (:func:`forgettable`: the store dropped a prefix and
    kept the rest, which no key chain reaches now). A dataless node above a
    node that holds a copy of its own stays, and invariant 2 reports it.
    """
    out = nodes
    while True:
        gone = next(
            (
                i
                for i, entry in enumerate(out)
                if entry is not None
                and dataless(layout, entry)
                and all(forgettable(layout, _at(out, d)) for d in descendants(out, i))
            ),
            None,
        )
        if gone is None:
            return out
        for d in (gone, *descendants(out, gone)):
            out = _put(out, d, None)


def descendants(nodes: Nodes, index: int) -> list[int]:
    """Return the slots below ``index``, nearest first."""
    out = children(nodes, index)
    for i in out:
        out += [c for c in children(nodes, i) if c not in out]
    return out


def _at(nodes: Nodes, index: int) -> NodeEntry:
    entry = nodes[index]
    assert entry is not None
    return entry


def _put(nodes: Nodes, index: int, entry: NodeEntry | None) -> Nodes:
    return (*nodes[:index], entry, *nodes[index + 1 :])


def prune_forest(
    layout: Layout, trees: Trees, forest: Forest, memo: dict[int, int | None]
) -> Forest:
    """:func:`prune` on a canonical state: drop every dataless subtree root with nothing of its own below."""

    def sub(sid: int) -> int | None:
        if sid in memo:
            return memo[sid]
        lid = trees.local[sid]
        if dataless(layout, (0, *trees.locals[lid])) and all(
            _forgettable(c) for c in trees.kids[sid]
        ):
            memo[sid] = None
            return None
        kids = [k for k in (sub(c) for c in trees.kids[sid]) if k is not None]
        memo[sid] = trees.sid(lid, trees.order(kids), trees.slot[sid])
        return memo[sid]

    def _forgettable(sid: int) -> bool:
        return forgettable(layout, (0, *trees.locals[trees.local[sid]])) and all(
            _forgettable(c) for c in trees.kids[sid]
        )

    return trees.order([k for k in (sub(s) for s in forest) if k is not None])
