"""The two memory tiers of a cache: pools, their page allocators and the copy engine.

:class:`Tiers` is where the residency machines' effects touch memory. It is
the only cache module that imports torch (and numpy, for a CPU pool's
synthetic KV); the tree, the policies and the machines stay torch-free.
"""

from __future__ import annotations

import functools
import math
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import cast

import numpy as np
import torch
from numpy.typing import NDArray

from fsm_cache.engine.trail import choose
from fsm_cache.errors import BadArgument, ConfigError, PageBusy
from fsm_cache.memory.copies import CopyEngine, check_stream, engine_of
from fsm_cache.memory.kv import (
    KVLayout,
    KVPool,
    default_device,
    device_pool,
    host_pool,
    upload,
)
from fsm_cache.memory.pages import PageAllocator
from fsm_cache.memory.tickets import Copier
from fsm_cache.numeric import finite, shown, whole


CopierFactory = Callable[[KVPool, KVPool], Copier]
_COPIER_METHODS = tuple(
    name for name, value in vars(Copier).items() if callable(value) and not name.startswith("_")
)
"""What the cache calls on its copy engine: the methods of the :class:`Copier` protocol."""
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
"""The element types a cache's KV may have, by the name of their ``torch`` attribute."""
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
TENSOR_BYTES = 2**63 - 1
"""The most bytes one tensor can hold (torch sizes are signed 64-bit)."""


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
        device: ``cuda``, ``cuda:N``, ``cpu``, or None for CUDA when available.
        write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.
        selective_threshold: Hits before a selective write-through backs a node up.
        load_back_threshold: Fewest tokens worth loading back rather than recomputing.
        debug: Check every invariant after every operation.
        trail: Trail mode: keep call sites of recent events per node, so refusals
            name them (``None``: ``FSM_CACHE_TRAIL``).
        copier: Builds the copy engine from the two pools (tests inject faults here):
            a new :class:`~fsm_cache.memory.copies.CopyEngine` over the pools it
            is given, or a wrapper of one that names it ``inner``
            (:class:`~fsm_cache.testing.faults.FaultyCopyEngine`); anything
            else is refused when a cache is built (see :class:`Tiers`).
        log_limit: Most entries the cache's event log keeps (the oldest go
            first), so a long-running server's log stays bounded; None keeps
            every entry (replays and audits of whole runs). Keyword-only.

    :meth:`check` (which :class:`~fsm_cache.cache.hicache.HiCache` and
    :class:`Tiers` call first) raises :class:`ConfigError` naming the first bad
    value, so no wrong type or size reaches torch as an unrelated error.

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
    log_limit: int | None

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
        log_limit: int | None = 100_000,
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
        """Raise :class:`ConfigError` naming the first value of the wrong type or out of range.

        Fields are checked in their order, then the sizes: each pool must fit
        in the memory it lives in (the GPU's, or the machine's for the host
        pool and a CPU device pool), so an absurd size is refused here rather
        than by the allocator. Messages read
        ``config: device_pages must be an int >= 1, got 2.5``.
        """
        _need_int(self, "device_pages", 1)
        if self.host_pages is not None:
            _need_int(self, "host_pages", 0, none=True)
        ratio = self.host_ratio
        if not finite(ratio) or ratio < 0:
            raise ConfigError(f"config: host_ratio must be a finite real >= 0, got {shown(ratio)}")
        for name in ("page_size", "layers", "heads", "head_dim"):
            _need_int(self, name, 1)
        _dtype_of(self.dtype)
        _device_of(self.device)
        if not isinstance(self.write_policy, str) or self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"config: write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        _need_int(self, "selective_threshold", 1)
        _need_int(self, "load_back_threshold", 0)
        if not isinstance(self.debug, bool):
            raise ConfigError(f"config: debug must be a bool, got {self.debug!r}")
        if self.trail is not None and not isinstance(self.trail, bool):
            raise ConfigError(f"config: trail must be a bool or None, got {self.trail!r}")
        if self.copier is not None and not callable(self.copier):
            raise ConfigError(
                "config: copier must be None or a callable (device_pool, host_pool) -> Copier, "
                f"got {self.copier!r}"
            )
        if self.log_limit is not None:
            _need_int(self, "log_limit", 1, none=True)
        _check_sizes(self)

    def layout(self) -> KVLayout:
        """Return the KV layout the pools are built with.

        Raises:
            ConfigError: ``dtype`` is unknown or missing from this torch.
        """
        dtype = _dtype_of(self.dtype)
        return KVLayout(self.layers, self.heads, self.head_dim, dtype, self.page_size)


