"""The copy engine on a real GPU: ordering against compute, polls that never block, bytes.

Every test here needs CUDA (the ``gpu`` marker skips them elsewhere;
``scripts/gpu_check.sh`` runs them). The CPU-side twins of these checks, on
fake streams, are in ``test_fake_cuda.py``. None depends on timing: where a
copy must still be pending, an event on the compute stream proves it was.
"""

from __future__ import annotations

import warnings

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.errors import CopyFailed
    from fsm_cache.memory.copies import CopyEngine, Direction, Ticket
    from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
    from fsm_cache.memory.tiers import CacheConfig, Tiers, synthetic_kv

pytestmark = pytest.mark.gpu

SPIN = 4_000_000_000  # GPU cycles of the compute kernel that holds copies back (~2 s)
BIG = KVLayout(layers=32, heads=8, head_dim=128, dtype=torch.float16, page_size=16)  # 2 MiB pages


def engine(pages: int, layout: KVLayout = BIG) -> CopyEngine:
    """A CUDA engine whose device pages hold random bytes and whose pinned host pool is zero."""
    dev = device_pool(layout, pages, torch.device("cuda"))
    host = host_pool(layout, pages, pin=True, device=dev.device)
    dev.tensor.view(torch.uint8).random_(0, 256)
    host.tensor.view(torch.uint8).zero_()
    torch.cuda.synchronize()
    return CopyEngine(dev, host)


def raw(pool: KVPool, pages: list[int] | tuple[int, ...]) -> torch.Tensor:
    return pool.read(list(pages)).view(torch.uint8)


def spin() -> torch.cuda.Event:
    """Keep the current (compute) stream busy; return an event recorded after the spin."""
    torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]  # noqa: SLF001 (only a spin kernel will do)
    after = torch.cuda.Event()  # type: ignore[no-untyped-call]
    after.record()
    return after


def test_a_slow_copy_is_never_acknowledged_early() -> None:
    pages = 256  # 512 MiB in one batch
    eng = engine(pages)
    src = list(range(pages))
    dst = [(7 * p) % pages for p in src]  # scattered, many runs
    want = raw(eng.device, src)
    ticket = eng.start_write(src, dst)
    acked: list[Ticket] = []
    while not acked:
        for done in eng.poll():  # right after the start too: only what has finished
            assert done.ok
            assert torch.equal(raw(eng.host, done.ticket.dst_pages), want)
            acked.append(done.ticket)
    assert acked == [ticket]
    eng.close()


def test_poll_never_blocks_while_a_copy_waits_for_compute() -> None:
    eng = engine(8)
    compute_done = spin()
    ticket = eng.start_load([0, 1], [2, 3])  # waits for the compute stream
    got = eng.poll()
    still_computing = not compute_done.query()  # type: ignore[no-untyped-call]
    assert still_computing  # so the copy could not have finished when poll looked
    assert got == []
    assert eng.in_flight() == [ticket]
    assert [c.ticket for c in eng.drain()] == [ticket]


def test_a_load_lands_after_the_compute_queued_before_it() -> None:
    eng = engine(8)
    want = raw(eng.host, [4, 5])
    spin()
    eng.device.pages[2:4].fill_(0x5A)  # compute writes the destination pages, late
    eng.start_load([4, 5], [2, 3])
    assert all(c.ok for c in eng.drain())
    assert torch.equal(raw(eng.device, [2, 3]), want)  # the load, not the compute's bytes


def test_a_backup_reads_what_compute_wrote_before_it() -> None:
    eng = engine(8)
    spin()
    eng.device.pages[6].fill_(0x3C)  # compute writes the source page, late
    eng.start_write([6], [1])
    assert all(c.ok for c in eng.drain())
    assert bool((raw(eng.host, [1]) == 0x3C).all())


