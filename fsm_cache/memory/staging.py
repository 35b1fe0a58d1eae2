"""Moving pages between the pools: streams, reused staging buffers, chunked gather and scatter.

:class:`Mover` moves one batch of pages in one direction, as the copy engine
(:mod:`fsm_cache.memory.copies`) submits it. Pages are moved as words
(:attr:`~fsm_cache.memory.kv.KVPool.words`: one contiguous row per page, layer
and plane, read as 64-bit integers where the page size allows), bit for bit
whatever the KV dtype.

* **device to host**: the device pages are gathered (``index_select``) into a
  staging buffer in page-first order, then copied to the host pages, one
  ``copy_`` per run of consecutive host pages (the batch is first sorted by
  host page, so the runs of all its tickets coalesce).
* **host to device**: the host pages are copied into a staging buffer, one
  ``copy_`` per run, then scattered (``index_copy_``) into the device pages.

A batch larger than one buffer runs in chunks through two staging buffers that
are kept and reused: on CUDA each direction has two streams, the first stage of
a chunk (the gather, or the load into staging) runs on one while the second
stage of the previous chunk (the copy out, or the scatter) runs on the other,
so the kernel and the transfer overlap; each buffer is filled again only after
the stage that read it has finished. The copy engine records the batch's event
on the second stream, after the last chunk. A buffer is allocated when it is
first needed, inside the stage that fills it (on CUDA, from the copy stream's
pool of the caching allocator), never up front.

On a CPU device pool the same code runs synchronously with no streams, and two
shortcuts apply: a chunk whose host pages form one run is gathered straight
into them (no staging), and one whose device pages form a run too is one
``copy_``. ``fsm_cache.testing.fakecuda`` runs the stream logic on CPU pools.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, cast, runtime_checkable

import torch

from fsm_cache.memory.kv import KVPool, upload
from fsm_cache.memory.pages import run_start
from fsm_cache.memory.tickets import Direction, host_runs


__all__ = ["CudaStreams", "Event", "Mover", "Stream", "Streams", "page_index"]


class Event(Protocol):
    """What the engine needs of an event: ``torch.cuda.Event`` or a fake."""

    def record(self, stream: Any) -> Any:
        """Mark the point after the work queued so far on ``stream`` (a :class:`Stream`)."""
        ...

    def query(self) -> bool:
        """Whether the work before the mark has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work before the mark has finished."""
        ...


class Stream(Protocol):
    """What the engine needs of a stream: ``torch.cuda.Stream`` or a fake."""

    def wait_stream(self, stream: Any) -> None:
        """Make later work here wait for the work queued so far on ``stream`` (a :class:`Stream`)."""
        ...

    def wait_event(self, event: Any) -> None:
        """Make later work here wait for ``event`` (an :class:`Event`) without blocking the host."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work queued here has finished."""
        ...


@runtime_checkable
class Streams(Protocol):
    """Where the engine gets its streams and events, and how it queues work on them.

    :class:`CudaStreams` is the real one; ``fsm_cache.testing.fakecuda``
    provides a CPU fake that defers each copy until its event completes, so
    the ordering logic runs on machines without a GPU.
    """

    def new_stream(self, device: torch.device) -> Stream:
        """Return a new side stream on ``device``."""
        ...

    def current_stream(self, device: torch.device) -> Stream:
        """Return the stream compute runs on (``torch.cuda.current_stream``)."""
        ...

    def new_event(self) -> Event:
        """Return a new, unrecorded event."""
        ...

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        """Queue ``work``'s device operations on ``stream``."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block the host until every stream of ``device`` is idle."""
        ...


