"""Request slots: the device memory a request computes KV into, checked before an insert.

As in SGLang, a request's KV slots are allocated before its forward pass and
handed to the cache on insert; the slots of a prefix the cache already holds
on the device stay the request's to free. These pure functions answer, in
whole pages, which parts of an insert need device memory and whether the
caller's slots for them are pages the request holds, each once, before
anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsm_cache.cache.tree import Key, TreeNode
from fsm_cache.errors import ForeignSlot, NotASlot
from fsm_cache.memory.pages import FREE, REQUEST, PageAllocator, pages_of
from fsm_cache.numeric import boolean


NEW_TAIL = -1
"""The key of :func:`wanted` under which the new tail of an insert is listed."""


def check_count(slots: Sequence[int] | None, tokens: int) -> None:
    """Refuse fewer caller slots than tokens (before the walk, so that nothing changes).

    Raises:
        NotASlot: There are too few, and one is a bool (:func:`refuse_bool`).
        ForeignSlot: There are too few.
    """
    if slots is not None and len(slots) < tokens:
        refuse_bool(slots, "insert")
        raise ForeignSlot(f"insert: {len(slots)} device slots for {tokens} tokens")


def refuse_bool(slots: Sequence[object], op: str) -> None:
    """Refuse the caller's ``slots`` if one is a bool of any kind, naming the first and where.

    Called where a check of ``slots`` refused them, never on an accepted
    call: the argument checks let bools through (looking for them cost an
    insert a fifth of its time), and the pool refuses each one it reads. A
    bool equals slot 0 or 1, so it can also pass as the slot it equals and
    fail a later check (a page given twice, not whole pages); the refusal
    names the bool, whatever else is wrong.

    Raises:
        NotASlot: ``slots[i]`` is a bool (``free_slots: slots[1] is True, not an int``).
    """
    for i, slot in enumerate(slots):
        if boolean(slot):
            raise NotASlot(f"{op}: slots[{i}] is {slot!r}, not an int") from None


def wanted(path: Sequence[TreeNode], key: Key, cut: int = 0) -> list[tuple[int, int, int]]:
    """Return ``(node id, offset, tokens)`` of each part of ``key`` that needs device pages.

    Those are the host-only nodes of the matched ``path`` (adopted with new
    pages) and the unmatched tail (:data:`NEW_TAIL`), in key order. With a
    ``cut`` (a :meth:`~fsm_cache.cache.tree.RadixTree.find` that ended inside
    the last node), the last node counts as the prefix a split would leave:
    its first ``cut`` tokens, in its states, so the parts are those of the
    walk that splits it (their ids aside).
    """
    offset, out = 0, []
    for node in path:
        if node.device == "absent":
            out.append((node.id, offset, len(node.key)))
        offset += len(node.key)
    if cut:
        last = path[-1]
        offset += cut - len(last.key)
        if last.device == "absent":
            out[-1] = (last.id, out[-1][1], cut)
    if offset < len(key):
        out.append((NEW_TAIL, offset, len(key) - offset))
    return out


def pages_in(parts: Sequence[tuple[int, int, int]], page_size: int) -> int:
    """Return how many device pages the parts of :func:`wanted` need, together."""
    return sum(n for _, _, n in parts) // page_size


def held(allocator: PageAllocator, pages: Sequence[int], op: str = "insert") -> tuple[int, ...]:
    """Return ``pages`` as the pool's own ints if every one is held by a request, once.

    The cache keeps the result as a node's pages, never the caller's objects
    (:meth:`PageAllocator.owned`).

    Args:
        allocator: The device pool's allocator.
        pages: The caller's pages.
        op: The operation a refusal names.

    Raises:
        ForeignSlot: A page is outside the pool, free, owned by a node, or repeated.
    """
    own = allocator.owned(pages, REQUEST)
    if own is not None:
        return own  # the common case, checked in C; otherwise name the first fault
    seen: set[int] = set()
    for p in pages:
        try:
            owner = allocator.owner_of(p)
        except ForeignSlot as exc:  # outside the pool, or no int (of the same class)
            raise type(exc)(f"{op}: {exc}") from None
        if owner == FREE:
            raise ForeignSlot(
                f"{op}: device page {p} is free; a request's slots come from alloc_slots"
            )
        if owner != REQUEST:
            raise ForeignSlot(f"{op}: device page {p} belongs to node {owner}, not to a request")
        if p in seen:
            raise ForeignSlot(f"{op}: device page {p} is given twice")
        seen.add(p)
    # only an int subclass that compares unlike the page it equals gets here
    raise ForeignSlot(f"{op}: device slots {list(pages)!r} could not be checked as the request's")


def request_pages(slots: Sequence[int], page_size: int, op: str) -> list[int]:
    """Return the pages whose slots are exactly ``slots``, as :func:`pages_of`, naming ``op``.

    Raises:
        NotASlot: A slot is no int (a bool).
        ForeignSlot: ``slots`` is not a run of whole, aligned pages.
    """
    try:
        return pages_of(slots, page_size)
    except ForeignSlot as exc:  # or a NotASlot, kept as one
        raise type(exc)(f"{op}: {exc}") from None