def test_wait_holds_the_compute_stream_until_the_load_lands() -> None:
    pages = 128
    eng = engine(pages)
    eng.host.tensor.view(torch.uint8).random_(0, 256)
    want = raw(eng.host, list(range(pages)))
    ticket = eng.start_load(list(range(pages)), list(range(pages)))
    eng.wait([ticket.id])  # the current stream; returns at once
    seen = eng.device.pages.clone()  # queued on the current stream after the wait
    torch.cuda.synchronize()
    got = seen.permute(1, 2, 0, 3, 4, 5).reshape(want.shape)
    assert torch.equal(got.cpu(), want)
    assert [c.ticket for c in eng.drain()] == [ticket]
    eng.wait([ticket.id])  # reported: nothing to wait for


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16", "float32"])
def test_round_trips_are_byte_exact(dtype: str) -> None:
    config = CacheConfig(
        device_pages=16, host_pages=16, page_size=16, layers=2, heads=2, head_dim=16,
        dtype=dtype, device="cuda",
    )  # fmt: skip
    tiers = Tiers(config)
    layout = tiers.device.layout
    tokens = list(range(1000, 1000 + 3 * 16))
    want = synthetic_kv(layout, tokens).view(torch.uint8)
    tiers.write_tokens([4, 9, 2], tokens)
    tiers.copier.start_write([4, 9, 2], [7, 8, 1])
    assert all(c.ok for c in tiers.copier.drain())
    assert torch.equal(raw(tiers.host, [7, 8, 1]), want)
    tiers.copier.start_load([7, 8, 1], [11, 12, 13])
    assert all(c.ok for c in tiers.copier.drain())
    assert torch.equal(raw(tiers.device, [11, 12, 13]), want)
    tiers.close()


def test_tiers_close_waits_for_copies_and_unpins() -> None:
    config = CacheConfig(
        device_pages=64, host_pages=64, layers=8, heads=8, head_dim=128, device="cuda"
    )
    tiers = Tiers(config)
    # random bytes: a fresh device pool may read as zeros, as the host pool does, and a
    # close that never ran the copy would pass
    tiers.device.tensor.view(torch.uint8).random_(0, 256)
    torch.cuda.synchronize()
    want = raw(tiers.device, list(range(64)))
    spin()
    tiers.copier.start_write(list(range(64)), list(range(64)))
    assert tiers.host.tensor.is_pinned()
    tiers.close()
    assert tiers.copier.in_flight() == []
    assert not tiers.host.tensor.is_pinned()
    assert torch.equal(raw(tiers.host, list(range(64))), want)
    with pytest.raises(CopyFailed, match=r"^copy engine closed: d2h copy refused$"):
        tiers.copier.start_write([0], [0])
    tiers.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_a_batch_of_many_chunks_through_two_buffers_is_byte_exact(dtype: torch.dtype) -> None:
    """Chunks alternate two staging buffers on two streams; every page lands where it should."""
    layout = KVLayout(layers=4, heads=2, head_dim=16, dtype=dtype, page_size=8)
    dev = device_pool(layout, 64, torch.device("cuda"))
    host = host_pool(layout, 64, pin=True, device=dev.device)
    dev.tensor.view(torch.uint8).random_(0, 256)
    host.tensor.view(torch.uint8).zero_()
    eng = CopyEngine(dev, host, staging_bytes=3 * layout.page_bytes)  # 3 pages per chunk
    src = list(range(0, 40, 2))  # 20 pages: seven chunks
    dst = [(11 * p) % 64 for p in range(20)]  # scattered host pages
    want = raw(dev, src)
    spin()  # the gathers must wait for compute; the copies then race the next chunk's gather
    first, second = eng.start_write(src[:7], dst[:7]), eng.start_write(src[7:], dst[7:])
    assert [c.ticket for c in eng.drain()] == [first, second]
    assert torch.equal(raw(host, dst), want)
    back = list(range(1, 41, 2))
    eng.start_load(dst, back)
    assert all(c.ok for c in eng.drain())
    assert torch.equal(raw(dev, back), want)
    eng.close()
    host.close()


def test_backups_of_several_polls_move_in_one_submission_on_cuda() -> None:
    eng = CopyEngine(*_pools(16), batch_polls=3)
    want = raw(eng.device, [1, 2, 3])
    tickets = [eng.start_write([p], [p + 8]) for p in (1, 2, 3)]
    assert eng.poll() == []  # one poll: the batch waits for a third
    assert eng.poll() == []
    reported = eng.poll() + eng.drain()
    assert sorted(c.ticket.id for c in reported) == [t.id for t in tickets]
    assert torch.equal(raw(eng.host, [9, 10, 11]), want)
    eng.close()


