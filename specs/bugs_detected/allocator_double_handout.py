"""NEGATIVE CONTROL (found by verify): an allocator that hands the same page out twice.

It forgets to take the pages it returns off the free list, so the next
allocation returns them again. The allocator contracts of
``fsm_cache.contracts.pages`` are applied to it unchanged.
"""

from __future__ import annotations

from fsm_cache.contracts.pages import harness
from fsm_cache.memory.pages import PageAllocator


class DoubleHandout(PageAllocator):
    """BUG: returns free pages without removing them from the free list."""

    def alloc(self, num_slots: int, owner: int = 0) -> list[int]:
        pages = super().alloc(num_slots, owner)
        self._free.extend(reversed(pages))
        return pages


globals().update(harness(DoubleHandout, __name__))