def _need_int(config: CacheConfig, name: str, least: int, *, none: bool = False) -> None:
    value = getattr(config, name)
    if not whole(value, least):
        what = f"None or an int >= {least}" if none else f"an int >= {least}"
        raise ConfigError(f"config: {name} must be {what}, got {value!r}")


def _dtype_of(name: object) -> torch.dtype:
    """Return the torch dtype called ``name``, refusing names outside :data:`DTYPES`.

    A known name this torch lacks (``float8_e4m3fn`` before torch 2.1) is
    refused too, rather than silently replaced by another type.
    """
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"config: dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"config: dtype {name} is not available in torch {torch.__version__}")
    return dtype


def _device_of(name: object) -> torch.device:
    """Return the device ``name`` asks for (None: CUDA when available), refusing what is absent."""
    if name is None:
        return default_device()
    usage = "config: device must be None, 'cpu', 'cuda' or 'cuda:N'"
    if not isinstance(name, str):
        raise ConfigError(f"{usage}, got {name!r}")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's "Expected one of cpu, cuda, ... device type"
        raise ConfigError(f"{usage}, got {name!r}") from None
    if device.type not in {"cpu", "cuda"}:
        raise ConfigError(f"{usage}, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            plural = "device" if count == 1 else "devices"
            raise ConfigError(
                f"config: device {name!r} is not available: torch sees {count} CUDA {plural}"
            )
    return device


def memory_capacity(device: torch.device) -> int | None:
    """Return the bytes of memory on ``device``, or None where that is unknown.

    A CUDA device's total memory, or the machine's physical memory for the
    CPU. :meth:`CacheConfig.check` refuses pools larger than this.
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf, or no such name here
        return None


def _host_pages_of(config: CacheConfig) -> int | None:
    """The host pool's pages: ``host_pages``, else ``host_ratio * device_pages`` (None: infinite)."""
    if config.host_pages is not None:
        return config.host_pages
    pages = config.device_pages * config.host_ratio
    return int(pages) if math.isfinite(pages) else None


def _limit(device: torch.device) -> tuple[int, str]:
    """The most bytes a pool on ``device`` may take, and how a message names that limit."""
    capacity = memory_capacity(device)
    if capacity is None:
        return TENSOR_BYTES, f"the {TENSOR_BYTES} bytes a tensor can hold"
    return capacity, f"the {capacity} bytes of memory of {device}"


def _check_sizes(config: CacheConfig) -> None:
    """Refuse pools that cannot fit where they live, alone or, both on the CPU, together."""
    page = config.layout().page_bytes
    where, cpu = _device_of(config.device), torch.device("cpu")
    limit, named = _limit(where)
    device_bytes = config.device_pages * page
    if device_bytes > limit:
        raise ConfigError(
            f"config: device_pages={config.device_pages} needs {device_bytes} bytes, "
            f"more than {named}"
        )
    limit, named = _limit(cpu)
    host = _host_pages_of(config)
    if host is None:
        raise ConfigError(
            f"config: host_ratio={config.host_ratio!r} times device_pages={config.device_pages} "
            f"is infinitely many host pages, more than {named}"
        )
    host_bytes = host * page
    if host_bytes > limit:
        if config.host_pages is not None:
            why = f"host_pages={host} needs"
        else:
            why = f"host_ratio={config.host_ratio!r} gives {host} host pages, which need"
        raise ConfigError(f"config: {why} {host_bytes} bytes, more than {named}")
    if where.type == "cpu" and device_bytes + host_bytes > limit:
        raise ConfigError(
            f"config: device_pages={config.device_pages} and {host} host pages need "
            f"{device_bytes + host_bytes} bytes together, more than {named}"
        )


class Tiers:
    """The device pool, the host pool and the copies between them.

    Args:
        config: The cache's configuration; checked again here.
        compute_stream: The stream the serving engine's forward pass runs on,
            which the copy engine orders every copy after
            (:class:`~fsm_cache.memory.copies.CopyEngine`'s ``compute_stream``),
            and which :meth:`write_tokens` writes on, as a forward pass would;
            None: the device's current stream at each copy's start. Only for
            the default engine: a ``config.copier`` builds its own engine, and
            is given the stream there; :meth:`write_tokens` and
            :meth:`read_device` then follow the engine's ``compute_stream``
            where it has one
            (:attr:`~fsm_cache.memory.copies.CopyEngine.compute_stream`).

    Raises:
        ConfigError: A value is bad (see :meth:`CacheConfig.check`), a
            ``compute_stream`` is given with a ``config.copier``, or a pool
            could not be allocated or page-locked; the message names the pool,
            its pages and bytes, the device, and the allocator's reason. Or
            ``config.copier`` returned no copy engine over this cache's own
            pools (see :func:`_checked_copier`): the pools are given back, as
            :meth:`close` gives them back, and an engine the copier built
            over them is closed; one over other pools (another cache's) is
            left alone.
        BadArgument: ``compute_stream`` is not a stream, or one of another
            GPU than the device pool's. Nothing is allocated. Or the copier's
            engine exposes a ``compute_stream`` that is no stream, or one of
            another GPU: the engine is closed and the host pool unregistered,
            as :meth:`close` does.
    """

    def __init__(self, config: CacheConfig, *, compute_stream: object | None = None) -> None:
        config.check()
        if compute_stream is not None and config.copier is not None:
            raise ConfigError(
                "config: compute_stream is for the default copy engine; a copier builds its "
                "own: give the stream to the engine it builds (CopyEngine(device, host, "
                "compute_stream=...))"
            )
        layout = config.layout()
        where = _device_of(config.device)
        if where.type == "cuda" and where.index is None:  # the GPU its pool would be made on
            where = torch.device("cuda", torch.cuda.current_device())
        check_stream("compute_stream", compute_stream, where)  # before any memory is taken
        self.device = _allocate(
            "device", config.device_pages, layout, where, lambda n: device_pool(layout, n, where)
        )
        gpu = self.device.device if self.device.device.type == "cuda" else None  # with its index
        host = _host_pages_of(config) or 0  # finite: check() refused more than memory holds
        self.host = _allocate(
            "host",
            host,
            layout,
            torch.device("cpu"),
            lambda n: host_pool(layout, n, pin=gpu is not None, device=gpu),
        )
        self.closed = False
        if config.copier is None:
            self.copier: Copier = CopyEngine(self.device, self.host, compute_stream=compute_stream)
        else:
            self.copier = self._build_copier(config.copier)
        self.page_size = config.page_size
        # CUDA only: the stream write_tokens writes on, so the copies ordered after it see the KV.
        # The engine owns it; a copier's engine may have one too (FaultyCopyEngine's, a user's).
        forward = getattr(self.copier, "compute_stream", None)
        if config.copier is not None:  # the default engine checked its own before any memory
            try:  # a user's copier exposes its own: refused here, not at the first write_tokens
                check_stream("the copier's compute_stream", forward, self.device.device)
            except BadArgument:
                self.close()
                raise
        self._forward = (
            cast("torch.cuda.Stream", forward)
            if forward is not None and self.device.device.type == "cuda"
            else None
        )

    def _build_copier(self, copier: CopierFactory) -> Copier:
        """Return the engine ``copier`` builds over this cache's pools, checked.

        A factory that raises, or returns no engine over these pools, gives
        the pools back before its error goes on (:meth:`_release`); an engine
        it built over them is closed first, and one over other pools, which
        belongs to someone else (another cache's), is left as it is.

        Raises:
            ConfigError: What the factory returned is refused (:func:`_checked_copier`).
        """
        try:
            made = copier(self.device, self.host)
        except BaseException:
            self._release()
            raise
        try:
            return _checked_copier(made, self.device, self.host)
        except ConfigError:
            engine = engine_of(made)
            try:  # one over these pools was built for this cache: no other holds them
                if engine is not None and self._holds_a_pool(engine):
                    engine.close()
            finally:
                self._release()
            raise

    def _holds_a_pool(self, engine: CopyEngine) -> bool:
        """Whether ``engine`` moves into or out of one of this cache's pools."""
        return engine.device is self.device or engine.host is self.host

    def close(self) -> None:
        """Wait for every copy, then give both pools' memory back; idempotent.

        Drains and closes the copy engine (every copy in flight finishes; the
        completions are dropped, so apply them first if they matter, as
        ``HiCache.close`` does), synchronises the device (no queued kernel or
        side-stream copy may still touch the pools when their memory goes
        back to the allocator), unregisters the host pool and drops both
        pools' memory (:meth:`~fsm_cache.memory.kv.KVPool.release`): it is
        free when this returns, not when Python's cyclic garbage collector
        reclaims the cache whose parts refer to each other. After it the
        engine refuses new copies and the pools refuse every page. A view of
        a pool taken before (or held by a copy engine of the caller's own)
        keeps the memory it views.

        Raises:
            PinnedMemoryError: ``cudaHostUnregister`` failed; the tiers count
                as closed all the same, and the host pool keeps its memory
                (it may still be registered).
            RuntimeError: The copies could not be waited for (a CUDA error);
                nothing is released and the tiers stay open, so ``close`` may
                be called again: no copy may still run into memory given back.
        """
        if self.closed:
            return
        self.copier.close()
        self._release()

    def _release(self) -> None:
        """Let the device go idle, then give the pools' memory back (:meth:`close`'s end)."""
        if self.device.device.type == "cuda":
            torch.cuda.synchronize(self.device.device)
        self.closed = True
        # now, not when the cache is collected: its parts refer to each other, so only
        # Python's cyclic garbage collector would free them, at a time of its choosing
        try:
            self.host.release()
        finally:
            self.device.release()

    def reset(self) -> None:
        """Free every page of both pools, keeping their tensors (and pinned memory) as they are.

        The copy engine must have nothing in flight (drain it first): no page may be busy.

        Raises:
            PageBusy: a copy is in flight, which would run into pages handed
                out again; nothing is reset.
        """
        busy = self.copier.in_flight()
        if busy:
            raise PageBusy(
                f"tiers: reset refused: {len(busy)} copies in flight (ticket {busy[0].id} first); "
                "drain the copy engine first"
            )
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
        """Hand pages from ``owner`` to ``new`` in both pools (a split); all or none.

        If the host pool's hand-over raises (an allocator that broke), the
        device pages are handed back to ``owner`` before the error goes on,
        so a split that fails leaves both pools as they were.
        """
        self.device.allocator.reassign(device, owner, new)
        try:
            self.host.allocator.reassign(host, owner, new)
        except BaseException:
            self.device.allocator.reassign(device, new, owner)
            raise

    def write_tokens(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Fill ``pages`` with KV derived from ``tokens``, as a model's forward pass would.

        The bytes are :func:`synthetic_kv`'s, made on the device pool's own
        device from constants computed once per layout, in a few tensor
        operations a call.

        On CUDA with a ``compute_stream`` the writes are queued there, where
        a forward pass writes KV: the copies follow that stream, not the
        current one, so a backup started after this call reads what it wrote.

        Raises:
            ForeignSlot: a page is outside the device pool.
            PoolError: a page is listed twice, or ``tokens`` do not fill ``pages``.
        """
        if self._forward is None:
            self._write_tokens(pages, tokens)
            return
        with torch.cuda.stream(self._forward):  # CUDA only
            self._write_tokens(pages, tokens)

    def _write_tokens(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        n = len(tokens)
        if n and n == len(pages) * self.page_size:
            pattern = self._synthetic
            slots = pattern.slot_values(tokens)  # a small layout, a short write: slots last
            if slots is not None:
                self.device.write_slots(pages, slots)
            else:
                self.device.write_values(pages, pattern.values(tokens), pages_last=True)
        else:  # nothing to write, or refused by the pool with its message
            self.device.write(pages, self._synthetic.kv(tokens))

    @functools.cached_property
    def _synthetic(self) -> _Pattern:
        """The synthetic KV's constants for the device pool (made at the first write)."""
        return _pattern(self.device.layout, self.device.device)

    def read_device(self, pages: Sequence[int]) -> torch.Tensor:
        """Return the KV held in device ``pages`` (tests, examples), read on the current stream.

        On CUDA with a ``compute_stream`` the current stream first waits for
        the work queued on that one so far, where :meth:`write_tokens` writes,
        so the read follows the KV written before it; the host never blocks.
        """
        if self._forward is not None:  # CUDA only
            torch.cuda.current_stream(self.device.device).wait_stream(self._forward)
        return self.device.read(pages)


def _checked_copier(made: object, device: KVPool, host: KVPool) -> Copier:
    """Return what a ``CacheConfig(copier=...)`` factory made, if it is a copy engine for these pools.

    It must have the :class:`Copier` methods, and be a
    :class:`~fsm_cache.memory.copies.CopyEngine` or wrap one
    (:func:`~fsm_cache.memory.copies.engine_of`: through ``inner``) that
    moves between ``device`` and ``host``, the pools the factory was given.
    Those are new with every cache, so an engine over them belongs to no
    other cache: a factory that hands one engine to two caches is refused at
    the second, whose copies would otherwise run in the first cache's pools.

    Raises:
        ConfigError: Naming what is wrong: no engine (``None``, a tuple), a
            wrapper without a :class:`Copier` method, or an engine over other pools.
    """
    engine = engine_of(made)
    if engine is None:
        raise ConfigError(
            "config: copier must return a CopyEngine over the pools it is given, or a wrapper "
            f"of one that names it inner, got {type(made).__name__}"
        )
    missing = [name for name in _COPIER_METHODS if not callable(getattr(made, name, None))]
    if missing:
        raise ConfigError(
            f"config: copier returned a {type(made).__name__}, which lacks the copy engine "
            f"methods {', '.join(missing)}"
        )
    foreign = [
        f"another {pool.name} pool"
        for pool, held in ((device, engine.device), (host, engine.host))
        if held is not pool
    ]
    if foreign:
        raise ConfigError(
            f"config: copier returned an engine over {' and '.join(foreign)} than it was "
            "called with (another cache's engine?): it must build a new CopyEngine from the "
            "pools it is given"
        )
    return cast("Copier", made)


def _allocate(
    name: str,
    pages: int,
    layout: KVLayout,
    where: torch.device,
    allocate: Callable[[int], KVPool],
) -> KVPool:
    """Allocate a pool, turning the allocator's failure into a :class:`ConfigError` naming it."""
    try:
        return allocate(pages)
    except (RuntimeError, MemoryError, OverflowError) as exc:  # torch.OutOfMemoryError included
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"config: cannot allocate the {name} pool of {pages} pages "
            f"({pages * layout.page_bytes} bytes) on {where}: {reason}"
        ) from exc


DIGIT_BITS = 4
"""Bits of a slot's code each element of :func:`synthetic_kv` holds."""
_DIGITS = 1 << DIGIT_BITS  # 16 digits of a 64-bit code, each 0..15
_PERIOD = _DIGITS * _DIGITS  # the pattern's length: digit k % 16 plus offset k + k // 16
_TOP = 64 - DIGIT_BITS  # an entry is computed in the top 4 bits of a 64-bit word
_CPU = torch.device("cpu")
SLOT_RUN = 512
"""Most tokens a small layout's KV is made for in the device order, slots last, in one call.

Its constants take ``8 * SLOT_RUN`` bytes per element of a token (rounded up
to whole pages), about 1 MiB at 256 elements; longer writes take the general
path, a view more."""


def synthetic_kv(layout: KVLayout, tokens: Sequence[int]) -> torch.Tensor:
    """Return KV whose every slot's bytes name its token and its position in the page.

    Shape ``[layers, planes, len(tokens), heads, head_dim]``: what a forward
    pass over ``tokens`` (starting at a page boundary, as every caller passes
    whole pages) would write. Round trips compare it byte for byte, so a page
    copied to the wrong place, or slots permuted within a page, show up.

    A slot's code is ``token * page_size + position``. Its pattern is a ring
    of 256 entries: entry ``k`` is the code's base-16 digit ``k % 16`` plus
    ``k + k // 16``, mod 16, less 8: an integer in ``-8..7``, exact in every
    supported dtype (float8 e4m3 holds every integer up to 16). Each
    ``(layer, plane)`` block of ``heads * head_dim`` elements reads the ring
    from its own starting point. Any 16 consecutive entries hold all 16
    digits, each under its own offset, and no two stretches of 16 or more
    entries from different starting points are equal, whatever the code. So:

    * the bytes are unique per ``(token, position)`` for every 64-bit code
      once a token has 16 elements (``layers * planes * heads * head_dim``),
      and for codes below ``16 ** E`` with ``E < 16`` elements (blocks smaller
      than 16 continue each other's digits);
    * with blocks of 16 elements or more, the first 256 blocks start at
      different points, so KV copied to another layer or plane shows up too.

    How it is computed (a few tensor operations a call on constants made
    once per layout, plus a copy per layer and plane past 256 elements a
    token) is :class:`_Pattern`'s business; :meth:`Tiers.write_tokens`
    computes the same bytes on the device pool's device.
    """
    kv = _pattern(layout, _CPU).kv(tokens)
    # a copy with every stride canonical: contiguous() keeps a size-1 dimension's stride,
    # and a last one other than 1 would refuse a byte view
    return torch.empty(kv.shape, dtype=kv.dtype, device=_CPU).copy_(kv)


def _wrap(value: int) -> int:
    """``value`` modulo ``2**64`` as a signed 64-bit integer, as int64 arithmetic wraps."""
    return (value + 2**63) % 2**64 - 2**63


@functools.lru_cache(maxsize=64)
def _pattern(layout: KVLayout, device: torch.device) -> _Pattern:
    """The constants of ``layout``'s pattern on ``device``, made once per pair."""
    return _Pattern(layout, device)


class _Pattern:
    """:func:`synthetic_kv` for one layout on one device, with its constants made once.

    Entry ``k`` of a code's pattern is computed in the top 4 bits of one
    64-bit word, ``lift_k + code * mult_k`` modulo ``2**64`` (int64
    arithmetic wraps): ``mult_k = 2 ** (60 - 4 * (k % 16))`` moves the
    code's digit ``k % 16`` into the top 4 bits (lower digits fall below
    them, higher ones out of the word), and ``lift_k = (off_k + 8) << 60``
    adds the entry's offset ``off_k = k + k // 16`` there. An arithmetic
    shift right by 60 reads the 4 bits as a signed integer, and
    ``(digit + off + 8) % 16`` read as ``-8..7`` is ``(digit + off) % 16 - 8``,
    the entry; cast to the KV's dtype, it stays exact.

    With ``code = token * page_size + position`` the word is
    ``(lift_k + position * mult_k) + token * (page_size * mult_k)``: the
    first term is a constant per entry and position in the page
    (:attr:`base`), the factor of the second one per entry (:attr:`scale`),
    so one ``addcmul`` over the tokens of whole pages, one shift and one
    cast make the KV. A small layout (at most 256 elements a token)
    computes each element as its own entry, in the KV's shape. A larger
    one computes the ring a token, long enough that each ``(layer, plane)``
    block's window of it is a slice, and copies the windows.

    Attributes:
        layout: The KV layout.
        device: Where the constants live and the KV is made.
        base: The constant term: ``[layers, planes, page_size, heads,
            head_dim, 1]`` for a small layout, ``[page_size, ring]`` for a large one.
        scale: The tokens' factor: ``[layers, planes, 1, heads, head_dim, 1]``,
            or ``[ring]``.
        starts: Where each block's window starts in the ring (empty for a
            small layout).

    A small layout's KV of up to :data:`SLOT_RUN` tokens is also made in
    the device pool's order with the slots last (:meth:`slot_values`), from
    :attr:`base` laid out that way and repeated over that many slots once:
    a view of it per length (kept) broadcasts against the tokens as they
    come, so no view of the tokens is made per call, which at page sizes
    above one saves a tensor operation an insert.
    """

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        lay, ps = layout, layout.page_size
        self._dims = (lay.layers, lay.planes, lay.heads, lay.head_dim)
        self._on_cpu = device.type == "cpu"
        inner, blocks = lay.heads * lay.head_dim, lay.layers * lay.planes
        # where each (layer, plane) block starts reading the circular pattern
        step = _DIGITS + 1 if inner >= _DIGITS else inner + _DIGITS  # see synthetic_kv
        if blocks * inner <= _PERIOD:  # a small layout: each element is its own entry
            self.starts: list[int] = []
            entries = [(b * step + i) % _PERIOD for b in range(blocks) for i in range(inner)]
        else:  # the ring, repeated so each block's window of it is a slice
            self.starts = [block * step % _PERIOD for block in range(blocks)]
            laps = (inner + 2 * _PERIOD - 1) // _PERIOD
            entries = [k % _PERIOD for k in range(laps * _PERIOD)]
        mult = [1 << (_TOP - DIGIT_BITS * (k % _DIGITS)) for k in entries]
        lift = [(k + k // _DIGITS + _DIGITS // 2) % _DIGITS << _TOP for k in entries]
        base = [[_wrap(c + j * m) for c, m in zip(lift, mult, strict=True)] for j in range(ps)]
        self.base = torch.tensor(base, dtype=torch.int64, device=device)
        self.scale = torch.tensor([_wrap(ps * m) for m in mult], dtype=torch.int64, device=device)
        self._slot_bases: dict[int, torch.Tensor] = {}  # by tokens: views of _tiled
        self._tiled: torch.Tensor | None = None  # a small layout's base over SLOT_RUN slots
        self._slot_scale = self.scale  # and its factor, slots last (set below)
        self._slot_run = 0  # the most tokens made slots last: the slots of _tiled (none: 0)
        # on CPU the same two as numpy arrays (views of them), and views of the first by tokens
        self._np_bases: dict[int, NDArray[np.int64]] = {}
        self._np: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None
        if not self.starts:  # to the KV's order with the pages last (see values)
            per_position = self.base.view(ps, lay.layers, lay.planes, lay.heads, lay.head_dim)
            self.base = per_position.permute(1, 2, 0, 3, 4).unsqueeze(-1).contiguous()
            self.scale = self.scale.view(lay.layers, lay.planes, 1, lay.heads, lay.head_dim, 1)
            # the slots last, [layers, planes, heads, head_dim, slots]: see slot_values
            by_slot = per_position.permute(1, 2, 3, 4, 0)
            self._tiled = by_slot.repeat(1, 1, 1, 1, -(-SLOT_RUN // ps))  # a new, contiguous one
            self._slot_scale = self.scale.view(*self._dims, 1)
            self._slot_run = self._tiled.shape[-1]
            if self._on_cpu:
                self._np = (self._tiled.numpy(), self._slot_scale.numpy())
        if device.type == "cuda":  # shared by caches on other streams: done before any reads
            torch.cuda.synchronize(device)

    def kv(self, tokens: Sequence[int]) -> torch.Tensor:
        """Return :func:`synthetic_kv` of ``tokens`` on :attr:`device`, maybe not contiguous."""
        n = len(tokens)
        if n % self.layout.page_size or not n:
            return self._part(tokens)
        layers, planes, heads, dim = self._dims
        values = self.values(tokens).to(self.layout.dtype)  # maybe strided: see values
        return values.permute(0, 1, 5, 2, 3, 4).reshape(layers, planes, n, heads, dim)

    def values(self, tokens: Sequence[int]) -> torch.Tensor:
        """The KV of ``tokens``, whole pages and at least one, split into pages, pages last.

        ``[layers, planes, page_size, heads, head_dim, pages]`` of the KV's
        integers: int64 for a small layout, to be cast where they are stored
        (:meth:`KVPool.write_values` with ``pages_last``), already in the KV's
        dtype for a large one. A small layout broadcasts its constants over
        the tokens laid out last (for a page size of 1, the tokens as they
        come), which saves a view and measured 2 us faster than the device
        layout's order for 48 tokens. Its values may be laid out in another
        order than the shape's (the broadcast of ``addcmul`` orders
        dimensions by its inputs' strides, and ignores those of dimensions
        of size 1): copies take any strides, and views of them must be
        reshapes.
        """
        n, ps = len(tokens), self.layout.page_size
        # ids up to 2**64 - 1, read as int64: the code's arithmetic is modulo 2**64 either way
        ids = torch.frombuffer(array("Q", tokens), dtype=torch.int64)
        if not self._on_cpu:  # a call per insert: the upload's own test would cost it
            ids = upload(ids, self.device)
        if not self.starts:
            if ps > 1:  # [page_size, 1, 1, pages]: each token under its position, by page
                ids = ids.as_strided((ps, 1, 1, n // ps), (1, 1, 1, ps))
            words = torch.addcmul(self.base, ids, self.scale)
            return words.bitwise_right_shift_(_TOP)
        layers, planes, heads, dim = self._dims
        dtype = self.layout.dtype
        words = torch.addcmul(self.base, ids.view(n // ps, ps, 1), self.scale)
        ring = words.bitwise_right_shift_(_TOP).to(dtype).reshape(n, -1)
        kv = torch.empty((len(self.starts), n, heads * dim), dtype=dtype, device=self.device)
        for block, start in enumerate(self.starts):  # slices of whole rows: plain copies
            kv[block].copy_(ring[:, start : start + heads * dim])
        return kv.view(layers, planes, n // ps, ps, heads, dim).permute(0, 1, 3, 4, 5, 2)

    def slot_values(self, tokens: Sequence[int]) -> torch.Tensor | NDArray[np.int64] | None:
        """The KV of ``tokens`` as the device pool lays it out, the slots last; None if not made so.

        ``[layers, planes, heads, head_dim, len(tokens)]`` of the KV's
        integers as int64, for :meth:`KVPool.write_slots`: made in one
        ``addcmul`` of the tokens as they come and one shift, for a small
        layout and whole pages of at most :data:`SLOT_RUN` tokens (at least
        one page). Otherwise None: :meth:`values` makes them, with a view
        of the tokens more at page sizes above one.

        On CPU they are a numpy array, made by the same arithmetic on numpy
        views of the same constants: a numpy call on arrays this small costs
        a fraction of a torch call's dispatch, and these few calls were most
        of an insert that writes its own KV (docs/benchmarks.md).
        """
        n = len(tokens)
        if not 0 < n <= self._slot_run or n % self.layout.page_size:
            return None
        if self._np is not None:
            return self._numpy_values(tokens, n, *self._np)
        base = self._slot_bases.get(n)
        if base is None:
            tiled = cast("torch.Tensor", self._tiled)  # made wherever _slot_run is above 0
            base = self._slot_bases[n] = tiled[..., :n]  # one view per length, at most
        # ids up to 2**64 - 1, read as int64: the code's arithmetic is modulo 2**64 either way;
        # here off the CPU only (on it, numpy makes the values)
        ids = upload(torch.frombuffer(array("Q", tokens), dtype=torch.int64), self.device)
        return torch.addcmul(base, ids, self._slot_scale).bitwise_right_shift_(_TOP)

    def _numpy_values(
        self,
        tokens: Sequence[int],
        n: int,
        tiled: NDArray[np.int64],
        scale: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        """:meth:`slot_values` on CPU: the same words, computed by numpy (wrapping as int64 does)."""
        base = self._np_bases.get(n)
        if base is None:
            base = self._np_bases[n] = tiled[..., :n]  # one view per length, at most
        words = np.frombuffer(array("Q", tokens), dtype=np.int64) * scale
        words += base
        words >>= _TOP
        return words

    def _part(self, tokens: Sequence[int]) -> torch.Tensor:
        """The KV of no tokens, or of a part of a page: made for whole pages, then cut.

        A slot's code does not depend on the slots after it, so padding the
        last page changes none of the slots kept.
        """
        n, ps = len(tokens), self.layout.page_size
        if not n:  # frombuffer refuses an empty buffer
            layers, planes, heads, dim = self._dims
            shape = (layers, planes, 0, heads, dim)
            return torch.empty(shape, dtype=self.layout.dtype, device=self.device)
        return self.kv((*tokens, *(0,) * (ps - n % ps)))[:, :, :n]
