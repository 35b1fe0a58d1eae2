"""The residency spec's effects, bound once to the parts of a cache that move memory.

``specs/residency.toml`` names the effects ``start_write``, ``free_host``,
``free_device``, ``start_load`` and ``adopt_device``. The engine runs an
effect after every check of an event passed and before it commits, so an
effect that fails (a full host pool, a page still being copied) leaves the
node unchanged. Effects only touch the node they are fired at, its pages and
the queues of the parts they are given; copies start when the operation
flushes (:meth:`~fsm_cache.cache.transfers.Transfers.flush`).
"""

from __future__ import annotations

from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.eviction import Evictor
from fsm_cache.cache.transfers import Transfers
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine.core import Effect
from fsm_cache.errors import PoolExhausted
from fsm_cache.memory.tickets import Direction
from fsm_cache.memory.tiers import Tiers


class MemoryEffects:
    """The memory side of each residency transition of one cache.

    Args:
        core: Holds the pages staged for ``load`` and ``adopt``.
        tiers: The pools the pages come from and go back to.
        transfers: Queues the copies that ``write`` and ``load`` start.
        evictor: Frees host room for a write; learns of new device leaves.
    """

    def __init__(
        self, core: CacheCore, tiers: Tiers, transfers: Transfers, evictor: Evictor
    ) -> None:
        self._core = core
        self._tiers = tiers
        self._transfers = transfers
        self._evictor = evictor

    def bound(self) -> dict[str, Effect]:
        """Return the effects by the names the spec gives them."""
        return {
            "start_write": self.start_write,
            "free_host": self.free_host,
            "free_device": self.free_device,
            "start_load": self.start_load,
            "adopt_device": self.adopt_device,
        }

    def start_write(self, node: TreeNode) -> None:
        """Take host pages (evicting host leaves if the pool is full) and queue the copy.

        A write no eviction could make room for is refused with PoolExhausted
        before anything is evicted.
        """
        size = len(node.device_pages)
        try:
            pages = self._tiers.alloc_host(size, node.id)
        except PoolExhausted:
            if not self._evictor.could_free_host(size):
                raise  # no eviction could make room: refused before anything is evicted
            self._evictor.evict_host(len(node.key))
            pages = self._tiers.alloc_host(size, node.id)
        node.host_pages = pages
        self._transfers.queue(Direction.D2H, node)

    def free_host(self, node: TreeNode) -> None:
        """Give the host pages back (refused while a copy still uses them).

        The parent may have just become a host leaf.
        """
        self._tiers.free_host(node.host_pages, node.id)
        node.host_pages = ()
        parent = node.parent
        if parent is not None:
            self._evictor.offer_host(parent)

    def free_device(self, node: TreeNode) -> None:
        """Give the device pages back.

        The parent may have just become a device leaf, and the node, if a host
        copy stays, a host leaf.
        """
        self._tiers.free_device(node.device_pages, node.id)
        node.device_pages = ()
        self._evictor.offer_host(node)
        parent = node.parent
        if parent is not None:
            self._evictor.offer(parent)

    def start_load(self, node: TreeNode) -> None:
        """Take the staged device pages and queue the host-to-device copy."""
        self.adopt_device(node)
        self._transfers.queue(Direction.H2D, node)

    def adopt_device(self, node: TreeNode) -> None:
        """Take the staged device pages, which already hold the node's KV (recomputed).

        The allocator hands them over first: where it breaks (an error from
        outside the cache), the node is left as it was, as an effect that
        raises must leave its record (:class:`~fsm_cache.errors.EffectFailed`),
        and the operation that staged the pages gives back those no node took.
        """
        pages = self._core.take_staged(node.id)
        self._tiers.device.allocator.reassign(pages, 0, node.id)
        node.device_pages = pages
        self._evictor.offer(node)
