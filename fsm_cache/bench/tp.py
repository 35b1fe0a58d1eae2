"""What tensor-parallel agreement costs a scheduler step, on ``ranks`` gloo processes.

A serving engine serves a step's requests (32 here) on each rank's cache with
local bookkeeping only and agrees once per step
(:meth:`~fsm_cache.distributed.agreement.DistributedCache.step`, one
all-reduce). :func:`run_tp_bench` starts ``ranks`` CPU processes on the gloo
backend (127.0.0.1 only) and measures, on each:

* the median time of one agreed step with nothing to apply (the bare cost of
  the all-reduce) next to a local ``HiCache.poll()``;
* the trace of ``fsm-cache bench cache`` (:mod:`fsm_cache.bench.cache`: the
  :class:`~fsm_cache.bench.workload.ChatWorkload` requests, match + insert per
  request, write-through to the host tier) served in steps of ``per_step``
  requests twice side by side, step by step: on one cache with a local
  ``HiCache.poll()`` after each step, and on another with the agreed step.
  The ranks start each timed half together (an untimed barrier), and each
  half lasts from the first rank's start to the last rank's end, since a
  tensor-parallel group moves at its slowest rank's pace whatever the cache
  does; each step counts its best of ``rounds`` rounds, and the ratio of the
  two sums is what agreement costs a step (the target is 1.10x on 2 ranks);
* the same for the small trace the distributed tests replay (:func:`chat_trace`
  through :func:`serve_chat_trace`: a cache the trace overflows, so load-backs
  and host evictions come with the copies).

After each agreed replay the ranks drain and verify that they applied the same
transitions, and each rank checks that its agreed cache applied the transitions
its local one did (the same work on both sides of the ratio), or every rank
raises :class:`~fsm_cache.bench.cache.UnequalWork`. A rank that raises one of
fsm_cache's errors has :func:`run_tp_bench` raise it, typed, with the rank
named; ``fsm-cache bench tp`` calls :func:`run_tp_bench`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    start_processes,
)

from fsm_cache.bench import cache as cachebench
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import Key
from fsm_cache.distributed.agreement import DistributedCache
from fsm_cache.distributed.collectives import Collectives
from fsm_cache.errors import FsmCacheError, PoolExhausted, RankFailure
from fsm_cache.memory.tiers import CacheConfig


def chat_trace(
    requests: int,
    *,
    sessions: int = 6,
    seed: int = 0,
    page_size: int = 4,
    max_len: int = 96,
) -> list[Key]:
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


def serve_request(cache: HiCache, tokens: Key) -> None:
    """Serve one request: look the prefix up, load back what the host holds, insert the rest.

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


def serve_chat_trace(
    cache: HiCache, trace: Sequence[Key], poll: Callable[[], object], evict_every: int = 8
) -> None:
    """Serve every request of ``trace``, polling after each and evicting every few."""
    quarter = cache.config.device_pages * cache.config.page_size // 4
    for i, tokens in enumerate(trace, 1):
        serve_request(cache, tokens)
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


def cache_trace_config(device_pages: int = 512) -> CacheConfig:
    """The write-through cache of ``bench cache``: four times the device pool on the host."""
    return cachebench.trace_config(device_pages, 4 * device_pages)


PER_STEP = 32
"""Requests a scheduler step serves between two agreements."""


@dataclass(frozen=True)
class StepTimes:
    """One trace served in steps with the local and with the agreed poll, step by step.

    Attributes:
        requests: Requests in the trace.
        per_step: Requests per step.
        steps: Steps in the trace.
        local_ms: Summed over the steps, the group's time to serve the step's
            requests and call ``HiCache.poll()``: from the first rank's start to
            the last rank's end, in the step's best round.
        agreed_ms: The same with one :meth:`DistributedCache.step` per step.
    """

    requests: int
    per_step: int
    steps: int
    local_ms: float
    agreed_ms: float

    @property
    def ratio(self) -> float:
        """What a step costs with agreement, as a multiple of the local step."""
        return self.agreed_ms / self.local_ms

    def format(self) -> list[str]:
        """Two lines: the local and the agreed step, with the ratio and the added time."""
        local_us, agreed_us = (1e3 * ms / self.steps for ms in (self.local_ms, self.agreed_ms))
        return [
            f"    local polls  {local_us:10,.0f} us per step",
            f"    agreed step  {agreed_us:10,.0f} us per step  "
            f"({self.ratio:.2f}x local; {agreed_us - local_us:+,.0f} us per step)",
        ]