def _pools(pages: int) -> tuple[KVPool, KVPool]:
    layout = KVLayout(layers=2, heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    dev = device_pool(layout, pages, torch.device("cuda"))
    host = host_pool(layout, pages, pin=True, device=dev.device)
    dev.tensor.view(torch.uint8).random_(0, 256)
    host.tensor.view(torch.uint8).zero_()
    return dev, host


def test_the_host_pool_is_registered_with_the_cache_gpu() -> None:
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    pool = host_pool(BIG, 2, pin=True, device=last)
    assert pool.tensor.is_pinned()
    pool.close()
    assert not pool.tensor.is_pinned()
    pool.close()


def _stream_of(pointer: int) -> int:
    """The stream the caching allocator tied the segment that holds ``pointer`` to."""
    for segment in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
        if segment["address"] <= pointer < segment["address"] + segment["total_size"]:
            return int(segment["stream"])
    raise AssertionError(f"no segment of the caching allocator holds {pointer:#x}")


def test_staging_is_allocated_on_the_copy_stream_not_the_callers() -> None:
    """Taken under the caller's stream, a buffer could be a block that stream still used.

    The allocator hands a stream the blocks it freed itself; the copy stream
    waits for compute only as it stood at the copy's start, so it could write
    into a block the caller's queued kernels still read.
    """
    eng = engine(8)
    caller = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(caller):
        eng.start_write([1, 5, 2], [3, 0, 6])
        assert all(c.ok for c in eng.drain())
        eng.start_load([3, 0, 6], [4, 7, 0])
        assert all(c.ok for c in eng.drain())
    mover = eng._mover  # noqa: SLF001 (where the buffers and the copy streams are)
    for direction in Direction:
        buffer = mover._buffers[direction][0]  # noqa: SLF001 (one chunk: slot 0)
        assert buffer is not None
        copy_stream = mover.streams[direction]
        assert _stream_of(buffer.data_ptr()) == copy_stream.cuda_stream  # type: ignore[attr-defined]
        assert _stream_of(buffer.data_ptr()) != caller.cuda_stream
    eng.close()


def warm(cache: HiCache) -> None:
    """Build the cache's synthetic-KV constants (an insert), then wait for the device.

    The first insert of a layout builds them and synchronises the device as it
    does: after a spin that would wait the spin out before the KV is written, and
    a test of the order of that write could not fail.
    """
    cache.insert(list(range(10_000, 10_016)))
    while cache.tiers.copier.in_flight():
        cache.poll()
    torch.cuda.synchronize()


def test_a_cache_given_a_compute_stream_backs_up_the_kv_it_wrote_there() -> None:
    """The cache wrote its own KV on the current stream, which its copies no longer followed."""
    forward = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    config = CacheConfig(device="cuda", device_pages=64, page_size=16, head_dim=16)
    cache = HiCache(config, compute_stream=forward)
    warm(cache)
    prompt = list(range(64))
    spin()  # the current stream is busy: work queued on it now runs seconds later
    cache.insert(prompt)  # write-through: the KV written, then a backup started
    while cache.tiers.copier.in_flight():
        cache.poll()
    backed = [node for node in cache.tree if node.host_pages]
    assert backed
    for node in backed:
        want = synthetic_kv(cache.tiers.host.layout, node.key).view(torch.uint8)
        assert torch.equal(cache.tiers.host.read(node.host_pages).view(torch.uint8), want)
    cache.close()


def test_a_copiers_engine_with_a_compute_stream_has_the_cache_write_its_kv_there() -> None:
    """A copier's engine ordered after ``forward``; the cache wrote its KV on the current stream."""
    from functools import partial

    from fsm_cache.testing.faults import FaultyCopyEngine

    forward = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    engine = partial(CopyEngine, compute_stream=forward)
    config = CacheConfig(
        device="cuda", device_pages=64, page_size=16, head_dim=16,
        copier=FaultyCopyEngine.copier(engine=engine),
    )  # fmt: skip
    cache = HiCache(config)
    warm(cache)
    prompt = list(range(64))
    spin()  # the current stream is busy: work queued on it now runs seconds later
    cache.insert(prompt)
    while cache.tiers.copier.in_flight():
        cache.poll()
    backed = [node for node in cache.tree if node.host_pages]
    assert backed
    for node in backed:
        want = synthetic_kv(cache.tiers.host.layout, node.key).view(torch.uint8)
        assert torch.equal(cache.tiers.host.read(node.host_pages).view(torch.uint8), want)
    cache.close()
