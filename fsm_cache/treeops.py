"""Tree operations of the radix cache, as the model checker applies them.

Spec events change one node (and its ancestors when they propagate); these
change the tree: :func:`insert` adds a new leaf, :func:`split` cuts a node
into a prefix and a suffix, :func:`prune` deletes nodes that hold their data
nowhere. Each returns the new model state, or None when the operation does
not apply. A control module in ``specs/bugs_detected`` may replace any of
them with a broken variant to show the checker catches it.
"""

from __future__ import annotations

from fsm_cache.forest import Forest, Trees
from fsm_cache.model import Entry, Layout, Nodes, children
from fsm_cache.residency import HOST_HELD


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


def split(layout: Layout, nodes: Nodes, index: int, slot: int) -> Nodes | None:
    """Cut node ``index`` into a new prefix node in ``slot`` and the suffix ``index``.

    The prefix takes the node's place under its parent and copies its states
    and counters: every holder of the node holds both halves, and every lock
    below passes through the prefix. A propagating counter's holds stay with
    the suffix (the prefix's count is all its child's); other holds are copied.
    """
    entry = nodes[index]
    if entry is None or nodes[slot] is not None:
        return None
    parent = int(entry[0])
    base = layout.base
    holds = tuple(
        0 if key[0] in layout.propagating else entry[base + i] for i, key in enumerate(layout.holds)
    )
    prefix: Entry = (parent, *entry[1:base], *holds)
    moved = _put(nodes, slot, prefix)
    return _put(moved, index, (slot, *entry[1:]))


def dataless(layout: Layout, entry: Entry) -> bool:
    """Whether a node holds its data nowhere (device absent and no valid host copy)."""
    if not (layout.has("device") and layout.has("host")):
        return False
    return (
        layout.state(entry, "device") == "absent" and layout.state(entry, "host") not in HOST_HELD
    )


def prune(layout: Layout, nodes: Nodes) -> Nodes:
    """Delete every dataless leaf, as the cache does when a node's last copy goes."""
    out = nodes
    while True:
        gone = next(
            (
                i
                for i, entry in enumerate(out)
                if entry is not None and dataless(layout, entry) and not children(out, i)
            ),
            None,
        )
        if gone is None:
            return out
        out = _put(out, gone, None)


def _put(nodes: Nodes, index: int, entry: Entry | None) -> Nodes:
    return (*nodes[:index], entry, *nodes[index + 1 :])


def prune_forest(
    layout: Layout, trees: Trees, forest: Forest, memo: dict[int, int | None]
) -> Forest:
    """:func:`prune` on a canonical state: drop every subtree whose nodes all hold no data."""

    def sub(sid: int) -> int | None:
        if sid in memo:
            return memo[sid]
        kids = [k for k in (sub(c) for c in trees.kids[sid]) if k is not None]
        lid = trees.local[sid]
        gone = not kids and dataless(layout, (0, *trees.locals[lid]))
        memo[sid] = None if gone else trees.sid(lid, trees.order(kids))
        return memo[sid]

    return trees.order([k for k in (sub(s) for s in forest) if k is not None])
