"""Batched submission, word views and the double-buffered staging of the copy engine.

The engine starts a backup at once (checked, its pages busy) but moves its
bytes when it submits the open batch; these tests pin down when that happens,
that a batch of many tickets and many chunks still lands bit for bit where each
ticket said, on CPU and through the fake CUDA streams, and that failures and
injected faults still reach exactly the tickets they concern.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable

import pytest
import torch

from fsm_cache.errors import BadArgument, CopyFailed
from fsm_cache.memory import staging
from fsm_cache.memory.copies import CopyEngine, Direction
from fsm_cache.memory.kv import WORDS, KVLayout, KVPool, device_pool, host_pool, word_type
from fsm_cache.memory.pages import run_start
from fsm_cache.memory.tickets import BusyPages, PageSet, Ticket, host_runs
from fsm_cache.testing.fakecuda import FakeStreams
from fsm_cache.testing.faults import POISON, FaultyCopyEngine


CPU = torch.device("cpu")
LAYOUT = KVLayout(layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)


def pools(pages: int = 32, layout: KVLayout = LAYOUT) -> tuple[KVPool, KVPool]:
    """A device pool of random bytes and a zeroed host pool, both on the CPU."""
    dev = device_pool(layout, pages, CPU)
    host = host_pool(layout, pages, pin=False)
    dev.tensor.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(pages))
    host.tensor.view(torch.uint8).zero_()
    return dev, host


def raw(pool: KVPool, pages: list[int] | tuple[int, ...]) -> torch.Tensor:
    return pool.read(list(pages)).view(torch.uint8)


def engine(
    fake: FakeStreams | None = None, *, pages: int = 32, chunk: int = 64, **kwargs: int
) -> CopyEngine:
    dev, host = pools(pages)
    return CopyEngine(dev, host, chunk * LAYOUT.page_bytes, streams=fake, **kwargs)


# -- words -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row_bytes", "word"),
    [(64, torch.int64), (12, torch.int32), (6, torch.int16), (3, torch.uint8), (1, torch.uint8)],
)
def test_the_widest_word_that_divides_a_row_is_used(row_bytes: int, word: torch.dtype) -> None:
    assert word_type(row_bytes) == word
    assert WORDS[0] == torch.int64


@pytest.mark.parametrize(
    "layout",
    [
        LAYOUT,  # rows of 4 * 2 * 4 * 2 = 64 bytes: int64
        KVLayout(layers=3, heads=1, head_dim=3, dtype=torch.float16, page_size=1),  # 6: int16
        KVLayout.mla(layers=2, latent_dim=5, dtype=torch.float8_e4m3fn, page_size=3),  # 15: uint8
    ],
    ids=["int64", "int16", "uint8"],
)
def test_word_views_are_the_page_bytes(layout: KVLayout) -> None:
    dev, host = pools(6, layout)
    host.tensor.view(torch.uint8).random_(0, 256)
    for pool in (dev, host):
        assert pool.words.shape[:2] == (6, layout.layers * layout.planes)
        for page in range(6):  # the words of a page are exactly its bytes, in read()'s order
            words = pool.words[page].contiguous().view(torch.uint8).view(pool.pages[page].shape)
            assert torch.equal(words, pool.pages[page])


# -- when bytes move -----------------------------------------------------------------


def test_a_backup_moves_at_the_next_poll_and_is_reported_by_it() -> None:
    eng = engine()
    want = raw(eng.device, [3, 4])
    ticket = eng.start_write([3, 4], [10, 11])
    assert not raw(eng.host, [10, 11]).any()  # started, not moved: still zeros
    assert eng.host_busy([10])
    assert eng.device_busy([4])
    assert [c.ticket for c in eng.poll()] == [ticket]
    assert torch.equal(raw(eng.host, [10, 11]), want)


def test_backups_of_many_operations_move_in_one_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine()
    moves: list[tuple[Direction, list[int], list[int]]] = []
    move = staging.Mover.move

    def spy(
        mover: staging.Mover,
        direction: Direction,
        src: list[int],
        dst: list[int],
        runs: tuple[int | None, int | None] | None = None,
    ) -> None:
        moves.append((direction, list(src), list(dst)))
        move(mover, direction, src, dst, runs)

    monkeypatch.setattr(staging.Mover, "move", spy)
    want = raw(eng.device, [5, 1, 7, 2])
    tickets = [eng.start_write([5, 1], [20, 21]), eng.start_write([7], [22])]
    tickets.append(eng.start_write([2], [9]))
    assert moves == []
    assert [c.ticket for c in eng.poll()] == tickets
    assert moves == [(Direction.D2H, [5, 1, 7, 2], [20, 21, 22, 9])]
    assert torch.equal(raw(eng.host, [20, 21, 22, 9]), want)


def test_a_full_batch_is_submitted_when_it_fills_a_staging_buffer() -> None:
    eng = engine(chunk=3)
    eng.start_write([0], [0])
    eng.start_write([1], [1])
    assert not raw(eng.host, [0, 1]).any()
    eng.start_write([2], [2])  # three pages: one buffer's worth
    assert torch.equal(raw(eng.host, [0, 1, 2]), raw(eng.device, [0, 1, 2]))
    assert len(eng.poll()) == 3


def test_a_load_submits_the_open_backups_first_so_copies_keep_their_order() -> None:
    eng = engine()
    want = raw(eng.device, [6])
    eng.start_write([6], [4])  # device 6 -> host 4, still open
    eng.start_load([4], [9])  # host 4 -> device 9: must read what the backup wrote
    assert torch.equal(raw(eng.device, [9]), want)  # a CPU load is there when start_load returns
    assert [c.ticket.direction for c in eng.poll()] == [Direction.D2H, Direction.H2D]


@pytest.mark.parametrize("polls", [1, 3])
def test_batch_polls_holds_the_open_batch_for_that_many_polls(polls: int) -> None:
    eng = engine(batch_polls=polls)
    first = eng.start_write([1], [1])
    for _ in range(polls - 1):
        assert eng.poll() == []
        assert not raw(eng.host, [1]).any()
    assert [c.ticket for c in eng.poll()] == [first]
    assert torch.equal(raw(eng.host, [1]), raw(eng.device, [1]))
    assert eng.poll() == []
    assert eng.in_flight() == []


def test_drain_and_wait_submit_whatever_the_batch_polls() -> None:
    eng = engine(batch_polls=100)
    ticket = eng.start_write([3], [3])
    eng.wait([ticket.id])  # compute is about to read: the copy must have run
    assert torch.equal(raw(eng.host, [3]), raw(eng.device, [3]))
    assert [c.ticket for c in eng.poll()] == [ticket]  # submitted, so reported at once
    second = eng.start_write([4], [4])
    assert [c.ticket for c in eng.drain()] == [second]


def test_batch_polls_must_be_a_positive_int() -> None:
    dev, host = pools(2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(BadArgument, match=r"^copy engine: batch_polls must be an int >= 1"):
            CopyEngine(dev, host, batch_polls=bad)  # type: ignore[arg-type]


# -- many chunks, two buffers --------------------------------------------------------


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake-cuda"])
@pytest.mark.parametrize("seed", range(4))
def test_a_batch_of_many_chunks_lands_bit_for_bit(fake: bool, seed: int) -> None:
    streams = FakeStreams(seed=seed, max_polls=2) if fake else None
    eng = engine(streams, pages=40, chunk=3)  # 3 pages per buffer: a 10-page batch is 4 chunks
    rng = random.Random(seed)
    src = rng.sample(range(40), 10)
    scattered = rng.sample(range(30), 6)
    dst = [*scattered[:2], 30, 31, 32, 33, *scattered[2:]]  # a run among scattered pages
    want = raw(eng.device, src)
    eng.start_write(src[:4], dst[:4])
    eng.start_write(src[4:], dst[4:])
    done = eng.drain()
    assert [c.ok for c in done] == [True, True]
    assert torch.equal(raw(eng.host, dst), want)
    back = rng.sample([p for p in range(40) if p not in src], len(dst))
    eng.start_load(dst, back)
    assert [c.ok for c in eng.drain()] == [True]
    assert torch.equal(raw(eng.device, back), want)


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake-cuda"])
@pytest.mark.parametrize("chunk", [1, 64], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("seed", range(8))
def test_a_copy_reads_what_a_copy_of_the_other_direction_still_writes_after_it(
    fake: bool, chunk: int, seed: int
) -> None:
    """Read after write across the two directions, each on its own streams, in start order.

    A load from host pages a backup still writes gets the backed-up bytes; a
    backup of device pages a load still writes gets the loaded bytes.
    """
    eng = engine(FakeStreams(seed=seed, max_polls=3) if fake else None, pages=16, chunk=chunk)
    device = raw(eng.device, [0, 1])
    eng.start_write([0, 1], [3, 4])  # backup into host 3-4 (a run)
    eng.start_load([4, 3], [6, 5])  # load from them, still being written
    done = []
    while eng.in_flight():
        done += eng.poll()
    assert [c.ok for c in done] == [True, True]
    assert torch.equal(raw(eng.device, [5, 6]), device)
    eng.host.tensor.view(torch.uint8)[0].random_(0, 256)  # host page 0 differs from device 8
    host = raw(eng.host, [0])
    eng.start_load([0], [8])
    eng.start_write([8], [9])  # back up the device page the load still writes
    while eng.in_flight():
        assert all(c.ok for c in eng.poll())
    assert torch.equal(raw(eng.host, [9]), host)


@pytest.mark.parametrize(
    ("stage", "src", "dst"),
    [
        ("_gather", [5, 3, 1, 0, 2, 4], [9, 7, 8, 6, 11, 10]),  # scattered device pages
        ("_copy", [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),  # runs on both sides
    ],
)
def test_a_failure_in_a_first_stage_fails_the_batch_on_streams(
    monkeypatch: pytest.MonkeyPatch, stage: str, src: list[int], dst: list[int]
) -> None:
    """The first stages run on a stream no event is recorded on: their error must still tell.

    Six pages through a two-page buffer: three chunks, each first stage on
    the gather stream, the batch's event on the direction's stream.
    """
    eng = engine(FakeStreams(seed=0, max_polls=0), pages=16, chunk=2)

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(staging, stage, broken)
    ticket = eng.start_write(src, dst)
    (done,) = eng.drain()
    assert (done.ticket, done.ok) == (ticket, False)
    assert str(done.error) == "copy 1 failed on the device: fake CUDA error in queued work: boom"
    assert eng.busy_device_pages() == eng.busy_host_pages() == frozenset()


def test_several_chunks_alternate_two_buffers_on_two_streams() -> None:
    fake = FakeStreams(seed=1, max_polls=1000)
    eng = engine(fake, pages=16, chunk=2)
    eng.start_write([1, 2, 3, 4, 5, 6], [9, 3, 8, 12, 0, 5])  # three chunks of two pages
    assert eng.poll() == []
    d2h, h2d, _, gather = fake.streams  # the third: the engine's ordering stream
    assert gather.pending > 0
    assert d2h.pending > 0
    assert not raw(eng.host, [9, 3]).any()  # nothing ran: it all waits for its event
    gather.synchronize()  # the gathers run ahead as far as the two buffers let them
    (done,) = eng.drain()
    assert done.ok
    assert torch.equal(raw(eng.host, [9, 3, 8, 12, 0, 5]), raw(eng.device, [1, 2, 3, 4, 5, 6]))
    assert h2d.pending == 0
    assert len(fake.events) == 1  # one event for the batch, recorded after its last chunk


def test_a_single_chunk_runs_on_the_direction_stream_alone() -> None:
    fake = FakeStreams(seed=0, max_polls=1000)
    eng = engine(fake, pages=16, chunk=8)
    eng.start_write([1, 2], [5, 9])
    eng.poll()
    assert len(fake.streams) == 3  # the engine's ordering stream, no second one for a chunk
    eng.drain()
    assert torch.equal(raw(eng.host, [5, 9]), raw(eng.device, [1, 2]))


def test_on_streams_a_batch_is_sorted_by_host_page_so_runs_coalesce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfers: list[int] = []
    copy = staging._copy  # noqa: SLF001 (spied on: one call per transfer of a run of host pages)

    def spy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        transfers.append(len(dst))
        copy(dst, src, non_blocking)

    monkeypatch.setattr(staging, "_copy", spy)
    eng = engine(FakeStreams(seed=2, max_polls=1), pages=16)
    want = raw(eng.device, [7, 2, 9, 4])
    eng.start_write([7, 2], [12, 13])
    eng.start_write([9, 4], [10, 11])  # together with the first: host pages 10..13, one run
    assert all(c.ok for c in eng.drain())
    assert torch.equal(raw(eng.host, [12, 13, 10, 11]), want)
    assert transfers == [4]  # one transfer of the one run, as on CUDA
    eng.start_write([1, 3], [5, 0])  # two runs, even sorted: two transfers
    assert all(c.ok for c in eng.drain())
    assert transfers == [4, 1, 1]
    assert torch.equal(raw(eng.host, [5, 0]), raw(eng.device, [1, 3]))


def test_staging_buffers_are_kept_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine(pages=32, chunk=4)
    used: set[tuple[int, int]] = set()
    take = staging.Mover._buffer  # noqa: SLF001 (spied on, to see which memory is staged through)

    def spy(mover: staging.Mover, direction: Direction, slot: int, pages: int) -> torch.Tensor:
        buffer = take(mover, direction, slot, pages)
        used.add((slot, buffer.data_ptr()))
        return buffer

    monkeypatch.setattr(staging.Mover, "_buffer", spy)
    for round_ in range(3):
        hosts = [20 - 2 * i for i in range(8)]  # scattered host pages: staged
        src = list(range(8 * round_, 8 * round_ + 8))
        eng.start_write(src, hosts)
        assert all(c.ok for c in eng.drain())
        assert torch.equal(raw(eng.host, hosts), raw(eng.device, src))
    assert sorted(slot for slot, _ in used) == [0, 1]  # two buffers, the same in every round


class _EagerStreams(FakeStreams):
    """Fake streams that run work when it is queued, as CUDA launches it, noting on which stream."""

    running: object = None

    def run_on(self, stream: staging.Stream, work: Callable[[], None]) -> None:
        self.running = stream
        try:
            work()
        finally:
            self.running = None


@pytest.mark.parametrize("chunk", [8, 2], ids=["one chunk", "three chunks"])
def test_staging_is_taken_on_the_copy_stream_that_fills_it(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Taken under the caller's stream, a CUDA buffer could be a block that stream still used.

    The caching allocator ties a block to the stream current at its allocation
    (``tests/test_gpu.py`` checks that on a GPU); here, that the buffer is
    taken inside the stage that fills it, on a side stream.
    """
    fake = _EagerStreams(seed=0, max_polls=0)
    eng = engine(fake, pages=16, chunk=chunk)
    taken: list[object] = []
    take = staging.Mover._buffer  # noqa: SLF001 (spied on, to see where buffers are taken)

    def spy(mover: staging.Mover, direction: Direction, slot: int, pages: int) -> torch.Tensor:
        taken.append(fake.running)
        return take(mover, direction, slot, pages)

    monkeypatch.setattr(staging.Mover, "_buffer", spy)
    eng.start_write([1, 2, 3, 4, 5, 6], [9, 3, 8, 12, 0, 5])
    assert all(c.ok for c in eng.drain())
    eng.start_load([9, 3, 8, 12, 0, 5], [7, 8, 9, 10, 11, 12])
    assert all(c.ok for c in eng.drain())
    assert torch.equal(raw(eng.device, [7, 8, 9, 10, 11, 12]), raw(eng.device, [1, 2, 3, 4, 5, 6]))
    assert taken  # staged: the host pages are no run
    assert all(stream in fake.streams for stream in taken)  # side streams, never None
    eng.close()


