"""The two memory tiers of a cache: pools, their page allocators and the copy engine.

:class:`Tiers` is where the residency machines' effects touch memory. It is
the only cache module that imports torch; the tree, the policies and the
machines stay torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch

from fsm_cache.engine.trail import choose
from fsm_cache.errors import ConfigError, PageBusy
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
from fsm_cache.memory.pages import PageAllocator
from fsm_cache.memory.tickets import Copier


CopierFactory = Callable[[KVPool, KVPool], Copier]
_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", torch.float16),
}


@dataclass(frozen=True, init=False)
class CacheConfig:
    """How big the cache is, what its KV looks like, and how it behaves.

    Attributes:
        device_pages: Pages in the device pool.
        host_pages: Pages in the host pool; defaults to ``host_ratio * device_pages``.
        host_ratio: Host pages per device page when ``host_pages`` is not given.
        page_size: Tokens per page; keys, splits and slot runs are multiples of it.
        layers: Transformer layers of the KV.
        heads: KV heads per layer.
        head_dim: Elements per head.
        dtype: Element type name (``float16``, ``bfloat16``, ``float32``, ``float8_e4m3fn``).
        device: ``cuda``, ``cpu``, or None for CUDA when available.
        write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.
        selective_threshold: Hits before a selective write-through backs a node up.
        load_back_threshold: Fewest tokens worth loading back rather than recomputing.
        debug: Check every invariant after every operation.
        trail: Trail mode: keep call sites of recent events per node, so refusals
            name them (``None``: ``FSM_CACHE_TRAIL``).
        copier: Builds the copy engine from the two pools (tests inject faults here).

    ``audit=`` is the deprecated spelling of ``trail=`` (it warns; passing both
    with different values raises :class:`ConfigError`), and :attr:`audit` reads
    ``trail``; both go in the next release. The initialiser is written out only
    to accept that keyword: ``audit`` is no field, so :func:`dataclasses.replace`
    and comparisons see ``trail`` alone.
    """

    device_pages: int
    host_pages: int | None
    host_ratio: float
    page_size: int
    layers: int
    heads: int
    head_dim: int
    dtype: str
    device: str | None
    write_policy: str
    selective_threshold: int
    load_back_threshold: int
    debug: bool
    trail: bool | None
    copier: CopierFactory | None = field(compare=False)

    def __init__(  # noqa: PLR0917 (the positional order the generated initialiser had)
        self,
        device_pages: int = 256,
        host_pages: int | None = None,
        host_ratio: float = 2.0,
        page_size: int = 16,
        layers: int = 2,
        heads: int = 2,
        head_dim: int = 16,
        dtype: str = "float16",
        device: str | None = None,
        write_policy: str = "write_through",
        selective_threshold: int = 2,
        load_back_threshold: int = 10,
        debug: bool = False,
        trail: bool | None = None,
        copier: CopierFactory | None = None,
        *,
        audit: bool | None = None,
    ) -> None:
        trail = choose(trail, audit, "CacheConfig", stacklevel=2)
        given = locals()  # every field is a parameter of the same name
        for name in (f.name for f in fields(self)):
            object.__setattr__(self, name, given[name])

    @property
    def audit(self) -> bool | None:
        """Deprecated name of :attr:`trail`; goes in the next release."""
        return self.trail

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first value out of range."""
        positive = ("device_pages", "page_size", "layers", "heads", "head_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"config: {name} must be >= 1, got {getattr(self, name)}")
        if self.host_pages is not None and self.host_pages < 0:
            raise ConfigError(f"config: host_pages must be >= 0, got {self.host_pages}")
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"config: dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        policies = ("write_through", "write_through_selective", "write_back")
        if self.write_policy not in policies:
            msg = f"config: write_policy must be one of {', '.join(policies)}, got {self.write_policy!r}"
            raise ConfigError(msg)
        if self.selective_threshold < 1 or self.load_back_threshold < 0:
            raise ConfigError(
                "config: selective_threshold must be >= 1 and load_back_threshold >= 0"
            )

    def layout(self) -> KVLayout:
        """Return the KV layout the pools are built with."""
        return KVLayout(self.layers, self.heads, self.head_dim, _DTYPES[self.dtype], self.page_size)


class Tiers:
    """The device pool, the host pool and the copies between them.

    Args:
        config: The cache's configuration (already checked).
    """

    def __init__(self, config: CacheConfig) -> None:
        layout = config.layout()
        where = torch.device(config.device) if config.device else None
        self.device = device_pool(layout, config.device_pages, where)
        host = config.host_pages
        if host is None:
            host = int(config.device_pages * config.host_ratio)
        self.host = host_pool(layout, host, pin=self.device.device.type == "cuda")
        make = config.copier or CopyEngine
        self.copier: Copier = make(self.device, self.host)
        self.page_size = config.page_size

    def reset(self) -> None:
        """Free every page of both pools, keeping their tensors (and pinned memory) as they are.

        The copy engine must have nothing in flight (drain it first): no page may be busy.
        """
        for pool in (self.device, self.host):
            pool.allocator = PageAllocator(pool.name, pool.num_pages, pool.layout.page_size)

    def alloc_device(self, pages: int, owner: int) -> tuple[int, ...]:
        """Take ``pages`` device pages for ``owner`` (raises PoolExhausted, changes nothing)."""
        return tuple(self.device.allocator.alloc(pages * self.page_size, owner))

    def alloc_host(self, pages: int, owner: int) -> tuple[int, ...]:
        """Take ``pages`` host pages for ``owner`` (raises PoolExhausted, changes nothing)."""
        return tuple(self.host.allocator.alloc(pages * self.page_size, owner))

    def free_device(self, pages: Sequence[int], owner: int) -> None:
        """Give device pages back, refusing while a copy still reads or writes them."""
        if self.copier.device_busy(pages):
            raise PageBusy(f"device pages of node {owner} are still being copied")
        self.device.allocator.free(pages, owner)

    def free_host(self, pages: Sequence[int], owner: int) -> None:
        """Give host pages back, refusing while a copy still reads or writes them."""
        if self.copier.host_busy(pages):
            raise PageBusy(f"host pages of node {owner} are still being copied")
        self.host.allocator.free(pages, owner)

    def reassign(self, device: Sequence[int], host: Sequence[int], owner: int, new: int) -> None:
        """Hand pages from ``owner`` to ``new`` in both pools (a split)."""
        self.device.allocator.reassign(device, owner, new)
        self.host.allocator.reassign(host, owner, new)

    def write_tokens(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Fill ``pages`` with KV derived from ``tokens``, as a model's forward pass would."""
        self.device.write(pages, synthetic_kv(self.device.layout, tokens))

    def read_device(self, pages: Sequence[int]) -> torch.Tensor:
        """Return the KV held in device ``pages`` (tests, examples)."""
        return self.device.read(pages)


def synthetic_kv(layout: KVLayout, tokens: Sequence[int]) -> torch.Tensor:
    """Return a KV tensor whose every token's vector depends on its token id, reproducibly.

    Shape ``[layers, planes, len(tokens), heads, head_dim]``: what a forward
    pass over ``tokens`` would write, close enough for bit-exact round trips
    (a page copied to the wrong place shows up as a different token's values).
    Values are multiples of 1/8 below 128, exact in every supported dtype.
    """
    ids = torch.tensor(list(tokens), dtype=torch.float32)
    values = torch.remainder(ids, 997.0) * 0.125 - 62.0
    shape = (layout.layers, layout.planes, len(tokens), layout.heads, layout.head_dim)
    return values.view(1, 1, -1, 1, 1).expand(shape).to(layout.dtype)
