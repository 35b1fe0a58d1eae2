"""The copy engine: bit-exact round trips, tickets, busy pages, and injected faults."""

from __future__ import annotations

import gc
import inspect
import pickle
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

    from fsm_cache.bench import copies as bench_copies_module
    from fsm_cache.bench.copies import CopyBenchResult, run_copy_bench
    from fsm_cache.bench.memory import bench_copies, ceiling_copy
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.tree import TreeNode
    from fsm_cache.cli.main import main
    from fsm_cache.errors import BadArgument, CopyFailed, ForeignSlot, NotASlot, PageBusy
    from fsm_cache.memory import copies, staging
    from fsm_cache.memory.copies import Completion, CopyEngine, Direction, host_runs
    from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
    from fsm_cache.memory.staging import Stream
    from fsm_cache.memory.tiers import CacheConfig, Tiers
    from fsm_cache.testing.fakecuda import FakeEvent, FakeStream, FakeStreams, deferred_copier
    from fsm_cache.testing.faults import POISON, Faults, FaultyCopyEngine

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("fake", id="fake-cuda"),  # CPU pools, the CUDA path on fake streams
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_cuda]),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def make(
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
    *,
    dev_pages: int = 8,
    host_pages: int = 8,
    staging_pages: int = 64,
    mla: bool = False,
) -> CopyEngine:
    layout = (
        KVLayout.mla(layers=3, latent_dim=12, dtype=dtype, page_size=4)
        if mla
        else KVLayout(layers=3, heads=2, head_dim=4, dtype=dtype, page_size=4)
    )
    fake = device == "fake"
    dev = device_pool(layout, dev_pages, torch.device("cpu" if fake else device))
    host = host_pool(layout, host_pages)
    dev.tensor.view(torch.uint8).random_(0, 256)
    host.tensor.view(torch.uint8).zero_()
    streams = FakeStreams(seed=dev_pages, max_polls=3) if fake else None
    return CopyEngine(dev, host, staging_bytes=staging_pages * layout.page_bytes, streams=streams)


def raw(pool: KVPool, pages: list[int]) -> torch.Tensor:
    """The pages' bytes: bit-exact even where random bytes are NaNs."""
    return pool.read(pages).view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_round_trip_is_bit_exact(device: str, dtype: torch.dtype, mla: bool) -> None:
    engine = make(device, dtype, staging_pages=2, mla=mla)
    src, spare = [6, 1, 4], [0, 7, 3]
    before = raw(engine.device, src)
    host = [5, 2, 3]  # two runs: [5] and [2, 3]
    engine.start_write(src, host)
    assert [c.ok for c in engine.drain()] == [True]
    assert torch.equal(raw(engine.host, host), before)
    engine.device.tensor.view(torch.uint8).zero_()
    engine.start_load(host, spare)
    assert [c.ok for c in engine.drain()] == [True]
    assert torch.equal(raw(engine.device, spare), before)


def test_host_runs_split_at_gaps() -> None:
    assert list(host_runs([4, 5, 6, 1, 2, 9])) == [(4, 0, 3), (1, 3, 2), (9, 5, 1)]
    assert list(host_runs([])) == []


def test_cpu_ticket_is_reported_once_at_the_next_poll() -> None:
    engine = make()
    ticket = engine.start_write([2, 3], [0, 1])
    assert ticket.direction is Direction.D2H
    assert (ticket.device_pages, ticket.host_pages) == ((2, 3), (0, 1))
    assert engine.in_flight() == [ticket]
    assert engine.device_busy([3])
    assert engine.host_busy([0, 7])
    assert not engine.device_busy([0, 1])
    assert not engine.host_busy([2])
    assert engine.busy_device_pages() == {2, 3}
    assert engine.busy_host_pages() == {0, 1}
    assert engine.poll() == [Completion(ticket)]
    assert engine.poll() == []
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == frozenset() == engine.busy_host_pages()
    assert engine.stats.bytes[Direction.D2H] == 2 * engine.device.layout.page_bytes


def test_overlapping_tickets_keep_pages_busy_until_both_are_reported() -> None:
    engine = FaultyCopyEngine(make(), delay=1)
    first = engine.start_write([2], [0])
    assert engine.poll() == []
    second = engine.start_load([0], [5])
    assert [c.ticket for c in engine.poll()] == [first]
    assert engine.host_busy([0])
    assert [c.ticket for c in engine.poll()] == [second]
    assert not engine.host_busy([0])


NO_SEQUENCE = "copy: pages must be a sequence (a list or tuple), got"


@pytest.mark.parametrize(
    ("src", "dst", "error", "message"),
    [
        ([1, 2], [0], ValueError, "copy: 2 source pages but 1 destination pages"),
        ([1, 2], [0, 0], ValueError, "copy: a destination page is listed twice"),
        ([8], [0], ForeignSlot, "device pool: page 8 outside 0..7"),
        ([0], [-1], ForeignSlot, "host pool: page -1 outside 0..7"),
        ([1.5], [2], NotASlot, "device pool: page 1.5 is not an int"),
        ([True], [2], NotASlot, "device pool: page True is not an int"),
        ([0, 1], [2, False], NotASlot, "host pool: page False is not an int"),
        ([0], [[1]], NotASlot, "host pool: page [1] is not an int"),
        ([9, True], [0, 1], NotASlot, "device pool: page True is not an int"),  # a bool first
        ([0, 1], (2, 0.0), NotASlot, "host pool: page 0.0 is not an int"),
        ([torch.tensor(8)], [0], ForeignSlot, "device pool: page 8 outside 0..7"),
        ([torch.tensor([1, 2])], [0], NotASlot, "device pool: page tensor([1, 2]) is not an int"),
        (torch.tensor([0, 1]), [2, 3], BadArgument, f"{NO_SEQUENCE} Tensor"),
        ([0, 1], torch.tensor([2, 3]), BadArgument, f"{NO_SEQUENCE} Tensor"),
        ([0], {1}, BadArgument, f"{NO_SEQUENCE} set"),
        (b"\x00", [1], BadArgument, f"{NO_SEQUENCE} bytes"),
    ],
)
def test_bad_copies_are_refused_before_anything_starts(
    src: list[int], dst: list[int], error: type[Exception], message: str
) -> None:
    engine = make()
    with pytest.raises(error, match=re.escape(message)) as info:
        engine.start_write(src, dst)
    assert str(info.value) == message
    assert engine.in_flight() == []
    assert engine.poll() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()


def test_an_array_of_pages_is_refused_as_no_sequence() -> None:
    """A numpy array raised numpy's ValueError (no truth value), a tensor torch's RuntimeError."""
    np = pytest.importorskip("numpy")
    engine = make()
    arrays: list[tuple[Any, Any, str]] = [
        (np.array([0, 1]), [2, 3], "ndarray"),
        ([0, 1], torch.tensor([2, 3]), "Tensor"),
    ]
    for start in (engine.start_write, engine.start_load):
        for src, dst, kind in arrays:
            with pytest.raises(BadArgument) as caught:
                start(src, dst)
            assert str(caught.value) == f"{NO_SEQUENCE} {kind}"
    assert engine.in_flight() == []