class CudaStreams:  # CUDA only: tested by the gpu-marked tests, faked on CPU by fakecuda
    """The real :class:`Streams`: ``torch.cuda`` streams and events."""

    def new_stream(self, device: torch.device) -> Stream:
        """Return ``torch.cuda.Stream(device)``."""
        stream: Stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def current_stream(self, device: torch.device) -> Stream:
        """Return ``torch.cuda.current_stream(device)``."""
        stream: Stream = torch.cuda.current_stream(device)
        return stream

    def new_event(self) -> Event:
        """Return ``torch.cuda.Event(blocking=True)`` (timing off: the cheapest kind).

        Blocking: a host that waits on it (``drain``, ``close``) sleeps until
        the device signals it instead of spinning a core the scheduler and the
        other ranks need; ``query``, what ``poll`` calls, is the same either way.
        """
        event: Event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        return event

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        """Run ``work`` now with ``stream`` and its device current: its kernels queue there.

        The device is made current too, so nothing ``work`` does (pinning an
        index tensor, say) touches another GPU's context.
        """
        cuda_stream = cast("torch.cuda.Stream", stream)
        with torch.cuda.device(cuda_stream.device), torch.cuda.stream(cuda_stream):
            work()

    def synchronize(self, device: torch.device) -> None:
        """``torch.cuda.synchronize(device)``."""
        torch.cuda.synchronize(device)


def page_index(pages: Sequence[int], device: torch.device) -> torch.Tensor:
    """Return ``pages`` as an int64 index tensor on ``device``.

    Built from an ``array`` (several times cheaper than ``torch.tensor`` of a
    list), and uploaded without blocking the host (:func:`~fsm_cache.memory.kv.upload`).
    """
    return upload(torch.frombuffer(array.array("q", pages), dtype=torch.int64), device)


