"""The KV tensors: layouts, sizing, page views, and exact-size pinned host memory."""

from __future__ import annotations

import gc
import re
import warnings
import weakref
from typing import Any

import numpy as np
import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

    from fsm_cache.errors import BadArgument, ForeignSlot, NotASlot, PinnedMemoryError, PoolError
    from fsm_cache.memory import kv
    from fsm_cache.memory.kv import (
        KVLayout,
        KVPool,
        alloc_exact_host,
        default_device,
        device_pool,
        host_pool,
    )
    from fsm_cache.memory.tiers import synthetic_kv

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

LAYOUT = KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
KV_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def test_layout_sizes() -> None:
    assert LAYOUT.itemsize == 2
    assert LAYOUT.page_bytes == 3 * 2 * 2 * 4 * 2 * 4
    assert LAYOUT.pages_for_bytes(LAYOUT.page_bytes * 5 + 1) == 5


def test_mla_layout_has_one_latent_plane() -> None:
    mla = KVLayout.mla(layers=2, latent_dim=576, dtype=torch.bfloat16, page_size=8)
    assert (mla.planes, mla.heads, mla.head_dim) == (1, 1, 576)
    pool = device_pool(mla, 3, torch.device("cpu"))
    assert pool.tensor.shape == (2, 1, 24, 1, 576)


def test_device_pool_is_layer_first_and_host_pool_page_first() -> None:
    dev = device_pool(LAYOUT, 5, torch.device("cpu"))
    host = host_pool(LAYOUT, 7, pin=False)
    assert dev.tensor.shape == (3, 2, 20, 2, 4)
    assert host.tensor.shape == (7, 3, 2, 4, 2, 4)
    assert dev.nbytes == 5 * LAYOUT.page_bytes
    assert host.nbytes == 7 * LAYOUT.page_bytes
    assert dev.pages.shape == (5, *host.pages.shape[1:])
    assert host.pages[0].is_contiguous()
    assert (dev.allocator.name, dev.allocator.num_pages, dev.allocator.page_size) == (
        "device",
        5,
        4,
    )
    assert (host.allocator.name, host.allocator.num_pages) == ("host", 7)


def test_page_view_addresses_the_right_slots() -> None:
    dev = device_pool(LAYOUT, 4, torch.device("cpu"))
    dev.tensor.zero_()
    dev.tensor[:, :, 8:12] = 1.5  # page 2
    assert torch.equal(dev.read([2]), torch.full((3, 2, 4, 2, 4), 1.5, dtype=torch.float16))
    assert int(dev.read([1]).count_nonzero()) == 0


@pytest.mark.parametrize("name", ["device", "host"])
def test_write_then_read_round_trips_bytes(name: str) -> None:
    pool = device_pool(LAYOUT, 4, torch.device("cpu")) if name == "device" else host_pool(LAYOUT, 4)
    kv = torch.randn(3, 2, 8, 2, 4).to(torch.float16)
    pool.write([3, 1], kv)
    assert torch.equal(pool.read([3, 1]), kv)
    assert torch.equal(pool.read([1]), kv[:, :, 4:])


def test_fill_poisons_only_the_given_pages() -> None:
    pool = host_pool(LAYOUT, 3)
    pool.tensor.zero_()
    pool.fill([1], 0xFF)
    assert bool((pool.pages[1] == 0xFF).all())
    assert int(pool.pages[0].count_nonzero()) == 0
    assert int(pool.pages[2].count_nonzero()) == 0


@pytest.mark.parametrize(
    ("pages", "byte", "error", "message"),
    [
        ([0, -1], 0xFF, ForeignSlot, "device pool: page -1 outside 0..2"),
        ([0, 3], 0xFF, ForeignSlot, "device pool: page 3 outside 0..2"),
        ([0, True], 0xFF, NotASlot, "device pool: page True is not an int"),
        ([0, 1.0], 0xFF, NotASlot, "device pool: page 1.0 is not an int"),
        ([3, False], 0xFF, NotASlot, "device pool: page False is not an int"),  # a bool first
        ([0], 256, BadArgument, "device pool: fill byte must be an int in 0..255, got 256"),
        ([0], -1, BadArgument, "device pool: fill byte must be an int in 0..255, got -1"),
        ([0], 1.5, BadArgument, "device pool: fill byte must be an int in 0..255, got 1.5"),
    ],
)
def test_a_refused_fill_poisons_no_page(
    pages: list[int], byte: object, error: type[Exception], message: str
) -> None:
    """A page counted from the end, or one past it, was poisoned, or the pages before it."""
    pool = device_pool(LAYOUT, 3, torch.device("cpu"))
    pool.tensor.zero_()
    with pytest.raises(error) as info:
        pool.fill(pages, byte)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert int(pool.tensor.view(torch.uint8).count_nonzero()) == 0