@dataclass(frozen=True)
class TPBench:
    """Figures of one run (the group's per step; rank 0's per call).

    Attributes:
        ranks: Processes in the gloo group.
        per_step: Requests per scheduler step.
        polls: Polls timed for the per-call figures.
        transport: How the agreed caches' rows travel (``Collectives.transport``).
        agreed_step_us: Median microseconds of one agreed step with nothing to apply,
            its rows over ``transport``.
        gloo_step_us: The same with every collective on gloo (``local_sockets=False``).
        local_poll_us: Median microseconds of one local ``HiCache.poll()``.
        rounds: Times each trace was served each way; each step counts its best round.
        cache_trace: The ``bench cache`` trace.
        small_trace: The small trace of the distributed tests.
    """

    ranks: int
    per_step: int
    polls: int
    transport: str
    agreed_step_us: float
    gloo_step_us: float
    local_poll_us: float
    rounds: int
    cache_trace: StepTimes
    small_trace: StepTimes

    def format(self) -> str:
        """Return the figures as a table."""
        return "\n".join(
            [
                f"tensor-parallel agreement: {self.ranks} gloo ranks on CPU, "
                f"{self.per_step} requests per step; rows over {self.transport}",
                f"  agreed step, nothing to apply {self.agreed_step_us:10.1f} us "
                f"(median of {self.polls})",
                f"    all on gloo                 {self.gloo_step_us:10.1f} us",
                f"  local HiCache.poll()          {self.local_poll_us:10.1f} us",
                f"  bench cache trace: {self.cache_trace.requests} chat requests, "
                f"write-through to host, page {cachebench.PAGE}; {self.cache_trace.steps} steps, "
                f"best of {self.rounds}",
                *self.cache_trace.format(),
                f"  small trace: {self.small_trace.requests} requests, "
                f"load-backs and host evictions, page {bench_config().page_size}; "
                f"{self.small_trace.steps} steps, best of {self.rounds}",
                *self.small_trace.format(),
            ]
        )


class Sizes(TypedDict, total=False):
    """Sizes :func:`run_tp_bench` takes by keyword, as ``fsm-cache bench tp`` passes them."""

    polls: int
    requests: int
    small_requests: int
    rounds: int


QUICK: Sizes = {"polls": 100, "requests": 128, "small_requests": 64, "rounds": 1}
"""Sizes for a smoke run (``fsm-cache bench tp --quick``): the measurements take seconds;
starting the ranks (a torch import each) takes most of the run."""


def run_tp_bench(
    ranks: int = 2,
    *,
    per_step: int = PER_STEP,
    polls: int = 2000,
    requests: int = 2000,
    small_requests: int = 640,
    rounds: int = 3,
    timeout: float = 60.0,
    local_sockets: bool = True,
) -> TPBench:
    """Spawn ``ranks`` gloo processes on 127.0.0.1, measure, and return the figures.

    Args:
        ranks: Processes in the group.
        per_step: Requests per scheduler step.
        polls: Polls timed for the per-call figures.
        requests: Requests of the ``bench cache`` trace.
        small_requests: Requests of the small trace.
        rounds: Times each trace is served each way.
        timeout: Seconds a collective may wait.
        local_sockets: The agreed caches' ``DistributedCache(local_sockets=)``:
            rows over the ranks' Unix sockets (the default), or all on gloo.
            The bare agreed step is timed both ways whichever this is.

    Raises:
        UnequalWork: On some rank the agreed replay applied other transitions
            than the local one.
        RankFailure: A rank raised another of fsm_cache's errors (its type and
            message are given), or exited without a result (killed, say).
        ProcessRaisedException: A rank raised anything else (a defect);
            carries its traceback.
    """
    settings = Settings(per_step, polls, requests, small_requests, rounds, timeout, local_sockets)
    with tempfile.TemporaryDirectory(prefix="fsm-tpbench-") as tmp:
        args = (ranks, str(Path(tmp) / "store"), tmp, settings)
        ranked = _start_ranks(args, ranks)
        try:
            while not ranked.join():
                pass
        except ProcessException as exc:
            raise rank_error(exc, Path(tmp)) from exc
        finally:  # a Ctrl-C leaves ranks running; torch keeps a failed rank's error file
            _end_ranks(ranked)
        figures = json.loads((Path(tmp) / "rank0.json").read_text())
    big, small = (StepTimes(**figures.pop(k)) for k in ("cache_trace", "small_trace"))
    return TPBench(**figures, cache_trace=big, small_trace=small)