def test_numpy_and_tensor_integer_pages_are_copied_as_the_ints_they_stand_for() -> None:
    """In-range pages the allocator takes were refused as outside the pool.

    The ticket holds the ints, so the busy pages compare with the cache's ints
    (a 0-d tensor hashes by identity, and would never have looked busy).
    """
    np = pytest.importorskip("numpy")
    tensor: Any = torch.tensor  # pages are typed ints; these stand for ints
    engine = make()
    engine.device.fill([1], 7)
    engine.device.fill([2], 9)
    ticket = engine.start_write([np.int64(1), tensor(2)], (np.int32(5), tensor([6])))
    assert (ticket.src_pages, ticket.dst_pages) == ((1, 2), (5, 6))
    assert all(type(p) is int for p in (*ticket.src_pages, *ticket.dst_pages))
    assert engine.host_busy([5])
    assert engine.device_busy([2])
    with pytest.raises(BadArgument, match="host page 6 is still in use"):
        engine.start_write([3], [6])
    assert [c.ok for c in engine.drain()] == [True]
    assert torch.equal(engine.host.read([5, 6]), engine.device.read([1, 2]))
    load = engine.start_load([np.int64(5)], [tensor(7)])
    assert (load.src_pages, load.dst_pages) == ((5,), (7,))
    assert [c.ok for c in engine.drain()] == [True]
    assert torch.equal(engine.device.read([7]), engine.device.read([1]))


@pytest.mark.parametrize("delay", [0, 2])
def test_a_busy_destination_is_refused_until_its_copy_is_reported(delay: int) -> None:
    engine = FaultyCopyEngine(make(), delay=delay)
    engine.start_write([1], [2])
    for polls in range(delay + 1):
        if polls:
            assert engine.poll() == []  # done in the inner engine, acknowledgement held
        with pytest.raises(ValueError, match=re.escape("copy: host page 2 is still in use")):
            engine.start_write([3], [2])  # write after write
        with pytest.raises(ValueError, match=re.escape("copy: device page 1 is still in use")):
            engine.start_load([0], [1])  # write after read
    assert len(engine.poll()) == 1
    engine.start_write([3], [2])
    engine.start_load([0], [1])
    assert len(engine.drain()) == 2


def test_a_launch_that_raises_anything_fails_its_tickets_and_leaves_nothing_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only a RuntimeError: a ValueError at launch must not strand the pages busy."""
    engine = make()

    def broken(dst: object, src: object, non_blocking: bool) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(staging, "_copy", broken)
    ticket = engine.start_write([0, 1], [0, 1])
    (done,) = engine.poll()
    assert (done.ticket, done.ok) == (ticket, False)
    assert str(done.error) == "copy 1 (d2h) failed: ValueError: boom"
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    monkeypatch.undo()
    engine.start_write([2, 3], [0, 1])  # the host pages are free again
    assert [c.ok for c in engine.drain()] == [True]


def test_a_launch_that_raises_is_reported_as_a_failed_ticket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = make()

    def broken(dst: object, src: object, non_blocking: bool) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(staging, "_copy", broken)  # the one copy_ of page 0 into page 1
    ticket = engine.start_load([0], [1])
    assert engine.host_busy([0])
    (done,) = engine.poll()
    assert done.ticket == ticket
    assert not done.ok
    assert str(done.error) == "copy 1 (h2d) failed: boom"
    assert engine.stats.failures[Direction.H2D] == 1


def _interrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next copy step raise KeyboardInterrupt (Ctrl-C while torch copies), then work."""
    real, armed = staging._copy, [True]  # noqa: SLF001

    def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt("Ctrl-C")
        real(dst, src, non_blocking)

    monkeypatch.setattr(staging, "_copy", copy)