@pytest.mark.parametrize("name", ["device", "host"])
@pytest.mark.parametrize("as_", ["numpy", "tensor"])
def test_pages_in_an_array_or_a_tensor_are_written_as_a_list_of_them(name: str, as_: str) -> None:
    """An array of pages has no truth value: a write asks it nothing but what it asked before.

    The writes look for the allocator's runs first (``run_of``), which must
    answer None for such a sequence rather than raise.
    """
    np = pytest.importorskip("numpy")
    made: Any = np.array if as_ == "numpy" else torch.tensor
    pool = device_pool(LAYOUT, 6, torch.device("cpu")) if name == "device" else host_pool(LAYOUT, 6)
    pool.tensor.zero_()
    kv = synthetic_kv(LAYOUT, list(range(8)))
    lay = LAYOUT
    shape = (lay.layers, lay.planes, 2, lay.page_size, lay.heads, lay.head_dim)
    for listed in ([3, 4], [5, 0]):
        pages = made(listed)
        assert pool.allocator.run_of(pages) is None
        pool.write(pages, kv)
        assert torch.equal(pool.read(listed), kv)
        pool.tensor.zero_()
        pool.write_values(pages, kv.reshape(shape).permute(0, 1, 3, 4, 5, 2), pages_last=True)
        assert torch.equal(pool.read(listed), kv)
        pool.tensor.zero_()
        pool.write_slots(pages, kv.permute(0, 1, 3, 4, 2))
        assert torch.equal(pool.read(listed), kv)


