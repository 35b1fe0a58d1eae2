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
is present; see ``docs/memory.md`` for why not ``pin_memory=True``. The
registration is made with the device pool's GPU current (``torch.cuda.device``),
so a rank on ``cuda:3`` that never called ``torch.cuda.set_device`` neither
creates a context on GPU 0 nor pins the memory for the wrong context.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from fsm_cache.errors import BadArgument, ForeignSlot, PinnedMemoryError, PoolError
from fsm_cache.memory.pages import PageAllocator, page_index
from fsm_cache.numeric import boolean, finite, shown, whole


QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
"""The quantized dtypes: torch offers no test of a dtype (``is_quantized`` is a tensor's).

Plain bytes mean nothing in them without a scale, and a pool of one (a
tensor made without a quantizer) crashes the interpreter."""

_INT = frozenset((int,))
"""The one page type :meth:`KVPool._index` accepts without a look at each page."""


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

    Raises:
        BadArgument: a size is not an int >= 1 (a page of no bytes cannot be
            copied or counted), ``planes`` is neither 1 nor 2, or ``dtype`` is
            not a ``torch.dtype`` or is a quantized one (:data:`QUANTIZED`).
    """

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    planes: int = 2

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not whole(value, 1):
                raise BadArgument(f"KV layout: {name} must be an int >= 1, got {value!r}")
        if self.planes not in {1, 2} or not whole(self.planes):
            raise BadArgument(f"KV layout: planes must be 1 or 2, got {self.planes!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise BadArgument(f"KV layout: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype in QUANTIZED:  # torch.empty of one crashes the interpreter
            raise BadArgument(
                f"KV layout: dtype must be a plain dtype, got the quantized {self.dtype}"
            )

    @classmethod
    def mla(cls, layers: int, latent_dim: int, dtype: torch.dtype, page_size: int) -> KVLayout:
        """Return the layout of an MLA cache: one latent vector per token and layer."""
        return cls(layers, 1, latent_dim, dtype, page_size, planes=1)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

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
        num_pages: Pages in the pool (none once :meth:`release` gave its memory back).
        tensor: The KV in the tier's layout (see the module docstring).
        pages: A uint8 view ``[pages, ...]`` indexed by page on dim 0 (for the
            device pool a non-contiguous permuted view).
        words: The same bytes as ``[pages, layers * planes, words]``: each
            page's row for one layer and plane is contiguous, read as the
            widest integer word that divides it (64-bit where the page size
            allows), so a gather or scatter moves 8 bytes per element instead
            of one, bit for bit.
        allocator: The pool's :class:`PageAllocator`.
        pinned: Whether the memory is page-locked by this pool.
        released: Whether :meth:`release` gave the pool's memory back.

    Raises:
        BadArgument: ``name`` is neither ``device`` nor ``host``, ``num_pages``
            is not an int >= 0, or ``tensor`` is not a contiguous tensor of
            the shape and dtype that ``name``'s layout needs for ``num_pages``
            pages (:func:`device_pool` and :func:`host_pool` make them); the
            views would otherwise alias or reinterpret its memory.
    """

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        num_pages: int,
        tensor: torch.Tensor,
        pinned: bool,
        *,
        pin_device: torch.device | None = None,
    ) -> None:
        _check_pool(name, layout, num_pages, tensor)
        self.name = name
        self.layout = layout
        self.pinned = pinned
        self.released = False
        self._maybe_registered = False  # an unregistration failed: never give the memory back
        self.allocator = PageAllocator(name, num_pages, layout.page_size)
        self._page_first = name == "host"
        self._hold(tensor, num_pages)
        self._on_cpu = tensor.device.type == "cpu"  # the page index's fast path reads it
        self._pin_device = pin_device
        self._finalizer: weakref.finalize[..., KVPool] | None = None
        if pinned:
            self._finalizer = weakref.finalize(self, _unregister_at_exit, tensor, pin_device)

    def _hold(self, tensor: torch.Tensor, num_pages: int) -> None:
        """Take ``tensor`` as the pool's memory of ``num_pages`` pages, with every view of it."""
        layout, name = self.layout, self.name
        self.num_pages = num_pages
        self.tensor = tensor
        self.pages = _page_view(tensor, layout, num_pages, page_first=name == "host")
        self.words = _word_view(tensor, layout, num_pages, page_first=name == "host")
        # what writes address: runs of pages as slices of the pool split into pages,
        # other pages by index in a contiguous view of the words (the host's own, or
        # the device's layer-first ``[layers * planes, pages, words]``)
        self._paged = tensor if self._page_first else tensor.view(*_paged_shape(layout, num_pages))
        # the same split into pages with the pages last, ``[layers, planes, page_size, heads,
        # head_dim, pages]`` on either tier: what write_values(pages_last=True) addresses
        self._paged_last = self._paged.permute(
            (1, 2, 3, 4, 5, 0) if self._page_first else (0, 1, 3, 4, 5, 2)
        )
        self._dest = self.words if self._page_first else self.words.permute(1, 0, 2)
        # the device pool with its slots last, ``[layers, planes, heads, head_dim, slots]``:
        # what write_slots addresses (the host's pages are first: no such view of it)
        self._slots_last = tensor if self._page_first else tensor.permute(0, 1, 3, 4, 2)
        # and as a numpy array, on CPU where numpy has the dtype: what write_slots stores numpy
        # values through, a numpy call costing a fraction of a torch call on a short write
        self._slots_np = None if self._page_first else _numpy_view(self._slots_last)

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
        No pages give an empty tensor of that shape.

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside the pool.
        """
        idx = self._index(pages)
        lay = self.layout
        shape = _pool_shape("device", lay, len(pages))
        if idx is None:
            return torch.empty(shape, dtype=lay.dtype, device="cpu")
        data = self.pages.index_select(0, idx).permute(1, 2, 0, 3, 4, 5)
        return data.reshape(*shape[:-1], -1).view(lay.dtype).to("cpu")

    def write(self, pages: Sequence[int], kv: torch.Tensor) -> None:
        """Store ``kv`` (device layout, ``len(pages) * page_size`` tokens) into ``pages``.

        No pages and an empty ``kv`` write nothing. The whole request is
        checked first, so a refused write changes no page. The checks run in
        C over the whole list (the pages' types as a set, an ascending run as
        one comparison with a range, else the bounds and a set of the pages);
        only a refused request is walked page by page, to name the first
        culprit. A run of pages is stored as one slice, other pages with one
        ``index_copy_`` of the pool's words.

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside the pool.
            PoolError: a page is listed twice, or ``kv`` has another shape or
                dtype than ``pages`` need.
        """
        pages, where = self._where(pages)
        lay, n = self.layout, len(pages)
        shape = _pool_shape("device", lay, n)
        if kv.shape != shape or kv.dtype != lay.dtype:
            raise PoolError(
                f"{self.name} pool: kv of shape {tuple(kv.shape)} and dtype {kv.dtype} "
                f"does not fit {n} pages, which need shape {shape} and dtype {lay.dtype}"
            )
        if where is not None:
            self._store(pages, where, kv.reshape(_paged_shape(lay, n)))

    def write_values(
        self, pages: Sequence[int], values: torch.Tensor, *, pages_last: bool = False
    ) -> None:
        """Store ``values`` into ``pages``, cast to the pool's dtype as ``Tensor.copy_`` casts.

        ``values`` is ``[layers, planes, len(pages), page_size, heads,
        head_dim]``: the device layout with its slots split into pages, in
        any dtype on any device; with ``pages_last``, the same dimensions
        with the pages moved last, ``[layers, planes, page_size, heads,
        head_dim, len(pages)]``. For KV computed in another type, such as
        :meth:`Tiers.write_tokens`'s small integers (exact in every KV
        dtype): the cast happens on the way into the pool instead of in a
        tensor of its own, and KV computed with the pages last (a broadcast
        over the tokens) is copied in that order, where a permuted view of
        it would cost the copy about a microsecond more. Checked as
        :meth:`write`; a refused write changes no page.

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside the pool.
            PoolError: a page is listed twice, or ``values`` has another
                shape than ``pages`` need.
        """
        pages, where = self._where(pages)
        n = len(pages)
        shape = _paged_shape(self.layout, n)
        if pages_last:
            shape = (*shape[:2], *shape[3:], n)
        self._refuse_shape(values, shape, n)
        if where is None:
            return
        if not pages_last:
            self._store(pages, where, values)
        elif isinstance(where, int):  # a run: one slice, in the values' own order
            self._paged_last[..., where : where + n] = values  # a view and a copy_, in one call
        else:
            self._store(pages, where, values.permute(0, 1, 5, 2, 3, 4))

    def write_slots(self, pages: Sequence[int], values: torch.Tensor | NDArray[Any]) -> None:
        """Store ``values``, laid out with the slots last, into ``pages``, cast as ``copy_`` casts.

        ``values`` is ``[layers, planes, heads, head_dim, len(pages) *
        page_size]``: the device layout with its slots moved last, the
        order :meth:`Tiers.write_tokens <fsm_cache.memory.tiers.Tiers.write_tokens>`
        makes a small layout's KV in, broadcast over the tokens as they come.
        A run of pages of the device pool is one slice of the pool in that
        order; other pages, and the host pool, are written as
        :meth:`write_values` writes them. Checked as :meth:`write`; a
        refused write changes no page.

        ``values`` may be a numpy array (what ``write_tokens`` makes on CPU):
        a run of a CPU device pool whose dtype numpy has (not bfloat16 or
        float8) is then stored through a numpy view of the pool, with
        numpy's cast, which rounds to nearest even as ``copy_`` does; other
        writes take it as a tensor (``torch.from_numpy``, no copy).

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside the pool.
            PoolError: a page is listed twice, or ``values`` has another
                shape than ``pages`` need.
        """
        pages, where = self._where(pages)
        lay, n = self.layout, len(pages)
        ps = lay.page_size
        shape = (lay.layers, lay.planes, lay.heads, lay.head_dim, n * ps)
        self._refuse_shape(values, shape, n)
        if where is None:
            return
        if isinstance(where, int) and not self._page_first:  # a run: one slice of the slots
            if self._slots_np is not None and isinstance(values, np.ndarray):
                self._slots_np[..., where * ps : (where + n) * ps] = values
            else:
                self._slots_last[..., where * ps : (where + n) * ps] = _tensor(values)
        else:
            paged = _tensor(values).reshape(*shape[:4], n, ps).permute(0, 1, 4, 5, 2, 3)
            self._store(pages, where, paged)

    def _refuse_shape(
        self, values: torch.Tensor | NDArray[Any], shape: tuple[int, ...], n: int
    ) -> None:
        """Raise :class:`PoolError` unless ``values`` has the ``shape`` that ``n`` pages need."""
        if values.shape != shape:
            raise PoolError(
                f"{self.name} pool: values of shape {tuple(values.shape)} do not fit "
                f"{n} pages, which need shape {shape}"
            )

    def _store(self, pages: Sequence[int], where: int | torch.Tensor, paged: torch.Tensor) -> None:
        """Write ``paged`` (``[layers, planes, pages, page_size, heads, head_dim]``) to ``pages``.

        ``where`` is what :meth:`_where` returned for them: the first page of
        a run, stored as one slice (``copy_`` takes any device, dtype and
        strides), or an index, whose pages must be distinct.
        """
        n = len(pages)
        if isinstance(where, int):  # a run: each page listed once
            if self._page_first:
                self._paged.narrow(0, where, n).copy_(paged.permute(2, 0, 1, 3, 4, 5))
            else:
                self._paged.narrow(2, where, n).copy_(paged)
            return
        if len(set(pages)) != n:
            self._refuse_repeats(pages)
        exact = paged.to(self.device, self.layout.dtype).contiguous()
        rows = exact.view(self.words.shape[1], n, -1).view(self.words.dtype)
        if self._page_first:
            self._dest.index_copy_(0, where, rows.transpose(0, 1))
        else:
            self._dest.index_copy_(1, where, rows)

    def _where(self, pages: Sequence[int]) -> tuple[Sequence[int], int | torch.Tensor | None]:
        """Check ``pages``; return them as ints (:meth:`check_pages`) and where they are.

        Where: the first page of an ascending run, else an index (None: no pages).
        A run the pool's allocator handed out is recognised by identity, in C
        (:meth:`~fsm_cache.memory.pages.PageAllocator.run_of`), before any
        look at each page's type: the pages an insert writes its KV to.

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside ``0..num_pages - 1``.
        """
        if len(pages) == 0:  # not ``not pages``: an array of pages has no truth value
            return pages, None
        first, n = self.allocator.run_of(pages), len(pages)
        if first is not None and first + n <= self.num_pages:  # pages the allocator handed out
            return pages, first
        if not _INT.issuperset(map(type, pages)):
            pages = self.check_pages(pages)  # names the culprit, or converts (a numpy integer)
        first = pages[0]
        if pages[-1] == first + n - 1 and first >= 0 and first + n <= self.num_pages:
            run = range(first, first + n)  # compared in C, as a tuple or a list
            if (pages == tuple(run)) if isinstance(pages, tuple) else (list(pages) == list(run)):
                return pages, first
        return pages, self._pages_index(pages)

    def _index(self, pages: Sequence[int]) -> torch.Tensor | None:
        """Check ``pages`` and return them as an index on the pool's device (None: no pages).

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside ``0..num_pages - 1``.
        """
        if len(pages) == 0:  # not ``not pages``: an array of pages has no truth value
            return None
        if not _INT.issuperset(map(type, pages)):
            pages = self.check_pages(pages)
        return self._pages_index(pages)

    def _pages_index(self, pages: Sequence[int]) -> torch.Tensor:
        """``pages`` (ints, not empty) as an index on the pool's device, after their bounds."""
        if not (min(pages) >= 0 and max(pages) < self.num_pages):
            self.check_pages(pages)
        idx = torch.frombuffer(array("q", pages), dtype=torch.int64)
        return idx if self._on_cpu else upload(idx, self.device)  # device: a tensor's, ~1 us

    def check_pages(self, pages: Sequence[int]) -> Sequence[int]:
        """Return ``pages`` as ints, refusing them unless each is a page of the pool.

        Pages are taken as the pool's allocator takes them
        (:func:`~fsm_cache.memory.pages.page_index`): a numpy integer or a
        one-element integer tensor is the int it stands for, and the result
        holds that int, so the pages compare and hash as ints (a tensor hashes
        by identity); a bool (equal to page 0 or 1) or a float is no page.
        Checked in C where every page is an int in range (the common case),
        which returns ``pages`` itself; otherwise the first fault is named, a
        bool first, as the allocator names it.

        Raises:
            NotASlot: a page is not an int (``device pool: page True is not an int``).
            ForeignSlot: a page is outside ``0..num_pages - 1``, or the pool was released.
        """
        if len(pages) == 0 or (  # not ``not pages``: an array of pages has no truth value
            _INT.issuperset(map(type, pages)) and min(pages) >= 0 and max(pages) < self.num_pages
        ):
            return pages
        name, num_pages = self.name, self.num_pages
        for p in pages:  # a bool first: it equals page 0 or 1, so the range would take it
            if boolean(p):
                page_index(name, num_pages, p)
        if self.released:
            raise ForeignSlot(
                f"{name} pool: page {pages[0]!r} refused: the pool was released (its cache "
                "was closed, or dropped unclosed) and gave its memory back, so it has no pages"
            )
        return [page_index(name, num_pages, p) for p in pages]

    def _refuse_repeats(self, pages: Sequence[int]) -> None:
        """Raise :class:`PoolError` naming the first page ``pages`` lists twice."""
        seen: set[int] = set()
        for p in pages:
            if p in seen:
                raise PoolError(f"{self.name} pool: page {p} is listed twice")
            seen.add(p)

    def fill(self, pages: Sequence[int], byte: int) -> None:
        """Set every byte of ``pages`` to ``byte`` (poisons the pages a failed copy wrote).

        Checked whole first, as :meth:`write` is: a refused fill changes no
        page (a negative page would otherwise poison one counted from the end).

        Raises:
            NotASlot: a page is not an int (a bool, a float).
            ForeignSlot: a page is outside ``0..num_pages - 1``.
            BadArgument: ``byte`` is not an int in ``0..255``.
        """
        pages = self.check_pages(pages)
        if not whole(byte) or byte > 0xFF:
            raise BadArgument(f"{self.name} pool: fill byte must be an int in 0..255, got {byte!r}")
        for p in pages:
            self.pages[p].fill_(byte)

    def close(self) -> None:
        """Unregister pinned memory now instead of at garbage collection; idempotent.

        The pool stays usable as pageable memory (copies from it become
        synchronous); :attr:`pinned` turns False. Wait for every copy that
        reads or writes the pool first (:meth:`Tiers.close` does).

        Raises:
            PinnedMemoryError: ``cudaHostUnregister`` failed. The pool counts
                as closed anyway: a second close does nothing.
        """
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is None or finalizer.detach() is None:
            return
        self.pinned = False
        try:
            unregister_host(self.tensor, self._pin_device)
        except PinnedMemoryError:
            self._maybe_registered = True  # release() must not give this memory back
            raise

    def release(self) -> None:
        """Give the pool's memory back now: unregister it (:meth:`close`), then drop it; idempotent.

        The end of a cache (:meth:`Tiers.close`): a cache's parts refer to each
        other, so without this its pools would stay allocated until Python's
        cyclic garbage collector reclaimed the cache. The pool keeps its
        layout, its allocator and a tensor of no pages: every page asked of it
        from now on is refused (:class:`~fsm_cache.errors.ForeignSlot`). A view
        of the pool taken before (``pages``, ``words``, a tensor ``read``
        returned) keeps the memory it views. Wait for every copy that reads or
        writes the pool first (:meth:`Tiers.close` does).

        Where unregistering failed (now, or at an earlier :meth:`close`) the
        memory is kept, as it may still be registered: freeing registered
        memory is undefined. The pool is then not released.

        Raises:
            PinnedMemoryError: As :meth:`close`; the memory is kept.
        """
        if self.released:
            return
        self.close()
        if self._maybe_registered:
            return
        self.released = True
        self._hold(self.tensor.new_empty(_pool_shape(self.name, self.layout, 0)), 0)