class Mover:
    """Moves batches of pages between a device pool and a host pool through reused staging.

    Args:
        device: The device pool.
        host: The host pool.
        chunk_pages: Pages one staging buffer holds: the most one chunk moves.
        streams: Where streams come from; None: run synchronously (a CPU engine).

    Attributes:
        streams: Per direction, the stream each batch ends on (where the copy
            engine waits for compute first and records the batch's event);
            empty without ``streams``.
    """

    def __init__(
        self, device: KVPool, host: KVPool, chunk_pages: int, streams: Streams | None
    ) -> None:
        self._dev = device.words
        self._host = host.words
        self._where = device.device
        # The CUDA data path (one transfer per run of host pages, no CPU shortcuts); fake
        # streams take it too, so the path a GPU runs is the one the CPU tests run.
        self._cuda = self._where.type == "cuda" or streams is not None
        self._chunk = max(1, chunk_pages)
        self._api = streams
        self.streams: dict[Direction, Stream] = (
            {d: streams.new_stream(self._where) for d in Direction} if streams else {}
        )
        self._first: dict[Direction, Stream] = {}  # made on the first batch of several chunks
        self._buffers: dict[Direction, list[torch.Tensor | None]] = {
            d: [None, None] for d in Direction
        }
        self._retired: list[torch.Tensor] = []  # outgrown buffers queued work may still read

    def move(
        self,
        direction: Direction,
        src: Sequence[int],
        dst: Sequence[int],
        runs: tuple[int | None, int | None] | None = None,
    ) -> None:
        """Queue (or, without streams, run) the copy of ``src[i]`` to ``dst[i]`` for every ``i``.

        The direction's stream must already wait for what it must follow
        (compute); the batch's last work is queued on it. ``runs`` are
        :func:`~fsm_cache.memory.tickets.run_start` of ``src`` and ``dst``
        where the caller knows them already.

        Raises:
            RuntimeError: torch refused to queue a step (out of memory, say);
                some of the batch may be queued already.
        """
        n, step = len(src), self._chunk
        if n == 0:
            return
        if self._api is None and not self._cuda:
            if runs is None:
                runs = (run_start(src), run_start(dst))
            if runs[0] is not None and runs[1] is not None:  # one run each side: one copy, here
                self._run_to_run(direction, runs[0], runs[1], n)
                return
        if self._api is not None:  # streams: one transfer per run of host pages, so make few
            ordered = _in_host_order(direction, src, dst)
            if ordered[0] is not src:
                src, dst, runs = *ordered, None
        last = self.streams.get(direction)
        if n <= step:  # one chunk: both stages on the direction's stream, one after the other
            one, two = self._stages(direction, src, dst, 0, runs)
            self._run(last, one)
            self._run(last, two)
            return
        first = self._first_stream(direction)
        if first is None or last is None:
            for i, lo in enumerate(range(0, n, step)):
                one, two = self._stages(direction, src[lo : lo + step], dst[lo : lo + step], i % 2)
                self._run(first, one)
                self._run(last, two)
            return
        first.wait_stream(last)  # compute, and the previous batch's use of the buffers
        try:
            for i, lo in enumerate(range(0, n, step)):
                one, two = self._stages(direction, src[lo : lo + step], dst[lo : lo + step], i % 2)
                self._run(first, one)
                if i:
                    first.wait_stream(last)  # the previous chunk's second stage frees its buffer
                last.wait_stream(first)
                self._run(last, two)
        except BaseException:  # the batch's event, recorded on ``last``, covers ``first`` too
            last.wait_stream(first)
            raise

    def _stages(
        self,
        direction: Direction,
        src: Sequence[int],
        dst: Sequence[int],
        slot: int,
        runs: tuple[int | None, int | None] | None = None,
    ) -> tuple[Callable[[], None], Callable[[], None] | None]:
        """The two stages of one chunk, staged (when they need to be) through buffer ``slot``.

        The buffer is taken when the first stage runs, on its stream (:class:`_Staged`).
        """
        buffer = _Staged(partial(self._buffer, direction, slot, len(src)))
        if runs is None:
            runs = (run_start(src), run_start(dst))
        if direction is Direction.D2H:
            return self._d2h(src, dst, buffer, runs)
        return self._h2d(src, dst, buffer, runs)

    def _run_to_run(self, direction: Direction, src: int, dst: int, n: int) -> None:
        """Copy ``n`` pages from page ``src`` on to page ``dst`` on, on a CPU pool: one ``copy_``.

        The common CPU batch (pages handed out together) needs no staging and
        no closures; a copy this small costs about what the dispatch does.
        """
        if direction is Direction.D2H:
            _copy(self._host[dst : dst + n], self._dev[src : src + n], False)
        else:
            _copy(self._dev[dst : dst + n], self._host[src : src + n], False)

    def synchronize(self) -> None:
        """Block until every copy queued on the streams has run (nothing to wait for without)."""
        if self._api is not None:
            self._api.synchronize(self._where)

    def release(self) -> None:
        """Drop outgrown staging buffers; call only when no queued copy can still use them."""
        self._retired.clear()

    def close(self) -> None:
        """Drop the staging buffers and the views of the pools: the engine moves nothing more.

        Its pools can then give their memory back
        (:meth:`~fsm_cache.memory.kv.KVPool.release`): a view would keep it.
        Call only when no queued copy can still use them.
        """
        self.release()
        self._buffers = {d: [None, None] for d in Direction}
        self._dev = self._dev.new_empty((0, *self._dev.shape[1:]))
        self._host = self._host.new_empty((0, *self._host.shape[1:]))

    def _first_stream(self, direction: Direction) -> Stream | None:
        if self._api is None:
            return None
        if direction not in self._first:
            self._first[direction] = self._api.new_stream(self._where)
        return self._first[direction]

    def _run(self, stream: Stream | None, work: Callable[[], None] | None) -> None:
        if work is None:
            return
        if stream is None or self._api is None:
            work()
        else:
            self._api.run_on(stream, work)

    def _buffer(self, direction: Direction, slot: int, pages: int) -> torch.Tensor:
        """Staging buffer ``slot`` of ``direction``, at least ``pages`` pages; kept for reuse.

        Called inside a chunk's first stage (:class:`_Staged`), so on CUDA a
        new buffer comes from the caching allocator's pool of the copy stream
        that fills it. A buffer also used on the other stream of its direction
        needs no ``record_stream``: it is freed only when no queued copy can
        use it (:meth:`release` once every batch has finished, or with the
        engine after a synchronisation).
        """
        buffers = self._buffers[direction]
        have = buffers[slot]
        if have is not None and have.shape[0] >= pages:
            return have[:pages]
        if have is not None:
            self._retired.append(have)  # queued work may still read it
        size = min(self._chunk, 1 << max(pages - 1, 0).bit_length())
        shape = (size, *self._dev.shape[1:])
        fresh = torch.empty(shape, dtype=self._dev.dtype, device=self._where)
        buffers[slot] = fresh
        return fresh[:pages]

    def _d2h(
        self,
        src: Sequence[int],
        dst: Sequence[int],
        staging: Callable[[], torch.Tensor],
        runs: tuple[int | None, int | None],
    ) -> tuple[Callable[[], None], Callable[[], None] | None]:
        """The chunk's gather and copy out (None: the gather wrote the host pages itself)."""
        dev, host, where = self._dev, self._host, self._where
        at = None if self._cuda else runs[1]
        if at is not None:  # CPU, host pages in one run: straight into them
            out = host[at : at + len(dst)]
            begin = runs[0]
            if begin is not None:  # device pages in one run too: one strided copy
                return (lambda: _copy(out, dev[begin : begin + len(src)], False)), None
            return (lambda: _gather(dev, page_index(src, where), out)), None

        def copy_out() -> None:
            buffer = staging()
            if self._cuda:  # CUDA: one transfer per run of host pages
                for first, off, n in host_runs(dst):
                    _copy(host[first : first + n], buffer[off : off + n], True)
            else:
                _scatter(host, page_index(dst, where), buffer)

        return (lambda: _gather(dev, page_index(src, where), staging())), copy_out

    def _h2d(
        self,
        src: Sequence[int],
        dst: Sequence[int],
        staging: Callable[[], torch.Tensor],
        runs: tuple[int | None, int | None],
    ) -> tuple[Callable[[], None], Callable[[], None] | None]:
        """The chunk's load into staging and scatter (None: one step reads the host pages)."""
        dev, host, where = self._dev, self._host, self._where
        at = None if self._cuda else runs[0]
        if at is not None:  # CPU, host pages in one run: read straight from them
            data = host[at : at + len(src)]
            begin = runs[1]
            if begin is not None:  # device pages in one run too: one strided copy
                return (lambda: _copy(dev[begin : begin + len(dst)], data, False)), None
            return (lambda: _scatter(dev, page_index(dst, where), data)), None

        def load() -> None:
            buffer = staging()
            if self._cuda:  # CUDA: one transfer per run of host pages
                for first, off, n in host_runs(src):
                    _copy(buffer[off : off + n], host[first : first + n], True)
            else:
                _gather(host, page_index(src, where), buffer)

        return load, lambda: _scatter(dev, page_index(dst, where), staging())


