"""Tensor-parallel agreement: gloo ranks on CPU apply the same transitions, or say where not.

The multi-process tests spawn 2 and 4 ranks (``torch.multiprocessing``, spawn
start method, a FileStore in a temporary folder, 127.0.0.1 only). Each rank
runs scenarios one after another over one process group and writes what it
saw as JSON; the tests compare the ranks' files. A rank that raises fails its
test with the rank's traceback; a group that outlives its deadline is killed.

The scenarios serve their requests in scheduler steps, as a serving engine
does: a few requests on each rank's cache, then one agreed
``DistributedCache.step()``.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import enum
import hashlib
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from clocks import HandClock


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.spawn import start_processes

    from fsm_cache import native
    from fsm_cache.bench import cache as cachebench
    from fsm_cache.bench import tp as tpbench
    from fsm_cache.bench.tp import (
        StepTimes,
        TPBench,
        bench_config,
        cache_trace_config,
        chat_trace,
        run_tp_bench,
        serve_chat_trace,
        serve_request,
    )
    from fsm_cache.cache.arguments import TokenKey
    from fsm_cache.cache.eventlog import EventLog
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.replay import replay
    from fsm_cache.cli import bench
    from fsm_cache.distributed import agreement
    from fsm_cache.distributed.agreement import (
        STORAGE_SLOTS,
        DistributedCache,
        shared_values_apart,
    )
    from fsm_cache.distributed.collectives import CPU, Collectives, SameHostRows, cpu_group
    from fsm_cache.distributed.digest import (
        TransitionDigest,
        collectives_message,
        copy_nodes,
        divergence_message,
        failure_difference,
        failure_message,
        first_difference,
        involved_nodes,
        lost_message,
        operation_message,
        operation_text,
        queued_message,
        reset_message,
        stalled_message,
    )
    from fsm_cache.errors import (
        BadArgument,
        CacheClosed,
        ConfigError,
        CopyFailed,
        InvariantViolation,
        NoProcessGroup,
        RankDivergence,
        RankFailure,
    )
    from fsm_cache.memory.copies import Completion, CopyEngine, Ticket
    from fsm_cache.memory.tickets import Direction
    from fsm_cache.memory.tiers import CacheConfig
    from fsm_cache.testing.faults import FaultyCopyEngine

TIMEOUT = 20.0  # seconds a collective waits for the other ranks
# Seconds a whole spawned group may run before the test kills it: long enough for a loaded
# machine (four ranks took 64 s beside four busy processes on two cores), short of the
# suite's pytest timeout (300 s), which would not name the group.
DEADLINE = 240.0
Results = list[dict[str, Any]]


# -- spawning ------------------------------------------------------------------


def spawn(worker: Callable[..., None], world: int, folder: Path) -> Results:
    """Run ``worker(rank, world, store, out)`` on ``world`` ranks; return each rank's JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    args = (world, str(folder / "store"), str(folder))
    ctx = start_processes(worker, args=args, nprocs=world, join=False)  # type: ignore[no-untyped-call]
    ends = time.monotonic() + DEADLINE
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with a rank's traceback
        if time.monotonic() > ends:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{world} ranks still running after {DEADLINE:g} s")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def join_group(rank: int, world: int, store: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )


def skewed(rank: int, fail: Collection[int] = ()) -> CacheConfig:
    """A small debug cache whose acknowledgements come late and shuffled, differently per rank."""
    copier = FaultyCopyEngine.copier(fail=fail, delay=rank % 3, shuffle=True, seed=rank)
    return bench_config(debug=True, copier=copier)


def fingerprint(cache: HiCache) -> list[list[Any]]:
    """Every node: id, parent, key length, residency and pages, in id order."""
    return [
        [n.id, n.parent and n.parent.id, len(n.key), n.residency(), n.device_pages, n.host_pages]
        for n in sorted(cache.tree.nodes.values(), key=lambda n: n.id)
    ]


# -- what each rank runs ---------------------------------------------------------


def every(requests: int, step: Callable[[], object]) -> Callable[[], None]:
    """A per-request callback that ends a scheduler step every ``requests`` requests."""
    served = itertools.count(1)

    def after_request() -> None:
        if next(served) % requests == 0:
            step()

    return after_request


def agree_on_workload(rank: int) -> dict[str, Any]:
    """Run the chat trace with skewed acknowledgements; report digests, tree and skew seen."""
    shared = DistributedCache(HiCache(skewed(rank)), timeout=TIMEOUT)
    ahead = 0

    def step() -> None:
        nonlocal ahead
        ahead = max(ahead, shared.buffered)
        shared.step()

    serve_chat_trace(shared.cache, chat_trace(60), every(4, step))
    shared.drain()
    digest = shared.verify_agreement()
    return {
        "digest": digest.hex(),
        "transitions": shared.transitions,
        "tree": fingerprint(shared.cache),
        "events": dict(shared.cache.stats().transitions),
        "ahead": ahead,
        "in_flight": len(shared.cache.issued()),
        # acknowledgements applied inside an operation (an allocation or insert that waited)
        "waits": sum(o == "wait" and len(a) > 0 for o, a in shared.cache.log.acknowledgements()),
    }


def divergence(rank: int, world: int, inject: Callable[[DistributedCache], None]) -> str:
    """Serve a few requests, let the last rank ``inject`` a fault, and report what verify says."""
    faulty = rank == world - 1
    shared = DistributedCache(HiCache(skewed(0)), timeout=TIMEOUT)
    for tokens in chat_trace(6, seed=1):
        serve_request(shared.cache, tokens)
        shared.step()
    shared.verify_agreement()
    serve_request(shared.cache, chat_trace(7, seed=1)[-1])  # leaves copies in flight
    if faulty:
        inject(shared)
    try:
        for _ in range(2):
            shared.step()
        shared.verify_agreement()
    except RankDivergence as exc:
        return str(exc)
    return "no divergence"


def drop_ack(shared: DistributedCache) -> None:
    """Forget the oldest copy in flight, as a rank that lost its acknowledgement would."""
    # The bug being simulated: the rank's own bookkeeping loses a copy in flight. Nothing public
    # can do that, so the test reaches under the read-only view.
    in_flight = cast("dict[int, object]", shared.cache.transfers.in_flight())
    in_flight.pop(shared.cache.issued()[0])


def extra_eviction(shared: DistributedCache) -> None:
    """Evict device memory on this rank only."""
    shared.cache.evict(8)


def two_rank_worker(rank: int, world: int, store: str, out: str) -> None:
    join_group(rank, world, store)
    report: dict[str, Any] = {"workload": agree_on_workload(rank)}
    report["dropped_ack"] = divergence(rank, world, drop_ack)
    report["extra_eviction"] = divergence(rank, world, extra_eviction)
    report["failed_copy"] = failed_copy(rank, world)
    report["fail_then_drain"] = fail_then_drain(rank, world)
    report["failing_locked_load"] = failing_locked_load(rank)
    report["after_reset"] = after_a_reset(rank, world)
    report["lost_in_drain"] = lost_completion(rank, world, stall=False)
    report["lost_in_poll"] = lost_completion(rank, world, stall=True)
    report["lost_in_wait"] = lost_in_a_wait(rank, world)
    report["failed_in_wait"] = failed_in_a_wait(rank, world)
    report["per_step"] = one_collective_per_step(rank, local_sockets=True)
    report["per_step_gloo"] = one_collective_per_step(rank, local_sockets=False)
    report["side_group"] = agree_on_a_side_group(rank, local_sockets=False)
    report["side_group_sockets"] = agree_on_a_side_group(rank, local_sockets=True)
    report["given_group"] = agree_on_a_given_group(rank, local_sockets=False)
    report["given_group_sockets"] = agree_on_a_given_group(rank, local_sockets=True)
    report["parted_keys"] = parted_keys(rank)
    report["reset_alone"] = reset_alone(rank, world)
    report["step_vs_verify"] = step_versus(rank, "verify_agreement")
    report["step_vs_drain"] = step_versus(rank, "drain")
    report["raised_before"] = raised_before_the_collective(rank)
    report["slow_report"] = a_slow_report(rank)
    dist.barrier()  # the default group is whole: the slow rank catches up here
    report["hang"] = survive_a_hang(rank)  # last: the group is broken after it
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def failed_copy(rank: int, world: int) -> dict[str, Any]:
    """The last rank's third copy fails; the others' succeeds: every rank must fail it."""
    fail = {3} if rank == world - 1 else set()
    shared = DistributedCache(HiCache(skewed(0, fail=fail)), timeout=TIMEOUT)
    outcome = "no divergence"
    try:
        serve_chat_trace(shared.cache, chat_trace(6, seed=1), shared.step)
        shared.drain()
        shared.verify_agreement()
    except RankDivergence as exc:
        outcome = str(exc)
    return {"outcome": outcome, "failed": failures(shared.cache), "tree": fingerprint(shared.cache)}


def failures(cache: HiCache) -> list[list[Any]]:
    """The failure transitions a cache applied, ``[node, event]`` in order."""
    return [
        [node, event]
        for kind, node, event in cache.log.since(0)
        if kind == "transition" and str(event).endswith("_failed")
    ]


class _FailingLoads(FaultyCopyEngine):
    """Every load fails, however often it runs again."""

    def start_load(self, host_pages: Any, device_pages: Any, *, stream: Any = None) -> Ticket:
        self.fail = self.fail | {self.started + 1}  # this copy's position
        return super().start_load(host_pages, device_pages, stream=stream)


def fail_then_drain(rank: int, world: int) -> dict[str, Any]:
    """A parent's backup fails on the last rank only, its child's waits for it; then drain.

    Where the backup succeeded the child's backup would start, so ranks that left
    ``drain`` on what they saw would part: one in another round, one in ``verify``.
    """
    fail = {1} if rank == world - 1 else set()
    config = bench_config(debug=True, copier=FaultyCopyEngine.copier(fail=fail))
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    cache = shared.cache
    cache.insert(list(range(16)))  # the parent: its backup starts
    cache.insert(list(range(32)))  # the child: its backup waits for the parent's
    applied = shared.drain()
    shared.verify_agreement()
    return {
        "applied": applied,
        "issued": len(cache.issued()),
        "failed": failures(cache),
        "tree": fingerprint(cache),
    }


def failing_locked_load(rank: int) -> dict[str, Any]:
    """Every load fails, under a request's lock: drain must still return, on every rank."""
    config = bench_config(debug=True, copier=_FailingLoads.copier(), load_back_threshold=1)
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    cache = shared.cache
    cache.insert(list(range(16)))
    shared.drain()
    cache.evict(16)
    node = cache.match_prefix(list(range(16))).last_host_node
    assert cache.load_back(node)
    lock = cache.lock(node)
    steps = shared.steps
    shared.drain()
    report = {
        "rounds": shared.steps - steps,
        "node": node.residency(),
        "nodes": len(cache.tree.nodes),
    }
    lock.release()
    return report


def after_a_reset(rank: int, world: int) -> str:
    """Every rank resets its cache and serves again; then the last rank alone evicts."""
    shared = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    for seed in (1, 2):
        for tokens in chat_trace(4, seed=seed):
            serve_request(shared.cache, tokens)
            shared.step()
        shared.drain()
        shared.verify_agreement()
        if seed == 1:
            shared.cache.reset()
    if rank == world - 1:
        shared.cache.evict(1000)
    try:
        shared.step()
        shared.verify_agreement()
    except RankDivergence as exc:
        return str(exc)
    return "no divergence"


def outcomes(shared: DistributedCache) -> list[str]:
    """What ``step``, ``drain`` and ``verify_agreement`` say, in turn."""
    said = []
    for call in (shared.step, shared.drain, shared.verify_agreement):
        try:
            call()
            said.append("ok")
        except RankDivergence as exc:
            said.append(str(exc))
    return said


def parted_keys(rank: int) -> dict[str, list[str]]:
    """The ranks cache different keys, where the transitions alone look the same on every rank.

    The same two prompts in another order; a prompt four times longer on one
    rank (same node, same events); one more prompt on one rank under
    ``write_through_selective``, whose insert fires no transition at all.
    """
    swapped = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    a, b = list(range(16)), list(range(100, 116))
    for prompt in (a, b) if rank == 0 else (b, a):
        swapped.cache.insert(prompt)
    longer = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    longer.cache.insert(list(range(16 if rank == 0 else 64)))
    selective = bench_config(debug=True, write_policy="write_through_selective")
    extra = DistributedCache(HiCache(selective), timeout=TIMEOUT)
    for tokens in chat_trace(4, seed=1):
        serve_request(extra.cache, tokens)
        extra.step()
    if rank == 1:
        extra.cache.insert(list(range(5000, 5032)))
    # the same prompt for another tenant: the same node, the same events, in another namespace
    tenants = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    tenants.cache.insert(a, namespace=_Tenant.A if rank == 0 else _Tenant.B)
    return {
        "swapped": outcomes(swapped),
        "longer": outcomes(longer),
        "extra": outcomes(extra),
        "tenants": outcomes(tenants),
    }


class _Tenant(enum.Enum):
    """A namespace kind a server may key its tenants or adapters by."""

    A = "a"
    B = "b"


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """Another: a value that compares by its name, not by the rank that loaded it."""

    name: str
    rank: int = dataclasses.field(default=0, compare=False)