def _numpy_view(tensor: torch.Tensor) -> NDArray[Any] | None:
    """``tensor``'s memory as a numpy array, or None off the CPU or for a dtype numpy lacks."""
    if tensor.device.type != "cpu":
        return None
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16, the float8 types
        return None


def _tensor(values: torch.Tensor | NDArray[Any]) -> torch.Tensor:
    """``values`` as a tensor: itself, or a numpy array's memory (no copy)."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _check_pool(name: object, layout: KVLayout, num_pages: object, tensor: object) -> None:
    """Refuse a pool whose tensor is not what its views assume; see :class:`KVPool`."""
    if name not in {"device", "host"}:
        raise BadArgument(f"KV pool: name must be 'device' or 'host', got {name!r}")
    if not isinstance(layout, KVLayout):
        raise BadArgument(f"{name} pool: layout must be a KVLayout, got {type(layout).__name__}")
    if not whole(num_pages):
        raise BadArgument(f"{name} pool: num_pages must be an int >= 0, got {num_pages!r}")
    if not isinstance(tensor, torch.Tensor):
        raise BadArgument(
            f"{name} pool: tensor must be a torch.Tensor, got {type(tensor).__name__}"
        )
    shape = _pool_shape(name, layout, num_pages)
    if tuple(tensor.shape) != shape or tensor.dtype != layout.dtype:
        raise BadArgument(
            f"{name} pool: a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
            f"does not hold {num_pages} pages, which need shape {shape} and dtype {layout.dtype}"
        )
    if not tensor.is_contiguous():
        raise BadArgument(
            f"{name} pool: the tensor must be contiguous, got strides {tensor.stride()}"
        )
    # no pool either way: autograd refuses every in-place write to a tensor that requires
    # grad, and a lazy negation's bit is one no byte view (nor numpy view) can carry
    if tensor.requires_grad or tensor.is_neg():
        what = "requires grad" if tensor.requires_grad else "is a lazy negation (is_neg())"
        raise BadArgument(f"{name} pool: the tensor {what}; give it a plain tensor")


def _pool_shape(name: str, layout: KVLayout, pages: int) -> tuple[int, ...]:
    """The shape of ``pages`` pages in ``name``'s pool: host pages first, device slots third.

    KV in the device layout, wherever it is held, has the device's shape.
    """
    lay = layout
    if name == "host":
        return (pages, lay.layers, lay.planes, lay.page_size, lay.heads, lay.head_dim)
    return (lay.layers, lay.planes, pages * lay.page_size, lay.heads, lay.head_dim)


def _paged_shape(layout: KVLayout, pages: int) -> tuple[int, ...]:
    """The device layout of ``pages`` pages with its slots split into pages."""
    lay = layout
    return (lay.layers, lay.planes, pages, lay.page_size, lay.heads, lay.head_dim)


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


WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""The integer types pages are moved as, widest first; the first that divides a row is used."""