@pytest.mark.parametrize("name", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("listed", [[3, 4], [5, 0]], ids=str)
def test_slots_given_as_a_numpy_array_are_stored_as_the_same_tensor(
    name: str, dtype: torch.dtype, listed: list[int]
) -> None:
    """``write_slots`` stores int64 numpy values (what ``write_tokens`` makes on CPU) as their tensor.

    Through a numpy view of a CPU device pool for a run, where numpy has the
    dtype; otherwise as ``torch.from_numpy`` of them: each byte the same as
    the tensor's store, which casts as ``copy_`` does.
    """
    layout = KVLayout(layers=3, heads=2, head_dim=4, dtype=dtype, page_size=4)
    pool = device_pool(layout, 6, torch.device("cpu")) if name == "device" else host_pool(layout, 6)
    ints = torch.randint(-8, 8, (3, 2, 2, 4, 8), generator=torch.Generator().manual_seed(5))
    pool.tensor.zero_()
    pool.write_slots(listed, ints)
    expected = pool.read(listed)
    pool.tensor.zero_()
    pool.write_slots(listed, ints.numpy())
    assert torch.equal(pool.read(listed).view(torch.uint8), expected.view(torch.uint8))
    assert int(pool.read([1, 2]).view(torch.uint8).count_nonzero()) == 0
    with pytest.raises(PoolError, match=r"values of shape \(3, 2, 2, 4, 7\) do not fit 2 pages"):
        pool.write_slots(listed, np.zeros((3, 2, 2, 4, 7), dtype=np.int64))


@pytest.mark.parametrize("name", ["device", "host"])
def test_a_pool_takes_the_integer_pages_its_allocator_takes(name: str) -> None:
    """A numpy integer or a one-element tensor in range was refused as outside the pool.

    Its allocator takes them (``as_index``): the pool reads, writes and fills
    the pages they stand for, and names a bool or a float as no int, as the
    allocator does, rather than as outside a range it is inside.
    """
    np = pytest.importorskip("numpy")
    tensor: Any = torch.tensor  # pages are typed ints; these stand for ints
    pool = device_pool(LAYOUT, 3, torch.device("cpu")) if name == "device" else host_pool(LAYOUT, 3)
    pool.tensor.zero_()
    kv = synthetic_kv(LAYOUT, list(range(8)))
    for pages in ([np.int64(2), tensor(0)], (np.int32(0), np.int64(1))):
        pool.write(pages, kv)
        assert torch.equal(pool.read(pages), kv)
        assert torch.equal(pool.read([int(p) for p in pages]), kv)
    pool.fill([np.int16(2), tensor([1])], 0x7F)
    assert bool((pool.pages[1] == 0x7F).all() and (pool.pages[2] == 0x7F).all())
    assert pool.check_pages([np.int64(1), tensor(2)]) == [1, 2]
    assert pool.allocator.owner_of(np.int64(1)) == -1  # the allocator's take, for comparison
    bads: list[Any] = [np.True_, True, 1.0, np.float64(1.0), tensor(True), "1", None]
    for bad in bads:
        with pytest.raises(NotASlot) as caught:
            pool.read([0, bad])
        assert str(caught.value) == f"{name} pool: page {bad!r} is not an int"
        with pytest.raises(NotASlot):
            pool.allocator.owner_of(bad)  # the same refusal
    with pytest.raises(ForeignSlot) as outside:
        pool.read([np.int64(3)])
    assert str(outside.value) == f"{name} pool: page 3 outside 0..2"


def test_host_pool_sized_by_bytes_or_ratio() -> None:
    assert host_pool(LAYOUT, byte_budget=LAYOUT.page_bytes * 3 + 7).num_pages == 3
    assert host_pool(LAYOUT, ratio=2.5, device_pages=4).num_pages == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "host_pool: give exactly one of num_pages, byte_budget, ratio"),
        (
            {"num_pages": 3, "ratio": 1.0},
            "host_pool: give exactly one of num_pages, byte_budget, ratio",
        ),
        ({"ratio": 1.0}, "host_pool: ratio needs device_pages"),
    ],
)
def test_host_pool_needs_exactly_one_size(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        host_pool(LAYOUT, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_host_pool_unpinned_without_cuda() -> None:
    pool = host_pool(LAYOUT, 2)
    assert pool.pinned is CUDA
    pool.close()
    pool.close()


def test_default_device_matches_cuda_availability() -> None:
    assert default_device().type == ("cuda" if CUDA else "cpu")


def test_exact_host_allocation_is_the_requested_size() -> None:
    t = alloc_exact_host((3, 5, 7), torch.bfloat16, pin=False)
    assert t.shape == (3, 5, 7)
    assert t.untyped_storage().nbytes() == 3 * 5 * 7 * 2


@pytest.mark.gpu
@needs_cuda
def test_pinned_host_pool_is_pinned_at_exactly_its_size() -> None:
    # 3 pages of an odd size: the caching host allocator would round to a power of two.
    layout = KVLayout(layers=3, heads=3, head_dim=40, dtype=torch.float16, page_size=16)
    pool = host_pool(layout, 3, pin=True)
    assert pool.pinned
    assert pool.tensor.is_pinned()
    assert pool.tensor.untyped_storage().nbytes() == 3 * layout.page_bytes
    pool.close()
    assert not pool.tensor.is_pinned()


@pytest.mark.gpu
@needs_cuda
def test_a_refused_registration_leaves_no_error_for_the_next_kernel() -> None:
    """A failed ``cudaHostRegister`` or ``cudaHostUnregister`` fails only itself.

    The runtime keeps a failed call's error until ``cudaGetLastError`` reads
    it, and torch reads it after every kernel launch: the next kernel, however
    unrelated, raised the registration's error.
    """
    gpu = torch.device("cuda", torch.cuda.current_device())
    pool = host_pool(LAYOUT, 2, pin=True, device=gpu)
    refused = r"^cudaHost(Register|Unregister) of \d+ bytes on cuda:\d+ failed with cudaError"
    with pytest.raises(PinnedMemoryError, match=refused):
        kv.register_host(pool.tensor, gpu)  # cudaErrorHostMemoryAlreadyRegistered
    assert torch.ones(3, device=gpu).sum().item() == 3
    pool.close()
    with pytest.raises(PinnedMemoryError, match=refused):
        kv.unregister_host(pool.tensor, gpu)  # cudaErrorHostMemoryNotRegistered
    assert torch.ones(3, device=gpu).sum().item() == 3


@pytest.mark.gpu
@needs_cuda
def test_device_pool_defaults_to_cuda() -> None:
    pool = device_pool(LAYOUT, 2)
    assert pool.device.type == "cuda"
    kv = torch.randn(3, 2, 4, 2, 4).to(torch.float16)
    pool.write([1], kv)
    assert torch.equal(pool.read([1]), kv)


# -- empty and mismatched reads and writes ---------------------------------------------


@pytest.mark.parametrize("name", ["device", "host"])
def test_no_pages_read_empty_and_write_nothing(name: str) -> None:
    pool = device_pool(LAYOUT, 4, torch.device("cpu")) if name == "device" else host_pool(LAYOUT, 4)
    pool.tensor.view(torch.uint8).fill_(7)
    empty = pool.read([])
    assert empty.shape == (3, 2, 0, 2, 4)
    assert empty.dtype == torch.float16
    pool.write([], empty)
    pool.write((), torch.empty(3, 2, 0, 2, 4, dtype=torch.float16))
    assert bool((pool.tensor.view(torch.uint8) == 7).all())


@pytest.mark.parametrize(
    ("pages", "kv", "message"),
    [
        (
            [1, 2],
            torch.zeros(3, 2, 4, 2, 4, dtype=torch.float16),
            "device pool: kv of shape (3, 2, 4, 2, 4) and dtype torch.float16 does not fit "
            "2 pages, which need shape (3, 2, 8, 2, 4) and dtype torch.float16",
        ),
        (
            [],
            torch.zeros(3, 2, 4, 2, 4, dtype=torch.float16),
            "device pool: kv of shape (3, 2, 4, 2, 4) and dtype torch.float16 does not fit "
            "0 pages, which need shape (3, 2, 0, 2, 4) and dtype torch.float16",
        ),
        (
            [1],
            torch.zeros(3, 2, 4, 2, 4, dtype=torch.float32),
            "device pool: kv of shape (3, 2, 4, 2, 4) and dtype torch.float32 does not fit "
            "1 pages, which need shape (3, 2, 4, 2, 4) and dtype torch.float16",
        ),
        (
            [1],
            torch.zeros(3, 2, 4, 4, 2, dtype=torch.float16),
            "device pool: kv of shape (3, 2, 4, 4, 2) and dtype torch.float16 does not fit "
            "1 pages, which need shape (3, 2, 4, 2, 4) and dtype torch.float16",
        ),
        (
            [2, 2],
            torch.zeros(3, 2, 8, 2, 4, dtype=torch.float16),
            "device pool: page 2 is listed twice",
        ),
    ],
)
def test_a_write_that_does_not_fit_is_refused_and_changes_nothing(
    pages: list[int], kv: torch.Tensor, message: str
) -> None:
    pool = device_pool(LAYOUT, 4, torch.device("cpu"))
    pool.tensor.view(torch.uint8).fill_(7)
    with pytest.raises(PoolError) as caught:
        pool.write(pages, kv)
    assert str(caught.value) == message
    assert bool((pool.tensor.view(torch.uint8) == 7).all())


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (4, "host pool: page 4 outside 0..3"),
        (-1, "host pool: page -1 outside 0..3"),
        (1.0, "host pool: page 1.0 is not an int"),  # a NotASlot, as the allocator says
        (True, "host pool: page True is not an int"),
    ],
)
def test_a_page_outside_the_pool_is_refused_by_read_and_write(page: object, message: str) -> None:
    pool = host_pool(LAYOUT, 4)
    pool.tensor.view(torch.uint8).fill_(7)
    with pytest.raises(ForeignSlot) as caught:
        pool.read([0, page])  # type: ignore[list-item]
    assert str(caught.value) == message
    with pytest.raises(ForeignSlot) as caught:
        pool.write([0, page], torch.zeros(3, 2, 8, 2, 4, dtype=torch.float16))  # type: ignore[list-item]
    assert str(caught.value) == message
    assert bool((pool.tensor.view(torch.uint8) == 7).all())


