"""The KV tensors: layouts, sizing, page views, and exact-size pinned host memory."""

from __future__ import annotations

import re
import warnings

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

    from fsm_cache.memory.kv import (
        KVLayout,
        alloc_exact_host,
        default_device,
        device_pool,
        host_pool,
    )

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

LAYOUT = KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.float16, page_size=4)


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
def test_device_pool_defaults_to_cuda() -> None:
    pool = device_pool(LAYOUT, 2)
    assert pool.device.type == "cuda"
    kv = torch.randn(3, 2, 4, 2, 4).to(torch.float16)
    pool.write([1], kv)
    assert torch.equal(pool.read([1]), kv)