@pytest.mark.parametrize("seed", range(4))
def test_an_outgrown_staging_buffer_is_freed_once_the_polls_report_its_copies(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Not only at a drain, which a serving loop may never call: GPU memory held for good."""
    eng = engine(FakeStreams(seed=seed, max_polls=3), pages=32, chunk=8)
    buffers: list[weakref.ref[torch.Tensor]] = []
    take = staging.Mover._buffer  # noqa: SLF001 (spied on, to see which memory is staged through)

    def spy(mover: staging.Mover, direction: Direction, slot: int, pages: int) -> torch.Tensor:
        view = take(mover, direction, slot, pages)
        whole = view._base  # noqa: SLF001 (the buffer the view of ``pages`` pages is cut from)
        buffers.append(weakref.ref(view if whole is None else whole))
        return view

    monkeypatch.setattr(staging.Mover, "_buffer", spy)
    eng.start_write([1], [9])
    eng.poll()  # submitted through a buffer of one page
    eng.start_write([2, 3, 4], [12, 14, 16])
    eng.poll()  # through a buffer of four pages: the first one is outgrown
    while eng.in_flight():
        assert all(c.ok for c in eng.poll())
    gc.collect()
    # taken when each batch's first stage ran: the one-page buffer, then the four-page one
    outgrown, current = buffers[0], buffers[-1]
    assert outgrown() is None
    kept = current()
    assert kept is not None  # kept for the next batch
    assert kept.shape[0] == 4
    assert torch.equal(raw(eng.host, [9, 12, 14, 16]), raw(eng.device, [1, 2, 3, 4]))


# -- failures ------------------------------------------------------------------------


def test_a_submission_that_fails_fails_every_ticket_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine()

    def broken(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(staging, "_gather", broken)
    first = eng.start_write([1], [5])
    second = eng.start_write([2], [3])  # not one run with the first: gathered through staging
    done = eng.poll()
    assert [c.ticket for c in done] == [first, second]
    assert [str(c.error) for c in done] == [
        "copy 1 (d2h) failed: no memory",
        "copy 2 (d2h) failed: no memory",
    ]
    assert eng.stats.failures[Direction.D2H] == 2
    assert eng.busy_host_pages() == frozenset()


def test_an_injected_failure_reaches_only_its_ticket_of_a_batch() -> None:
    inner = engine()
    eng = FaultyCopyEngine(inner, fail=[2])
    want = raw(inner.device, [1, 3])
    tickets = [eng.start_write([p], [p + 10]) for p in (1, 2, 3)]
    done = {c.ticket.id: c for c in eng.poll()}
    assert sorted(done) == [t.id for t in tickets]
    assert [done[t.id].ok for t in tickets] == [True, False, True]
    assert bool((inner.host.pages[12] == POISON).all())
    assert torch.equal(raw(inner.host, [11, 13]), want)


def test_a_closed_engine_refuses_and_its_open_batch_landed() -> None:
    eng = engine(batch_polls=5)
    eng.start_write([4], [4])
    eng.close()
    assert torch.equal(raw(eng.host, [4]), raw(eng.device, [4]))
    with pytest.raises(CopyFailed, match=r"^copy engine closed: d2h copy refused$"):
        eng.start_write([5], [5])


# -- the page bookkeeping ------------------------------------------------------------


def test_a_page_set_counts_every_holder() -> None:
    held = PageSet()
    held.add([1, 2, 3])
    held.add([3, 4, 4])  # page 3 held twice, page 4 listed twice
    assert sorted(held) == [1, 2, 3, 4]
    held.remove([1, 2, 3])
    assert sorted(held) == [3, 4]
    held.remove([4])
    assert 4 in held
    assert not held.isdisjoint([4])
    held.remove([3, 4])
    assert len(held) == 0
    assert held.frozen() == frozenset()


def test_a_page_set_tests_an_iterator_against_its_runs_too() -> None:
    """An iterator is read once: its pages must still meet the held runs, not only the set."""
    held = PageSet()
    held.add([3, 1])  # not a run: the set
    held.add([5, 6], 5)  # a run: a range
    assert not held.isdisjoint(iter([5]))
    assert not held.isdisjoint(p for p in [9, 6])
    assert not held.isdisjoint(iter([1]))
    assert held.isdisjoint(iter([2, 7]))


def test_busy_pages_follow_tickets_of_both_directions() -> None:
    busy = BusyPages()
    write = Ticket(1, Direction.D2H, (5, 6), (0, 1))
    load = Ticket(2, Direction.H2D, (0,), (5,))
    busy.add(write)
    busy.add(load)
    assert sorted(busy.device) == [5, 6]
    assert sorted(busy.host) == [0, 1]
    busy.remove(write)
    assert sorted(busy.device) == [5]
    assert sorted(busy.host) == [0]
    busy.remove(load)
    assert len(busy.device) == len(busy.host) == 0


@pytest.mark.parametrize(
    ("pages", "first"),
    [([], None), ([4], 4), ([4, 5, 6], 4), ([4, 6], None), ([4, 5, 7], None), ([6, 5, 4], None)],
)
def test_run_start_finds_one_ascending_run(pages: list[int], first: int | None) -> None:
    assert run_start(pages) == first
    runs = list(host_runs(pages))
    assert (len(runs) == 1) == (first is not None)