# -- page-locking: return codes are checked, close is idempotent ----------------------------


class FakeCudart:
    """Stands in for torch's cudart bindings: records calls, returns chosen error codes."""

    def __init__(self, register: int = 0, unregister: int = 0) -> None:
        self.codes = {"cudaHostRegister": register, "cudaHostUnregister": unregister}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("register", nbytes))
        return self.codes["cudaHostRegister"]

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("unregister", ptr))
        return self.codes["cudaHostUnregister"]

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802 (CUDA's name)
        return {1: "invalid argument", 2: "out of memory"}[err]


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(kv, "_cudart", lambda: fake)
    return fake


def pinned_pool(pages: int = 2) -> KVPool:
    """A host pool registered through the fake bindings, with no device made current."""
    shape = (pages, LAYOUT.layers, LAYOUT.planes, LAYOUT.page_size, LAYOUT.heads, LAYOUT.head_dim)
    tensor = alloc_exact_host(shape, LAYOUT.dtype, pin=True)
    return KVPool("host", LAYOUT, pages, tensor, pinned=True)


def test_registration_failure_is_a_typed_error(cudart: FakeCudart) -> None:
    cudart.codes["cudaHostRegister"] = 2
    with pytest.raises(PinnedMemoryError) as caught:
        pinned_pool()
    assert str(caught.value) == (
        f"cudaHostRegister of {2 * LAYOUT.page_bytes} bytes on the current CUDA device "
        "failed with cudaError 2 (out of memory)"
    )
    assert isinstance(caught.value, RuntimeError)


def test_close_unregisters_once(cudart: FakeCudart) -> None:
    pool = pinned_pool()
    assert pool.pinned
    pool.close()
    pool.close()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]
    assert not pool.pinned
    del pool
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]


