"""Request slots: the device memory a request computes KV into, and how insert takes it over.

As in SGLang, a request's KV slots are allocated before its forward pass and
handed to the cache on insert; the slots of a prefix the cache already holds
on the device stay the request's to free. This module answers, in whole
pages, where the device memory of an insert comes from: the caller's slots
(checked to be pages the request holds, each once, before anything changes),
or fresh pages taken (evicting if needed) and filled from the tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from fsm_cache.cache.eviction import alloc_device
from fsm_cache.errors import ForeignSlot
from fsm_cache.memory.pages import FREE, pages_of, slots_of


if TYPE_CHECKING:
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.tree import Key, Pages, TreeNode, Walk

REQUEST = 0
"""The owner of device pages a request holds (allocated, not yet adopted by a node)."""


def alloc(cache: HiCache, num_tokens: int) -> list[int]:
    """Return device slots for ``num_tokens`` (whole pages), evicting if needed."""
    pages = -(-num_tokens // cache.config.page_size)
    return slots_of(alloc_device(cache, pages, None), cache.config.page_size)


def free(cache: HiCache, slots: Sequence[int]) -> None:
    """Give back request-held device slots (whole pages)."""
    cache.tiers.free_device(pages_of(slots, cache.config.page_size), REQUEST)


def check_count(slots: Sequence[int] | None, tokens: int) -> None:
    """Refuse fewer caller slots than tokens (before the walk, so that nothing changes)."""
    if slots is not None and len(slots) < tokens:
        raise ForeignSlot(f"insert: {len(slots)} device slots for {tokens} tokens")


def fresh_pages(
    cache: HiCache, path: Sequence[TreeNode], key: Key, slots: Sequence[int] | None
) -> dict[int, Pages]:
    """Device pages for host-only path nodes (by id) and the new tail (key -1).

    Only the caller's slots for those parts are read, and checked before
    anything changes; slots of the part already on the device are the
    caller's business.

    Raises:
        ForeignSlot: The caller's slots (at least one per token, see
            :func:`check_count`) are not whole pages, repeat a page, or name a
            page the request does not hold.
        PoolExhausted: ``slots`` is None and eviction cannot free enough.
    """
    page, offset, wanted = cache.config.page_size, 0, []
    for node in path:
        if node.device == "absent":
            wanted.append((node.id, offset, len(node.key)))
        offset += len(node.key)
    if offset < len(key):
        wanted.append((-1, offset, len(key) - offset))
    if slots is not None:
        out = {ident: tuple(pages_of(slots[o : o + n], page)) for ident, o, n in wanted}
        _check_held(cache, [p for pages in out.values() for p in pages])
        return out
    total = sum(n for _, _, n in wanted) // page
    run = alloc_device(cache, total, path[-1] if path else None, path)
    out, at = {}, 0
    for ident, o, n in wanted:
        out[ident] = run[at : at + n // page]
        cache.tiers.write_tokens(out[ident], key[o : o + n])
        at += n // page
    return out


def _check_held(cache: HiCache, pages: Sequence[int]) -> None:
    """Refuse unless every page is held by a request and listed once."""
    allocator = cache.tiers.device.allocator
    seen: set[int] = set()
    for p in pages:
        owner = allocator.owner_of(p)  # ForeignSlot when outside the pool
        if owner == FREE:
            raise ForeignSlot(
                f"insert: device page {p} is free; a request's slots come from alloc_slots"
            )
        if owner != REQUEST:
            raise ForeignSlot(f"insert: device page {p} belongs to node {owner}, not to a request")
        if p in seen:
            raise ForeignSlot(f"insert: device page {p} is given twice")
        seen.add(p)


def take_over(
    cache: HiCache, walk: Walk, key: Key, fresh: dict[int, Pages], namespace: Hashable
) -> tuple[TreeNode, ...]:
    """Hang the new tail under the walk's end and adopt the host-only path nodes.

    ``fresh`` comes from :func:`fresh_pages`: request-held pages, so no step
    here can be refused. Returns the new leaf, if there is one.
    """
    added: tuple[TreeNode, ...] = ()
    if walk.matched < len(key):
        parent = walk.path[-1] if walk.path else cache.tree.root(namespace)
        leaf = cache.tree.add_leaf(parent, key[walk.matched :], fresh.pop(-1))
        cache.tiers.device.allocator.reassign(leaf.device_pages, REQUEST, leaf.id)
        cache.leaf_heap.push(leaf)
        added = (leaf,)
    for node in walk.path:
        if node.id in fresh:
            cache._incoming[node.id] = fresh[node.id]
            cache._fire(node, "adopt")
    return added