def reset_alone(rank: int, world: int) -> list[str]:
    """The last rank resets its cache alone, then every rank serves one more request."""
    shared = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    for tokens in chat_trace(4, seed=1):
        serve_request(shared.cache, tokens)
        shared.step()
    shared.drain()
    shared.verify_agreement()
    if rank == world - 1:
        shared.cache.reset()
    serve_request(shared.cache, chat_trace(5, seed=1)[-1])
    return outcomes(shared)[::2]  # step and verify_agreement (drain says what step says)


def step_versus(rank: int, other: str) -> list[Any]:
    """Rank 0 steps where rank 1 calls ``other``: both raise at once, well inside the timeout.

    Both trees agree when they meet (one request served alike), so only the kind of
    the collective can tell the methods apart. On a gloo group of its own with a
    short timeout, which a timed-out collective would leave broken. The clock
    starts when both ranks have served (a barrier): a loaded machine may run
    one rank's request a second later than the other's.
    """
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    shared = DistributedCache(HiCache(bench_config(debug=True)), side, timeout=2.0)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    dist.barrier(group=side)
    started = time.monotonic()
    try:
        shared.step() if rank == 0 else getattr(shared, other)()
        said = "no error"
    except (RankDivergence, RankFailure) as exc:
        said = f"{type(exc).__name__}: {exc}"
    return [said, time.monotonic() - started < 1.0]


def raised_before_the_collective(rank: int) -> list[Any]:
    """Rank 1's own work before the step's collective raises: both raise at once.

    Rank 1 keeps a shorter event log than its digest needs (a configuration that
    differs between the ranks), so its step raises ConfigError before the
    all-reduce. On a gloo group of its own with a timeout the test would notice;
    the clock starts when both ranks have served, as in :func:`step_versus`.
    """
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    limit = {"log_limit": 1} if rank == 1 else {}
    shared = DistributedCache(HiCache(bench_config(debug=True, **limit)), side, timeout=5.0)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    before = len(shared.cache.log.transitions())
    dist.barrier(group=side)
    started = time.monotonic()
    try:
        shared.step()
        said = "no error"
    except (ConfigError, RankFailure) as exc:
        said = f"{type(exc).__name__}: {exc}"
    quick = time.monotonic() - started < 1.0
    return [said, quick, shared.steps, len(shared.cache.log.transitions()) - before]


@dataclasses.dataclass(frozen=True)
class _SlowReports(Collectives):
    """Takes part in every agreement, and is 3 s late to every report's gather."""

    def all_gather_object(self, obj: Any, what: str = "divergence report") -> list[Any]:
        time.sleep(3.0)
        return super().all_gather_object(obj, what)


def a_slow_report(rank: int) -> str:
    """The last rank diverges, then is slow to join the report's gather: the other gives up.

    On a gloo group of its own, which the timeout leaves broken. The ranks meet
    (a barrier) before the step, whose all-reduce has the same 1 s timeout.
    """
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    shared = DistributedCache(HiCache(bench_config()), side, timeout=1.0)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    shared.drain()
    if rank == 1:
        shared.cache.evict(1000)
        comm = shared.comm
        shared.comm = _SlowReports.of(
            comm.group, comm.timeout
        )  # its group's sockets: no collective
    dist.barrier(group=side)
    try:
        shared.step()
    except (RankDivergence, RankFailure) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _Lossy(FaultyCopyEngine):
    """Loses the completions of the copies started at the positions in ``lose`` (from 1)."""

    lose: frozenset[int] = frozenset()

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__(inner)
        self._lost: set[int] = set()

    def forget(self, tickets: Iterable[int]) -> None:
        """Lose the completions of these copies, already started."""
        self._lost.update(tickets)

    def start_write(self, device_pages: Any, host_pages: Any, *, stream: Any = None) -> Ticket:
        return self._mark(super().start_write(device_pages, host_pages, stream=stream))

    def start_load(self, host_pages: Any, device_pages: Any, *, stream: Any = None) -> Ticket:
        return self._mark(super().start_load(host_pages, device_pages, stream=stream))

    def _mark(self, ticket: Ticket) -> Ticket:
        if self.started in self.lose:
            self._lost.add(ticket.id)
        return ticket

    def poll(self) -> list[Completion]:
        return [c for c in super().poll() if c.ticket.id not in self._lost]

    def drain(self) -> list[Completion]:
        return [c for c in super().drain() if c.ticket.id not in self._lost]


def lost_completion(rank: int, world: int, *, stall: bool) -> tuple[str, int]:
    """The last rank loses the completion of the first copy of the seventh request.

    ``stall``: keep polling until the group gives up on the copy; otherwise
    drain, which must notice the loss at once. Returns the message and how many
    polls after the loss returned normally.

    The stall clock (the agreement's ``time``) is moved by hand, faster on rank
    0 than on rank 1, so the ranks' clocks disagree on when the copy is overdue:
    they must still give up at the same step. The collectives keep the long
    timeout (as a 1 s one, a loaded machine could time one out instead).
    """
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=_Lossy.copier())), timeout=TIMEOUT
    )
    copier = shared.cache.tiers.copier
    assert isinstance(copier, _Lossy)
    trace = chat_trace(7, seed=1)
    for tokens in trace[:-1]:
        serve_request(shared.cache, tokens)
        shared.step()
    if rank == world - 1:
        copier.lose = frozenset({copier.started + 1})
    serve_request(shared.cache, trace[-1])
    polls = 0
    clock = HandClock()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agreement, "time", clock)
        try:
            if not stall:
                shared.drain()
            for _ in range(40):  # 40 s of steps on rank 0: longer than the timeout, and bounded
                shared.step()
                polls += 1
                clock.now += 1.0 if rank == 0 else 0.5
        except RankDivergence as exc:
            return str(exc), polls
    return "no divergence", polls


def lost_in_a_wait(rank: int, world: int) -> list[str]:
    """The last rank loses the completion of a copy an insert then waits for.

    Steps come every four requests; the 21st request's insert must wait for
    the copies in flight (device memory is short), and applies them all on
    every rank without a collective. The last rank, which lost one, raises
    there; every rank raises at the next step. Returns both messages.
    """
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=_Lossy.copier())), timeout=TIMEOUT
    )
    copier = shared.cache.tiers.copier
    assert isinstance(copier, _Lossy)
    trace = chat_trace(21, seed=1)
    serve_chat_trace(shared.cache, trace[:-1], every(4, shared.step), evict_every=len(trace))
    in_flight = shared.cache.issued()
    assert in_flight
    if rank == world - 1:
        copier.forget(in_flight[:1])
    waited = len(shared.cache.log.acknowledgements())
    messages = []
    try:
        serve_request(shared.cache, trace[-1])
        assert any(origin == "wait" for origin, _ in shared.cache.log.acknowledgements()[waited:])
        messages.append("served")
    except RankDivergence as exc:
        messages.append(str(exc))
    try:
        shared.step()
        messages.append("no divergence")
    except RankDivergence as exc:
        messages.append(str(exc))
    return messages


class _Spoiling(FaultyCopyEngine):
    """Reports the copies it is told to spoil, already started, as failed."""

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__(inner)
        self._spoilt: set[int] = set()

    def spoil(self, tickets: Iterable[int]) -> None:
        self._spoilt.update(tickets)

    def poll(self) -> list[Completion]:
        return [self._outcome(c) for c in super().poll()]

    def drain(self) -> list[Completion]:
        return [self._outcome(c) for c in super().drain()]

    def _outcome(self, completion: Completion) -> Completion:
        if completion.ticket.id not in self._spoilt:
            return completion
        return Completion(completion.ticket, CopyFailed("injected failure"))


def failed_in_a_wait(rank: int, world: int) -> list[str]:
    """As :func:`lost_in_a_wait`, but the last rank's copy fails instead of going unreported.

    A wait applies each rank's own outcome, so the ranks part there, and the next
    step names it on every rank.
    """
    config = bench_config(debug=True, copier=_Spoiling.copier())
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    copier = shared.cache.tiers.copier
    assert isinstance(copier, _Spoiling)
    trace = chat_trace(21, seed=1)
    serve_chat_trace(shared.cache, trace[:-1], every(4, shared.step), evict_every=len(trace))
    if rank == world - 1:
        copier.spoil(shared.cache.issued()[:1])
    serve_request(shared.cache, trace[-1])
    try:
        shared.step()
    except RankDivergence as exc:
        return [str(exc)]
    return ["no divergence"]


def count_collectives(calls: list[tuple[str, Any, list[str]]]) -> Callable[[], None]:
    """Record ``(name, group, tensor devices)`` of each collective started here; return the undo.

    An exchange over same-host sockets is recorded as ``("same-host rows", its
    SameHostRows, [])``.
    """
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier")
    saved = {name: getattr(dist, name) for name in names}
    exchange = SameHostRows.exchange

    def exchanging(self: SameHostRows, data: bytes, timeout: float) -> list[bytes]:
        calls.append(("same-host rows", self, []))
        return exchange(self, data, timeout)

    def recording(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls.append((name, kwargs.get("group"), [str(t.device) for t in tensors]))
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, recording(name))
    SameHostRows.exchange = exchanging  # type: ignore[method-assign]

    def undo() -> None:
        for name, original in saved.items():
            setattr(dist, name, original)
        SameHostRows.exchange = exchange  # type: ignore[method-assign]

    return undo


def one_collective_per_step(rank: int, local_sockets: bool) -> dict[str, Any]:
    """Serve 96 requests in three steps of 32 under memory pressure; count the collectives."""
    shared = DistributedCache(HiCache(skewed(rank)), timeout=TIMEOUT, local_sockets=local_sockets)
    calls: list[tuple[str, Any, list[str]]] = []
    per_step = []
    undo = count_collectives(calls)
    try:
        trace = chat_trace(96)
        for start in (0, 32, 64):
            before = len(calls)
            serve_chat_trace(shared.cache, trace[start : start + 32], lambda: None)
            served = len(calls)
            shared.step()
            per_step.append([served - before, len(calls) - served])
    finally:
        undo()
    acks = shared.cache.log.acknowledgements()
    return {
        "per_step": per_step,  # [collectives while serving, collectives in step()]
        "names": sorted({name for name, *_ in calls}),
        "waits": sum(origin == "wait" and len(applied) > 0 for origin, applied in acks),
        "steps": shared.steps,
        "transport": shared.comm.transport,
    }


def agree_on_a_side_group(rank: int, local_sockets: bool) -> dict[str, Any]:
    """A default group that is not gloo (NCCL, as far as the cache can tell): a gloo side group.

    Only the default group's backend is disguised; the side group is a real gloo group.
    """
    real = dist.get_backend

    def nccl_default(group: Any = None) -> str:
        return "nccl" if group is None or group is dist.group.WORLD else real(group)

    dist.get_backend = nccl_default  # type: ignore[assignment]
    try:
        shared = DistributedCache(
            HiCache(skewed(rank)), timeout=TIMEOUT, local_sockets=local_sockets
        )
    finally:
        dist.get_backend = real
    return observe_agreement(shared)


def agree_on_a_given_group(rank: int, local_sockets: bool) -> dict[str, Any]:
    """A gloo group built by the caller (SGLang's ``tp_cpu_group``) is used as it is."""
    tp_cpu_group = dist.new_group(backend="gloo")
    shared = DistributedCache(
        HiCache(skewed(rank)), tp_cpu_group, timeout=TIMEOUT, local_sockets=local_sockets
    )
    report = observe_agreement(shared)
    report["given"] = shared.group is tp_cpu_group
    return report


def observe_agreement(shared: DistributedCache) -> dict[str, Any]:
    """Serve a few steps, drain, verify; report the group and every collective's group and tensors."""
    calls: list[tuple[str, Any, list[str]]] = []
    undo = count_collectives(calls)
    try:
        serve_chat_trace(shared.cache, chat_trace(24, seed=4), every(8, shared.step))
        shared.drain()
        shared.verify_agreement()
    finally:
        undo()
    return {
        "backend": str(dist.get_backend(shared.group)),
        "default": shared.group is None or shared.group is dist.group.WORLD,
        "on_the_group": all(group in (shared.group, shared.comm.sockets) for _, group, _ in calls),
        "devices": sorted({d for *_, devices in calls for d in devices}),
        "collectives": len(calls),
        "names": sorted({name for name, *_ in calls}),
        "device": str(shared.device),
        "transport": shared.comm.transport,
    }


def survive_a_hang(rank: int) -> str:
    """Rank 1 stops taking part for longer than the timeout; rank 0 must give up, not wait."""
    shared = DistributedCache(HiCache(bench_config()), timeout=1.0)
    shared.step()
    if rank == 1:
        time.sleep(3.0)
    try:
        shared.step()
    except RankFailure as exc:
        return str(exc)
    return "finished"