def test_unregister_failure_at_close_raises_once(cudart: FakeCudart) -> None:
    pool = pinned_pool()
    cudart.codes["cudaHostUnregister"] = 1
    with pytest.raises(PinnedMemoryError) as caught:
        pool.close()
    assert str(caught.value) == (
        f"cudaHostUnregister of {2 * LAYOUT.page_bytes} bytes on the current CUDA device "
        "failed with cudaError 1 (invalid argument)"
    )
    pool.close()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]


def test_release_keeps_memory_that_may_still_be_registered(cudart: FakeCudart) -> None:
    """A second release dropped the memory an unregistration had failed on, maybe still locked."""
    pool = pinned_pool()
    cudart.codes["cudaHostUnregister"] = 1
    tensor = pool.tensor
    with pytest.raises(PinnedMemoryError):
        pool.release()
    cudart.codes["cudaHostUnregister"] = 0
    pool.release()
    assert (pool.released, pool.num_pages, pool.tensor is tensor) == (False, 2, True)
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]


def test_unregister_failure_at_garbage_collection_warns(cudart: FakeCudart) -> None:
    pool = pinned_pool()
    cudart.codes["cudaHostUnregister"] = 1
    with pytest.warns(RuntimeWarning, match=r"^cudaHostUnregister of \d+ bytes .* cudaError 1"):
        del pool  # the last reference: the finalizer runs here


def test_an_unpinned_pool_never_calls_cuda(cudart: FakeCudart) -> None:
    pool = host_pool(LAYOUT, 2, pin=False)
    pool.close()
    assert cudart.calls == []


# -- synthetic KV: every (token, position) has its own bytes, in every dtype ------------------


def distinct_rows(rows: torch.Tensor) -> bool:
    """Whether the rows of a uint8 matrix (a multiple of 8 bytes wide) are pairwise different.

    Sorts the rows lexicographically as int64 words (stable sorts, last word first)
    and compares neighbours: exact, and fast enough for millions of rows.
    """
    words = rows.contiguous().view(torch.int64)
    order = torch.arange(words.shape[0])
    for col in reversed(range(words.shape[1])):
        order = order[torch.sort(words[order, col], stable=True).indices]
    ordered = words[order]
    return bool((ordered[1:] != ordered[:-1]).any(dim=1).all())


def slot_bytes(kv_tensor: torch.Tensor) -> torch.Tensor:
    """``[layers, P, n, H, D]`` KV as one row of bytes per slot ``[n, bytes]``."""
    n = kv_tensor.shape[2]
    return kv_tensor.permute(2, 0, 1, 3, 4).contiguous().view(torch.uint8).reshape(n, -1)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_synthetic_kv_is_injective_for_every_token_and_position(dtype: torch.dtype) -> None:
    # the smallest layout the tests use: 8 elements a token, 4 bits each
    layout = KVLayout(layers=1, heads=1, head_dim=4, dtype=dtype, page_size=8)
    tokens = torch.arange(100_001).repeat_interleave(8).tolist()  # every token at every position
    rows = slot_bytes(synthetic_kv(layout, tokens))
    assert rows.shape == (len(tokens), 8 * layout.itemsize)
    assert distinct_rows(rows)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_synthetic_kv_values_are_exact_small_integers(dtype: torch.dtype) -> None:
    layout = KVLayout(layers=2, heads=2, head_dim=16, dtype=dtype, page_size=16)
    tokens = [0, 1, 996, 997, 1993, 2**31 - 1, 151_935, *range(9)]
    kv_tensor = synthetic_kv(layout, tokens)
    assert kv_tensor.dtype == dtype
    values = kv_tensor.to(torch.float32)
    assert bool((values == values.round()).all())
    assert bool(((values >= -8) & (values <= 7)).all())
    assert distinct_rows(slot_bytes(kv_tensor)[:7])  # tokens 997 apart differ
    # every element's value differs across layers and planes for the same token
    per_layer = values[:, :, 0].reshape(4, -1)
    assert all(not torch.equal(per_layer[i], per_layer[j]) for i in range(4) for j in range(i))