def _start_ranks(args: tuple[object, ...], ranks: int) -> ProcessContext:
    """Start the rank processes of :func:`run_tp_bench` with Ctrl-C (SIGINT) ignored in them.

    A terminal's Ctrl-C goes to every process of its group: each rank,
    still importing torch or in a collective, printed a traceback of its
    own under the command's ``interrupted``. The ranks inherit SIGINT
    ignored (a disposition that survives their ``exec``); the caller ends
    them (:func:`_end_ranks`), and the kernel does if the caller dies
    (:func:`_end_with_parent`).
    """
    main = threading.current_thread() is threading.main_thread()  # where signals are set
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        started = start_processes(_bench_rank, args=args, nprocs=ranks, join=False)  # type: ignore[no-untyped-call]
    finally:
        if main:
            signal.signal(signal.SIGINT, before)
    return cast("ProcessContext", started)


def _end_ranks(ranked: ProcessContext) -> None:
    """End the rank processes of :func:`run_tp_bench` still running, and remove their error files."""
    for process in ranked.processes:
        if process.is_alive():
            process.terminate()
    for process in ranked.processes:
        process.join(timeout=_END_WAIT)
        if process.is_alive():
            process.kill()
            process.join()
    for name in ranked.error_files:
        with contextlib.suppress(OSError):
            os.unlink(name)


_END_WAIT = 5.0
"""Seconds an interrupted rank is given to end on SIGTERM before it is killed."""


@dataclass(frozen=True)
class Settings:
    """The sizes of one run, as :func:`run_tp_bench` takes them, for every rank."""

    per_step: int
    polls: int
    requests: int
    small_requests: int
    rounds: int
    timeout: float
    local_sockets: bool


def _bench_rank(rank: int, world: int, store: str, out: str, settings: Settings) -> None:
    """One rank of :func:`run_tp_bench`; rank 0 writes the figures as JSON.

    An error of fsm_cache's is written to ``rank<N>.error`` (its type's name
    and its message) before it ends the rank, for :func:`rank_error`.
    """
    _end_with_parent()
    torch.set_num_threads(1)  # a core per rank at most; idle intra-op threads would spin
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=settings.timeout),
        )
        try:
            figures = _measure(world, settings)
            if rank == 0:
                (Path(out) / "rank0.json").write_text(json.dumps(asdict(figures)))
        finally:
            dist.destroy_process_group()
    except FsmCacheError as exc:
        (Path(out) / f"rank{rank}.error").write_text(json.dumps([type(exc).__name__, str(exc)]))
        raise


def _end_with_parent() -> None:
    """Have the kernel end this rank with SIGTERM when its parent dies (Linux only).

    torch's spawn asks for SIGINT, which a rank ignores (:func:`_start_ranks`),
    so a parent killed outright (SIGKILL, the OOM killer) left its ranks
    running the benchmark to its end under init. Where torch offers no way to
    ask (another platform), nothing is asked.
    """
    ask = getattr(torch.multiprocessing, "_prctl_pr_set_pdeathsig", None)
    if callable(ask):
        ask(signal.SIGTERM)


