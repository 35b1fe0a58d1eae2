"""What tensor-parallel agreement costs: per agreed poll, and on a chat-like HiCache trace.

:func:`run_tp_bench` starts ``ranks`` CPU processes on the gloo backend
(127.0.0.1 only) and measures, on each:

* the median time of one agreed :meth:`~fsm_cache.distributed.DistributedCache.poll`
  with nothing to apply (the bare cost of the MIN all-reduce) next to a local
  ``HiCache.poll()``;
* the wall time of replaying a chat-like trace (:func:`chat_trace`: match,
  load back, insert, poll per request, evictions every few requests) with the
  local poll and with the agreed poll; the difference is what agreement adds.

Figures are rank 0's; the ranks run in lock step, so the slowest sets the pace.
``fsm-cache bench tp`` calls :func:`run_tp_bench`.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from fsm_cache.cache import HiCache
from fsm_cache.distributed import DistributedCache
from fsm_cache.errors import PoolExhausted
from fsm_cache.tiers import CacheConfig


Request = tuple[int, ...]


def chat_trace(
    requests: int,
    *,
    sessions: int = 6,
    seed: int = 0,
    page_size: int = 4,
    max_len: int = 96,
) -> list[Request]:
    """Return a reproducible chat-like trace: each request extends its session's conversation.

    Sessions share one of two system prompts; a turn adds a user message and
    the previous answer, and a conversation that outgrows ``max_len`` tokens
    starts over. Lengths are whole pages.
    """
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(1000) for _ in range(2 * page_size)) for _ in range(2)]
    talks = [systems[s % 2] for s in range(sessions)]
    trace = []
    for _ in range(requests):
        s = rng.randrange(sessions)
        turn = tuple(rng.randrange(1000) for _ in range(page_size * rng.randint(1, 4)))
        talks[s] = talks[s] + turn if len(talks[s]) + len(turn) <= max_len else systems[s % 2]
        trace.append(talks[s])
    return trace


def serve(cache: HiCache, tokens: Request) -> None:
    """One request: look the prefix up, load back what the host holds, insert the rest.

    The matched path is locked while the insert allocates, as a scheduler
    holds a running request's prefix, so that eviction cannot take it.
    """
    found = cache.match_prefix(tokens)
    held = found.last_device_node
    if found.host_len and cache.load_back(found.last_host_node):
        held = found.last_host_node
    lock = None if held.is_root else cache.lock(held)
    try:
        cache.insert(tokens)
    except PoolExhausted:
        pass  # every device page is locked or busy with copies: the request is not cached
    finally:
        if lock is not None:
            cache.unlock(lock)


def replay(
    cache: HiCache, trace: Sequence[Request], poll: Callable[[], object], evict_every: int = 8
) -> None:
    """Serve every request of ``trace``, polling after each and evicting every few."""
    quarter = cache.config.device_pages * cache.config.page_size // 4
    for i, tokens in enumerate(trace, 1):
        serve(cache, tokens)
        poll()
        if i % evict_every == 0:
            cache.evict(quarter)
            cache.evict_host(quarter)


def bench_config(**overrides: object) -> CacheConfig:
    """A small CPU cache: page_size 4, a tiny KV, a device pool the trace overflows."""
    base: dict[str, object] = {
        "device_pages": 48,
        "host_pages": 96,
        "page_size": 4,
        "layers": 1,
        "heads": 1,
        "head_dim": 8,
        "dtype": "float32",
        "device": "cpu",
    }
    base.update(overrides)
    return CacheConfig(**base)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TPBench:
    """Figures of one run (rank 0's).

    Attributes:
        ranks: Processes in the gloo group.
        polls: Polls timed for the per-call figures.
        agreed_poll_us: Median microseconds of one agreed poll with nothing to apply.
        local_poll_us: Median microseconds of one local ``HiCache.poll()``.
        requests: Requests in the trace.
        trace_local_s: Seconds to replay the trace with the local poll.
        trace_agreed_s: Seconds to replay it with the agreed poll.
    """

    ranks: int
    polls: int
    agreed_poll_us: float
    local_poll_us: float
    requests: int
    trace_local_s: float
    trace_agreed_s: float

    @property
    def overhead_pct(self) -> float:
        """What agreement adds to the trace replay, in percent of the local replay."""
        return 100.0 * (self.trace_agreed_s - self.trace_local_s) / self.trace_local_s

    def format(self) -> str:
        """Return the figures, one per line."""
        per_local = 1e6 * self.trace_local_s / self.requests
        per_agreed = 1e6 * self.trace_agreed_s / self.requests
        return "\n".join(
            [
                f"tensor-parallel agreement: {self.ranks} gloo ranks on CPU",
                f"agreed poll (median of {self.polls}) {self.agreed_poll_us:10.1f} us",
                f"local poll  (median of {self.polls}) {self.local_poll_us:10.1f} us",
                f"trace, local poll    {per_local:10.1f} us/request  ({self.requests} requests)",
                f"trace, agreed poll   {per_agreed:10.1f} us/request",
                f"agreement overhead   {self.overhead_pct:+10.1f} %",
            ]
        )


def run_tp_bench(
    ranks: int = 2, *, polls: int = 2000, requests: int = 400, timeout: float = 60.0
) -> TPBench:
    """Spawn ``ranks`` gloo processes on 127.0.0.1, measure, and return rank 0's figures.

    Raises:
        ProcessRaisedException: A rank failed; carries its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="fsm-tpbench-") as tmp:
        args = (ranks, str(Path(tmp) / "store"), tmp, _Settings(polls, requests, timeout))
        start_processes(_bench_rank, args=args, nprocs=ranks)  # type: ignore[no-untyped-call]
        figures = json.loads((Path(tmp) / "rank0.json").read_text())
    return TPBench(**figures)


@dataclass(frozen=True)
class _Settings:
    polls: int
    requests: int
    timeout: float


def _bench_rank(rank: int, world: int, store: str, out: str, settings: _Settings) -> None:
    """One rank of :func:`run_tp_bench`; rank 0 writes the figures as JSON."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=settings.timeout),
    )
    try:
        figures = _measure(world, settings.polls, settings.requests, settings.timeout)
        if rank == 0:
            (Path(out) / "rank0.json").write_text(json.dumps(asdict(figures)))
    finally:
        dist.destroy_process_group()


def _measure(world: int, polls: int, requests: int, timeout: float) -> TPBench:
    idle = HiCache(bench_config())
    agreed = DistributedCache(idle, timeout=timeout)
    agreed_us = _median_us(agreed.poll, polls)
    local_us = _median_us(idle.poll, polls)
    trace = chat_trace(requests)
    dist.barrier()
    local = HiCache(bench_config())
    started = time.perf_counter()
    replay(local, trace, local.poll)
    local_s = time.perf_counter() - started
    dist.barrier()
    shared = DistributedCache(HiCache(bench_config()), timeout=timeout)
    started = time.perf_counter()
    replay(shared.cache, trace, shared.poll)
    agreed_s = time.perf_counter() - started
    return TPBench(world, polls, agreed_us, local_us, requests, local_s, agreed_s)


def _median_us(call: Callable[[], object], times: int) -> float:
    samples = []
    for _ in range(times):
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000.0