def test_synthetic_kv_is_injective_for_large_token_ids_in_the_default_layout() -> None:
    layout = KVLayout(layers=2, heads=2, head_dim=16, dtype=torch.float8_e4m3fn, page_size=16)
    ids = torch.randint(0, 2**40, (3_000,), generator=torch.Generator().manual_seed(0))
    tokens = torch.unique(ids).repeat_interleave(16).tolist()
    assert distinct_rows(slot_bytes(synthetic_kv(layout, tokens)))


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_a_page_copied_to_the_wrong_place_is_detected(dtype: torch.dtype) -> None:
    layout = KVLayout(layers=1, heads=1, head_dim=4, dtype=dtype, page_size=4)
    pool = host_pool(layout, 4, pin=False)
    first, second = [5, 6, 7, 8], [5 + 997, 6 + 997, 7 + 997, 8 + 997]  # alike before the fix
    pool.write([0, 1], synthetic_kv(layout, first + second))
    pool.pages[1].copy_(pool.pages[0])  # page 0 copied over page 1
    got = pool.read([0, 1]).view(torch.uint8)
    assert torch.equal(got[:, :, :4], synthetic_kv(layout, first).view(torch.uint8))
    assert not torch.equal(got[:, :, 4:], synthetic_kv(layout, second).view(torch.uint8))
    # slots swapped within a page show up too
    repeated = [7, 7, 7, 7]
    pool.write([2], synthetic_kv(layout, repeated))
    pool.pages[2].copy_(pool.pages[2].flip(2))
    assert not torch.equal(
        pool.read([2]).view(torch.uint8), synthetic_kv(layout, repeated).view(torch.uint8)
    )


def reference_kv(layout: KVLayout, tokens: list[int]) -> torch.Tensor:
    """synthetic_kv's definition, element by element (slow; for small cases)."""
    inner = layout.heads * layout.head_dim
    step = 17 if inner >= 16 else inner + 16
    out = torch.empty(layout.layers, layout.planes, len(tokens), layout.heads, layout.head_dim)
    for t, token in enumerate(tokens):
        code = token * layout.page_size + t % layout.page_size
        for block in range(layout.layers * layout.planes):
            for i in range(inner):
                k = (block * step + i) % 256
                value = ((code >> 4 * (k % 16)) & 15) + k + k // 16
                layer, plane = divmod(block, layout.planes)
                out[layer, plane, t, i // layout.head_dim, i % layout.head_dim] = value % 16 - 8
    return out.to(layout.dtype)


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(layers=1, heads=1, head_dim=4, dtype=torch.float16, page_size=4),
        KVLayout(layers=3, heads=1, head_dim=8, dtype=torch.bfloat16, page_size=2),
        KVLayout(layers=2, heads=2, head_dim=16, dtype=torch.float32, page_size=4),
        KVLayout(layers=5, heads=3, head_dim=40, dtype=torch.float8_e4m3fn, page_size=4),
        KVLayout.mla(layers=3, latent_dim=300, dtype=torch.bfloat16, page_size=2),
    ],
    ids=["tiny", "small", "default", "wide", "mla"],
)
def test_synthetic_kv_matches_its_definition(layout: KVLayout) -> None:
    tokens = [0, 1, 5, 997, 2**33 + 7, 151_935, 12, 13]
    got = synthetic_kv(layout, tokens)
    assert got.shape == (layout.layers, layout.planes, 8, layout.heads, layout.head_dim)
    assert got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), reference_kv(layout, tokens).view(torch.uint8))


def test_the_first_256_layer_and_plane_blocks_all_differ() -> None:
    layout = KVLayout(layers=130, heads=1, head_dim=16, dtype=torch.float8_e4m3fn, page_size=4)
    for token in (0, 7, 2**40 + 3):
        blocks = synthetic_kv(layout, [token]).view(torch.uint8).reshape(260, 16)
        assert distinct_rows(blocks[:256])  # 16 bytes a block