def word_type(row_bytes: int) -> torch.dtype:
    """Return the widest of :data:`WORDS` whose size divides ``row_bytes``."""
    return next(w for w in WORDS if row_bytes % w.itemsize == 0)


def _word_view(
    tensor: torch.Tensor, layout: KVLayout, num_pages: int, page_first: bool
) -> torch.Tensor:
    """The pool as ``[pages, layers * planes, words]``: one contiguous row per page and plane."""
    lay = layout
    rows = lay.layers * lay.planes
    row_bytes = lay.page_size * lay.heads * lay.head_dim * lay.itemsize
    raw = tensor.view(torch.uint8)
    if page_first:
        return raw.view(num_pages, rows, row_bytes).view(word_type(row_bytes))
    return raw.view(rows, num_pages, row_bytes).view(word_type(row_bytes)).permute(1, 0, 2)


def device_pool(layout: KVLayout, num_pages: int, device: torch.device | None = None) -> KVPool:
    """Allocate the device pool ``[layers, P, num_pages*page_size, heads, head_dim]``.

    Args:
        layout: The KV layout.
        num_pages: Pages to allocate.
        device: Where; :func:`default_device` when ``None``.
    """
    if not whole(num_pages):
        raise BadArgument(f"device pool: num_pages must be an int >= 0, got {num_pages!r}")
    where = device or default_device()
    tensor = torch.empty(_pool_shape("device", layout, num_pages), dtype=layout.dtype, device=where)
    return KVPool("device", layout, num_pages, tensor, pinned=False)