def rank_error(failed: ProcessException, out: Path) -> BaseException:
    """Return what to raise for a rank of :func:`run_tp_bench` that failed.

    The error a rank wrote (:func:`_bench_rank`) is raised typed: an
    :class:`~fsm_cache.bench.cache.UnequalWork` as itself, any other as a
    :class:`~fsm_cache.errors.RankFailure` naming the rank, the type and the
    message. A rank that exited without one (killed) is a ``RankFailure``
    too; one that raised anything else is a defect, and ``failed`` (with its
    traceback) is raised as it is.

    Args:
        failed: What ``start_processes`` raised.
        out: The folder the ranks wrote to.
    """
    rank = failed.error_index
    written = out / f"rank{rank}.error"
    if written.exists():
        name, message = json.loads(written.read_text())
        if name == cachebench.UnequalWork.__name__:
            return cachebench.UnequalWork(message)
        return RankFailure(f"bench tp: rank {rank} failed: {name}: {message}")
    if isinstance(failed, ProcessExitedException):
        return RankFailure(f"bench tp: rank {rank} failed: {failed.msg}")
    return failed


def idle_calls(
    timeout: float, local_sockets: bool = True
) -> tuple[Callable[[], int], Callable[[], int]]:
    """Return the agreed step and the local poll that the per-call figures time, both idle.

    Each on a cache of its own, with the same (no) traffic. The local poll
    must not be the wrapped cache's: a cache that a :class:`DistributedCache`
    wraps takes its acknowledgements from the wrapper, so its own ``poll()``
    never reaches the copy engine and would time less than a local poll does.
    A collective: every rank of the default group calls it.

    Args:
        timeout: Seconds the agreed step's collective may wait.
        local_sockets: The agreed cache's ``DistributedCache(local_sockets=)``.
    """
    return agreed_step(timeout, local_sockets), HiCache(bench_config()).poll


def agreed_step(timeout: float, local_sockets: bool = True) -> Callable[[], int]:
    """Return the step of a new, idle :class:`DistributedCache` (a collective, as :func:`idle_calls`)."""
    agreed = DistributedCache(HiCache(bench_config()), timeout=timeout, local_sockets=local_sockets)
    return agreed.step


def _measure(world: int, settings: Settings) -> TPBench:
    """Measure on this rank: an idle agreed step (both ways) beside an idle local poll, then both traces."""
    step, poll = idle_calls(settings.timeout, settings.local_sockets)
    agreed_us = _median_us(step, settings.polls)
    local_us = _median_us(poll, settings.polls)
    gloo_us = _median_us(agreed_step(settings.timeout, local_sockets=False), settings.polls)
    # as the agreed side of the traces has it: the group's sockets, set up by then, or gloo
    transport = Collectives.of(
        None, settings.timeout, local_sockets=settings.local_sockets
    ).transport
    return TPBench(
        world,
        settings.per_step,
        settings.polls,
        transport,
        agreed_us,
        gloo_us,
        local_us,
        settings.rounds,
        compare_steps(
            cache_trace_config,
            cachebench.serve_trace,
            cachebench.trace(settings.requests),
            settings,
            "bench cache trace",
        ),
        compare_steps(
            bench_config,
            serve_chat_trace,
            chat_trace(settings.small_requests),
            settings,
            "small trace",
        ),
    )


K = TypeVar("K")
Replayer = Callable[[HiCache, Sequence[K], Callable[[], object]], object]


def compare_steps(
    config: Callable[[], CacheConfig],
    run: Replayer[K],
    trace: Sequence[K],
    settings: Settings,
    name: str,
) -> StepTimes:
    """Serve ``trace`` in steps with the local and the agreed poll, alternating step by step.

    A half of a step lasts from the first rank's start to the last rank's end
    (the group moves at its slowest rank's pace), and each step counts its best
    round, as the other benchmarks take the best of their rounds: a rank that
    lost its core for a while in one round does not count, in either half.
    A collective: every rank of the default group calls it.

    Raises:
        UnequalWork: On every rank, when on some rank the agreed cache applied
            other transitions than the local one (``name`` says which trace).
    """
    local: list[list[Span]] = []  # per round, per step
    agreed: list[list[Span]] = []
    unequal = ""  # on this rank, the first round's transitions that differ between the sides
    for round_ in range(settings.rounds):
        # the last round's caches hold each other in cycles: collected here, not in a timed step
        gc.collect()
        mine, theirs, differs = _round(config, run, trace, settings, round_)
        local.append(mine)
        agreed.append(theirs)
        unequal = unequal or differs
    comm = Collectives.of(None, settings.timeout, local_sockets=settings.local_sockets)
    every: list[tuple[list[list[Span]], list[list[Span]], str]]
    every = comm.all_gather_object((local, agreed, unequal))
    for rank, (_, _, differs) in enumerate(every):
        if differs:  # raised on every rank, so that none waits for the others' next collective
            raise cachebench.UnequalWork(
                f"bench tp, {name}: on rank {rank} the agreed replay applied other transitions "
                f"than the local one ({differs}), so their ratio would compare different work"
            )
    local_ms = _best_group_ms([mine[0] for mine in every])
    agreed_ms = _best_group_ms([mine[1] for mine in every])
    steps = len(range(0, len(trace), settings.per_step))
    return StepTimes(len(trace), settings.per_step, steps, local_ms, agreed_ms)