# -- bad pools and layouts are refused before any view is made --------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 0}, "KV layout: layers must be an int >= 1, got 0"),
        ({"heads": 2.0}, "KV layout: heads must be an int >= 1, got 2.0"),
        ({"head_dim": -4}, "KV layout: head_dim must be an int >= 1, got -4"),
        ({"page_size": True}, "KV layout: page_size must be an int >= 1, got True"),
        ({"planes": 3}, "KV layout: planes must be 1 or 2, got 3"),
        ({"planes": True}, "KV layout: planes must be 1 or 2, got True"),
        ({"dtype": "float16"}, "KV layout: dtype must be a torch.dtype, got 'float16'"),
        *(
            ({"dtype": q}, f"KV layout: dtype must be a plain dtype, got the quantized {q}")
            for q in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
        ),
    ],
)
def test_a_layout_of_no_bytes_or_no_type_is_refused(
    kwargs: dict[str, object], message: str
) -> None:
    given: dict[str, object] = {
        "layers": 3,
        "heads": 2,
        "head_dim": 4,
        "dtype": torch.float16,
        "page_size": 4,
        **kwargs,
    }
    with pytest.raises(BadArgument) as caught:
        KVLayout(**given)  # type: ignore[arg-type]
    assert str(caught.value) == message


HOST_SHAPE = (4, 3, 2, 4, 2, 4)


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        (
            "host",
            torch.empty(HOST_SHAPE[::-1], dtype=torch.float16).permute(5, 4, 3, 2, 1, 0),
            "host pool: the tensor must be contiguous, got strides (1, 4, 12, 24, 96, 192)",
        ),
        (
            "host",
            torch.empty((1, *HOST_SHAPE[1:]), dtype=torch.float16).expand(HOST_SHAPE),
            "host pool: the tensor must be contiguous, got strides (0, 64, 32, 8, 4, 1)",
        ),
        (
            "host",
            torch.empty(4 * 3 * 2 * 4 * 2 * 4, dtype=torch.float16),
            "host pool: a tensor of shape (768,) and dtype torch.float16 does not hold 4 pages, "
            "which need shape (4, 3, 2, 4, 2, 4) and dtype torch.float16",
        ),
        (
            "host",
            torch.empty(HOST_SHAPE, dtype=torch.float32),
            "host pool: a tensor of shape (4, 3, 2, 4, 2, 4) and dtype torch.float32 does not "
            "hold 4 pages, which need shape (4, 3, 2, 4, 2, 4) and dtype torch.float16",
        ),
        (
            "device",
            torch.empty(HOST_SHAPE, dtype=torch.float16),  # the host's layout, same bytes
            "device pool: a tensor of shape (4, 3, 2, 4, 2, 4) and dtype torch.float16 does not "
            "hold 4 pages, which need shape (3, 2, 16, 2, 4) and dtype torch.float16",
        ),
        (
            "device",
            torch.zeros((3, 2, 16, 2, 4), dtype=torch.float16, requires_grad=True),
            "device pool: the tensor requires grad; give it a plain tensor",
        ),
        (
            "host",
            torch.zeros(HOST_SHAPE, dtype=torch.float16)._neg_view(),  # noqa: SLF001 (torch's)
            "host pool: the tensor is a lazy negation (is_neg()); give it a plain tensor",
        ),
        ("gpu", torch.empty(HOST_SHAPE), "KV pool: name must be 'device' or 'host', got 'gpu'"),
        ("host", [0.0], "host pool: tensor must be a torch.Tensor, got list"),
    ],
    ids=[
        "permuted",
        "expanded",
        "flat",
        "dtype",
        "host-layout",
        "grad",
        "negative",
        "name",
        "list",
    ],
)
def test_a_pool_over_a_tensor_its_views_cannot_address_is_refused(
    name: str, tensor: torch.Tensor, message: str
) -> None:
    with pytest.raises(BadArgument) as caught:
        KVPool(name, LAYOUT, 4, tensor, pinned=False)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: device_pool(LAYOUT, -1, torch.device("cpu")),
            "device pool: num_pages must be an int >= 0, got -1",
        ),
        (
            lambda: host_pool(LAYOUT, -1, pin=False),
            "host_pool: num_pages must be an int >= 0, got -1",
        ),
        (
            lambda: host_pool(LAYOUT, 2.5, pin=False),  # type: ignore[arg-type]
            "host_pool: num_pages must be an int >= 0, got 2.5",
        ),
        (
            lambda: host_pool(LAYOUT, byte_budget=-192, pin=False),
            "host_pool: byte_budget must be an int >= 0, got -192",
        ),
        (
            lambda: host_pool(LAYOUT, ratio=-1.0, device_pages=4, pin=False),
            "host_pool: ratio must be a finite real >= 0, got -1.0",
        ),
        (
            lambda: host_pool(LAYOUT, ratio=float("nan"), device_pages=4, pin=False),
            "host_pool: ratio must be a finite real >= 0, got nan",
        ),
        (
            lambda: host_pool(LAYOUT, ratio=2.0, device_pages=-4, pin=False),
            "host_pool: device_pages must be an int >= 0, got -4",
        ),
        (  # math.isfinite raised OverflowError
            lambda: host_pool(LAYOUT, ratio=10**400, device_pages=4, pin=False),
            "host_pool: ratio must be a finite real >= 0, got an int of 1329 bits",
        ),
    ],
    ids=[
        "device-negative",
        "negative",
        "fraction",
        "budget",
        "ratio",
        "nan",
        "device-pages",
        "huge-ratio",
    ],
)
def test_a_pool_of_an_impossible_size_is_a_typed_error(make: object, message: str) -> None:
    with pytest.raises(BadArgument) as caught:
        make()  # type: ignore[operator]
    assert str(caught.value) == message