def host_pool(
    layout: KVLayout,
    num_pages: int | None = None,
    *,
    byte_budget: int | None = None,
    ratio: float | None = None,
    device_pages: int | None = None,
    pin: bool | None = None,
    device: torch.device | None = None,
) -> KVPool:
    """Allocate the host pool, sized by exactly one of pages, bytes, or a ratio.

    Args:
        layout: The KV layout.
        num_pages: Pages to allocate.
        byte_budget: Bytes to spend; rounded down to whole pages.
        ratio: Host pages per device page (SGLang's ``hicache_ratio``).
        device_pages: The device pool's pages, required with ``ratio``.
        pin: Page-lock the memory; defaults to whether CUDA is available.
        device: The CUDA device whose copies use the pool: the memory is
            registered (and later unregistered) with it current. None: the
            current CUDA device.

    Raises:
        BadArgument: not exactly one size was given, ``ratio`` lacks
            ``device_pages``, or the size is not a whole number of pages
            ``>= 0`` (``num_pages``, ``byte_budget`` and ``device_pages``
            ints, ``ratio`` a finite real).
        PinnedMemoryError: ``cudaHostRegister`` failed.
    """
    pages = _host_pages(layout, num_pages, byte_budget, ratio, device_pages)
    pinned = torch.cuda.is_available() if pin is None else pin
    where = _pin_device(device) if pinned else None
    shape = _pool_shape("host", layout, pages)
    tensor = alloc_exact_host(shape, layout.dtype, pinned, device=where)
    return KVPool("host", layout, pages, tensor, pinned=pinned, pin_device=where)


