"""Request slots: the device memory a request computes KV into, and how insert takes it over.

As in SGLang, a request's KV slots are allocated before its forward pass and
handed to the cache on insert; the slots of a prefix the cache already holds
on the device stay the request's to free. This module answers, in whole
pages, where the device memory of an insert comes from: the caller's slots,
or fresh pages taken (evicting if needed) and filled from the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsm_cache.eviction import alloc_device
from fsm_cache.pools import pages_of, slots_of


if TYPE_CHECKING:
    from fsm_cache.cache import HiCache
    from fsm_cache.tree import Key, Pages, TreeNode


def alloc(cache: HiCache, num_tokens: int) -> list[int]:
    """Return device slots for ``num_tokens`` (whole pages), evicting if needed."""
    pages = -(-num_tokens // cache.config.page_size)
    return slots_of(alloc_device(cache, pages, None), cache.config.page_size)


def free(cache: HiCache, slots: Sequence[int]) -> None:
    """Give back request-held device slots (whole pages)."""
    cache.tiers.free_device(pages_of(slots, cache.config.page_size), 0)


def fresh_pages(
    cache: HiCache, path: Sequence[TreeNode], key: Key, slots: Sequence[int] | None
) -> dict[int, Pages]:
    """Device pages for host-only path nodes (by id) and the new tail (key -1).

    Only the caller's slots for those parts are read (and checked to be whole
    pages); slots of the part already on the device are the caller's business.
    """
    page, offset, wanted = cache.config.page_size, 0, []
    for node in path:
        if node.device == "absent":
            wanted.append((node.id, offset, len(node.key)))
        offset += len(node.key)
    if offset < len(key):
        wanted.append((-1, offset, len(key) - offset))
    if slots is not None:
        return {ident: tuple(pages_of(slots[o : o + n], page)) for ident, o, n in wanted}
    total = sum(n for _, _, n in wanted) // page
    run = alloc_device(cache, total, path[-1] if path else None)
    out, at = {}, 0
    for ident, o, n in wanted:
        out[ident] = run[at : at + n // page]
        cache.tiers.write_tokens(out[ident], key[o : o + n])
        at += n // page
    return out