def four_rank_worker(rank: int, world: int, store: str, out: str) -> None:
    join_group(rank, world, store)
    report: dict[str, Any] = {"workload": agree_on_workload(rank)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    report["three_methods"] = three_methods(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    report["death"] = survive_a_death(rank, world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def three_methods(rank: int) -> str:
    """Ranks 0 and 1 step, rank 2 verifies, rank 3 drains: each must be named for its own.

    On a gloo group of its own, as :func:`step_versus`.
    """
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    shared = DistributedCache(HiCache(bench_config(debug=True)), side, timeout=5.0)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    call = {2: shared.verify_agreement, 3: shared.drain}.get(rank, shared.step)
    try:
        call()
    except RankDivergence as exc:
        return str(exc)
    return "no divergence"


def survive_a_death(rank: int, world: int) -> str:
    """The last rank dies after three requests; the others must fail, not hang."""
    shared = DistributedCache(HiCache(skewed(rank)), timeout=TIMEOUT)
    try:
        for i, tokens in enumerate(chat_trace(40, seed=2)):
            if i == 3 and rank == world - 1:
                os._exit(0)  # dies without a word, as a crashed rank does
            serve_request(shared.cache, tokens)
            shared.step()
    except RankFailure as exc:
        return str(exc)
    return "finished"


class _LaunchFails(FaultyCopyEngine):
    """Fails the copies at the positions in ``fail`` at their launch: a wait says so at once."""

    def __init__(self, inner: CopyEngine, **faults: Any) -> None:
        super().__init__(inner, **faults)
        self.launch_failed: set[int] = set()

    def start_load(self, host_pages: Any, device_pages: Any, *, stream: Any = None) -> Ticket:
        ticket = super().start_load(host_pages, device_pages, stream=stream)
        if self.started in self.fail:
            self.launch_failed.add(ticket.id)
        return ticket

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> bool:
        ids = list(ticket_ids)
        return not self.launch_failed.intersection(ids) and super().wait(ids, stream)


def host_only(shared: DistributedCache, *prompts: list[int]) -> None:
    """Cache ``prompts``, back them up on every rank, and evict them from the device."""
    for prompt in prompts:
        shared.cache.insert(prompt)
    shared.drain()
    shared.cache.evict(1000)


def a_launch_failed_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank's load fails at its launch: every rank's wait must say no, then yes."""
    config = bench_config(debug=True, copier=_LaunchFails.copier(), load_back_threshold=1)
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    cache, prompt = shared.cache, list(range(16))
    host_only(shared, prompt)
    copier = cache.tiers.copier
    assert isinstance(copier, _LaunchFails)
    if rank == world - 1:
        copier.fail = frozenset({copier.started + 1})
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    assert chain
    lock = cache.lock(chain[-1])
    said = [cache.wait_loaded(chain)]
    shared.step()  # failed on every rank; locked, so copied again
    said.append(cache.wait_loaded(chain))
    lock.release()
    shared.drain()
    shared.verify_agreement()
    acks = [[number, ok] for _, batch in cache.log.acknowledgements() for number, ok in batch]
    return {"said": said, "acks": acks, "node": chain[-1].residency()}


def a_failure_held_back_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank's load fails while the others' is still copying: every wait must say no.

    The step reports the failure on the last rank and holds it back, unapplied
    (the others' copies have not finished), so the node is still loading there
    and its copy engine no longer knows the copy: it answered that the copy
    could be read, and every rank ran the forward pass over pages it never wrote.
    """
    config = bench_config(debug=True, copier=FaultyCopyEngine.copier(), load_back_threshold=1)
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    cache, prompt = shared.cache, list(range(16))
    host_only(shared, prompt)
    copier = cache.tiers.copier
    assert isinstance(copier, FaultyCopyEngine)
    if rank == world - 1:
        copier.fail = frozenset({copier.started + 1})
    else:
        copier.delay = 1
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    assert chain
    lock = cache.lock(chain[-1])
    applied = shared.step()
    held, said = shared.buffered, cache.wait_loaded(chain)
    lock.release()
    shared.drain()
    shared.verify_agreement()
    acks = [[number, ok] for _, batch in cache.log.acknowledgements() for number, ok in batch]
    return {"applied": applied, "held": held, "said": said, "acks": acks}


class _BrokenStart(FaultyCopyEngine):
    """Raises RuntimeError, no refusal (a broken engine), at the next load's start, once."""

    def __init__(self, inner: CopyEngine, **faults: Any) -> None:
        super().__init__(inner, **faults)
        self.break_next = False

    def start_load(self, host_pages: Any, device_pages: Any, *, stream: Any = None) -> Ticket:
        if self.break_next:
            self.break_next = False
            raise RuntimeError("injected broken engine")
        return super().start_load(host_pages, device_pages, stream=stream)


def a_load_refused_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank's copy engine refuses to start a load: every rank must answer alike.

    The refused start failed the load at once there alone: that rank's
    ``load_back`` answered None where the others' answered the chain, and
    the ranks parted at the call, named only at the next collective.
    """
    copier = FaultyCopyEngine.copier()
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=copier, load_back_threshold=1)), timeout=TIMEOUT
    )
    cache, prompt = shared.cache, list(range(16))
    host_only(shared, prompt)
    engine = cache.tiers.copier
    assert isinstance(engine, FaultyCopyEngine)
    if rank == world - 1:
        engine.refuse = frozenset({engine.started + 1})
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    report: dict[str, Any] = {"chain": None if chain is None else [n.id for n in chain]}
    try:
        lock = cache.lock(chain[-1]) if chain else None
        said = [cache.wait_loaded(chain or [])]
        applied = shared.step()  # failed on every rank; locked, so copied again
        said.append(cache.wait_loaded(chain or []))
        if lock is not None:
            lock.release()
        shared.drain()
        shared.verify_agreement()
    except RankDivergence as exc:
        report["divergence"] = str(exc)
        return report
    acks = [[number, ok] for _, batch in cache.log.acknowledgements() for number, ok in batch]
    node = chain[-1].residency() if chain else None
    report.update(said=said, applied=applied, acks=acks, node=node)
    return report


def a_refused_load_waited_for(rank: int, world: int) -> dict[str, Any]:
    """The last rank refuses a load's start, and an insert through the chain waits for it.

    The known gap of a copy failing on one rank inside a wait, pinned: the wait
    applies each rank's own outcome (failed on the last rank, done on the
    others), so the ranks part there, and the next step names it on every rank.
    """
    copier = FaultyCopyEngine.copier()
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=copier, load_back_threshold=1)), timeout=TIMEOUT
    )
    cache, prompt = shared.cache, list(range(16))
    host_only(shared, prompt)
    engine = cache.tiers.copier
    assert isinstance(engine, FaultyCopyEngine)
    if rank == world - 1:
        engine.refuse = frozenset({engine.started + 1})
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    cache.insert([*prompt, *range(500, 516)])  # through the loading chain: waits for it
    report: dict[str, Any] = {"chain": None if chain is None else [n.id for n in chain]}
    report["loaded"] = [n.device for n in chain or []]
    try:
        shared.step()
        report["step"] = "no divergence"
    except RankDivergence as exc:
        report["step"] = f"{type(exc).__name__}: {exc}"
    return report


def a_write_refused_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank's copy engine refuses to start a backup: it must fail on every rank.

    The refused start failed the backup at once there alone (``unbacked``
    there, ``writing`` elsewhere), and the next step named the ranks apart.
    """
    refuse = {1} if rank == world - 1 else set()
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=FaultyCopyEngine.copier(refuse=refuse))),
        timeout=TIMEOUT,
    )
    cache = shared.cache
    cache.insert(list(range(16)))
    report: dict[str, Any] = {"after_insert": cache.tree.nodes[1].residency()}
    try:
        report["applied"] = shared.step()
        shared.drain()
        shared.verify_agreement()
    except RankDivergence as exc:
        report["divergence"] = str(exc)
        return report
    report["node"] = cache.tree.nodes[1].residency()
    return report


def waits_for_different_loads(rank: int, world: int) -> list[str]:
    """The last rank's engine breaks at its first load's start, so it waits for the second's.

    Its ``load_back`` raised (the broken start failed the load there alone) and
    the others' did not: their waits must not pair up as if they were one.
    """
    shared = DistributedCache(
        HiCache(bench_config(debug=True, copier=_BrokenStart.copier(), load_back_threshold=1)),
        timeout=TIMEOUT,
    )
    cache = shared.cache
    prompts = [list(range(16)), list(range(100, 116))]
    host_only(shared, *prompts)
    engine = cache.tiers.copier
    assert isinstance(engine, _BrokenStart)
    engine.break_next = rank == world - 1
    try:
        for prompt in prompts:
            try:
                chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
            except CopyFailed:
                continue
            if chain:
                cache.wait_loaded(chain)
                break
        shared.step()
    except RankDivergence as exc:
        return [where(exc), str(exc)]
    return ["no divergence"]


def where(exc: BaseException) -> str:
    """The DistributedCache method, or cache operation, whose frame raised ``exc`` last."""
    names = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
    return next(n for n in reversed(names) if n in ("step", "_agree_wait", "wait_loaded"))


def failed_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank's allocator breaks in an insert under ``write_through_selective``.

    The insert fires no transition where it succeeds, so only the failure, logged
    on the rank where it happened, tells the ranks apart.
    """
    selective = bench_config(debug=True, write_policy="write_through_selective")
    shared = DistributedCache(HiCache(selective), timeout=TIMEOUT)
    cache = shared.cache
    for tokens in chat_trace(4, seed=1):
        serve_request(cache, tokens)
        shared.step()
    before = fingerprint(cache)
    allocator = cache.tiers.device.allocator
    if rank == world - 1:

        def broken(*args: Any, **kwargs: Any) -> list[int]:
            raise RuntimeError("injected allocator fault")

        allocator.alloc = broken  # type: ignore[method-assign]
    try:
        cache.insert(list(range(5000, 5032)))
        raised = "served"
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        vars(allocator).pop("alloc", None)
    return {"raised": raised, "unchanged": fingerprint(cache) == before, "said": outcomes(shared)}


def failed_taking_over(rank: int, world: int, *, everywhere: bool) -> dict[str, Any]:
    """The allocator breaks as an insert's new leaf takes its pages: on the last rank, or on all.

    The leaf stayed in the tree before the failure, unlogged, holding pages the
    allocator did not give it: a replay of the rank's log skipped the insert
    and built another tree, and where it broke on every rank the step agreed
    on caches that all held the broken leaf.
    """
    selective = bench_config(debug=True, write_policy="write_through_selective")
    shared = DistributedCache(HiCache(selective), timeout=TIMEOUT)
    cache = shared.cache
    for tokens in chat_trace(4, seed=1):
        serve_request(cache, tokens)
        shared.step()
    before = fingerprint(cache)
    allocator = cache.tiers.device.allocator
    if everywhere or rank == world - 1:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected allocator fault")

        allocator.reassign = broken  # type: ignore[method-assign]
    try:
        cache.insert(list(range(5000, 5032)))
        raised = "served"
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        vars(allocator).pop("reassign", None)
    unchanged = fingerprint(cache) == before
    try:
        said = outcomes(shared)
    except InvariantViolation as exc:  # a debug cache's check after the step applied
        said = [str(exc)]
    replayed = fingerprint(replay(cache.log, selective)) == fingerprint(cache)
    try:
        cache.check_invariants()
        sound = "sound"
    except InvariantViolation as exc:
        sound = str(exc)
    return {
        "raised": raised,
        "unchanged": unchanged,
        "said": said,
        "replayed": replayed,
        "sound": sound,
    }


def queued_on_one_rank(rank: int, world: int) -> str:
    """The last rank keeps a node queued for a copy that no operation started.

    The bug simulated: a rank's own bookkeeping queues a copy the others' does
    not. Nothing public can do that, so the test queues it by hand, as an
    effect would. Only the flag of anything in flight or queued tells the ranks apart.
    """
    shared = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    cache = shared.cache
    cache.insert(list(range(16)))
    shared.drain()
    if rank == world - 1:
        cache.transfers.queue(Direction.D2H, cache.tree.nodes[1])
    try:
        shared.step()
    except RankDivergence as exc:
        return str(exc)
    return "no divergence"


def answers_worker(rank: int, world: int, store: str, out: str) -> None:
    """Scenarios of what the cache answers its caller, and of failures on one rank."""
    join_group(rank, world, store)
    report: dict[str, Any] = {
        "launch_failed": a_launch_failed_on_one_rank(rank, world),
        "failure_held_back": a_failure_held_back_on_one_rank(rank, world),
        "load_refused": a_load_refused_on_one_rank(rank, world),
        "write_refused": a_write_refused_on_one_rank(rank, world),
        "different_loads": waits_for_different_loads(rank, world),
        "failed_on_one": failed_on_one_rank(rank, world),
        "taking_over_on_one": failed_taking_over(rank, world, everywhere=False),
        "taking_over_everywhere": failed_taking_over(rank, world, everywhere=True),
        "queued_on_one": queued_on_one_rank(rank, world),
        "refused_then_waited": a_refused_load_waited_for(rank, world),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# -- multi-process tests ---------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return spawn(two_rank_worker, 2, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return spawn(four_rank_worker, 4, tmp_path_factory.mktemp("tp4"))


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return spawn(answers_worker, 2, tmp_path_factory.mktemp("answers"))


def test_a_failed_load_held_back_by_a_step_is_unready_on_every_rank(answers: Results) -> None:
    """Its copy engine forgot the copy once it reported it; the step holds the failure back."""
    last = len(answers) - 1
    for rank, result in enumerate(answers):
        report = result["failure_held_back"]
        assert report["applied"] == 0
        assert report["held"] == (1 if rank == last else 0)
        assert report["said"] is False
    assert answers[0]["failure_held_back"]["acks"] == answers[last]["failure_held_back"]["acks"]


def test_a_load_whose_launch_failed_on_one_rank_is_unready_on_every_rank(
    answers: Results,
) -> None:
    """``wait_loaded`` said False on the failing rank only, so the ranks ran different passes."""
    for result in answers:
        report = result["launch_failed"]
        assert report["said"] == [False, True]
        # the load (copy 2) applied as failed on every rank, and copied again (copy 3)
        assert report["acks"] == [[1, True], [2, False], [3, True]]
        assert report["node"] == "backed/resident (pins=0, locks=0)"


def test_a_load_refused_at_its_start_on_one_rank_is_answered_alike(answers: Results) -> None:
    """Refused there, it failed at once there alone: ``load_back`` said None on that rank only."""
    for result in answers:
        report = result["load_refused"]
        assert report.get("divergence") is None
        assert report["chain"] == [1]
        assert report["said"] == [False, True]
        assert report["applied"] == 1
        # the load (copy 2) applied as failed on every rank, and copied again (copy 3)
        assert report["acks"] == [[1, True], [2, False], [3, True]]
        assert report["node"] == "backed/resident (pins=0, locks=0)"


def test_a_load_refused_on_one_rank_and_waited_for_parts_the_ranks_named_alike(
    answers: Results,
) -> None:
    """Pins the known gap: the wait applies each rank's own outcome before the step can agree."""
    key = hash((*range(16), *range(500, 516))) & ((1 << 64) - 1)
    insert = f"insert(<32 ids {key:016x}>, None, None)"
    want = (
        f"RankDivergence: rank divergence at transition 4: rank 0 applied node 1 load_done in"
        f" {insert}, rank 1 applied node 1 load_failed in {insert}; node 1 now: rank 0"
        " backed/resident (pins=0, locks=0), rank 1 backed/resident (pins=0, locks=0)"
    )
    for result in answers:
        report = result["refused_then_waited"]
        assert report["chain"] == [1]  # the refused start kept in flight: a chain everywhere
        assert report["loaded"] == ["resident"]  # done here, or failed and recomputed
        assert report["step"] == want