def _host_pages(
    layout: KVLayout,
    num_pages: int | None,
    byte_budget: int | None,
    ratio: float | None,
    device_pages: int | None,
) -> int:
    given = [x for x in (num_pages, byte_budget, ratio) if x is not None]
    if len(given) != 1:
        raise BadArgument("host_pool: give exactly one of num_pages, byte_budget, ratio")
    for name, value in (("num_pages", num_pages), ("byte_budget", byte_budget)):
        if value is not None and not whole(value):
            raise BadArgument(f"host_pool: {name} must be an int >= 0, got {value!r}")
    if num_pages is not None:
        return num_pages
    if byte_budget is not None:
        return layout.pages_for_bytes(byte_budget)
    if device_pages is None:
        raise BadArgument("host_pool: ratio needs device_pages")
    if not whole(device_pages):
        raise BadArgument(f"host_pool: device_pages must be an int >= 0, got {device_pages!r}")
    if not finite(ratio) or ratio < 0:
        raise BadArgument(f"host_pool: ratio must be a finite real >= 0, got {shown(ratio)}")
    return int(device_pages * ratio)


def upload(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Return ``index``, a CPU tensor, on ``device``, without blocking the host.

    A copy from pageable memory to CUDA blocks the host until the stream has
    run it (a hidden synchronisation on every call): on CUDA ``index`` is
    pinned first and uploaded with ``non_blocking``, on the current stream.
    The pinned buffer is kept from reuse until that copy has run.
    """
    if device.type == "cpu":
        return index
    if device.type == "cuda":  # CUDA only
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _pin_device(device: torch.device | None) -> torch.device:
    """The CUDA device to register under: ``device`` with its index, else the current one."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def alloc_exact_host(
    shape: Sequence[int], dtype: torch.dtype, pin: bool, *, device: torch.device | None = None
) -> torch.Tensor:
    """Allocate a CPU tensor of exactly ``shape``, page-locked in place when ``pin``.

    ``torch.empty(pin_memory=True)`` goes through the caching host allocator,
    which rounds every block up to a power of two: a 65 GiB pool would take
    128 GiB of locked memory. Registering a plain allocation pins exactly its
    bytes. Unregister it with :func:`unregister_host` (same ``device``) before
    it is freed.

    Args:
        shape: The tensor's shape.
        dtype: Its element type.
        pin: Page-lock it.
        device: The CUDA device current during the registration (None: the
            current one); pinned memory belongs to that device's context.

    Raises:
        PinnedMemoryError: ``cudaHostRegister`` failed.
    """
    tensor = torch.empty(tuple(shape), dtype=dtype, device="cpu")  # whatever the default device
    if pin and tensor.numel():
        register_host(tensor, device)
    return tensor


