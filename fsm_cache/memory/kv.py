"""The KV tensors: a device pool and a host pool, with their layouts.

Layouts (``P`` = planes: 2 for K and V, 1 for an MLA latent):

* device: ``[layers, P, slots, heads, head_dim]``, layer-first, as attention
  kernels read it; slot ``s`` of page ``p`` is ``p * page_size + i``.
* host: ``[pages, layers, P, page_size, heads, head_dim]``, page-first, so that
  each host page, and each run of consecutive host pages, is one contiguous
  block: a batch copies in one transfer per run instead of one per layer.

The copy engine moves raw bytes (:attr:`KVPool.page_bytes`), so every dtype,
float8 included, round-trips bit for bit. The host pool is page-locked with
``cudaHostRegister`` on a plain tensor of exactly the requested size when CUDA
is present; see ``docs/memory.md`` for why not ``pin_memory=True``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsm_cache.memory.pages import PageAllocator


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one token's KV across the model.

    Attributes:
        layers: Transformer layers.
        heads: KV heads per layer (1 for MLA).
        head_dim: Elements per head (the latent width for MLA).
        dtype: Element type.
        page_size: Tokens (slots) per page.
        planes: 2 for separate K and V, 1 for an MLA single latent.
    """

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    planes: int = 2

    @classmethod
    def mla(cls, layers: int, latent_dim: int, dtype: torch.dtype, page_size: int) -> KVLayout:
        """Return the layout of an MLA cache: one latent vector per token and layer."""
        return cls(layers, 1, latent_dim, dtype, page_size, planes=1)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and planes."""
        per_token = self.layers * self.planes * self.heads * self.head_dim * self.itemsize
        return per_token * self.page_size

    def pages_for_bytes(self, byte_budget: int) -> int:
        """Return how many whole pages fit in ``byte_budget`` bytes."""
        return byte_budget // self.page_bytes


def default_device() -> torch.device:
    """Return ``cuda`` when a CUDA device is available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class KVPool:
    """One tier's KV tensor, its byte views, and its page allocator.

    Attributes:
        name: ``device`` or ``host``; also the allocator's name.
        layout: The KV layout.
        num_pages: Pages in the pool.
        tensor: The KV in the tier's layout (see the module docstring).
        pages: A uint8 view ``[pages, ...]`` indexed by page on dim 0 (for the
            device pool a non-contiguous permuted view).
        allocator: The pool's :class:`PageAllocator`.
        pinned: Whether the memory is page-locked by this pool.
    """

    def __init__(
        self, name: str, layout: KVLayout, num_pages: int, tensor: torch.Tensor, pinned: bool
    ) -> None:
        self.name = name
        self.layout = layout
        self.num_pages = num_pages
        self.tensor = tensor
        self.pinned = pinned
        self.allocator = PageAllocator(name, num_pages, layout.page_size)
        self.pages = _page_view(tensor, layout, num_pages, page_first=name == "host")
        self._finalizer: weakref.finalize[..., KVPool] | None = None
        if pinned:
            self._finalizer = weakref.finalize(self, _unregister, tensor)

    @property
    def device(self) -> torch.device:
        """Where the pool's memory lives."""
        return self.tensor.device

    @property
    def nbytes(self) -> int:
        """Bytes of KV the pool holds (exactly ``num_pages * layout.page_bytes``)."""
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, pages: Sequence[int]) -> torch.Tensor:
        """Return a copy of ``pages`` in the device layout ``[layers, P, n*page_size, H, D]``.

        For tests and debugging: it synchronises, so keep it off the hot path.
        """
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        data = self.pages.index_select(0, idx).permute(1, 2, 0, 3, 4, 5)
        lay = self.layout
        shape = (lay.layers, lay.planes, len(pages) * lay.page_size, lay.heads, -1)
        return data.reshape(shape).view(lay.dtype).to("cpu")

    def write(self, pages: Sequence[int], kv: torch.Tensor) -> None:
        """Store ``kv`` (device layout, ``len(pages) * page_size`` tokens) into ``pages``."""
        lay = self.layout
        raw = kv.to(self.device).contiguous().view(torch.uint8)
        shape = (lay.layers, lay.planes, len(pages), lay.page_size, lay.heads, -1)
        staged = raw.reshape(shape).permute(2, 0, 1, 3, 4, 5)
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        self.pages.index_copy_(0, idx, staged.contiguous())

    def fill(self, pages: Sequence[int], byte: int) -> None:
        """Set every byte of ``pages`` to ``byte`` (poisons the pages a failed copy wrote)."""
        for p in pages:
            self.pages[p].fill_(byte)

    def close(self) -> None:
        """Unregister pinned memory now instead of at garbage collection."""
        if self._finalizer is not None:
            self._finalizer()