class _Staged:
    """A chunk's staging buffer: taken by the chunk's first stage, the same one for its second.

    Taken when the stage runs, inside :meth:`Streams.run_on`, not when the
    stages are built: on CUDA the caching allocator ties a block to the
    stream current at its allocation and hands that stream blocks it freed
    itself. Taken under the caller's stream, a new buffer could be a block
    that stream had freed while its queued kernels still used it, and the
    copy stream, ordered after compute only as it stood when the copy
    started, would write into it under them. Taken on the copy stream, a
    block can only follow that stream's own earlier work.
    """

    __slots__ = ("_buffer", "_take")

    def __init__(self, take: Callable[[], torch.Tensor]) -> None:
        self._take = take
        self._buffer: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self._take()
        return self._buffer


def _in_host_order(
    direction: Direction, src: Sequence[int], dst: Sequence[int]
) -> tuple[Sequence[int], Sequence[int]]:
    """The pairs ``src[i] -> dst[i]`` sorted by host page, so runs of host pages coalesce.

    Tickets of one batch often hold consecutive host pages in another order;
    sorted, they become one run, and one transfer. Pairs already in one run
    are returned as they are.
    """
    host = dst if direction is Direction.D2H else src
    if run_start(host) is not None:
        return src, dst
    order = sorted(range(len(host)), key=host.__getitem__)
    return [src[i] for i in order], [dst[i] for i in order]


def _gather(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(source, 0, index, out=out)


def _scatter(target: torch.Tensor, index: torch.Tensor, data: torch.Tensor) -> None:
    target.index_copy_(0, index, data)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    dst.copy_(src, non_blocking=non_blocking)