def register_host(tensor: torch.Tensor, device: torch.device | None) -> None:
    """Page-lock ``tensor``'s memory with ``device`` current (None: the current device).

    Raises:
        PinnedMemoryError: ``cudaHostRegister`` returned an error.
    """
    nbytes = tensor.numel() * tensor.element_size()
    with _current(device):
        err = _cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    _raise_on("cudaHostRegister", err, nbytes, device)


def unregister_host(tensor: torch.Tensor, device: torch.device | None) -> None:
    """Undo :func:`register_host` (same ``device``); an empty tensor was never registered.

    Raises:
        PinnedMemoryError: ``cudaHostUnregister`` returned an error.
    """
    if not tensor.numel():
        return
    with _current(device):
        err = _cudart().cudaHostUnregister(tensor.data_ptr())
    _raise_on("cudaHostUnregister", err, tensor.numel() * tensor.element_size(), device)


def _unregister_at_exit(tensor: torch.Tensor, device: torch.device | None) -> None:
    """The pool's finalizer: unregister, and warn (a finalizer cannot raise) on failure.

    The device is synchronised first: a pool dropped without :meth:`KVPool.close`
    may still be read or written by queued copies (a copy engine dropped in the
    same garbage collection may not have waited for them yet), and memory
    unregistered under a running DMA is undefined behaviour.
    """
    if torch.cuda.is_available():  # CUDA only
        with contextlib.suppress(RuntimeError):  # a broken device runs nothing more
            torch.cuda.synchronize(device)
    try:
        unregister_host(tensor, device)
    except PinnedMemoryError as exc:
        warnings.warn(str(exc), RuntimeWarning, stacklevel=1)


