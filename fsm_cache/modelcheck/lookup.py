"""Lookups: what ``match_prefix`` tells its callers, and the invariants callers rely on.

A lookup of a node's tokens walks from the radix root down the path to it
and answers which part of that path is on the device (its KV handed out to
the caller: ``device_len``, ``last_device_node``, ``device_pages``) and which
is a host hit (``host_len``, ``last_host_node``). :func:`match_prefix` is the
model's lookup, as HiCache's must answer: a node counts as device-matched
only while it and every node above it hold valid device KV by their states
(``resident``: the memory the device state claims, :mod:`fsm_cache.modelcheck.copies`),
so it stops at the first node that does not (a ``loading`` or ``absent``
node); the rest of the path is the host hit.

The invariants are read off the answer, not off the tree's shape
(:func:`violation`): the device part is contiguous from the root (no node's
KV is handed out for tokens a node above it holds), every page handed out
holds valid KV by the ghost account of memory (not by the states), and the
device part and the host hit together are the whole path. A control module
may replace ``match_prefix`` (``specs/bugs_detected/match_skips_loading.py``
counts every resident node on the path, wherever it hangs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsm_cache.modelcheck.copies import LOCAL, VALID, kind
from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes, ancestors


@dataclass(frozen=True)
class Match:
    """A lookup's answer, in positions along the path (0: the node under the root).

    Attributes:
        device: The nodes whose device KV is handed out, in path order.
        host: The nodes reported as a host hit, in path order.
    """

    device: tuple[int, ...]
    host: tuple[int, ...]


Lookup = Callable[[Layout, Sequence[NodeEntry]], Match]
"""A lookup: the layout and the entries of a path from the root, to its answer."""


def match_prefix(layout: Layout, path: Sequence[NodeEntry]) -> Match:
    """Return the model's lookup of ``path``.

    Device-matched while the device state claims valid KV; then a host hit
    while the node's state claims valid KV on either tier (a node past the
    device part may be ``resident`` under a parent still ``loading``); the
    rest (a node being fetched, or one held only in storage) is no hit.
    """
    k = 0
    while k < len(path) and _readable(layout, path[k], "device"):
        k += 1
    h = k
    while h < len(path) and any(_readable(layout, path[h], t) for t in LOCAL):
        h += 1
    return Match(tuple(range(k)), tuple(range(k, h)))


def applies(layout: Layout) -> bool:
    """Whether the spec's nodes have a device tier to look up."""
    return "device" in layout.memory.tiers


def violation(
    layout: Layout, path: Sequence[NodeEntry], ids: Sequence[int], found: Match
) -> str | None:
    """Return the first invariant the lookup's answer ``found`` on ``path`` breaks, or None.

    ``found`` may name any positions (a control module's lookup answers it):
    one off the path is such a finding too, named by the last check (the
    answer is not the path), never an IndexError.

    Args:
        layout: The node layout of the spec.
        path: The entries from the node under the root down to the node looked up.
        ids: The node numbers of ``path``, for messages.
        found: The lookup's answer.
    """
    device = found.device
    for at, pos in enumerate(device):
        if pos != at and _on(path, pos) and _on(path, at):
            gap = at
            state = layout.state(path[gap], "device")
            return f"lookup: node {ids[pos]}: match_prefix reports it on the device past node {ids[gap]}, which is {state}"
    for pos in device[: len(path)]:
        if not _on(path, pos):  # a position off the path: the last check names it
            continue
        have = _pages(layout, path[pos], "device")
        if have != VALID:
            return f"lookup: node {ids[pos]}: match_prefix hands out its device pages, which hold no valid KV ({kind(have)})"
    for pos in found.host:
        if _on(path, pos) and not _local(layout, path[pos]):
            have = kind(_pages(layout, path[pos], "host"))
            state = layout.state(path[pos], "host")
            return f"lookup: node {ids[pos]}: match_prefix reports it as a host hit, but it holds no valid KV on the host or the device (host {state}, {have})"
    local = _local_prefix(layout, path)
    if (*device, *found.host) != tuple(range(local)):
        on, hit = _named(ids, device), _named(ids, found.host)
        return f"lookup: node {ids[-1]}: match_prefix reports nodes {on} on the device and {hit} as a host hit, not the path {list(ids[:local])}"
    return None


def first_violation(layout: Layout, nodes: Nodes, match: Lookup = match_prefix) -> str | None:
    """Return the first lookup of a node of ``nodes`` (by ``match``) that breaks an invariant."""
    if not applies(layout):
        return None
    for i, entry in enumerate(nodes):
        if entry is None:
            continue
        ids = [*reversed(ancestors(nodes, i)), i]
        path = [e for e in (nodes[n] for n in ids) if e is not None]
        found = violation(layout, path, ids, match(layout, path))
        if found is not None:
            return found
    return None


def _on(path: Sequence[NodeEntry], pos: int) -> bool:
    """Whether ``pos`` is a position on ``path``: an answer may name any int, checked for it."""
    return 0 <= pos < len(path)


def _named(ids: Sequence[int], positions: Sequence[int]) -> list[int]:
    return [ids[p] if 0 <= p < len(ids) else p for p in positions]


def _readable(layout: Layout, entry: NodeEntry, tier: str) -> bool:
    return layout.memory.claims(tier, layout.state(entry, tier)) == VALID


def _pages(layout: Layout, entry: NodeEntry, tier: str) -> str:
    return str(layout.pages(entry)[layout.memory.tiers.index(tier)])


def _local_prefix(layout: Layout, path: Sequence[NodeEntry]) -> int:
    """Return how many nodes from the root hold valid KV on the device or the host, by their pages."""
    k = 0
    while k < len(path) and _local(layout, path[k]):
        k += 1
    return k


def _local(layout: Layout, entry: NodeEntry) -> bool:
    """Whether a node's pages hold valid KV on the host or the device (its own ghost account)."""
    return any(_pages(layout, entry, t) == VALID for t in LOCAL)