def test_an_empty_pool_says_it_has_no_pages() -> None:
    pool = host_pool(LAYOUT, 0, pin=False)
    with pytest.raises(ForeignSlot) as caught:
        pool.read([0])
    assert str(caught.value) == "host pool: page 0 outside the pool, which has no pages"


def test_a_pool_dropped_pinned_waits_for_the_device_before_unregistering(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = pinned_pool()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: cudart.calls.append(("synchronize", 0))
    )
    del pool  # the last reference: the finalizer runs here
    assert [c[0] for c in cudart.calls] == ["register", "synchronize", "unregister"]


@pytest.mark.usefixtures("no_cyclic_gc")
@pytest.mark.parametrize("make", [device_pool, host_pool], ids=["device", "host"])
def test_release_gives_the_memory_back_and_refuses_every_page_after(make: Any) -> None:
    np = pytest.importorskip("numpy")
    shape = make(LAYOUT, 3, device=torch.device("cpu")).tensor.shape
    raw = np.zeros(shape.numel() * LAYOUT.itemsize, dtype=np.uint8)  # dies with its last view
    memory = weakref.ref(raw)
    tensor = torch.from_numpy(raw).view(LAYOUT.dtype).view(shape)
    pool = KVPool(make.__name__.partition("_")[0], LAYOUT, 3, tensor, pinned=False)
    del raw, tensor
    pool.write([1], synthetic_kv(LAYOUT, [7] * LAYOUT.page_size))
    pool.release()
    assert memory() is None
    assert (pool.released, pool.num_pages, pool.layout) == (True, 0, LAYOUT)
    refused = (
        f"{pool.name} pool: page 1 refused: the pool was released (its cache was closed, or "
        "dropped unclosed) and gave its memory back, so it has no pages"
    )
    with pytest.raises(ForeignSlot) as raised:
        pool.read([1])
    assert str(raised.value) == refused
    with pytest.raises(ForeignSlot) as raised:
        pool.write([1], synthetic_kv(LAYOUT, [7] * LAYOUT.page_size))
    assert str(raised.value) == refused
    assert pool.read([]).numel() == 0  # no pages: nothing to refuse
    pool.release()  # idempotent
    assert pool.num_pages == 0


def test_a_view_taken_before_release_keeps_what_it_views() -> None:
    pool = device_pool(LAYOUT, 2, device=torch.device("cpu"))
    kv_ = synthetic_kv(LAYOUT, [3] * LAYOUT.page_size)
    pool.write([0], kv_)
    kept = KVPool("device", LAYOUT, 2, pool.tensor, pinned=False)
    pool.release()
    assert torch.equal(kept.read([0]).view(torch.uint8), kv_.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
def test_release_unregisters_a_pinned_pool_before_dropping_it() -> None:
    gpu = torch.device("cuda", torch.cuda.current_device())
    pool = host_pool(LAYOUT, 2, pin=True, device=gpu)
    tensor = pool.tensor
    assert tensor.is_pinned()
    pool.release()
    assert not tensor.is_pinned()  # unregistered first: freeing registered memory is undefined
    assert (pool.released, pool.pinned, pool.num_pages) == (True, False, 0)