def _round(
    config: Callable[[], CacheConfig],
    run: Replayer[K],
    trace: Sequence[K],
    settings: Settings,
    round_: int,
) -> tuple[list[Span], list[Span], str]:
    """Serve ``trace`` once each way on new caches, alternating step by step; see :func:`compare_steps`.

    Returns:
        This rank's spans of the local and of the agreed steps, and the
        transitions that differ between the two caches (empty when none do).
    """
    cache = HiCache(config())
    shared = DistributedCache(
        HiCache(config()), timeout=settings.timeout, local_sockets=settings.local_sockets
    )
    local: list[Span] = []
    agreed: list[Span] = []
    sides = [(local, cache, cache.poll), (agreed, shared.cache, shared.step)]
    for i, start in enumerate(range(0, len(trace), settings.per_step)):
        chunk = trace[start : start + settings.per_step]
        for spans, served, poll in sides[:: 1 if (i + round_) % 2 else -1]:
            dist.barrier()  # the ranks start each half together
            spans.append(_step_span(run, served, chunk, poll))
    shared.drain()
    shared.verify_agreement()  # the ranks really applied the same transitions (not timed)
    cache.close()  # its last copies applied, as drain() applied the agreed side's
    return local, agreed, unequal_transitions(cache, shared.cache)


def unequal_transitions(local: HiCache, agreed: HiCache) -> str:
    """Say which transitions ``agreed`` applied a different number of times than ``local``.

    Returns:
        ``"<event> <agreed> agreed, <local> local"`` for each such event, by
        name, comma-separated; empty when they applied the same.
    """
    mine, theirs = local.stats().transitions, agreed.stats().transitions
    return ", ".join(
        f"{event} {theirs.get(event, 0)} agreed, {mine.get(event, 0)} local"
        for event in sorted(mine.keys() | theirs.keys())
        if mine.get(event, 0) != theirs.get(event, 0)
    )


Span = tuple[float, float]
"""When a rank started and ended a half of a step, on the machine's monotonic clock."""


def _best_group_ms(spans: list[list[list[Span]]]) -> float:
    """Milliseconds summed over the steps of each step's best round, first start to last end.

    The ranks run on one machine, where ``time.perf_counter()`` reads the same
    monotonic clock in every process.

    Args:
        spans: Per rank, per round, per step: when the rank started and ended it.
    """
    rounds, steps = len(spans[0]), len(spans[0][0])

    def group(r: int, k: int) -> float:
        return max(rank[r][k][1] for rank in spans) - min(rank[r][k][0] for rank in spans)

    return 1e3 * sum(min(group(r, k) for r in range(rounds)) for k in range(steps))


def _step_span(
    run: Replayer[K], cache: HiCache, chunk: Sequence[K], poll: Callable[[], object]
) -> Span:
    """Serve one step's requests on ``cache``, ``poll`` once; return when it started and ended."""
    started = time.perf_counter()
    run(cache, chunk, _nothing)
    poll()
    return started, time.perf_counter()


def _nothing() -> None:
    """No poll per request: the step polls once."""


def _median_us(call: Callable[[], object], times: int) -> float:
    samples = []
    for _ in range(times):
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000.0