def _page_view(
    tensor: torch.Tensor, layout: KVLayout, num_pages: int, page_first: bool
) -> torch.Tensor:
    raw = tensor.view(torch.uint8)
    lay = layout
    row = lay.head_dim * lay.itemsize  # explicit, so an empty pool still has a shape
    if page_first:
        return raw.view(num_pages, lay.layers, lay.planes, lay.page_size, lay.heads, row)
    view = raw.view(lay.layers, lay.planes, num_pages, lay.page_size, lay.heads, row)
    return view.permute(2, 0, 1, 3, 4, 5)


def device_pool(layout: KVLayout, num_pages: int, device: torch.device | None = None) -> KVPool:
    """Allocate the device pool ``[layers, P, num_pages*page_size, heads, head_dim]``.

    Args:
        layout: The KV layout.
        num_pages: Pages to allocate.
        device: Where; :func:`default_device` when ``None``.
    """
    where = device or default_device()
    shape = (layout.layers, layout.planes, num_pages * layout.page_size, layout.heads)
    tensor = torch.empty((*shape, layout.head_dim), dtype=layout.dtype, device=where)
    return KVPool("device", layout, num_pages, tensor, pinned=False)


def host_pool(
    layout: KVLayout,
    num_pages: int | None = None,
    *,
    byte_budget: int | None = None,
    ratio: float | None = None,
    device_pages: int | None = None,
    pin: bool | None = None,
) -> KVPool:
    """Allocate the host pool, sized by exactly one of pages, bytes, or a ratio.

    Args:
        layout: The KV layout.
        num_pages: Pages to allocate.
        byte_budget: Bytes to spend; rounded down to whole pages.
        ratio: Host pages per device page (SGLang's ``hicache_ratio``).
        device_pages: The device pool's pages, required with ``ratio``.
        pin: Page-lock the memory; defaults to whether CUDA is available.

    Raises:
        ValueError: not exactly one size was given, or ``ratio`` lacks ``device_pages``.
    """
    pages = _host_pages(layout, num_pages, byte_budget, ratio, device_pages)
    pinned = torch.cuda.is_available() if pin is None else pin
    shape = (pages, layout.layers, layout.planes, layout.page_size, layout.heads)
    tensor = alloc_exact_host((*shape, layout.head_dim), layout.dtype, pinned)
    return KVPool("host", layout, pages, tensor, pinned=pinned)


def _host_pages(
    layout: KVLayout,
    num_pages: int | None,
    byte_budget: int | None,
    ratio: float | None,
    device_pages: int | None,
) -> int:
    given = [x for x in (num_pages, byte_budget, ratio) if x is not None]
    if len(given) != 1:
        raise ValueError("host_pool: give exactly one of num_pages, byte_budget, ratio")
    if num_pages is not None:
        return num_pages
    if byte_budget is not None:
        return layout.pages_for_bytes(byte_budget)
    if device_pages is None:
        raise ValueError("host_pool: ratio needs device_pages")
    return int(device_pages * (ratio or 0.0))


def alloc_exact_host(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Allocate a CPU tensor of exactly ``shape``, page-locked in place when ``pin``.

    ``torch.empty(pin_memory=True)`` goes through the caching host allocator,
    which rounds every block up to a power of two: a 65 GiB pool would take
    128 GiB of locked memory. Registering a plain allocation pins exactly its
    bytes. Unregister it with :func:`_unregister` before it is freed.

    Raises:
        RuntimeError: ``cudaHostRegister`` failed.
    """
    tensor = torch.empty(tuple(shape), dtype=dtype)
    if pin and tensor.numel():
        nbytes = tensor.numel() * tensor.element_size()
        err = int(_cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")
    return tensor


def _unregister(tensor: torch.Tensor) -> None:
    if tensor.numel():
        _cudart().cudaHostUnregister(tensor.data_ptr())


def _cudart() -> Any:
    """Return torch's CUDA runtime bindings (``cudaHostRegister`` and friends)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