def test_a_write_refused_at_its_start_on_one_rank_fails_on_every_rank(answers: Results) -> None:
    """Refused there, it failed at once there alone, and the next step named the ranks apart."""
    for result in answers:
        report = result["write_refused"]
        assert report.get("divergence") is None
        assert report["after_insert"] == "writing/resident (pins=0, locks=0)"
        assert report["applied"] == 1
        assert report["node"] == "unbacked/resident (pins=0, locks=0)"


def test_waits_for_different_loads_part_the_ranks_at_the_wait(answers: Results) -> None:
    """The wait compares the digests: a rank whose load gave up alone is named there."""
    want = (
        "rank divergence at transition 7: rank 0 applied nothing (only 7 transitions), "
        "rank 1 applied node 1 load_failed in load_back(1); node 1 now: rank 0 "
        "pinned/loading (pins=1, locks=0), rank 1 backed/absent (pins=0, locks=0)"
    )
    assert [r["different_loads"] for r in answers] == [["_agree_wait", want]] * 2


def test_an_operation_that_failed_on_one_rank_is_named_at_the_step(answers: Results) -> None:
    """An allocator that broke on one rank under selective write-through went unseen."""
    key = hash(tuple(range(5000, 5032))) & ((1 << 64) - 1)
    want = (
        "rank divergence after transition 8: an operation failed on some ranks only: "
        f"rank 0 had no failure, rank 1's insert(<32 ids {key:016x}>, None, None) raised "
        "RuntimeError: injected allocator fault"
    )
    first, last = (r["failed_on_one"] for r in answers)
    assert first["raised"] == "served"
    assert last["raised"] == "injected allocator fault"
    assert last["unchanged"]  # the failed insert changed nothing there
    assert first["said"] == last["said"] == [want] * 3


def test_an_allocator_that_broke_as_a_new_leaf_took_its_pages_changed_nothing(
    answers: Results,
) -> None:
    """The leaf stayed, unlogged: the rank's log replayed into another tree, and where it
    broke on every rank the step agreed on caches that all held it."""
    key = hash(tuple(range(5000, 5032))) & ((1 << 64) - 1)
    want = (
        "rank divergence after transition 8: an operation failed on some ranks only: "
        f"rank 0 had no failure, rank 1's insert(<32 ids {key:016x}>, None, None) raised "
        "RuntimeError: injected allocator fault"
    )
    first, last = (r["taking_over_on_one"] for r in answers)
    assert first["raised"] == "served"
    assert last["raised"] == "injected allocator fault"
    assert last["unchanged"]
    assert first["said"] == last["said"] == [want] * 3
    for result in answers:
        assert result["taking_over_on_one"]["replayed"]
        assert result["taking_over_on_one"]["sound"] == "sound"
        report = result["taking_over_everywhere"]
        assert report["raised"] == "injected allocator fault"
        assert report["unchanged"]
        assert report["said"] == ["ok"] * 3
        assert report["replayed"]
        assert report["sound"] == "sound"


def test_a_rank_with_a_copy_queued_alone_is_named(answers: Results) -> None:
    """Only the flag of anything queued differs: the message said "the digests differ"."""
    want = (
        "rank divergence after transition 2: the ranks have different copies waiting to "
        "start: rank 0 none, rank 1 d2h of nodes [1]; node 1 now: rank 0 backed/resident "
        "(pins=0, locks=0), rank 1 backed/resident (pins=0, locks=0)"
    )
    assert [r["queued_on_one"] for r in answers] == [want, want]


def assert_agreed(results: Results) -> None:
    runs = [r["workload"] for r in results]
    first = runs[0]
    assert first["in_flight"] == 0
    for event in ("write_done", "load_done", "evict_device", "evict_host"):
        assert first["events"][event] > 0, event
    for run in runs[1:]:
        assert run["digest"] == first["digest"]
        assert run["transitions"] == first["transitions"]
        assert run["events"] == first["events"]
        assert run["tree"] == first["tree"]
    # the fast rank really ran ahead of the slow ones: completions waited for agreement
    assert runs[0]["ahead"] > 0
    # allocations under pressure waited for copies inside the operation, identically
    assert first["waits"] > 0
    assert all(run["waits"] == first["waits"] for run in runs)


def test_two_ranks_with_skewed_acks_end_identical(two_ranks: Results) -> None:
    assert_agreed(two_ranks)


def test_four_ranks_with_skewed_acks_end_identical(four_ranks: Results) -> None:
    assert_agreed(four_ranks)


def test_a_dropped_acknowledgement_is_named(two_ranks: Results) -> None:
    want = (
        "rank divergence after transition 24: the ranks wait on different copies: "
        "rank 0 on 1 copy of nodes [8], rank 1 on 0 copies; "
        "node 8 now: rank 0 writing/resident (pins=0, locks=0), "
        "rank 1 writing/resident (pins=0, locks=0)"
    )
    assert [r["dropped_ack"] for r in two_ranks] == [want, want]


def test_an_eviction_on_one_rank_is_named_at_the_next_step(two_ranks: Results) -> None:
    want = (
        "rank divergence at transition 24: rank 0 applied nothing (only 24 transitions), "
        "rank 1 applied node 4 evict_device in evict(8); "
        "node 4 now: rank 0 backed/resident (pins=0, locks=0), "
        "rank 1 backed/absent (pins=0, locks=0)"
    )
    assert [r["extra_eviction"] for r in two_ranks] == [want, want]


def test_a_copy_failed_on_one_rank_in_a_wait_is_named_at_the_next_step(
    two_ranks: Results,
) -> None:
    key = hash(tuple(chat_trace(21, seed=1)[-1])) & ((1 << 64) - 1)
    insert = f"insert(<44 ids {key:016x}>, None, None)"  # the request that waited
    want = (
        f"rank divergence at transition 96: rank 0 applied node 21 write_done in {insert}, "
        f"rank 1 applied node 21 write_failed in {insert}; node 21 now: rank 0 backed/resident "
        "(pins=0, locks=0), rank 1 unbacked/resident (pins=0, locks=0)"
    )
    assert [r["failed_in_wait"] for r in two_ranks] == [[want], [want]]


def test_a_copy_failed_on_one_rank_fails_on_every_rank(two_ranks: Results) -> None:
    first, last = (r["failed_copy"] for r in two_ranks)
    assert first["outcome"] == last["outcome"] == "no divergence"
    assert first["failed"] == last["failed"] == [[3, "write_failed"]]
    assert first["tree"] == last["tree"]


def test_ranks_leave_drain_together_after_a_copy_failed_on_one(two_ranks: Results) -> None:
    first, last = (r["fail_then_drain"] for r in two_ranks)
    assert first == last
    assert first["failed"] == [[1, "write_failed"]]
    assert first["issued"] == 0


def test_drain_returns_while_a_locked_load_keeps_failing(two_ranks: Results) -> None:
    for rank in two_ranks:
        report = rank["failing_locked_load"]
        assert report["node"] == "pinned/loading (pins=1, locks=1)"
        assert report["rounds"] == report["nodes"] + 2


def test_a_divergence_after_a_reset_is_named(two_ranks: Results) -> None:
    want = (
        "rank divergence at transition 13: rank 0 applied nothing (only 13 transitions), "
        "rank 1 applied node 1 evict_device in evict(1000); node 1 now: rank 0 "
        "backed/resident (pins=0, locks=0), rank 1 backed/absent (pins=0, locks=0)"
    )
    assert [r["after_reset"] for r in two_ranks] == [want, want]


def test_ranks_that_cached_different_keys_are_named(two_ranks: Results) -> None:
    """Keys, their order and inserts without a transition are in the digest (they were not)."""
    a, b = hash(tuple(range(16))), hash(tuple(range(100, 116)))
    longer, extra = hash(tuple(range(64))), hash(tuple(range(5000, 5032)))
    mask = (1 << 64) - 1
    head = "rank divergence after transition {}: the ranks served different operations: "
    swapped = head.format(0) + (
        f"rank 0 called insert(<16 ids {a & mask:016x}>, None, None), "
        f"rank 1 called insert(<16 ids {b & mask:016x}>, None, None)"
    )
    lengths = head.format(0) + (
        f"rank 0 called insert(<16 ids {a & mask:016x}>, None, None), "
        f"rank 1 called insert(<64 ids {longer & mask:016x}>, None, None)"
    )
    more = head.format(8) + (
        f"rank 0 did nothing more, rank 1 called insert(<32 ids {extra & mask:016x}>, None, None)"
    )
    tenants = head.format(0) + (
        f"rank 0 called insert(<16 ids {a & mask:016x}>, _Tenant.A, None), "
        f"rank 1 called insert(<16 ids {a & mask:016x}>, _Tenant.B, None)"
    )
    for result in two_ranks:
        parted = result["parted_keys"]
        assert parted["swapped"] == [swapped] * 3
        assert parted["longer"] == [lengths] * 3
        assert parted["extra"] == [more] * 3
        # an enum namespace folded in by its type only: both ranks said "ok" (it did)
        assert parted["tenants"] == [tenants] * 3


def test_a_reset_on_one_rank_is_named_alike_on_every_rank(two_ranks: Results) -> None:
    want = (
        "rank divergence: the cache was reset on rank 1 and not on rank 0 (resets: rank 0 0, "
        "rank 1 1); every rank must reset its cache at the same point"
    )
    assert [r["reset_alone"] for r in two_ranks] == [[want, want], [want, want]]


def test_ranks_in_a_step_and_a_verification_raise_at_once(two_ranks: Results) -> None:
    want = (
        "RankDivergence: rank divergence after transition 0: the ranks reached different "
        "collectives: rank 0 a step, rank 1 a digest verification (the ranks called "
        "different DistributedCache methods)"
    )
    assert [r["step_vs_verify"] for r in two_ranks] == [[want, True], [want, True]]


def test_ranks_in_a_step_and_a_drain_raise_at_once(two_ranks: Results) -> None:
    want = (
        "RankDivergence: rank divergence after transition 0: the ranks reached different "
        "collectives: rank 0 a step, rank 1 a drain (the ranks called different "
        "DistributedCache methods)"
    )
    assert [r["step_vs_drain"] for r in two_ranks] == [[want, True], [want, True]]


def test_a_rank_that_raises_before_the_collective_takes_the_others_along(
    two_ranks: Results,
) -> None:
    """The others raise at once, naming the rank and its error, and apply nothing."""
    raised = (
        "ConfigError: distributed: the event log dropped {} entries the transition digest "
        "had not read; raise CacheConfig.log_limit"
    )
    mine, other = two_ranks[1]["raised_before"], two_ranks[0]["raised_before"]
    dropped = re.fullmatch(raised.replace("{}", r"(\d+)"), mine[0])
    assert dropped, mine
    told = raised.format(dropped[1]).replace("ConfigError: ", "ConfigError in step: ", 1)
    assert other[0] == (
        "RankFailure: rank 0 of 2: the agreement stopped before its collective, and no "
        f"rank applied anything in it: rank 1 raised {told}"
    )
    assert [mine[1:], other[1:]] == [[True, 0, 0], [True, 0, 0]]