def _current(device: torch.device | None) -> contextlib.AbstractContextManager[object]:
    if device is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _raise_on(call: str, err: Any, nbytes: int, device: torch.device | None) -> None:
    code = int(err)
    if not code:
        return
    where = "the current CUDA device" if device is None else str(device)
    try:
        name = str(_cudart().cudaGetErrorString(err))
    except (AttributeError, TypeError, RuntimeError):  # bindings without it, or no enum
        name = "unknown error"
    _consume_last_error(device)
    raise PinnedMemoryError(
        f"{call} of {nbytes} bytes on {where} failed with cudaError {code} ({name})"
    )


def _consume_last_error(device: torch.device | None) -> None:
    """Clear the error a failed runtime call left for ``cudaGetLastError`` in this thread.

    The CUDA runtime keeps it until ``cudaGetLastError`` reads it, and torch
    reads it after every kernel launch: the next, unrelated kernel would raise
    this call's error. torch's bindings have no ``cudaGetLastError``, so a
    one-element fill kernel is launched and the error its check raises is
    dropped. Without CUDA (fake bindings in tests) there is nothing to clear.
    """
    if not torch.cuda.is_available():
        return
    # whatever it raises, the error is read (and cleared) or the device is broken for good
    with contextlib.suppress(Exception):
        torch.ones(1, device=device or torch.device("cuda"))


def _cudart() -> Any:
    """Return torch's CUDA runtime bindings (``cudaHostRegister`` and friends)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