def test_an_interrupt_inside_a_launch_fails_its_tickets_and_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch was taken off the queue before the interrupt: its tickets were never reported."""
    engine = make()
    ticket = engine.start_write([0, 1], [0, 1])
    _interrupting(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        engine.poll()  # submits the backup: its copy is interrupted
    assert engine.in_flight() == [ticket]  # still to be reported
    (done,) = engine.poll()
    assert (done.ticket, done.ok) == (ticket, False)
    assert str(done.error) == "copy 1 (d2h) failed: KeyboardInterrupt: Ctrl-C"
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    engine.start_write([2, 3], [0, 1])  # the host pages are free again
    assert [c.ok for c in engine.drain()] == [True]


@pytest.mark.parametrize("interrupted", ["backup", "load"])
def test_an_interrupt_as_a_load_is_submitted_starts_no_load(
    monkeypatch: pytest.MonkeyPatch, interrupted: str
) -> None:
    """start_load raises: the load is taken back, the backup submitted before it fails.

    Whether the backup's copy or the load's own was interrupted, the caller
    never got the load's ticket, so none may be left to report it.
    """
    engine = make()
    backup = engine.start_write([0, 1], [0, 1])
    if interrupted == "load":
        engine.submit()
    _interrupting(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        engine.start_load([4], [4])
    assert engine.in_flight() == [backup]
    assert not engine.host_busy([4])
    assert not engine.device_busy([4])
    done = engine.drain()
    assert [(c.ticket, c.ok) for c in done] == [(backup, interrupted == "load")]
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    load = engine.start_load([4], [4])  # the pages were given back: it starts, and lands
    assert [(c.ticket, c.ok) for c in engine.drain()] == [(load, True)]


class _FlakyStreams(FakeStreams):
    """Fake streams whose next event, or next stream wait, fails as a CUDA launch error does."""

    fail: str | None = None

    def new_event(self) -> FakeEvent:
        if self.fail == "event":
            self.fail = None
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().new_event()

    def new_stream(self, device: torch.device) -> FakeStream:
        streams = self

        class Side(FakeStream):
            def wait_event(self, event: FakeEvent) -> None:
                if streams.fail == "wait" and self in streams.streams[:2]:  # a direction's
                    streams.fail = None
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                super().wait_event(event)

        stream = Side(device, f"side {len(self.streams)}")
        self.streams.append(stream)
        return stream


@pytest.mark.parametrize("where", ["event", "wait"])
def test_a_launch_error_outside_the_copy_fails_the_batch_and_leaves_nothing_busy(
    where: str,
) -> None:
    """Recording the batch's event, or making its stream wait, can raise too."""
    layout = KVLayout(layers=1, heads=1, head_dim=8, dtype=torch.float16, page_size=2)
    streams = _FlakyStreams(max_polls=0)
    engine = CopyEngine(
        device_pool(layout, 8, torch.device("cpu")), host_pool(layout, 8), streams=streams
    )
    backup = engine.start_write([0, 1], [0, 1])
    streams.fail = where
    load = engine.start_load([5], [5])  # submits the backup first: its launch fails
    done = engine.drain()
    assert [(c.ticket, c.ok) for c in done] == [(backup, False), (load, True)]
    assert str(done[0].error) == (
        "copy 1 (d2h) failed: CUDA error: an illegal memory access was encountered"
    )
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    engine.start_write([2], [0])  # the failed backup's host page is free again
    assert [c.ok for c in engine.drain()] == [True]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_launch_that_fails_part_way_poisons_its_whole_destination(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """The first chunk landed and the second raised: no page may read as the copy's KV."""
    engine = make(staging_pages=1)  # one page a chunk; pages 0 and 2 are two chunks
    engine.host.tensor.view(torch.uint8).random_(0, 256)
    real, calls = staging._copy, []  # noqa: SLF001

    def second_fails(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise RuntimeError("boom")
        real(dst, src, non_blocking)

    monkeypatch.setattr(staging, "_copy", second_fails)
    pool = engine.host if direction == "d2h" else engine.device
    neighbour = raw(pool, [1]).clone()
    start = engine.start_write if direction == "d2h" else engine.start_load
    ticket = start([0, 2], [0, 2])
    assert not engine.wait([ticket.id])  # the launch failed: compute must not read the pages
    (done,) = engine.poll()
    assert (done.ticket, done.ok) == (ticket, False)
    assert str(done.error) == f"copy 1 ({direction}) failed: boom"
    assert len(calls) == 2  # the first chunk was copied before the second raised
    assert bool((raw(pool, [0, 2]) == POISON).all())
    assert torch.equal(raw(pool, [1]), neighbour)
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()


class _FailingRun(FakeStreams):
    """Fake streams whose ``fail_at``-th ``run_on`` raises, as a kernel launch that fails does."""

    fail_at = 0
    runs = 0

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        self.runs += 1
        if self.runs == self.fail_at:
            raise RuntimeError("CUDA error: launch failure")
        super().run_on(stream, work)


def test_a_failed_loads_poison_is_queued_on_its_stream_before_its_event() -> None:
    """A stream made to wait for the load reads the poison; compute queues none of it."""
    fake = _FailingRun(max_polls=2)
    fake.fail_at = 3  # chunk 0's two stages are queued, chunk 1's first is not
    engine = make("fake", staging_pages=1)
    engine = CopyEngine(
        engine.device, engine.host, staging_bytes=engine.device.layout.page_bytes, streams=fake
    )
    dev = engine.device
    neighbour = raw(dev, [1]).clone()
    ticket = engine.start_load([0, 2], [0, 2])
    assert fake.runs == 4  # the poison's fill after the failed launch
    compute = fake.current_stream(torch.device("cpu"))
    assert not engine.wait([ticket.id], compute)
    seen: list[bool] = []
    compute.enqueue(lambda: seen.append(bool((raw(dev, [0, 2]) == POISON).all())))
    compute.synchronize()
    assert seen == [True]
    (done,) = engine.drain()
    assert str(done.error) == "copy 1 (h2d) failed: CUDA error: launch failure"
    assert torch.equal(raw(dev, [1]), neighbour)


def test_a_backup_whose_queued_work_fails_poisons_its_host_pages_when_reported() -> None:
    """queue_after's work that raises fails the copy as a launch does, poison included."""
    engine = make()

    def broken() -> None:
        raise ValueError("no room")

    ticket = engine.start_write([3], [4])
    engine.queue_after(ticket, broken)
    (done,) = engine.poll()
    assert str(done.error) == "copy 1 (d2h) failed: ValueError: no room"
    assert bool((raw(engine.host, [4]) == POISON).all())


def test_a_failed_backup_is_reported_when_its_poison_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report is what frees the copy's nodes: a poison that fails must not lose it."""
    engine = make()

    def broken() -> None:
        raise ValueError("no room")

    def unwritable(pages: object, byte: int) -> None:
        raise RuntimeError("host memory unwritable")

    first = engine.start_write([3], [4])
    engine.queue_after(first, broken)
    second = engine.start_write([5], [6])
    monkeypatch.setattr(engine.host, "fill", unwritable)
    done = engine.poll()
    assert [c.ticket for c in done] == [first, second]
    assert str(done[0].error) == "copy 1 (d2h) failed: ValueError: no room"
    assert done[1].ok
    assert engine.in_flight() == []
    assert engine.stats.poison_failures == {Direction.D2H: 1}  # given back unread: counted


def test_an_injected_failure_is_reported_when_its_poison_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault injector reports as the engine does: the poll's other copy is not lost."""
    engine = FaultyCopyEngine(make(), fail=(1,))
    first, second = engine.start_write([3], [4]), engine.start_write([5], [6])

    def unwritable(pages: object, byte: int) -> None:
        raise RuntimeError("host memory unwritable")

    monkeypatch.setattr(engine.inner.host, "fill", unwritable)
    done = engine.poll()
    assert [c.ticket for c in done] == [first, second]
    assert str(done[0].error) == "injected failure of copy 1"
    assert done[1].ok
    assert engine.inner.stats.poison_failures == {Direction.D2H: 1}


def interrupt_first_fill(monkeypatch: pytest.MonkeyPatch, pool: KVPool) -> None:
    """Make ``pool``'s first poison raise ``KeyboardInterrupt`` (a Ctrl-C), the later ones work."""
    fill, calls = pool.fill, []

    def interrupted(pages: Sequence[int], byte: int) -> None:
        calls.append(pages)
        if len(calls) == 1:
            raise KeyboardInterrupt
        fill(pages, byte)

    monkeypatch.setattr(pool, "fill", interrupted)


def test_a_poll_a_poison_interrupts_loses_no_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while a failed backup is poisoned: the next poll poisons it, then reports all.

    The poll had taken both copies off the engine; lost, their nodes would
    stay ``writing`` for good.
    """
    engine = make()

    def broken() -> None:
        raise ValueError("no room")

    first = engine.start_write([3], [4])
    engine.queue_after(first, broken)
    second = engine.start_write([5], [6])
    interrupt_first_fill(monkeypatch, engine.host)
    with pytest.raises(KeyboardInterrupt):
        engine.poll()
    assert engine.in_flight() == [first, second]  # finished, not reported yet
    done = engine.poll()
    assert [c.ticket for c in done] == [first, second]
    assert str(done[0].error) == "copy 1 (d2h) failed: ValueError: no room"
    assert done[1].ok
    assert bool((raw(engine.host, [4]) == POISON).all())  # poisoned before the report
    assert engine.stats.poison_failures == {}
    assert engine.in_flight() == []
    assert engine.poll() == []


def test_an_injected_failure_a_poison_interrupts_is_delivered_at_the_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FaultyCopyEngine(make(), fail=(1,))
    first, second = engine.start_write([3], [4]), engine.start_write([5], [6])
    interrupt_first_fill(monkeypatch, engine.inner.host)
    with pytest.raises(KeyboardInterrupt):
        engine.poll()
    assert engine.in_flight() == [first, second]
    done = engine.poll()
    assert [c.ticket for c in done] == [first, second]
    assert str(done[0].error) == "injected failure of copy 1"
    assert done[1].ok
    assert bool((raw(engine.inner.host, [4]) == POISON).all())
    assert engine.poll() == []


def test_poison_destination_takes_a_ticket() -> None:
    engine = make()
    with pytest.raises(BadArgument) as caught:
        engine.poison_destination([1])  # type: ignore[arg-type]
    assert str(caught.value) == "copy: poison_destination takes a Ticket, got list"


@pytest.mark.parametrize("seed", range(12))
def test_one_directions_tickets_are_reported_in_start_order(seed: int) -> None:
    """An event queried after an earlier one of its stream may find later work done."""
    engine = make("fake", dev_pages=8)
    engine = CopyEngine(engine.device, engine.host, streams=FakeStreams(seed=seed, max_polls=3))
    started = [engine.start_load([p], [p]).id for p in range(4)]
    reported: list[int] = []
    while engine.in_flight():
        reported.extend(c.ticket.id for c in engine.poll())
    assert reported == started


def test_a_chunked_launch_that_fails_midway_is_covered_by_its_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the first stream queued before the failure must run before the pages are free."""
    engine = make("fake", staging_pages=1)
    runs: list[object] = []
    real_run, real_wait = staging.Mover._run, FakeStream.wait_stream  # noqa: SLF001

    def run(self: staging.Mover, stream: Stream | None, work: Callable[[], None] | None) -> None:
        runs.append(stream)
        real_run(self, stream, work)

    def wait(self: FakeStream, other: FakeStream) -> None:
        if len(runs) == 3:  # chunk 1's gather is queued; its stream's wait fails
            runs.append(None)
            raise RuntimeError("CUDA error: launch failure")
        real_wait(self, other)

    monkeypatch.setattr(staging.Mover, "_run", run)
    monkeypatch.setattr(FakeStream, "wait_stream", wait)
    ticket = engine.start_write([0, 1], [0, 1])
    (done,) = engine.drain()
    assert (done.ticket, done.ok) == (ticket, False)
    assert str(done.error) == "copy 1 (d2h) failed: CUDA error: launch failure"
    streams = {id(s): s for s in runs if isinstance(s, FakeStream)}
    assert len(streams) == 2
    assert [s.pending for s in streams.values()] == [0, 0]


class Driver:
    """A stand-in for the cache: write nodes through, free on failure, load back."""

    def __init__(self, engine: FaultyCopyEngine) -> None:
        self.engine = engine
        self.dev = engine.inner.device
        self.host = engine.inner.host
        self.backed: dict[int, list[int]] = {}
        self.loaded: dict[int, list[int]] = {}
        self.owner: dict[int, int] = {}
        self.failures = 0

    def write_all(self, nodes: dict[int, list[int]]) -> None:
        for node, dev_pages in nodes.items():
            host_pages = self.host.allocator.alloc(len(dev_pages) * 4, owner=node)
            ticket = self.engine.start_write(dev_pages, host_pages)
            self.owner[ticket.id] = node
        self.settle(self.backed)

    def load_all(self) -> None:
        for node, host_pages in self.backed.items():
            dev_pages = self.dev.allocator.alloc(len(host_pages) * 4, owner=node)
            ticket = self.engine.start_load(host_pages, dev_pages)
            self.owner[ticket.id] = node
        self.settle(self.loaded)

    def settle(self, done: dict[int, list[int]]) -> None:
        while self.engine.in_flight():
            for c in self.engine.poll():
                self.ack(c, done)

    def ack(self, c: Completion, done: dict[int, list[int]]) -> None:
        node = self.owner.pop(c.ticket.id)
        pool = self.host if c.ticket.direction is Direction.D2H else self.dev
        dst = list(c.ticket.dst_pages)
        busy = self.engine.host_busy if pool is self.host else self.engine.device_busy
        assert not busy(dst)  # reported, so the pages may be freed now
        if c.ok:
            done[node] = dst
        else:
            self.failures += 1
            pool.allocator.free(dst, owner=node)


def own_scattered(pool: KVPool, sizes: dict[int, int]) -> dict[int, list[int]]:
    """Give each node its pages, with a filler page between nodes so they scatter."""
    nodes = {}
    for node, n in sizes.items():
        pool.allocator.alloc(4, owner=99)
        nodes[node] = pool.allocator.alloc(4 * n, owner=node)
    return nodes


@pytest.mark.parametrize("fail_at", range(1, 7))
def test_a_failure_at_any_copy_leaks_nothing_and_keeps_copied_data(fail_at: int) -> None:
    inner = make(dev_pages=16)
    nodes = own_scattered(inner.device, {10: 2, 11: 1, 12: 3})
    expected = {node: raw(inner.device, pages) for node, pages in nodes.items()}
    driver = Driver(FaultyCopyEngine(inner, fail=[fail_at], delay=1, shuffle=True, seed=fail_at))
    free_dev_before = inner.device.allocator.free_slots
    driver.write_all(nodes)
    driver.load_all()
    assert driver.failures == 1
    for pool in (inner.device, inner.host):
        pool.allocator.check()
    assert inner.host.allocator.used_slots == 4 * sum(len(p) for p in driver.backed.values())
    assert inner.device.allocator.free_slots == free_dev_before - 4 * sum(
        len(p) for p in driver.loaded.values()
    )
    assert inner.busy_device_pages() == frozenset() == inner.busy_host_pages()
    for node, host_pages in driver.backed.items():
        assert torch.equal(raw(inner.host, host_pages), expected[node])
    for node, dev_pages in driver.loaded.items():
        assert torch.equal(raw(inner.device, dev_pages), expected[node])
    assert len(driver.backed) + len(driver.loaded) == 2 * len(nodes) - 1 - (fail_at <= 3)


def test_failed_copy_poisons_its_destination() -> None:
    engine = FaultyCopyEngine(make(), fail=[1])
    engine.start_write([3], [4])
    (done,) = engine.poll()
    assert str(done.error) == "injected failure of copy 1"
    assert bool((engine.inner.host.pages[4] == POISON).all())


def test_refused_copy_starts_nothing() -> None:
    engine = FaultyCopyEngine(make(), refuse=[2])
    engine.start_write([0], [0])
    with pytest.raises(CopyFailed, match=r"^injected refusal of copy 2$"):
        engine.start_write([1], [1])
    assert [t.src_pages for t in engine.in_flight()] == [(0,)]
    assert not engine.host_busy([1])
    engine.start_write([1], [1])
    assert engine.started == 3


def test_delayed_acks_stay_busy_and_drain_delivers_them() -> None:
    engine = FaultyCopyEngine(make(), delay=3)
    ticket = engine.start_write([2], [1])
    assert engine.poll() == []
    assert engine.poll() == []
    assert engine.in_flight() == [ticket]
    assert engine.device_busy([2])
    assert engine.host_busy([1])
    assert engine.busy_device_pages() == {2}
    assert engine.busy_host_pages() == {1}
    assert [c.ticket for c in engine.drain()] == [ticket]
    assert not engine.device_busy([2])


def test_shuffled_acks_arrive_once_each_out_of_order() -> None:
    engine = FaultyCopyEngine(make(host_pages=8), shuffle=True, seed=3)
    tickets = [engine.start_write([p], [p]) for p in range(8)]
    got = [c.ticket for c in engine.poll()]
    assert sorted(got, key=lambda t: t.id) == tickets
    assert got != tickets
    assert engine.poll() == []


def test_copier_builds_a_new_faulty_engine_over_each_caches_pools() -> None:
    """``FaultyCopyEngine.copier`` is a ``CacheConfig(copier=...)`` factory: an engine a call."""
    pools = make()
    build = FaultyCopyEngine.copier(fail=[2], refuse=[3], delay=1, poison=False)
    first, second = build(pools.device, pools.host), build(pools.device, pools.host)
    assert type(first) is FaultyCopyEngine
    assert type(first.inner) is CopyEngine
    assert first.inner is not second.inner
    assert first.inner.device is pools.device
    assert first.inner.host is pools.host
    faults = (first.fail, first.refuse, first.delay, first.shuffle, first.poison)
    assert faults == (frozenset({2}), frozenset({3}), 1, False, False)
    first.start_write([0], [0])
    assert (first.started, second.started) == (1, 0)


def test_copier_passes_the_seed_of_the_order() -> None:
    direct = FaultyCopyEngine(make(host_pages=8), shuffle=True, seed=3)
    pools = make(host_pages=8)
    built = FaultyCopyEngine.copier(shuffle=True, seed=3)(pools.device, pools.host)
    orders = []
    for engine in (direct, built):
        for p in range(8):
            engine.start_write([p], [p])
        orders.append([c.ticket.src_pages for c in engine.poll()])
    assert orders[0] == orders[1] != sorted(orders[0])


class _Subclass(FaultyCopyEngine):
    """A subclass at module level, so that its factory pickles."""


def test_copier_on_a_subclass_builds_the_subclass_and_pickles() -> None:
    build = pickle.loads(pickle.dumps(_Subclass.copier(delay=2)))
    pools = make()
    engine = build(pools.device, pools.host)
    assert type(engine) is _Subclass
    assert engine.delay == 2


def test_copier_refuses_an_unknown_fault_when_called() -> None:
    """A misspelt fault is named where it is written, not when a cache builds its engine."""
    with pytest.raises(TypeError) as caught:
        FaultyCopyEngine.copier(fial=[1], delay=1, bogus=2)  # type: ignore[call-arg]
    assert str(caught.value) == "FaultyCopyEngine.copier got unknown faults: bogus, fial"


def test_copier_takes_exactly_the_keywords_of_the_engine() -> None:
    """``Faults`` types ``copier``'s keywords; it must name every keyword of the initialiser."""
    params = inspect.signature(FaultyCopyEngine).parameters.values()
    assert Faults.__optional_keys__ == {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    assert Faults.__required_keys__ == frozenset()


def test_the_faulty_engine_takes_every_method_and_parameter_of_the_engine() -> None:
    """It dropped ``stream=`` of the starts (and ``submit``), so a faulted run lost the ordering."""

    def methods(cls: type) -> dict[str, list[tuple[str, object, object]]]:
        public = [n for n, f in vars(cls).items() if callable(f) and not n.startswith("_")]
        return {
            name: [
                (p.name, p.kind, p.default)
                for p in inspect.signature(getattr(cls, name)).parameters.values()
            ]
            for name in public
        }

    faulty = methods(FaultyCopyEngine)
    for name, params in methods(CopyEngine).items():
        assert faulty.get(name) == params, name


@pytest.mark.parametrize("direction", ["write", "load"])
def test_a_faulty_engine_orders_its_copies_after_the_stream_it_is_given(direction: str) -> None:
    engine, _, forward = _ordered()
    faulty = FaultyCopyEngine(engine)
    engine.host.words[1].fill_(2)
    engine.device.words[6].fill_(1)
    read = torch.empty_like(engine.device.words[6])

    def compute() -> None:  # writes page 3, reads page 6: both queued before the copy starts
        engine.device.words[3].fill_(9)
        read.copy_(engine.device.words[6])

    forward.enqueue(compute)
    if direction == "write":
        faulty.start_write([3], [4], stream=forward)
    else:
        faulty.start_load([1], [6], stream=forward)
    assert all(c.ok for c in faulty.drain())
    forward.synchronize()
    if direction == "write":  # the backup read what the forward pass wrote
        assert bool((engine.host.words[4] == 9).all())
    else:  # the load overwrote page 6 only after the forward pass had read it
        assert bool((read == 1).all())
        assert bool((engine.device.words[6] == 2).all())
    faulty.close()


def test_a_faulty_engine_refuses_a_bad_stream_as_the_engine_does_and_counts_nothing() -> None:
    """A start the inner engine refused counted, shifting the positions of later faults."""
    faulty = FaultyCopyEngine(make(), fail=[1])
    for start in (faulty.start_write, faulty.start_load):
        with pytest.raises(BadArgument) as caught:
            start([0], [0], stream=42)
        assert str(caught.value) == (
            "copy engine: stream must be a stream (torch.cuda.Stream or the Streams' own), got int"
        )
    with pytest.raises(ForeignSlot):  # refused by the inner engine: no copy started either
        faulty.start_write([99], [0])
    assert faulty.started == 0
    assert faulty.in_flight() == []
    ticket = faulty.start_write([0], [0])  # still the first copy: the one that fails
    assert [(c.ticket, str(c.error)) for c in faulty.drain()] == [
        (ticket, "injected failure of copy 1")
    ]
    faulty.close()


def test_bench_copies_reports_each_path() -> None:
    result = bench_copies(4, layers=2, heads=2, head_dim=8, reps=2, device=torch.device("cpu"))
    assert (result.device, result.pages, result.reps) == ("cpu", 4, 2)
    assert result.nbytes == 4 * 16 * 2 * 2 * 2 * 8 * 2
    assert result.write_gbps > 0
    assert result.raw_gbps > 0
    assert result.load_gbps > 0
    assert result.ratio == result.write_gbps / result.raw_gbps
    assert result.ceiling_gbps is None
    assert "engine / raw" in result.render()


def test_bench_copies_drives_both_directions_through_the_machines() -> None:
    result = run_copy_bench(quick=True, reps=1)
    assert (result.nodes, result.nbytes) == (32, 32 * 2 * 2**20)  # 2 MiB pages
    assert result.machine_gbps > 0
    assert result.load_gbps > 0
    assert result.raw_gbps > 0
    if not CUDA:
        assert result.shares() == {}
        assert "ceiling" not in result.format()
    assert "load-backs (load -> copy -> poll -> load_done)" in result.format()
    assert result.round_trip_exact is True
    assert "round trip (backup, evict, load back): bytes equal" in result.format()


def test_bench_copies_finds_a_round_trip_that_loads_back_the_wrong_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load = bench_copies_module._machine_load  # noqa: SLF001

    def corrupting(cache: HiCache, chains: list[list[TreeNode]]) -> None:
        load(cache, chains)
        cache.tiers.device.words.bitwise_not_()  # every loaded page now differs

    monkeypatch.setattr(bench_copies_module, "_machine_load", corrupting)
    result = run_copy_bench(quick=True, reps=1)
    assert result.round_trip_exact is False
    assert "round trip (backup, evict, load back): BYTES DIFFER" in result.format()


@pytest.mark.parametrize(("exact", "status"), [(True, 0), (None, 0), (False, 1)])
def test_bench_copies_command_fails_on_a_wrong_round_trip(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exact: bool | None,
    status: int,
) -> None:
    canned = CopyBenchResult("cpu", 8, 2**20, 4.0, 4.0, 4.0, None, None, exact)
    monkeypatch.setattr(bench_copies_module, "run_copy_bench", lambda quick: canned)
    assert main(["bench", "copies", "--quick"]) == status
    assert capsys.readouterr().out.startswith(canned.format() + "\n")


def test_bench_copies_reports_each_direction_against_its_ceiling() -> None:
    result = CopyBenchResult("cuda:0", 8, 2**30, 40.0, 10.0, 45.0, 50.0, 50.0)
    assert result.shares() == {"d2h": 0.8, "h2d": 0.9}
    text = result.format()
    assert (
        "d2h: one large pinned copy_ (ceiling)    50.00 GB/s; machine = 80% (target >= 85%): MISSED"
        in text
    )
    assert (
        "h2d: one large pinned copy_ (ceiling)    50.00 GB/s; machine = 90% (target >= 85%): met"
        in text
    )
    assert "round trip" not in text  # not checked


def test_ceiling_copy_moves_flat_bytes_between_pools_of_other_layouts() -> None:
    layout = KVLayout(layers=2, heads=2, head_dim=8, page_size=4, dtype=torch.float16)
    dev = device_pool(layout, 4, torch.device("cpu"))
    host = host_pool(layout, 8, pin=False)  # page-first, and twice the device's size
    dev.tensor.copy_(torch.randn(dev.tensor.shape).to(dev.tensor.dtype))
    host.tensor.zero_()
    ceiling_copy(dev, host, dev.nbytes)()
    flat = host.tensor.view(-1).view(torch.uint8)
    assert torch.equal(flat[: dev.nbytes], dev.tensor.view(-1).view(torch.uint8))
    assert not flat[dev.nbytes :].any()
    with pytest.raises(ValueError, match=f"ceiling copy of {host.nbytes} bytes"):
        ceiling_copy(dev, host, host.nbytes)


@pytest.mark.gpu
@needs_cuda
def test_copy_benchmarks_measure_the_ceiling_on_cuda() -> None:
    small = bench_copies(4, layers=2, heads=2, head_dim=8, reps=2, device=torch.device("cuda"))
    assert small.ceiling_gbps is not None
    assert small.ceiling_gbps > 0
    result = run_copy_bench(quick=True, reps=2)
    assert result.ceiling_gbps is not None
    assert result.ceiling_gbps > 0
    assert result.ceiling_load_gbps is not None
    assert result.ceiling_load_gbps > 0
    assert set(result.shares()) == {"d2h", "h2d"}


@pytest.mark.gpu
@needs_cuda
def test_d2h_waits_for_the_compute_stream() -> None:
    engine = make("cuda", torch.float32, dev_pages=64, host_pages=64)
    dev = engine.device.tensor
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the compute stream busy, then write the KV last
        big = big @ big / 4096
    dev.fill_(3.0)
    engine.start_write(list(range(64)), list(range(64)))
    assert all(c.ok for c in engine.drain())
    assert bool((engine.host.read(list(range(64))) == 3.0).all())


@pytest.mark.gpu
@needs_cuda
def test_cuda_poll_never_blocks_and_reports_once() -> None:
    engine = make("cuda", dev_pages=64, host_pages=64)
    ticket = engine.start_write(list(range(64)), list(range(64)))
    reported = engine.poll()
    reported += engine.drain()
    assert [c.ticket for c in reported] == [ticket]
    assert engine.poll() == []
    assert engine.host.tensor.is_pinned()


@pytest.mark.parametrize("device", DEVICES)
def test_close_drains_refuses_new_copies_and_is_idempotent(device: str) -> None:
    engine = make(device)
    before = raw(engine.device, [1, 2])
    engine.start_write([1, 2], [3, 4])
    engine.close()
    assert engine.closed
    assert engine.in_flight() == []
    assert engine.busy_host_pages() == frozenset()
    assert torch.equal(raw(engine.host, [3, 4]), before)
    with pytest.raises(CopyFailed) as caught:
        engine.start_load([3], [0])
    assert str(caught.value) == "copy engine closed: h2d copy refused"
    assert engine.in_flight() == []
    engine.close()
    assert engine.poll() == []
    assert engine.drain() == []


def test_a_closed_faulty_engine_drops_held_acknowledgements() -> None:
    engine = FaultyCopyEngine(make(), delay=5)
    engine.start_write([1], [1])
    assert engine.poll() == []
    assert engine.in_flight() != []
    engine.close()
    assert engine.in_flight() == []
    assert not engine.host_busy([1])


def test_wait_says_whether_the_copies_can_still_land(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that failed is known before any poll: wait says so, where it said nothing."""
    engine = make()
    good = engine.start_load([0], [0])
    assert engine.wait([good.id]) is True

    def broken(dst: object, src: object, non_blocking: bool) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(staging, "_copy", broken)
    bad = engine.start_load([1], [1])
    assert engine.wait([bad.id]) is False
    assert engine.wait([good.id]) is True
    assert engine.wait([good.id, bad.id]) is False
    assert [c.ok for c in engine.poll()] == [True, False]
    assert engine.wait([bad.id]) is True  # reported: nothing left to wait for


# -- refused pools, and engines dropped unclosed ---------------------------------------------


LAYOUT = KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.float16, page_size=4)


@pytest.mark.parametrize(
    "other",
    [
        KVLayout(layers=3, heads=4, head_dim=2, dtype=torch.float16, page_size=4),  # same bytes
        KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.bfloat16, page_size=4),
        KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.float32, page_size=4),
        KVLayout(layers=3, heads=2, head_dim=4, dtype=torch.float16, page_size=8),
        KVLayout.mla(layers=3, latent_dim=8, dtype=torch.float16, page_size=4),
    ],
    ids=["heads", "dtype", "wider", "page_size", "mla"],
)
def test_pools_of_two_layouts_are_refused_naming_both(other: KVLayout) -> None:
    dev = device_pool(LAYOUT, 4, torch.device("cpu"))
    host = host_pool(other, 4, pin=False)
    with pytest.raises(BadArgument) as caught:
        CopyEngine(dev, host)
    assert str(caught.value) == (
        f"copy engine: the device pool's layout {LAYOUT} (384 bytes a page) differs from "
        f"the host pool's {other} ({other.page_bytes} bytes a page)"
    )
    assert dev.allocator.free_pages == host.allocator.free_pages == 4


def test_pools_in_the_wrong_places_are_refused() -> None:
    cpu = torch.device("cpu")
    dev, host = device_pool(LAYOUT, 4, cpu), host_pool(LAYOUT, 4, pin=False)
    meta_shape = (4, LAYOUT.layers, LAYOUT.planes, LAYOUT.page_size, LAYOUT.heads, LAYOUT.head_dim)
    on_meta = KVPool(
        "host", LAYOUT, 4, torch.empty(meta_shape, dtype=LAYOUT.dtype, device="meta"), False
    )
    dev_meta = device_pool(LAYOUT, 4, torch.device("meta"))
    cases: list[tuple[object, object, str]] = [
        (dev, dev, "copy engine: host must be the host pool, got the device pool"),
        (host, dev, "copy engine: device must be the device pool, got the host pool"),
        (dev, dev.tensor, "copy engine: host must be a KVPool, got Tensor"),
        (None, host, "copy engine: device must be a KVPool, got NoneType"),
        (dev, on_meta, "copy engine: the host pool must be on the CPU, got meta"),
        (dev_meta, host, "copy engine: the device pool must be on cpu or cuda, got meta"),
    ]
    for device, hosted, message in cases:
        with pytest.raises(BadArgument) as caught:
            CopyEngine(device, hosted)  # type: ignore[arg-type]
        assert str(caught.value) == message


@pytest.mark.parametrize("bad", [0, -1, 1.5e6, True, "64"])
def test_staging_bytes_must_be_a_positive_int(bad: object) -> None:
    dev, host = device_pool(LAYOUT, 4, torch.device("cpu")), host_pool(LAYOUT, 4, pin=False)
    with pytest.raises(BadArgument) as caught:
        CopyEngine(dev, host, staging_bytes=bad)  # type: ignore[arg-type]
    assert str(caught.value) == f"copy engine: staging_bytes must be an int >= 1, got {bad!r}"


@pytest.mark.parametrize("bad", ["cuda", torch.cuda, object()], ids=["text", "module", "object"])
def test_streams_that_are_no_streams_are_refused_at_once(bad: object) -> None:
    """A wrong ``streams=`` failed at the first copy, with an AttributeError from deep inside."""
    dev, host = device_pool(LAYOUT, 4, torch.device("cpu")), host_pool(LAYOUT, 4, pin=False)
    with pytest.raises(BadArgument) as caught:
        CopyEngine(dev, host, streams=bad)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "copy engine: streams must provide new_stream, current_stream, new_event, run_on and "
        f"synchronize (a Streams), got {type(bad).__name__}"
    )
    assert dev.allocator.free_pages == host.allocator.free_pages == 4


class _ClaimsCuda(KVPool):
    """A CPU pool that says it is on CUDA: the engine's construction-time checks run on CPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_a_pageable_host_pool_for_a_cuda_device_pool_warns_once_at_construction() -> None:
    plain = device_pool(LAYOUT, 4, torch.device("cpu"))
    dev = _ClaimsCuda("device", LAYOUT, 4, plain.tensor, pinned=False)
    host = host_pool(LAYOUT, 4, pin=False)
    with pytest.warns(RuntimeWarning) as caught:
        CopyEngine(dev, host, streams=FakeStreams())
    assert [str(w.message) for w in caught] == [
        "copy engine: the host pool (4 pages) is not pinned, so every copy between it and "
        "cuda:0 blocks the host in submit() and poll(); allocate it with "
        "host_pool(..., pin=True), as Tiers does"
    ]
    assert caught[0].filename == __file__  # points at the caller


@pytest.mark.gpu
@needs_cuda
def test_a_pageable_host_pool_on_cuda_warns() -> None:
    dev = device_pool(LAYOUT, 4, torch.device("cuda"))
    with pytest.warns(
        RuntimeWarning, match=r"^copy engine: the host pool \(4 pages\) is not pinned"
    ):
        CopyEngine(dev, host_pool(LAYOUT, 4, pin=False))


def test_an_engine_dropped_unclosed_waits_for_its_copies_and_warns() -> None:
    fake = FakeStreams(max_polls=1000)  # nothing lands until something waits for it
    engine = make("fake")
    engine = CopyEngine(engine.device, engine.host, streams=fake)
    host, want = engine.host, raw(engine.device, [1, 2])
    engine.start_write([1, 2], [3, 4])
    engine.poll()
    assert fake.streams[0].pending  # queued on its stream, not run
    name = repr(engine)
    assert name == "CopyEngine(8 device pages on cpu, 8 host pages, FakeStreams)"
    with pytest.warns(ResourceWarning) as caught:
        del engine  # the last reference: the finalizer runs here
    assert [str(w.message) for w in caught] == [
        f"unclosed {name} dropped with 1 copies in flight: waited for them; "
        "call close() before dropping it"
    ]
    assert [s.pending for s in fake.streams[:2]] == [0, 0]
    assert torch.equal(raw(host, [3, 4]), want)


def test_a_closed_or_idle_engine_is_dropped_quietly() -> None:
    fake = FakeStreams(max_polls=1000)
    engine = make("fake")
    closed = CopyEngine(engine.device, engine.host, streams=fake)
    closed.start_write([1], [1])
    closed.close()
    synchronous = make()
    synchronous.start_write([1], [1])  # on the CPU nothing is queued: it never ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del closed, synchronous, engine
        gc.collect()


def test_tiers_dropped_unclosed_wait_for_their_copies() -> None:
    fake = FakeStreams(max_polls=1000)
    tiers = Tiers(
        CacheConfig(device="cpu", device_pages=4, page_size=2, copier=deferred_copier(streams=fake))
    )
    tiers.write_tokens([0, 1], [5, 6, 7, 8])
    want = raw(tiers.device, [0, 1])
    host = tiers.host
    tiers.copier.start_write([0, 1], [2, 3])
    tiers.copier.poll()
    with pytest.warns(
        ResourceWarning, match=r"^unclosed CopyEngine\(4 device pages on cpu, 8 host"
    ):
        del tiers  # the last reference: the engine's finalizer runs here
    assert torch.equal(raw(host, [2, 3]), want)


def test_every_refused_copy_is_a_typed_error_that_starts_nothing() -> None:
    engine = make()
    engine.start_write([1], [2])
    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: engine.start_write([1, 2], [0]), "copy: 2 source pages but 1 destination pages"),
        (lambda: engine.start_write([1, 3], [0, 0]), "copy: a destination page is listed twice"),
        (
            lambda: engine.start_write([3], [2]),
            "copy: host page 2 is still in use by an unreported copy",
        ),
        (
            lambda: engine.start_load([0], [1]),
            "copy: device page 1 is still in use by an unreported copy",
        ),
        (
            lambda: engine.start_write(iter([3]), [4]),  # type: ignore[arg-type]
            "copy: pages must be a sequence (a list or tuple), got list_iterator",
        ),
        (
            lambda: engine.start_load([3], 4),  # type: ignore[arg-type]
            "copy: pages must be a sequence (a list or tuple), got int",
        ),
    ]
    for refused, message in refusals:
        with pytest.raises(BadArgument) as caught:
            refused()
        assert str(caught.value) == message
        assert isinstance(caught.value, ValueError)  # what these raised before
        assert [t.id for t in engine.in_flight()] == [1]
    assert [c.ticket.id for c in engine.poll()] == [1]
    assert engine.start_write([3], [4]).id == 2  # no id was spent on a refusal


@pytest.mark.parametrize("bad", [1.0, True, "1", None, 2])
def test_wait_refuses_what_is_no_ticket_id(bad: object) -> None:
    engine = make("fake")
    engine.start_write([0], [0])
    with pytest.raises(BadArgument) as caught:
        engine.wait([1, bad])  # type: ignore[list-item]
    assert str(caught.value) == f"copy: cannot wait for ticket {bad!r}: no copy started with it"
    engine.close()


def test_tiers_reset_with_copies_in_flight_is_refused_and_changes_nothing() -> None:
    tiers = Tiers(CacheConfig(device="cpu", device_pages=4, page_size=2))
    device, host = tiers.alloc_device(2, owner=1), tiers.alloc_host(2, owner=1)
    tiers.copier.start_write(device, host)
    with pytest.raises(PageBusy) as caught:
        tiers.reset()
    assert str(caught.value) == (
        "tiers: reset refused: 1 copies in flight (ticket 1 first); drain the copy engine first"
    )
    assert tiers.device.allocator.owners[:2] == (1, 1)
    assert tiers.host.allocator.owners[:2] == (1, 1)
    tiers.copier.drain()
    tiers.reset()
    assert tiers.device.allocator.free_pages == 4


# -- ordering after the stream that wrote the pages (review B2) -----------------------


class _SwitchedStreams(FakeStreams):
    """Fake streams whose current stream can be switched, as ``torch.cuda.stream(s)`` does."""

    now: FakeStream | None = None

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.now if self.now is not None else super().current_stream(device)


def _ordered(**kwargs: object) -> tuple[CopyEngine, _SwitchedStreams, FakeStream]:
    """An engine on switchable fake streams, its streams, and a forward stream of its own."""
    engine = make("fake")
    streams = _SwitchedStreams(max_polls=0)
    ordered = CopyEngine(engine.device, engine.host, streams=streams, **kwargs)  # type: ignore[arg-type]
    return ordered, streams, FakeStream(torch.device("cpu"), "forward")


def _write_page(engine: CopyEngine, page: int, value: int) -> Callable[[], None]:
    def write() -> None:
        engine.device.words[page].fill_(value)

    return write


def test_a_backup_follows_the_stream_current_at_its_start_not_at_its_submission() -> None:
    """SGLang's overlap: KV written on the forward stream, the batch submitted under another."""
    engine, streams, forward = _ordered()
    streams.now = forward
    forward.enqueue(_write_page(engine, 2, 7))  # the forward pass writes page 2, queued
    ticket = engine.start_write([2], [5])
    streams.now = None  # submitted later, under the default stream
    assert [(c.ticket, c.ok) for c in engine.drain()] == [(ticket, True)]
    assert bool((engine.host.words[5] == 7).all())
    assert torch.equal(raw(engine.host, [5]), raw(engine.device, [2]))
    engine.close()


@pytest.mark.parametrize("how", ["stream", "compute_stream"])
def test_a_copy_follows_the_stream_it_is_given(how: str) -> None:
    engine, _, forward = _ordered()
    if how == "compute_stream":
        engine, _, _ = _ordered(compute_stream=forward)
    forward.enqueue(_write_page(engine, 3, 9))
    given = {"stream": forward} if how == "stream" else {}
    engine.start_write([3], [4], **given)
    assert all(c.ok for c in engine.drain())
    assert bool((engine.host.words[4] == 9).all())
    engine.close()


def test_a_load_does_not_overwrite_pages_a_stream_given_to_wait_still_reads() -> None:
    """Pages loaded, read on a consumer stream, freed and loaded into again before it ran."""
    engine, _, consumer = _ordered()
    engine.host.words[0].fill_(1)
    engine.host.words[1].fill_(2)
    first = engine.start_load([0], [6])
    assert engine.wait([first.id], stream=consumer)
    read = torch.empty_like(engine.device.words[6])

    def compute() -> None:  # reads what the first load wrote
        read.copy_(engine.device.words[6])

    consumer.enqueue(compute)
    assert all(c.ok for c in engine.drain())
    engine.start_load([1], [6])  # page 6 freed and reused, its reader still queued
    assert all(c.ok for c in engine.drain())
    consumer.synchronize()
    assert bool((read == 1).all())  # what the first load put there, not the second
    assert bool((engine.device.words[6] == 2).all())
    engine.close()


def test_a_load_given_a_stream_still_follows_the_engines_compute_stream() -> None:
    """A ``stream=`` replaced ``compute_stream``: a load overwrote a page it still read."""
    forward = FakeStream(torch.device("cpu"), "forward")
    engine, _, other = _ordered(compute_stream=forward)
    engine.host.words[0].fill_(1)
    engine.host.words[1].fill_(2)
    engine.start_load([0], [6])
    assert all(c.ok for c in engine.drain())
    read = torch.empty_like(engine.device.words[6])

    def compute() -> None:  # the forward pass reads what the first load wrote
        read.copy_(engine.device.words[6])

    forward.enqueue(compute)
    engine.start_load([1], [6], stream=other)  # page 6 freed and reused, its reader queued
    assert all(c.ok for c in engine.drain())
    forward.synchronize()
    assert bool((read == 1).all())
    engine.close()


def test_the_streams_given_to_wait_are_the_latest_few() -> None:
    """Each start waits for them: a new stream object each step grew the list for ever."""
    engine, _, _ = _ordered()
    ticket = engine.start_write([0], [0])
    given = [
        FakeStream(torch.device("cpu"), f"reader {i}") for i in range(copies.MAX_CONSUMERS + 3)
    ]
    for stream in given:
        engine.wait([ticket.id], stream=stream)
    assert engine._consumers == given[-copies.MAX_CONSUMERS :]  # noqa: SLF001
    engine.close()


def test_a_cpu_engine_refuses_a_start_given_a_stream_that_is_not_a_stream() -> None:
    """The check ran only on streams, so the slip showed first on a GPU.

    ``wait`` is the exception: on CPU it only checks the ids (``test_fake_cuda``).
    """
    engine = make("cpu")
    ticket = engine.start_write([0], [0])
    calls: list[Callable[[], object]] = [
        lambda: engine.start_write([1], [1], stream=42),
        lambda: engine.start_load([2], [2], stream="forward"),
    ]
    for call in calls:
        with pytest.raises(BadArgument, match=r"^copy engine: stream must be a stream "):
            call()
    assert [t.id for t in engine.in_flight()] == [ticket.id]
    engine.close()


def test_a_stream_argument_that_is_not_a_stream_is_refused_and_starts_nothing() -> None:
    engine, _, _ = _ordered()
    with pytest.raises(BadArgument) as caught:
        engine.start_write([0], [0], stream=object())
    assert str(caught.value) == (
        "copy engine: stream must be a stream (torch.cuda.Stream or the Streams' own), got object"
    )
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    with pytest.raises(BadArgument) as caught:
        _ordered(compute_stream="forward")
    assert str(caught.value) == (
        "copy engine: compute_stream must be a stream (torch.cuda.Stream or the Streams' own), "
        "got str"
    )
    engine.close()


def test_a_device_error_ordering_a_copy_at_its_start_refuses_it_and_starts_nothing() -> None:
    engine, streams, _ = _ordered()

    class Broken(FakeStream):
        def mark(self, event: FakeEvent, generation: int) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    streams.now = Broken(torch.device("cpu"), "broken")
    with pytest.raises(CopyFailed) as caught:
        engine.start_write([0], [0])
    assert str(caught.value) == (
        "copy engine: d2h copy refused: cannot order it after compute: "
        "CUDA error: an illegal memory access was encountered"
    )
    assert engine.in_flight() == []
    assert engine.busy_device_pages() == engine.busy_host_pages() == frozenset()
    streams.now = None
    engine.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("how", ["current", "stream", "compute_stream"])
def test_cuda_a_backup_follows_the_forward_stream_that_wrote_its_pages(how: str) -> None:
    """The backup is submitted under the default stream while the forward stream still writes."""
    engine = make("cuda", torch.float32, dev_pages=64, host_pages=64)
    forward = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    if how == "compute_stream":
        engine = CopyEngine(engine.device, engine.host, compute_stream=forward)
    pages = list(range(64))
    with torch.cuda.stream(forward):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):  # keep the forward stream busy, then write the KV last
            big = big @ big / 4096
        engine.device.tensor.fill_(3.0)
        given = {"stream": forward} if how == "stream" else {}
        if how == "current":
            engine.start_write(pages, pages)
    if how != "current":
        engine.start_write(pages, pages, **given)
    assert all(c.ok for c in engine.drain())  # submitted here, under the default stream
    assert bool((engine.host.read(pages) == 3.0).all())
    engine.close()