def test_a_slow_rank_in_a_divergence_report_fails_the_other_after_the_timeout(
    two_ranks: Results,
) -> None:
    pattern = (
        r"RankFailure: rank 0 of 2: divergence report \(all_gather sizes\) failed after "
        r"[1-9]\d*\.\d\d s \(timeout 1 s\): another rank died or stopped taking part: .+"
    )
    assert re.fullmatch(pattern, two_ranks[0]["slow_report"]), two_ranks[0]["slow_report"]


def test_a_lost_completion_is_named_when_draining(two_ranks: Results) -> None:
    want = (
        "rank divergence after transition 24: a completion was lost: rank 1 drained its "
        "copy engine without the completion of copy 1 of 1 in flight (nodes [8]); "
        "node 8 now: rank 0 writing/resident (pins=0, locks=0), "
        "rank 1 writing/resident (pins=0, locks=0)"
    )
    assert [r["lost_in_drain"] for r in two_ranks] == [[want, 0], [want, 0]]


def test_a_completion_missing_past_the_timeout_is_named_when_stepping(two_ranks: Results) -> None:
    want = (
        "rank divergence after transition 24: copy 1 of 1 in flight (nodes [8]) finished "
        "on rank 0 and not on rank 1 for longer than the timeout (20 s); "
        "node 8 now: rank 0 writing/resident (pins=0, locks=0), "
        "rank 1 writing/resident (pins=0, locks=0)"
    )
    assert [r["lost_in_poll"][0] for r in two_ranks] == [want, want]
    # both ranks gave up at the same step, and not at the first one: that one starts the clock
    polls = {r["lost_in_poll"][1] for r in two_ranks}
    assert len(polls) == 1
    assert 1 <= polls.pop() < 40


def test_a_completion_lost_in_a_wait_is_named_at_the_next_step(two_ranks: Results) -> None:
    here = (
        "rank 1 of 2: a completion was lost: this rank drained its copy engine without the "
        "completion of copy 1 of 2 in flight (nodes [21]); every rank raises at the next step"
    )
    want = (
        "rank divergence after transition 96: a completion was lost: rank 1 drained its "
        "copy engine without the completion of copy 1 of 2 in flight (nodes [21]); "
        "node 21 now: rank 0 backed/resident (pins=0, locks=0), "
        "rank 1 writing/resident (pins=0, locks=0)"
    )
    assert [r["lost_in_wait"] for r in two_ranks] == [["served", want], [here, want]]


@pytest.mark.parametrize(
    ("scenario", "name", "transport"),
    [("per_step", "same-host rows", "same-host sockets"), ("per_step_gloo", "all_gather", "gloo")],
)
def test_a_step_of_32_requests_takes_one_collective(
    two_ranks: Results, scenario: str, name: str, transport: str
) -> None:
    for result in two_ranks:
        run = result[scenario]
        # serving, waits for copies under memory pressure included, takes no collective
        assert run["per_step"] == [[0, 1], [0, 1], [0, 1]]
        assert run["names"] == [name]
        assert run["transport"] == transport
        assert run["waits"] > 0
        assert run["steps"] == 3
    assert two_ranks[0][scenario]["waits"] == two_ranks[1][scenario]["waits"]


def test_a_default_group_that_is_not_gloo_gets_a_gloo_side_group(two_ranks: Results) -> None:
    for result in two_ranks:
        side = result["side_group"]
        assert side["backend"] == "gloo"
        assert not side["default"]
        assert side["on_the_group"]
        assert side["collectives"] > 0
        assert side["devices"] == ["cpu"]
        assert side["device"] == "cpu"
        assert side["transport"] == "gloo"


def test_a_given_gloo_group_is_used_as_it_is(two_ranks: Results) -> None:
    for result in two_ranks:
        given = result["given_group"]
        assert given["given"]
        assert (given["backend"], given["default"], given["on_the_group"]) == ("gloo", False, True)
        assert given["devices"] == ["cpu"]
        assert given["transport"] == "gloo"


@pytest.mark.parametrize("scenario", ["side_group_sockets", "given_group_sockets"])
def test_rows_go_over_the_sockets_of_the_agreement_group(two_ranks: Results, scenario: str) -> None:
    """Set up over the side (or given) gloo group, at construction; every row after it by socket."""
    for result in two_ranks:
        agreed = result[scenario]
        assert (agreed["backend"], agreed["default"], agreed["on_the_group"]) == (
            "gloo",
            False,
            True,
        )
        assert agreed["transport"] == "same-host sockets"
        assert agreed["names"] == ["same-host rows"]
        assert agreed["collectives"] > 0


def test_ranks_in_three_methods_are_each_named_for_their_own(four_ranks: Results) -> None:
    """With only the lowest and highest kind named, rank 2 read that it drained (it verified)."""
    want = (
        "rank divergence after transition 0: the ranks reached different collectives: "
        "ranks 0, 1 a step, rank 2 a digest verification, rank 3 a drain (the ranks called "
        "different DistributedCache methods)"
    )
    assert [r["three_methods"] for r in four_ranks] == [want] * 4


def test_a_dead_rank_makes_the_others_fail_not_hang(four_ranks: Results) -> None:
    assert "death" not in four_ranks[3]  # it died before reporting
    for rank, result in enumerate(four_ranks[:3]):
        pattern = (
            rf"rank {rank} of 4: step agreement \(all_gather MIN\) failed after \d+\.\d\d s "
            r"\(timeout 20 s\): another rank died or stopped taking part: .+"
        )
        assert re.fullmatch(pattern, result["death"]), result["death"]


def test_a_hung_rank_makes_the_other_fail_after_the_timeout(two_ranks: Results) -> None:
    pattern = (
        r"rank 0 of 2: step agreement \(all_gather MIN\) failed after \d+\.\d\d s "
        r"\(timeout 1 s\): another rank died or stopped taking part: rank 1 did not finish the "
        r"exchange within 1 s"
    )
    assert re.fullmatch(pattern, two_ranks[0]["hang"]), two_ranks[0]["hang"]


def test_tp_bench_runs_on_two_ranks() -> None:
    bench = run_tp_bench(
        2, per_step=8, polls=20, requests=20, small_requests=16, rounds=2, timeout=TIMEOUT
    )
    assert (bench.ranks, bench.per_step, bench.polls, bench.rounds) == (2, 8, 20, 2)
    assert (bench.cache_trace.requests, bench.small_trace.requests) == (20, 16)
    assert (bench.cache_trace.steps, bench.small_trace.steps) == (3, 2)  # a last, short step
    assert min(bench.agreed_step_us, bench.local_poll_us) > 0
    for served in (bench.cache_trace, bench.small_trace):
        assert min(served.local_ms, served.agreed_ms) > 0


# -- one process: digests, messages, a world of one --------------------------------


def test_digest_folds_in_only_new_entries() -> None:
    log = EventLog()
    digest = TransitionDigest(log)
    log.op("insert", (1, 2), None, None)
    log.transition(7, "write")
    first = digest.update()
    assert digest.update() == first  # nothing new: nothing folded in again
    log.op("poll")  # left out: it applies only what the group agreed on
    log.transition(7, "write_done")
    log.refusal("evict", BadArgument("evict: num_tokens must be >= 0, got -1"))
    second = digest.update()
    assert second != first
    assert digest.count == 2
    # how the entries were split between updates does not matter, and poll() is left out
    whole = EventLog()
    whole.op("insert", (1, 2), None, None)
    whole.transition(7, "write")
    whole.transition(7, "write_done")
    whole.refusal("evict", BadArgument("evict: num_tokens must be >= 0, got -1"))
    assert TransitionDigest(whole).update() == second


def test_the_digest_of_every_entry_form_does_not_depend_on_the_updates() -> None:
    transitions = [(7, "write"), (1 << 31, "write_done"), (1 << 64, "load"), (-3, "load_done")]
    ops: list[tuple[str, tuple[object, ...]]] = [
        ("lock", (5,)),
        ("evict", (1 << 70,)),
        ("insert", (tuple(range(20)), None, array.array("Q", range(20)))),
        ("match_prefix", ((1, 2), "lora")),
    ]
    whole, split = EventLog(), EventLog()
    by_one = TransitionDigest(split)
    for (node, event), (name, args) in zip(transitions, ops, strict=True):
        for log in (whole, split):
            log.transition(node, event)
            log.op(name, *args)
        by_one.update()
    assert by_one.update() == TransitionDigest(whole).update()
    assert by_one.count == len(transitions)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((("op", "insert", ((1, 2), None, None)),), (("op", "insert", ((1, 3), None, None)),)),
        (
            (("op", "insert", (tuple(range(9)), None, None)),),
            (("op", "insert", (tuple(range(1, 10)), None, None)),),
        ),
        ((("op", "insert", ((1,), None, None)),), (("op", "insert", ((1,), "lora", None)),)),
        (
            (("op", "insert", ((1,), None, array.array("Q", range(12)))),),
            (("op", "insert", ((1,), None, array.array("Q", range(1, 13)))),),
        ),
        ((("op", "lock", (3,)),), (("op", "unlock", (3,)),)),
        ((("op", "lock", (3,)),), (("op", "lock", (4,)),)),
        ((("op", "evict", (1 << 70,)),), (("op", "evict", (1 << 71,)),)),
        ((("op", "fire", ("pin", 3)),), (("op", "fire", ("release", 3)),)),
        ((("transition", 7, "write"),), (("transition", 8, "write"),)),
        ((("transition", 7, "write"),), (("transition", 7, "load"),)),
        # node ids past the one-word form fold in as three words, event included
        ((("transition", 1 << 31, "write"),), (("transition", 1 << 31, "load"),)),
        ((("transition", 1 << 31, "write"),), (("transition", (1 << 31) + 1, "write"),)),
        ((("transition", (1 << 31) - 1, "write"),), (("transition", 1 << 31, "write"),)),
        ((("transition", -1, "write"),), (("transition", -2, "write"),)),
        ((("transition", 0, "write"),), (("op", "lock", (0,)),)),
        (
            (("op", "lock", (3,)), ("op", "lock", (4,))),
            (("op", "lock", (4,)), ("op", "lock", (3,))),
        ),
        ((("op", "agreed_hits", ((3, 5), (3, 2))),), (("op", "agreed_hits", ((3, 5), (3, 1))),)),
        # namespaces that are not plain values, by value (they were by type only)
        (
            (("op", "insert", ((1,), _Tenant.A, None)),),
            (("op", "insert", ((1,), _Tenant.B, None)),),
        ),
        (
            (("op", "insert", ((1,), _Adapter("x"), None)),),
            (("op", "insert", ((1,), _Adapter("y"), None)),),
        ),
        (
            (("op", "match_prefix", ((1,), frozenset({"a"}))),),
            (("op", "match_prefix", ((1,), frozenset({"b"}))),),
        ),
    ],
)
def test_the_digest_tells_apart_what_every_rank_must_share(
    a: tuple[tuple[object, ...], ...], b: tuple[tuple[object, ...], ...]
) -> None:
    def digest(entries: tuple[tuple[object, ...], ...]) -> bytes:
        log = EventLog()
        for kind, first, second in entries:
            if kind == "op":
                log.op(first, *second)  # type: ignore[arg-type,misc]
            else:
                log.transition(first, second)  # type: ignore[arg-type]
        return TransitionDigest(log).update()

    assert digest(a) == digest(a)
    assert digest(a) != digest(b)


NAMESPACE_TEXT = """
from fsm_cache.cache.eventlog import EventLog
from fsm_cache.distributed.digest import TransitionDigest, operation_text
names = frozenset(f"lora-{i}" for i in range(20))
log = EventLog()
log.op("match_prefix", (1, 2), names)
print(operation_text("match_prefix", ((1, 2), names)), TransitionDigest(log).update().hex())
"""


def test_namespaces_that_compare_by_value_fold_in_by_value() -> None:
    """Equal namespaces fold alike, in every process; distinct ones apart (were by type only)."""
    assert operation_text("insert", ((1,), _Tenant.A, None)) == "insert((1,), _Tenant.A, None)"
    assert operation_text("insert", ((1,), _Adapter("x", rank=3), None)) == (
        "insert((1,), _Adapter(name='x'), None)"  # the field it does not compare is left out
    )
    assert operation_text("match_prefix", ((1,), frozenset({"b", "a"}))) == (
        "match_prefix((1,), frozenset({'a', 'b'}))"
    )

    def digest(namespace: object) -> bytes:
        log = EventLog()
        log.op("insert", (1,), namespace, None)
        return TransitionDigest(log).update()

    assert digest(_Adapter("x", rank=0)) == digest(_Adapter("x", rank=1))
    assert digest(_Tenant.A) != digest(_Tenant.B)
    # a set of strings iterates in an order of its hash, which each process seeds apart
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    seen = {
        subprocess.run(
            [sys.executable, "-c", NAMESPACE_TEXT],
            env={**env, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(seen) == 1, seen


def test_the_digest_leaves_out_what_each_rank_finds_alone() -> None:
    def digest(found: tuple[int, ...]) -> bytes:
        log = EventLog()
        log.op("agreed_hits", found, (3, 2))
        return TransitionDigest(log).update()

    assert digest((3, 5)) == digest((4, 2))


def digest_of(config: CacheConfig, *requests: list[int], poll: bool = False) -> bytes:
    """The digest of a cache that inserted ``requests`` (and polled after each, if asked)."""
    cache = HiCache(config)
    digest = TransitionDigest(cache.log)
    for tokens in requests:
        cache.insert(tokens)
        if poll:
            cache.poll()
    return digest.update()


def test_the_digest_covers_keys_their_order_and_inserts_that_fire_nothing() -> None:
    config = bench_config(debug=True)
    a, b = list(range(16)), list(range(100, 116))
    assert digest_of(config, a, b) == digest_of(config, a, b)
    assert digest_of(config, a, b) != digest_of(config, b, a)
    assert digest_of(config, a) != digest_of(config, list(range(64)))
    selective = bench_config(debug=True, write_policy="write_through_selective")
    assert digest_of(selective, a) != digest_of(selective, a, b)
    # a rank-local poll(), which applies nothing under agreement, is left out
    without = bench_config(debug=True, host_pages=0)
    assert digest_of(without, a, b) == digest_of(without, a, b, poll=True)


def test_operation_text_keeps_what_every_rank_shares() -> None:
    key = tuple(range(9))
    assert operation_text("insert", (key, None, None)) == (
        f"insert(<9 ids {hash(key) & ((1 << 64) - 1):016x}>, None, None)"
    )
    slots = array.array("Q", range(12))
    digest = hashlib.blake2b(slots, digest_size=8).hexdigest()
    assert operation_text("insert", ((1, 2), "lora-7", slots)) == (
        f"insert((1, 2), 'lora-7', <12 ids {digest}>)"
    )
    assert operation_text("match_prefix", ((4,), object())) == "match_prefix((4,), <object>)"
    assert operation_text("free_slots", (array.array("Q", [8, 9]),)) == "free_slots([8, 9])"
    assert operation_text("evict", (16,)) == "evict(16)"
    # each rank's own store found its own pages; only the agreed counts are shared
    assert operation_text("agreed_hits", ((3, 5), (3, 2))) == "agreed_hits((3, 2))"
    assert operation_text("poll", ()) is None
    assert operation_text("apply_completions", ()) is None


def test_operation_message_names_each_ranks_operation() -> None:
    served = [
        [(3, "called insert((1, 2), None, None)"), (4, "called match_prefix((1,), None)")],
        [(3, "called insert((1, 2), None, None)"), (4, "had insert refused (PoolExhausted)")],
        [(3, "called insert((1, 2), None, None)")],
    ]
    assert first_difference(served) == 1
    assert operation_message(1, served) == (
        "rank divergence after transition 4: the ranks served different operations: "
        "rank 0 called match_prefix((1,), None), rank 1 had insert refused (PoolExhausted), "
        "rank 2 did nothing more"
    )


def test_reset_message_names_the_ranks_that_reset() -> None:
    assert reset_message([1, 2, 2, 1]) == (
        "rank divergence: the cache was reset on ranks 1, 2 and not on ranks 0, 3 "
        "(resets: rank 0 1, rank 1 2, rank 2 2, rank 3 1); every rank must reset its cache "
        "at the same point"
    )


def test_digest_tail_starts_at_the_agreed_point() -> None:
    log = EventLog()
    digest = TransitionDigest(log)
    log.transition(1, "write")
    digest.update()
    digest.agree()
    log.transition(1, "write_done")
    log.op("poll")
    log.transition(2, "write")
    digest.update()
    assert (digest.agreed, digest.count) == (1, 3)
    assert digest.tail() == [(1, "write_done"), (2, "write")]


def test_each_transition_of_the_tail_is_named_with_its_operation() -> None:
    log = EventLog()
    digest = TransitionDigest(log)
    log.op("insert", tuple(range(4)), None, None)
    log.transition(1, "write")
    digest.update()
    digest.agree()
    log.transition(1, "write_done")  # still inside the insert, logged before the agreed point
    log.op("apply_completions", ())
    log.transition(1, "evict_device")
    log.op("evict", 8)
    log.transition(2, "delete")
    digest.update()
    named = [digest.operation_of(i) for i in range(4)]
    assert named == ["insert((0, 1, 2, 3), None, None)", "apply_completions", "evict(8)", None]


def test_first_difference() -> None:
    a = [(1, "write"), (1, "write_done")]
    assert first_difference([a, list(a)]) is None
    assert first_difference([a, [(1, "write"), (2, "write")]]) == 1
    assert first_difference([a, a[:1], a]) == 1
    assert first_difference([[], []]) is None


def test_divergence_message_names_every_rank_and_node() -> None:
    tails = [[(4, "write"), (7, "write_done")], [(4, "write"), (9, "evict_device")], [(4, "write")]]
    states = [{7: "backed/resident (pins=0, locks=0)"}, {9: "backed/absent (pins=0, locks=0)"}, {}]
    assert involved_nodes(tails, 1) == [7, 9]
    operations = ["apply_completions", "evict(9)", None]
    assert divergence_message(40, 1, tails, states, operations) == (
        "rank divergence at transition 41: rank 0 applied node 7 write_done in "
        "apply_completions, rank 1 applied node 9 evict_device in evict(9), rank 2 applied "
        "nothing (only 41 transitions); "
        "node 7 now: rank 0 backed/resident (pins=0, locks=0), rank 1 not in the tree, "
        "rank 2 not in the tree; "
        "node 9 now: rank 0 not in the tree, rank 1 backed/absent (pins=0, locks=0), "
        "rank 2 not in the tree"
    )


def test_collectives_message_names_each_ranks_collective() -> None:
    assert collectives_message(7, ["a drain", "a step", "a drain"], "why") == (
        "rank divergence after transition 7: the ranks reached different collectives: "
        "ranks 0, 2 a drain, rank 1 a step (why)"
    )


def test_copy_nodes_come_from_a_rank_that_still_holds_the_ticket() -> None:
    waits = [[[], [5, 6]], [[3], [5, 6]], [[4], []]]
    assert copy_nodes(waits) == [[3], [5, 6]]
    assert copy_nodes([[[]], [[]]]) == [[]]
    assert copy_nodes([]) == []


def test_lost_message_names_each_short_rank_and_its_copy() -> None:
    states = [
        {3: "writing/resident (pins=0, locks=0)"},
        {},
        {5: "writing/absent (pins=0, locks=0)"},
    ]
    assert lost_message(12, [[3], [5]], [0, 2, 1], states) == (
        "rank divergence after transition 12: a completion was lost: rank 0 drained its "
        "copy engine without the completion of copy 1 of 2 in flight (nodes [3]), "
        "rank 2 drained its copy engine without the completion of copy 2 of 2 in flight "
        "(nodes [5]); "
        "node 3 now: rank 0 writing/resident (pins=0, locks=0), rank 1 not in the tree, "
        "rank 2 not in the tree; "
        "node 5 now: rank 0 not in the tree, rank 1 not in the tree, "
        "rank 2 writing/absent (pins=0, locks=0)"
    )


def test_stalled_message_names_the_ranks_on_each_side() -> None:
    states = [{7: "backed/loading (pins=1, locks=1)"}] * 3
    assert stalled_message(30, [[7], [9]], [2, 0, 1], 0.5, states) == (
        "rank divergence after transition 30: copy 1 of 2 in flight (nodes [7]) finished "
        "on ranks 0, 2 and not on rank 1 for longer than the timeout (0.5 s); "
        "node 7 now: rank 0 backed/loading (pins=1, locks=1), "
        "rank 1 backed/loading (pins=1, locks=1), rank 2 backed/loading (pins=1, locks=1)"
    )


def test_a_failure_folds_in_apart_from_a_refusal_and_names_its_operation() -> None:
    """An operation that raised from outside the cache is in the digest (it was in no entry)."""

    def digest(*outcome: tuple[str, str, str]) -> TransitionDigest:
        log = EventLog()
        log.op("insert", (1, 2), None, None)
        for entry in outcome:
            log.append(entry)
        folded = TransitionDigest(log)
        folded.update()
        return folded

    served = digest().update()
    failed = digest(("failed", "insert", "RuntimeError: allocator broke"))
    assert failed.update() != served
    # the class is folded in, not the message, which may name what differs between ranks
    assert failed.update() == digest(("failed", "insert", "RuntimeError: at 0x7f")).update()
    assert failed.update() != digest(("failed", "insert", "OSError: allocator broke")).update()
    assert (
        failed.update() != digest(("refused", "insert", "RuntimeError: allocator broke")).update()
    )
    assert failed.failures() == [(0, "insert((1, 2), None, None)", "RuntimeError: allocator broke")]
    assert digest(("refused", "insert", "PoolExhausted: no room")).failures() == []


def test_failure_message_names_each_ranks_failure() -> None:
    failed = [
        [(3, "insert((1,), None, None)", "RuntimeError: broke")],
        [],
        [(3, "insert((1,), None, None)", "RuntimeError: broke"), (5, "evict(4)", "OSError: x")],
    ]
    assert failure_difference(failed) == 0
    # compared as the digest folds them in: by the error's class, not its message
    gpus = [
        [(3, "insert((1,), None, None)", f"RuntimeError: out of memory on GPU {r}")] for r in (0, 1)
    ]
    assert failure_difference(gpus) is None
    assert failure_difference([gpus[0], [(3, "insert((1,), None, None)", "OSError: x")]]) == 0
    assert failure_message(0, failed) == (
        "rank divergence after transition 3: an operation failed on some ranks only: "
        "rank 0's insert((1,), None, None) raised RuntimeError: broke, rank 1 had no failure, "
        "rank 2's insert((1,), None, None) raised RuntimeError: broke"
    )
    assert failure_message(1, [failed[0], failed[2]]) == (
        "rank divergence after transition 5: an operation failed on some ranks only: "
        "rank 0 had no failure, rank 1's evict(4) raised OSError: x"
    )


def test_queued_message_names_each_ranks_waiting_copies() -> None:
    states = [{4: "backed/resident (pins=0, locks=0)", 9: "backed/loading (pins=1, locks=1)"}] * 2
    assert queued_message(6, [[], [("d2h", [4]), ("h2d", [9])]], states) == (
        "rank divergence after transition 6: the ranks have different copies waiting to "
        "start: rank 0 none, rank 1 d2h of nodes [4] and h2d of nodes [9]; "
        "node 4 now: rank 0 backed/resident (pins=0, locks=0), "
        "rank 1 backed/resident (pins=0, locks=0); "
        "node 9 now: rank 0 backed/loading (pins=1, locks=1), "
        "rank 1 backed/loading (pins=1, locks=1)"
    )


def test_the_shared_values_apart_are_named_each_once() -> None:
    same = [0, 2, 30, 1, 2, 3, 4, 0, 0, 1]
    highs = [-v for v in same]
    assert shared_values_apart(same, highs) == []
    lows = [0, 2, 30, 0, 2, 3, 0, 0, 0, 0]  # two digest words, and the flag
    assert shared_values_apart(lows, highs) == ["digests", "flags of anything in flight or queued"]
    assert shared_values_apart(same[:7], highs[:7]) == []


@pytest.mark.usefixtures("world_of_one")
def test_a_load_wait_under_agreement_is_one_collective_and_refuses_alike() -> None:
    """``wait_loaded`` on a wrapped cache is agreed; a bad argument is still a BadArgument."""
    config = bench_config(debug=True, load_back_threshold=1)
    shared = DistributedCache(HiCache(config), timeout=TIMEOUT)
    cache, prompt = shared.cache, list(range(16))
    host_only(shared, prompt)
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    assert chain
    calls: list[tuple[str, Any, list[str]]] = []
    undo = count_collectives(calls)
    try:
        assert cache.wait_loaded(chain)
        with pytest.raises(BadArgument) as caught:
            cache.wait_loaded("")  # type: ignore[arg-type]
    finally:
        undo()
    assert str(caught.value) == "wait_loaded: expected a sequence of tree nodes, got str"
    # one MIN all-reduce each (an all_gather): the wait's, then the notice this rank raised
    assert [name for name, *_ in calls] == ["all_gather", "all_gather"]
    shared.drain()
    assert cache.wait_loaded(chain)  # resident now: nothing to wait for
    shared.verify_agreement()


class _BrokenClose(FaultyCopyEngine):
    """Cannot be closed while ``broken``: as a CUDA error in the engine's synchronisation."""

    broken = True

    def close(self) -> None:
        if _BrokenClose.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().close()


@pytest.mark.usefixtures("world_of_one")
def test_an_agreement_on_a_cache_closed_while_its_tiers_stay_open_is_refused() -> None:
    """The cache's own gate decides: its tiers stay open where giving memory back raised."""
    shared = DistributedCache(HiCache(bench_config(copier=_BrokenClose.copier())), timeout=TIMEOUT)
    with pytest.raises(RuntimeError):
        shared.cache.close()
    assert (shared.cache.closed, shared.cache.tiers.closed) == (True, False)
    for call in ("step", "drain", "verify_agreement"):
        with pytest.raises(CacheClosed) as caught:
            getattr(shared, call)()
        assert str(caught.value) == f"{call}: the cache of rank 0 of 1 was closed"
    assert shared.steps == 0
    _BrokenClose.broken = False  # the error passed: dropped, the cache gives the memory back
    tiers = shared.cache.tiers
    del shared, caught  # the error's traceback holds the DistributedCache too
    assert tiers.closed


def test_without_a_process_group_it_says_so() -> None:
    with pytest.raises(NoProcessGroup) as caught:
        DistributedCache(HiCache(bench_config()))
    assert str(caught.value) == (
        "distributed: no process group; call torch.distributed.init_process_group first"
    )


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    join_group(0, 1, str(tmp_path / "store"))
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_the_old_spellings_still_work_and_say_what_replaces_them() -> None:
    with pytest.warns(DeprecationWarning, match=r"verify_every=\.\.\.\) is deprecated and ignored"):
        DistributedCache(HiCache(bench_config(debug=True)), verify_every=5)
    cache = HiCache(bench_config(debug=True))
    with pytest.warns(DeprecationWarning, match=r"device=\.\.\.\) is deprecated and ignored"):
        shared = DistributedCache(cache, device=torch.device("cuda", 1))
    assert shared.device == CPU
    cache.insert(list(range(16)))
    assert cache.issued()
    with pytest.warns(DeprecationWarning, match=r"call step\(\) once per scheduler step"):
        assert shared.poll() == 1
    assert (cache.issued(), shared.steps) == ([], 1)


@pytest.mark.usefixtures("world_of_one")
def test_bad_settings_are_refused() -> None:
    cache = HiCache(bench_config())
    # below a millisecond torch.distributed waits 0 ms, which is no limit at all; past about
    # 9.2e9 s its clock overflows (1e10 timed out at once), and a timedelta's longest raised
    longest = timedelta.max.total_seconds()
    out_of_range = (0, -1.5, 0.0009, 1e-9, float("nan"), float("inf"), 1e10, longest)
    for timeout in (*out_of_range, "5", None, True):
        with pytest.raises(ConfigError) as caught:
            DistributedCache(cache, timeout=timeout)  # type: ignore[arg-type]
        assert str(caught.value) == (
            "distributed: timeout must be a number of seconds from 0.001 to 4.61169e+09 "
            "(torch.distributed waits whole milliseconds, 0 meaning no limit, and adds them to "
            f"its clock in 64-bit nanoseconds), got {timeout!r}"
        )
    for every in (-1, 1.5, "2", True):
        with pytest.raises(ConfigError) as caught:
            DistributedCache(cache, verify_every=every)  # type: ignore[arg-type]
        assert str(caught.value) == f"distributed: verify_every must be an int >= 0, got {every!r}"
    for transport in (1, "false", None):
        with pytest.raises(ConfigError) as caught:
            DistributedCache(cache, local_sockets=transport)  # type: ignore[arg-type]
        assert str(caught.value) == (
            f"distributed: local_sockets must be True or False, got {transport!r}"
        )
    assert not cache.transfers.acks_taken  # each refused before anything changed
    with pytest.raises(BadArgument) as refused:
        DistributedCache("cache")  # type: ignore[arg-type]
    assert str(refused.value) == "distributed: cache must be a HiCache, got str"
    first = DistributedCache(cache)  # kept: its cache holds it weakly
    with pytest.raises(ConfigError) as twice:
        DistributedCache(cache)  # a second wrapper would buffer completions the first waits for
    assert str(twice.value) == (
        "distributed: this cache's acknowledgements come from another DistributedCache"
        " already: wrap a cache once (two would each buffer completions the other waits for)"
    )
    with pytest.raises(BadArgument) as refused:
        DistributedCache(cache, group="tp")  # type: ignore[arg-type]
    assert str(refused.value) == (
        "distributed: group must be a torch.distributed ProcessGroup or None, got str"
    )
    assert cache.poll() == 0  # the refused wrappers took nothing over from the first
    cache.insert(list(range(16)))
    cache.close()
    assert cache.stats().transitions["write_done"] == 1
    del first
    write_back = dataclasses.replace(bench_config(), write_policy="write_back")
    with pytest.raises(ConfigError) as caught:
        DistributedCache(HiCache(write_back))
    assert str(caught.value) == (
        "distributed: write_back waits for its copies inside an allocation, where the "
        "ranks cannot agree on them yet; use write_through or write_through_selective"
    )


@pytest.mark.usefixtures("world_of_one")
def test_a_group_this_rank_cannot_agree_over_is_refused() -> None:
    """The placeholder a rank outside a group gets, and a destroyed group: no raw torch error."""
    cache = HiCache(bench_config())
    gone = dist.new_group(backend="gloo")
    dist.destroy_process_group(gone)
    refusals = {
        dist.GroupMember.NON_GROUP_MEMBER: (
            "distributed: this rank is not a member of the group it passed (new_group() gives "
            "the ranks outside a group a placeholder); pass the group of this rank's own ranks"
        ),
        gone: (
            "distributed: group is not a process group of this rank: it was destroyed, or "
            "this rank is not one of its members"
        ),
    }
    for group, message in refusals.items():
        with pytest.raises(BadArgument) as refused:
            DistributedCache(cache, group)
        assert str(refused.value) == message
    assert not cache.transfers.acks_taken  # nothing took the cache's acknowledgements over


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("default", ["gloo", "nccl"])
def test_the_shortest_and_the_longest_timeout_work_in_a_collective(
    default: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the group given, and on a gloo side group built with the timeout.

    A millisecond is short enough for gloo's own hand-off to outlast it on a
    loaded machine, so there the step or the digest check may end in the
    typed timeout instead: what is tested is that torch takes the bound,
    neither reading it as no limit nor overflowing its clock.
    """
    if default == "nccl":
        real = dist.get_backend
        monkeypatch.setattr(
            dist, "get_backend", lambda group=None: "nccl" if group is None else real(group)
        )
    for timeout in (0.001, 2**62 / 10**9):
        shared = DistributedCache(HiCache(bench_config()), timeout=timeout)
        assert (shared.group is None) == (default == "gloo")
        shared.cache.insert(list(range(16)))
        try:
            applied = shared.step()
            agreed = shared.verify_agreement()
        except RankFailure as failed:
            timed_out = str(failed)
        else:
            assert applied == 1
            assert agreed == shared.digest
            continue
        assert timeout == 0.001
        assert "(timeout 0.001 s)" in timed_out


class _HoldFirst(FaultyCopyEngine):
    """Withholds the acknowledgement of the first copy until ``let_go`` is set."""

    let_go = False
    _stash: tuple[Completion, ...] = ()

    def poll(self) -> list[Completion]:
        done = [*self._stash, *super().poll()]
        self._stash = () if self.let_go else tuple(c for c in done if c.ticket.id == 1)
        return [c for c in done if self.let_go or c.ticket.id != 1]


@pytest.mark.usefixtures("world_of_one")
def test_a_step_applies_only_the_finished_head_of_the_issue_order() -> None:
    cache = HiCache(bench_config(debug=True, copier=_HoldFirst.copier()))
    copier = cache.tiers.copier
    assert isinstance(copier, _HoldFirst)
    shared = DistributedCache(cache)
    for first in (100, 200, 300):
        cache.insert(range(first, first + 8))  # three unrelated prompts: three copies
    issued = cache.issued()
    assert issued == [1, 2, 3]
    assert shared.step() == 0  # the oldest copy has not finished: nothing may be applied
    assert (shared.buffered, shared.local_ready()) == (len(issued) - 1, 0)
    copier.let_go = True
    assert shared.step() == len(issued)
    assert shared.buffered == 0
    assert not set(issued) & set(cache.issued())
    assert [e for e in cache.log.entries if e[1] == "agreed_poll"] == [
        ("op", "agreed_poll", (0,)),
        ("op", "agreed_poll", (len(issued),)),
    ]


@pytest.mark.usefixtures("world_of_one")
def test_a_copy_applied_by_a_wait_stops_the_stall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head copy stalls past the timeout, then a wait applies it: the next one starts afresh.

    A second rank that has finished no copy is played by the reduction: its
    ready count, and so the first failed copy, is 0 while ``behind``. The stall
    clock (the agreement's ``time``) is moved by hand, and the collectives keep
    the long timeout: as a 0.2 s one, a loaded machine could time one out.
    """
    clock = HandClock()
    monkeypatch.setattr(agreement, "time", clock)
    behind = True
    reduce_min = Collectives.all_reduce_min

    def with_a_slow_peer(self: Collectives, values: list[int], what: str = "") -> list[int]:
        if behind:
            values = [*values[:2], 0, values[3], *values[4:6], 0, *values[7:]]
        return reduce_min(self, values, what)

    monkeypatch.setattr(Collectives, "all_reduce_min", with_a_slow_peer)
    shared = DistributedCache(HiCache(bench_config(debug=True)), timeout=TIMEOUT)
    cache = shared.cache
    cache.insert(list(range(176)))  # 44 of 48 device pages; its backup starts
    assert (shared.step(), shared.buffered) == (0, 1)  # finished here only: the clock starts
    clock.now += TIMEOUT + 1  # longer than the timeout
    waited = len(cache.log.acknowledgements())
    cache.insert(list(range(1000, 1032)))  # needs 8 pages: waits for that backup to evict
    assert [o for o, a in cache.log.acknowledgements()[waited:] if a] == ["wait"]
    assert len(cache.issued()) == 1  # the new prompt's backup, just started
    assert shared.step() == 0  # finished here only, and not for longer than the timeout
    behind = False
    assert shared.step() == 1


@pytest.mark.usefixtures("world_of_one")
def test_the_tp_bench_times_a_local_poll_that_reaches_the_copy_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step, poll = tpbench.idle_calls(TIMEOUT)
    polled: list[int] = []
    real = CopyEngine.poll

    def counting(self: CopyEngine) -> list[Completion]:
        polled.append(1)
        return real(self)

    monkeypatch.setattr(CopyEngine, "poll", counting)
    assert poll() == 0
    assert polled == [1]  # a wrapped cache's own poll() would not ask its copy engine
    assert step() == 0


@pytest.mark.usefixtures("world_of_one")
def test_drain_applies_everything_and_verify_returns_the_digest() -> None:
    cache = HiCache(
        bench_config(debug=True, copier=FaultyCopyEngine.copier(delay=2, shuffle=True, seed=1))
    )
    shared = DistributedCache(cache)
    serve_chat_trace(cache, chat_trace(20), every(4, shared.step))
    shared.drain()
    assert cache.issued() == []
    assert shared.verify_agreement() == shared.digest
    assert shared.transitions == len(cache.log.transitions())


@pytest.mark.usefixtures("world_of_one")
def test_a_gloo_group_is_its_own_cpu_group() -> None:
    assert cpu_group(None, TIMEOUT) is None
    given = dist.new_group(backend="gloo")
    assert cpu_group(given, TIMEOUT) is given
    shared = DistributedCache(HiCache(bench_config()))
    assert (shared.group, shared.device, shared.comm.device) == (None, CPU, CPU)


@pytest.mark.usefixtures("world_of_one")
def test_the_collectives_stay_on_the_cpu_whatever_the_default_device() -> None:
    """A model loader's ``set_default_device("cuda")`` moved the report's gathers; meta stands in.

    On a GPU, reading them back would wait for the compute queued before them.
    """
    comm = Collectives.of(None, TIMEOUT)
    default = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        assert comm.all_reduce_min([3, -1]) == [3, -1]
        assert comm.all_gather_digest([1, -2]) == [[1, -2]]
        assert comm.all_gather_object({"node": 7}) == [{"node": 7}]
    finally:
        torch.set_default_device(default)


@pytest.fixture
def nccl_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of one whose default group says it is NCCL, without a GPU."""
    real = dist.get_backend

    def nccl_default(group: Any = None) -> str:
        return "nccl" if group is None or group is dist.group.WORLD else real(group)

    monkeypatch.setattr(dist, "get_backend", nccl_default)


@pytest.mark.usefixtures("world_of_one", "nccl_backend")
def test_an_nccl_default_group_gets_a_gloo_side_group_and_cpu_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[dict[str, Any]] = []
    new_group = dist.new_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs)
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    shared = DistributedCache(HiCache(bench_config(debug=True)), timeout=7.0)
    assert built == [{"backend": "gloo", "timeout": timedelta(seconds=7)}]
    assert shared.group is not None
    assert dist.get_backend(shared.group) == "gloo"
    reduced: list[torch.Tensor] = []
    all_gather = dist.all_gather

    def spy(rows: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        assert kwargs["group"] is shared.group
        reduced.extend([*rows, tensor])
        return all_gather(rows, tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_gather", spy)
    shared.cache.insert(list(range(16)))
    assert shared.step() == 1
    assert [t.device for t in reduced] == [CPU, CPU]


@pytest.mark.usefixtures("world_of_one")
def test_an_nccl_group_smaller_than_the_world_must_bring_its_gloo_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    part = dist.new_group(backend="gloo")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is None else 1)
    with pytest.raises(ConfigError) as caught:
        cpu_group(part, TIMEOUT)
    assert str(caught.value) == (
        "distributed: the agreement needs a gloo group, and a nccl group of 1 of 2 ranks "
        "cannot get one here (every rank of the world would have to build it); build it on "
        'every rank with torch.distributed.new_group(ranks, backend="gloo") and pass that'
    )


@pytest.mark.usefixtures("world_of_one")
def test_a_mixed_group_is_used_and_a_whole_world_nccl_group_gets_a_side_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cpu:gloo,cuda:nccl`` sends CPU tensors to gloo; an NCCL group of every rank is twinned."""
    mixed, whole = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    real = dist.get_backend
    backends = {mixed: "cpu:gloo,cuda:nccl", whole: "nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backends.get(group, real(group)))
    built: list[dict[str, Any]] = []
    new_group = dist.new_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs)
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    assert cpu_group(mixed, TIMEOUT) is mixed
    assert built == []
    side = cpu_group(whole, 3.0)
    assert side is not whole
    assert built == [{"backend": "gloo", "timeout": timedelta(seconds=3)}]
    shared = DistributedCache(HiCache(bench_config()), whole, timeout=3.0)
    assert shared.group not in (whole, side, None)  # a side group of its own, each time
    assert real(shared.group) == "gloo"
    shared.cache.insert(list(range(16)))
    assert shared.step() == 1


@pytest.mark.usefixtures("world_of_one")
def test_a_step_serves_its_requests_without_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait of an allocation under memory pressure, too, needs no collective."""
    reduces: list[int] = []

    def agree_alone(self: Collectives, values: list[int], what: str = "") -> list[int]:
        reduces.append(len(values))
        return values  # the minimum over a world of one

    monkeypatch.setattr(Collectives, "all_reduce_min", agree_alone)
    shared = DistributedCache(HiCache(skewed(1)))
    trace = chat_trace(96, seed=3)
    for start in range(0, len(trace), 32):
        serve_chat_trace(shared.cache, trace[start : start + 32], lambda: None)
        assert len(reduces) == start // 32
        shared.step()
    waits = [a for o, a in shared.cache.log.acknowledgements() if o == "wait" and a]
    assert waits
    # the kind and its negation, ready and its negation, two flags, the first failed copy,
    # whether the query backoff may end, whether a storage copy failed, ten shared values
    # and theirs, one slot per storage copy considered (none here: -1 each)
    assert reduces == [2 + 7 + 2 * 10 + STORAGE_SLOTS] * 3


@pytest.mark.gpu
def test_nccl_ranks_agree_on_a_gloo_side_group_on_the_cpu(tmp_path: Path) -> None:
    """A cache on the last GPU while cuda:0 stays current; the agreement never touches a GPU."""
    last = torch.cuda.device_count() - 1
    gpu = torch.device("cuda", last)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.cuda.set_device(0)
        cache = HiCache(bench_config(device=f"cuda:{last}", debug=True))
        assert cache.tiers.device.device == gpu
        assert cache.tiers.host.tensor.is_pinned()
        shared = DistributedCache(cache, timeout=TIMEOUT)
        assert shared.group is not None
        assert dist.get_backend(shared.group) == "gloo"
        assert shared.device == CPU
        serve_chat_trace(cache, chat_trace(20), every(4, shared.step))
        shared.drain()
        assert cache.issued() == []
        assert cache.stats().transitions["write_done"] > 0
        assert shared.verify_agreement() == shared.digest
        assert torch.cuda.current_device() == 0
        cache.tiers.close()
        assert not cache.tiers.host.tensor.is_pinned()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_a_step_does_not_wait_for_the_compute_stream(tmp_path: Path) -> None:
    """With compute queued on the GPU, a step and a verification return before it ends.

    An NCCL all-reduce would be queued behind that compute, and reading its
    result back would wait for it; the gloo side group never touches the GPU.
    """
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        cache = HiCache(bench_config(device="cuda"))
        shared = DistributedCache(cache, timeout=TIMEOUT)
        serve_chat_trace(cache, chat_trace(8), every(4, shared.step))
        shared.drain()
        torch.cuda.synchronize()
        compute = torch.cuda.current_stream()
        busy = torch.ones(8192, 8192, device="cuda")
        for _ in range(40):  # about half a second of matrix products queued on it
            busy = busy @ busy
        assert shared.step() == 0
        assert shared.verify_agreement() == shared.digest
        assert not compute.query()  # the compute is still running: nothing waited for it
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_tp_bench_format() -> None:
    bench = TPBench(
        2,
        32,
        100,
        "same-host sockets",
        120.04,
        540.0,
        3.5,
        3,
        StepTimes(2000, 32, 63, 630.0, 661.5),
        StepTimes(640, 32, 20, 400.0, 360.0),
    )
    assert bench.cache_trace.ratio == pytest.approx(1.05)
    assert bench.format() == "\n".join(
        [
            "tensor-parallel agreement: 2 gloo ranks on CPU, 32 requests per step; "
            "rows over same-host sockets",
            "  agreed step, nothing to apply      120.0 us (median of 100)",
            "    all on gloo                      540.0 us",
            "  local HiCache.poll()                 3.5 us",
            "  bench cache trace: 2000 chat requests, write-through to host, page 16; "
            "63 steps, best of 3",
            "    local polls      10,000 us per step",
            "    agreed step      10,500 us per step  (1.05x local; +500 us per step)",
            "  small trace: 640 requests, load-backs and host evictions, page 4; "
            "20 steps, best of 3",
            "    local polls      20,000 us per step",
            "    agreed step      18,000 us per step  (0.90x local; -2,000 us per step)",
        ]
    )


@pytest.mark.parametrize("quick", [False, True])
def test_bench_tp_runs_both_group_sizes_and_honours_quick(
    quick: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[int, dict[str, int]]] = []
    figures = TPBench(
        2,
        32,
        1,
        "gloo",
        1.0,
        1.0,
        1.0,
        1,
        StepTimes(1, 32, 1, 1.0, 1.0),
        StepTimes(1, 32, 1, 1.0, 1.0),
    )

    def fake(ranks: int, **sizes: int) -> TPBench:
        calls.append((ranks, sizes))
        return figures

    defaults = inspect.signature(tpbench.run_tp_bench).parameters
    monkeypatch.setattr(tpbench, "run_tp_bench", fake)
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "tp", *(["--quick"] if quick else [])])
    assert args.handler(args) == 0
    sizes = tpbench.QUICK if quick else {}
    assert calls == [(2, sizes), (4, sizes)]
    tables, last = capsys.readouterr().out.removesuffix("\n").rsplit("\n", 1)
    assert f"{tables}\n" == f"{figures.format()}\n" * 2
    assert last == f"fsm_cache modules compiled with mypyc: {native.summary()}"
    assert all(size < defaults[name].default for name, size in tpbench.QUICK.items())


def test_the_bench_replays_the_cache_bench_trace() -> None:
    """The ``bench cache`` requests, one poll each: copies acknowledged, the latest turns cached."""
    trace = cachebench.trace(30)
    cache = HiCache(cache_trace_config())
    polls = []
    cachebench.serve_trace(cache, trace, lambda: polls.append(cache.poll()))
    assert len(polls) == len(trace)
    assert cache.stats().transitions["write_done"] > 0
    for tokens in trace[-3:]:
        assert cache.match_prefix(tokens).device_len == len(tokens)


def test_chat_trace_is_reproducible_and_page_aligned() -> None:
    trace = chat_trace(50, seed=4)
    assert trace == chat_trace(50, seed=4)
    assert trace != chat_trace(50, seed=5)
    assert all(len(t) % 4 == 0 and 8 <= len(t) <= 96 for t in trace)
    # conversations grow: some request extends an earlier one
    pairs = itertools.combinations(trace, 2)
    assert any(len(b) > len(a) and b[: len(a)] == a for a, b in pairs)


def test_the_caches_own_poll_applies_nothing_once_a_group_owns_its_acks(
    tmp_path: Path,
) -> None:
    """A single-rank group: copies in flight stay for the agreed poll, not cache.poll()."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        shared = DistributedCache(HiCache(skewed(0)), timeout=TIMEOUT)
        shared.cache.insert(list(range(32)))
        assert shared.cache.issued()
        assert shared.cache.poll() == 0
        assert shared.cache.issued()
        assert shared.drain() > 0
        assert shared.cache.issued() == []
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one", "no_cyclic_gc")
def test_a_dropped_distributed_cache_gives_its_caches_memory_back_at_once() -> None:
    """A DistributedCache and its cache held each other: dropped, both waited for the collector.

    The cache held the DistributedCache's methods (its acknowledgements, load
    waits, refused starts, storage hits) and the DistributedCache the cache,
    so the cache's pools stayed allocated until a full collection ran.
    """
    shared = DistributedCache(HiCache(skewed(0)), timeout=TIMEOUT)
    shared.cache.insert(list(range(32)))
    shared.step()
    pool = weakref.ref(shared.cache.tiers.device.tensor)
    del shared
    assert pool() is None


@pytest.mark.usefixtures("world_of_one")
def test_a_cache_whose_distributed_cache_was_dropped_goes_on_alone() -> None:
    """Held weakly by its cache, a dropped DistributedCache must neither strand nor lose a copy.

    The cache then applies its copies as its copy engine reports them, in
    issue order, with the start the engine refused that only the
    DistributedCache held; a later refused start fails at once, as on a
    plain cache, and a load wait is the rank's own answer.
    """
    copier = FaultyCopyEngine.copier(refuse=[1, 3])
    cache = HiCache(bench_config(debug=True, copier=copier, load_back_threshold=1))
    shared = DistributedCache(cache, timeout=TIMEOUT)
    cache.insert(list(range(32)))
    cache.insert(list(range(100, 132)))
    assert len(cache.issued()) == 2
    assert shared.buffered == 1  # the refused start, held as failed
    del shared
    assert cache.poll() == 2
    assert cache.issued() == []
    assert sorted(n.host for n in cache.tree) == ["backed", "unbacked"]
    cache.insert(list(range(200, 232)))  # the engine refuses its backup: failed at once
    assert cache.issued() == []
    assert sorted(n.host for n in cache.tree) == ["backed", "unbacked", "unbacked"]
    cache.close()


@pytest.mark.usefixtures("world_of_one")
def test_a_cache_whose_distributed_cache_was_dropped_can_be_wrapped_again() -> None:
    """The new wrapper takes over what the dropped one had buffered; a live one still refuses."""
    copier = FaultyCopyEngine.copier(refuse=[1])
    cache = HiCache(bench_config(debug=True, copier=copier))
    shared = DistributedCache(cache, timeout=TIMEOUT)
    cache.insert(list(range(32)))  # its backup's start refused: held by the wrapper, failed
    assert shared.buffered == 1
    del shared
    again = DistributedCache(cache, timeout=TIMEOUT)
    assert again.buffered == 1  # handed over, not lost with the dropped wrapper
    with pytest.raises(ConfigError) as twice:
        DistributedCache(cache)
    assert str(twice.value) == (
        "distributed: this cache's acknowledgements come from another DistributedCache"
        " already: wrap a cache once (two would each buffer completions the other waits for)"
    )
    assert again.step() == 1
    assert cache.issued() == []
    assert [n.host for n in cache.tree] == ["unbacked"]  # its backup failed, applied alike
    cache.close()


@pytest.mark.usefixtures("world_of_one")
def test_a_rewrapped_cache_keeps_each_refused_start_under_its_own_ticket() -> None:
    """The new wrapper's refused starts must not take the ids of those the dropped one left."""
    copier = FaultyCopyEngine.copier(refuse=[1, 2])
    cache = HiCache(bench_config(debug=True, copier=copier))
    shared = DistributedCache(cache, timeout=TIMEOUT)
    cache.insert(list(range(32)))  # refused: kept in flight as ticket -1
    del shared
    again = DistributedCache(cache, timeout=TIMEOUT)
    cache.insert(list(range(100, 132)))  # refused too: a ticket of its own, not -1 again
    assert cache.issued() == [-1, -2]
    assert [again.step(), again.step()] == [1, 1]  # a step applies up to its first failure
    assert cache.issued() == []
    assert [n.host for n in cache.tree] == ["unbacked", "unbacked"]
    cache.close()


def test_a_word_out_of_range_folds_in_alike_however_the_entries_are_split() -> None:
    big = (1 << 70, -(1 << 63), (1 << 63) - 1, 5)
    whole, split = EventLog(), EventLog()
    for n in big:
        whole.op("evict", n)
    one, two = TransitionDigest(whole), TransitionDigest(split)
    for n in big:
        split.op("evict", n)
        two.update()
    assert one.update() == two.update()


def test_a_long_token_key_folds_in_as_the_equal_tuple() -> None:
    """A TokenKey (SGLang's pattern) and a list of the same tokens are the same request."""
    tokens = list(range(64))
    one, two = HiCache(bench_config(debug=True)), HiCache(bench_config(debug=True))
    one.match_prefix(TokenKey(tokens))
    one.insert(TokenKey(tokens))
    two.match_prefix(tokens)
    two.insert(tokens)
    assert one.log.transitions() == two.log.transitions()
    assert TransitionDigest(one.log).update() == TransitionDigest(two.log).update()
