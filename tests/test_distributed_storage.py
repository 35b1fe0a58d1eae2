"""Tensor-parallel agreement of a storage tier: every rank acts on the prefix every rank holds.

Each rank keeps its own shard in its own store (a ``LocalFileStore`` in its own
folder, keyed in its rank's namespace), so the ranks' stores can answer
differently. The spawned tests run 2 gloo ranks on CPU (as tests/test_distributed.py
does), plant a fault in rank 1's store only, and compare what the ranks did:
the same transitions (equal digests), the same tree, the shorter prefix. The
unit tests drive one tier's hooks by hand, with the other rank's answer made up.
Copies run inline (``threads=0``) except where a copy must hang.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from clocks import HandClock


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.spawn import start_processes

    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.cache.tree import TreeNode
    from fsm_cache.distributed.agreement import DistributedCache
    from fsm_cache.distributed.collectives import Collectives
    from fsm_cache.errors import (
        ConfigError,
        CopyFailed,
        InvariantViolation,
        RankDivergence,
        StoreFailed,
    )
    from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
    from fsm_cache.storage import LocalFileStore, PutResult, Store, page_keys

PAGE = 4
TIMEOUT = 20.0  # seconds a collective waits for the other ranks
# Seconds a whole spawned group may run before the test kills it: long enough for a loaded
# machine (four ranks took 64 s beside four busy processes on two cores), short of the
# suite's pytest timeout (300 s), which would not name the group.
DEADLINE = 240.0
Results = list[dict[str, Any]]


def config() -> CacheConfig:
    """A small CPU cache of 4-token pages, checked after every operation."""
    return CacheConfig(
        device_pages=16,
        host_pages=32,
        page_size=PAGE,
        layers=1,
        heads=1,
        head_dim=4,
        device="cpu",
        debug=True,
        load_back_threshold=0,
    )


def tier(store: Store, rank: int = 0, ranks: int = 2, **overrides: Any) -> StorageConfig:
    """Inline copies, prefetch from one page on, this rank's namespace.

    A query is slow only past 5 s, so that a busy machine does not back a
    scenario off that is not about slow queries.
    """
    settings: dict[str, Any] = {
        "threads": 0,
        "prefetch_threshold": PAGE,
        "io_timeout": 5.0,
        "query_budget": 5.0,
    }
    settings.update(overrides)
    return StorageConfig(store, model="test", rank=rank, ranks=ranks, **settings)


def tokens(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PAGE))


def rows(cache: HiCache) -> list[list[Any]]:
    """Every node, parents first: id, parent id, tokens, host, device, storage, pins."""
    return [
        [n.id, n.parent.id if n.parent else None, len(n.key), n.host, n.device, n.storage, n.pins]
        for n in cache.tree
    ]


def events(cache: HiCache) -> list[str]:
    return [event for _, event in cache.log.transitions()]


class Faulty:
    """A store that passes through to ``inner`` except where a test plants a fault.

    Attributes:
        put_fails_after: Raise StoreFailed after storing this many pages of a put.
        after_exists: Called after each ``exists_prefix`` (drop a page behind its back).
        gate: Puts wait for this event first (a hung backend).
        exists_fails: ``exists_prefix`` raises (a server that stopped answering).
        before_put: Called with a put's keys before it runs (raise, or wait).
        queries: How many times ``exists_prefix`` was called.
        no_data: ``get`` gives pages with no data (on the meta device): a host write raises.
        drop_fails: ``drop`` raises (a Redis blip).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.put_fails_after: int | None = None
        self.after_exists: Callable[[], None] | None = None
        self.gate: threading.Event | None = None
        self.exists_fails = False
        self.before_put: Callable[[Sequence[str]], None] | None = None
        self.queries = 0
        self.no_data = False
        self.drop_fails = False

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self.queries += 1
        if self.exists_fails:
            raise StoreFailed("faulty", "exists", acknowledged=0, total=len(keys), cause="planted")
        found = self.inner.exists_prefix(keys)
        if self.after_exists is not None:
            self.after_exists()
        return found

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        pages = self.inner.get(keys)
        return [page.to("meta") for page in pages] if self.no_data else pages

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        if self.gate is not None:
            self.gate.wait()
        if self.before_put is not None:
            self.before_put(keys)
        cut = self.put_fails_after
        if cut is not None and cut < len(keys):
            self.inner.put(keys[:cut], pages[:cut])
            raise StoreFailed("faulty", "put", acknowledged=cut, total=len(keys), cause="planted")
        return self.inner.put(keys, pages)

    def drop(self, keys: Sequence[str]) -> int:
        if self.drop_fails:
            raise StoreFailed("faulty", "drop", acknowledged=0, total=len(keys), cause="planted")
        return self.inner.drop(keys)

    def capacity(self) -> Any:
        return self.inner.capacity()

    def close(self) -> None:
        self.inner.close()


# -- what each rank runs ---------------------------------------------------------


def wrapped(store: Store, rank: int, **overrides: Any) -> DistributedCache:
    return DistributedCache(
        HiCache(config(), storage=tier(store, rank, **overrides)), timeout=TIMEOUT
    )


def written(rank: int, folder: Path, toks: list[int]) -> tuple[LocalFileStore, list[str]]:
    """This rank's store holding ``toks``' pages, stored by an agreed cache; their keys."""
    store = LocalFileStore(folder / f"rank{rank}")
    shared = wrapped(store, rank)
    shared.cache.insert(toks)
    shared.drain()
    keys = page_keys(shared.cache.storage.namespace(), toks)  # type: ignore[union-attr]
    shared.cache.close()
    assert store.exists_prefix(keys) == len(keys)
    return store, keys


def report(shared: DistributedCache, **more: Any) -> dict[str, Any]:
    """What the ranks must agree on, and what each saw on its own."""
    cache = shared.cache
    return {
        "digest": shared.verify_agreement().hex(),
        "transitions": shared.transitions,
        "tree": rows(cache),
        "events": events(cache),
        "acks": cache.log.storage_acks(),
        "hits": [args for name, args in cache.log.operations() if name == "agreed_hits"],
        "prefetch": dict(cache.stats().prefetch),
        "failures": dict(cache.stats().storage_failures),
        "free_host": cache.tiers.host.allocator.free_pages,
        **more,
    }


def store_fails_on_one_rank(rank: int, folder: Path, *, retried: bool = False) -> dict[str, Any]:
    """Rank 1's store takes 2 of 5 pages of a put, then fails; rank 0's takes all 5.

    ``retried``: then rank 1's store is back, and the first lookup after the
    backoff the failure began stores the rest on both.
    """
    inner = LocalFileStore(folder / f"rank{rank}")
    store = Faulty(inner)
    store.put_fails_after = 2 if rank == 1 else None
    shared = wrapped(store, rank, query_backoff=0.05, query_backoff_max=0.05)
    toks = tokens(5)
    shared.cache.insert(toks)
    shared.drain()
    if retried:
        store.put_fails_after = None
        shared.cache.match_prefix(toks)  # backing off on both: stores nothing
        time.sleep(0.1)
        shared.step()  # both waits have passed
        shared.cache.match_prefix(toks)
        shared.drain()
    keys = page_keys(shared.cache.storage.namespace(), toks)  # type: ignore[union-attr]
    return report(shared, held=inner.exists_prefix(keys))


def store_times_out_on_one_rank(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's put never answers: past io_timeout it fails there, and so on rank 0."""
    inner = LocalFileStore(folder / f"rank{rank}")
    store = Faulty(inner)
    if rank == 1:
        store.gate = threading.Event()
    shared = wrapped(store, rank, threads=1, io_timeout=1.0)
    toks = tokens(2)
    shared.cache.insert(toks)
    shared.drain()  # waits for the put until its timeout on rank 1
    out = report(shared)
    if store.gate is not None:
        store.gate.set()  # the late answer comes to no one
    keys = page_keys(shared.cache.storage.namespace(), toks)  # type: ignore[union-attr]
    shared.cache.close()
    return {**out, "held": inner.exists_prefix(keys) if rank == 0 else None}


def hits_differ(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store lost page 4 of 6: both ranks fetch 4 pages."""
    toks = tokens(6)
    store, keys = written(rank, folder, toks)
    if rank == 1:
        store.drop([keys[4]])
    shared = wrapped(store, rank)
    found = shared.cache.match_prefix(toks)
    during = [found.host_len, found.storage_len]
    shared.drain()
    found = shared.cache.match_prefix(toks[: 4 * PAGE])  # nothing past it: no query
    return report(shared, during=during, after=[found.host_len, found.storage_len])


def hits_below_threshold(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store holds 1 page, rank 0's 6; two pages are the threshold: nobody fetches."""
    toks = tokens(6)
    store, keys = written(rank, folder, toks)
    if rank == 1:
        store.drop([keys[1]])
    shared = wrapped(store, rank, prefetch_threshold=2 * PAGE)
    found = shared.cache.match_prefix(toks)
    shared.drain()
    return report(shared, during=[found.host_len, found.storage_len])


def discover_differs(rank: int, folder: Path) -> dict[str, Any]:
    """Both cache 2 pages unstored; rank 1's store lost page 0: no rank discovers them."""
    toks = tokens(6)
    store, keys = written(rank, folder, toks)
    if rank == 1:
        store.drop([keys[0]])
    shared = wrapped(store, rank, policy="off")
    shared.cache.insert(toks[: 2 * PAGE])
    shared.drain()
    found = shared.cache.match_prefix(toks)
    during = [found.device_len, found.host_len, found.storage_len]
    shared.drain()
    return report(shared, during=during)


def read_loses_a_page(rank: int, folder: Path) -> dict[str, Any]:
    """Both stores said 6 pages; by the read rank 1's has lost page 3: both keep 3 pages."""
    toks = tokens(6)
    store, keys = written(rank, folder, toks)
    faulty = Faulty(store)

    def lose_page_3() -> None:
        store.drop([keys[3]])

    if rank == 1:
        faulty.after_exists = lose_page_3
    shared = wrapped(faulty, rank)
    found = shared.cache.match_prefix(toks)
    during = [found.host_len, found.storage_len]
    shared.drain()
    out = report(shared, during=during)
    out["bit_exact"] = loaded_bit_exact(shared, toks[: 3 * PAGE])
    return out


def loaded_bit_exact(shared: DistributedCache, toks: list[int]) -> bool:
    """Load ``toks``' host prefix to the device (agreed) and compare its KV with what was stored."""
    cache = shared.cache
    found = cache.match_prefix(toks)
    assert cache.load_back(found.last_host_node) is not None
    shared.drain()
    found = cache.match_prefix(toks)
    kv = cache.tiers.read_device(list(found.device_pages))
    expected = synthetic_kv(cache.tiers.device.layout, toks)
    return found.device_len == len(toks) and torch.equal(kv, expected)


def query_backs_off(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store stops answering queries: both ranks back off, and ask again at one step.

    Rank 0's backoff is 10 ms, rank 1's 2 s (clocks that disagree): rank 0's
    clock alone would let its next lookup ask, and the ranks would part. The
    tier's clock is moved by hand: on the real one a loaded machine could pass
    rank 1's 2 s before the step that must find it still backing off.
    """
    toks = tokens(4)
    store, _ = written(rank, folder, toks)
    faulty = Faulty(store)
    faulty.exists_fails = rank == 1
    wait = 0.01 if rank == 0 else 2.0
    clock = HandClock()
    shared = wrapped(
        faulty, rank, query_backoff=wait, query_backoff_max=wait, clock=clock.monotonic
    )
    seen = []

    def lookup() -> None:
        found = shared.cache.match_prefix(toks)
        seen.append([faulty.queries, found.storage_len])

    lookup()  # fails on rank 1: both back off
    clock.now += 0.05
    lookup()  # both ask nothing, though rank 0's wait has passed
    shared.step()  # rank 1's has not: still backing off
    lookup()
    faulty.exists_fails = False
    clock.now += 2.0
    shared.step()  # both waits have passed
    lookup()  # both ask, and fetch
    shared.drain()
    return report(shared, seen=seen)


def slow_query_backs_off(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store answers after 0.6 s, past a 0.3 s budget: both back off at that lookup.

    Its answer stands (both fetch the first prefix); the next lookup asks
    nothing on either rank until a step where both ranks' waits have passed
    (rank 0's is 10 ms, rank 1's 1 s: rank 0's clock alone would part them).
    The tier's clock is moved by hand, the slow answer's 0.6 s included: on
    the real one a loaded machine could make rank 0's query slow too, or pass
    rank 1's 1 s before the step that must find it still backing off.
    """
    first, second = tokens(3), tokens(3, start=5000)
    store, _ = written(rank, folder, first)
    more = LocalFileStore(folder / f"rank{rank}")
    faulty = Faulty(store)
    wait = 0.01 if rank == 0 else 1.0
    clock = HandClock()
    shared = wrapped(
        faulty,
        rank,
        query_budget=0.3,
        query_backoff=wait,
        query_backoff_max=wait,
        clock=clock.monotonic,
    )
    second_written = wrapped(more, rank)
    second_written.cache.insert(second)
    second_written.drain()
    second_written.cache.close()
    seen = []

    def lookup(toks: list[int]) -> None:
        found = shared.cache.match_prefix(toks)
        seen.append([faulty.queries, found.storage_len])

    def slow() -> None:
        clock.now += 0.6

    faulty.after_exists = slow if rank == 1 else None
    lookup(first)  # slow on rank 1: both use the answer, and back off
    faulty.after_exists = None
    clock.now += 0.05
    lookup(second)  # both ask nothing, though rank 0's wait has passed
    shared.step()  # rank 1's has not: still backing off
    lookup(second)
    clock.now += 1.0
    shared.step()  # both waits have passed
    lookup(second)  # both ask, and fetch
    shared.drain()
    return report(shared, seen=seen)


def copy_failure_backs_off(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store fails a put: at the step that applies it, both ranks back off.

    The store that failed a put is likely to fail the next lookup's query, so
    no lookup asks it until both ranks' waits have passed (rank 0's 10 ms,
    rank 1's 1 s), at one step. The tier's clock is moved by hand, so a
    loaded machine cannot pass rank 1's 1 s before the step that must find it
    still backing off.
    """
    toks = tokens(3)
    store, _ = written(rank, folder, toks)
    faulty = Faulty(store)
    faulty.put_fails_after = 0 if rank == 1 else None
    wait = 0.01 if rank == 0 else 1.0
    clock = HandClock()
    shared = wrapped(
        faulty, rank, query_backoff=wait, query_backoff_max=wait, clock=clock.monotonic
    )
    seen = []

    def lookup() -> None:
        found = shared.cache.match_prefix(toks)
        seen.append([faulty.queries, found.storage_len])

    shared.cache.insert(tokens(2, start=5000))
    shared.drain()  # its store fails on rank 1: both back off
    faulty.put_fails_after = None
    clock.now += 0.05
    lookup()  # both ask nothing, though rank 0's wait has passed
    shared.step()  # rank 1's has not: still backing off
    lookup()
    clock.now += 1.0
    shared.step()  # both waits have passed
    lookup()  # both ask, and fetch
    shared.drain()
    return report(shared, seen=seen)


def backoff_state(shared: DistributedCache, clock: HandClock) -> list[Any]:
    """Whether lookups back off, the failures in a row, and the seconds left to wait."""
    backoff = shared.cache.storage.backoff  # type: ignore[union-attr]
    return [backoff.closed, backoff.failures, max(0.0, backoff.until - clock.now)]


def one_outage_seen_at_two_steps(rank: int, folder: Path) -> dict[str, Any]:
    """Two stores in flight as the stores go down; the ranks see them fail a step apart.

    Rank 0's store fails the first at once (and takes the second); rank 1's
    takes the first and hangs on the second until its ``io_timeout``. One
    outage: the group backs off once, at the first step, on both ranks; the
    second step, where rank 1's copy times out, ends the backoff (both waits
    passed) and backs off no more, so both ask at the next lookup. Neither
    rank ends the row of failures at the second copy (rank 0's landed, but
    the group's outcome is a failure), so the next lookup's query, which
    fails, backs both off for as long. The tier's clock is moved by hand:
    the hung put times out only where the test says, however slowly a
    loaded machine runs it.
    """
    store = Faulty(LocalFileStore(folder / f"rank{rank}"))
    hung = threading.Event()
    first, second = tokens(2), tokens(2, start=5000)
    clock = HandClock()
    shared = wrapped(
        store,
        rank,
        policy="off",
        threads=1,
        io_timeout=1.0,
        query_backoff=1.0,
        query_backoff_max=30.0,
        clock=clock.monotonic,
    )
    cache = shared.cache
    namespace = cache.storage.namespace()  # type: ignore[union-attr]
    down = page_keys(namespace, first if rank == 0 else second)[0]

    def outage(keys: Sequence[str]) -> None:
        if keys[0] != down:
            return
        if rank == 1:
            hung.wait()
        raise StoreFailed("faulty", "put", acknowledged=0, total=len(keys), cause="planted")

    store.before_put = outage
    cache.insert(first)
    cache.insert(second)
    shared.drain()  # the host backups land; nothing stores on its own (policy off)
    for toks in (first, second):
        cache.fire("store", cache.match_prefix(toks).last_device_node)
    copies = list(cache.storage.in_flight().values())  # type: ignore[union-attr]
    for copy in copies if rank == 0 else copies[:1]:  # those that end here without the clock
        assert copy.done.wait(30)
    shared.step()  # the first failed on rank 0: both back off
    seen = [backoff_state(shared, clock)]
    clock.now += 1.0  # past the second's io_timeout, and past the wait
    shared.step()  # the second timed out on rank 1: the same outage
    seen.append(backoff_state(shared, clock))
    store.exists_fails = True
    found = cache.match_prefix(tokens(2, start=9000))  # both ask the store: it fails
    seen.append([store.queries, found.storage_len])
    seen.append(backoff_state(shared, clock))
    hung.set()
    out = report(shared, seen=seen)
    cache.close()
    return out


def no_backup_while_backing_off(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store fails a put: both back off, and no backup starts on either meanwhile.

    A host backup acknowledged during the backoff leaves its node unstored
    and unpinned on both ranks (the backoff is the group's, so is the
    decision); the first lookup after the backoff that matches it stores it
    on both. The tier's clock is moved by hand.
    """
    inner = LocalFileStore(folder / f"rank{rank}")
    store = Faulty(inner)
    store.put_fails_after = 0 if rank == 1 else None
    later = tokens(2, start=5000)
    clock = HandClock()
    shared = wrapped(store, rank, query_backoff=1.0, query_backoff_max=1.0, clock=clock.monotonic)
    shared.cache.insert(tokens(2))
    shared.drain()  # its store fails on rank 1: both back off
    store.put_fails_after = None
    shared.cache.insert(later)
    shared.drain()  # its host backup lands: no store starts
    during = rows(shared.cache)
    clock.now += 1.0
    shared.step()  # both waits have passed
    shared.cache.match_prefix(later)  # stores it, on both
    shared.drain()
    keys = page_keys(shared.cache.storage.namespace(), later)  # type: ignore[union-attr]
    return report(shared, during=during, held=inner.exists_prefix(keys))


def fetch_unwritten_on_one_rank(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1 reads 3 pages it cannot write to its host: the fetch fails on both.

    Rank 1 alone raises CopyFailed, from the step that applied the failure.
    Its step applied it as failed and rank 0's landed it, and the ranks
    parted at the next step.
    """
    toks = tokens(3)
    store, _ = written(rank, folder, toks)
    faulty = Faulty(store)
    faulty.no_data = rank == 1
    shared = wrapped(faulty, rank)
    during = shared.cache.match_prefix(toks).storage_len
    try:
        shared.step()
        raised = None
    except CopyFailed as exc:
        raised = str(exc)
    shared.step()
    return report(shared, during=during, raised=raised)


def evict_storage_drop_fails_on_one_rank(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1's store fails to drop: both ranks evict the node all the same.

    Rank 1 kept the node stored and answered 0 where rank 0 answered 8, and
    the ranks parted at the next step.
    """
    inner = LocalFileStore(folder / f"rank{rank}")
    store = Faulty(inner)
    shared = DistributedCache(
        HiCache(config(), storage=tier(store, rank, owned=True)), timeout=TIMEOUT
    )
    prompts = [tokens(2), tokens(2, start=5000)]
    for toks in prompts:
        shared.cache.insert(toks)
    shared.drain()
    store.drop_fails = rank == 1
    evicted = shared.cache.evict_storage(2 * PAGE)
    store.drop_fails = False
    shared.step()
    namespace = shared.cache.storage.namespace()  # type: ignore[union-attr]
    return report(
        shared,
        evicted=evicted,
        held=sum(inner.exists_prefix(page_keys(namespace, toks)) for toks in prompts),
        errors=dict(shared.cache.stats().storage_errors),
    )


def different_collectives(rank: int, folder: Path) -> str:
    """Rank 0's lookup asks the store while rank 1 ends a step: both say so."""
    toks = tokens(2)
    store, _ = written(rank, folder, toks)
    shared = wrapped(store, rank)
    try:
        if rank == 0:
            shared.cache.match_prefix(toks)
        else:
            shared.step()
    except RankDivergence as exc:
        return str(exc)
    return "no divergence"


SCENARIOS: dict[str, Callable[[int, Path], Any]] = {
    "store_fails": store_fails_on_one_rank,
    "store_times_out": store_times_out_on_one_rank,
    "store_retried": partial(store_fails_on_one_rank, retried=True),
    "hits_differ": hits_differ,
    "below_threshold": hits_below_threshold,
    "discover": discover_differs,
    "read_loses": read_loses_a_page,
    "query_backs_off": query_backs_off,
    "slow_query": slow_query_backs_off,
    "copy_failure": copy_failure_backs_off,
    "one_outage": one_outage_seen_at_two_steps,
    "no_backup": no_backup_while_backing_off,
    "collectives": different_collectives,
    "fetch_unwritten": fetch_unwritten_on_one_rank,
    "evict_drop_fails": evict_storage_drop_fails_on_one_rank,
}


def worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )
    results = {name: run(rank, Path(out, name)) for name, run in SCENARIOS.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Run every scenario on 2 gloo ranks; each rank's JSON."""
    folder = tmp_path_factory.mktemp("tp2storage")
    args = (2, str(folder / "group"), str(folder))
    ctx = start_processes(worker, args=args, nprocs=2, join=False)  # type: ignore[no-untyped-call]
    ends = time.monotonic() + DEADLINE
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with a rank's traceback
        if time.monotonic() > ends:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"2 ranks still running after {DEADLINE:g} s")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def agreed(ranks: Results, name: str) -> dict[str, Any]:
    """The scenario's report on rank 0, once every value the ranks must share is equal."""
    first, second = (r[name] for r in ranks)
    for shared in ("digest", "transitions", "tree", "events", "free_host"):
        assert first[shared] == second[shared], shared
    return dict(first)


# -- the spawned tests ------------------------------------------------------------


def test_a_store_failed_on_one_rank_splits_the_node_on_both(ranks: Results) -> None:
    run = agreed(ranks, "store_fails")
    assert [row[2:] for row in run["tree"]] == [
        [2 * PAGE, "backed", "resident", "stored", 0],
        [3 * PAGE, "backed", "resident", "unstored", 0],
    ]
    head, tail = run["tree"]
    assert tail[1] == head[0]  # the failed pages hang under the stored prefix
    assert [r["store_fails"]["acks"] for r in ranks] == [
        [["poll", [[1, "store", 2, "peer_failed"]]]],
        [["poll", [[1, "store", 2, "failed"]]]],
    ]
    assert [r["store_fails"]["failures"] for r in ranks] == [
        {"store:peer_failed": 1},
        {"store:failed": 1},
    ]
    # rank 0's store holds all five pages; its tree, like rank 1's, says two
    assert [r["store_fails"]["held"] for r in ranks] == [5, 2]


def test_a_store_failed_on_one_rank_is_started_again_on_both_by_a_lookup(
    ranks: Results,
) -> None:
    run = agreed(ranks, "store_retried")
    assert [row[2:] for row in run["tree"]] == [
        [2 * PAGE, "backed", "resident", "stored", 0],
        [3 * PAGE, "backed", "resident", "stored", 0],
    ]
    assert [r["store_retried"]["acks"][-1] for r in ranks] == [
        ["poll", [[2, "store", 3, "ok"]]]
    ] * 2
    assert [r["store_retried"]["held"] for r in ranks] == [5, 5]


def test_a_store_timed_out_on_one_rank_fails_on_both(ranks: Results) -> None:
    run = agreed(ranks, "store_times_out")
    assert [row[2:] for row in run["tree"]] == [[2 * PAGE, "backed", "resident", "unstored", 0]]
    assert run["events"][-1] == "store_failed"
    assert [r["store_times_out"]["acks"] for r in ranks] == [
        [["poll", [[1, "store", 0, "peer_failed"]]]],
        [["poll", [[1, "store", 0, "timeout"]]]],
    ]
    assert ranks[0]["store_times_out"]["held"] == 2


def test_hit_counts_that_differ_are_agreed_to_the_min(ranks: Results) -> None:
    run = agreed(ranks, "hits_differ")
    assert run["during"] == [0, 4 * PAGE]  # both fetch four pages
    assert [row[2:] for row in run["tree"]] == [[4 * PAGE, "backed", "absent", "stored", 0]]
    # (pages of the cached run, pages of the tail) found, then agreed
    assert [r["hits_differ"]["hits"] for r in ranks] == [
        [[[0, 6, 1, 1], [0, 4, 1, 1]]],
        [[[0, 4, 1, 1], [0, 4, 1, 1]]],
    ]
    assert run["after"] == [4 * PAGE, 0]
    assert [r["hits_differ"]["acks"] for r in ranks] == [[["poll", [[1, "fetch", 4, "ok"]]]]] * 2
    assert run["free_host"] == 32 - 4


def test_below_the_threshold_after_agreement_no_rank_prefetches(ranks: Results) -> None:
    run = agreed(ranks, "below_threshold")
    assert run["during"] == [0, 0]
    assert run["tree"] == []
    assert "fetch" not in run["events"]
    assert [r["below_threshold"]["hits"] for r in ranks] == [
        [[[0, 6, 1, 1], [0, 1, 1, 1]]],
        [[[0, 1, 1, 1], [0, 1, 1, 1]]],
    ]
    assert [r["below_threshold"]["prefetch"] for r in ranks] == [{"below_threshold": 1}] * 2


def test_a_cached_run_is_discovered_only_where_every_rank_holds_it(ranks: Results) -> None:
    run = agreed(ranks, "discover")
    assert "discover" not in run["events"]
    assert [row[2:] for row in run["tree"]] == [
        [2 * PAGE, "backed", "resident", "unstored", 0],
        [4 * PAGE, "backed", "absent", "stored", 0],
    ]
    assert run["during"] == [2 * PAGE, 0, 4 * PAGE]
    assert [r["discover"]["hits"] for r in ranks] == [
        [[[2, 4, 1, 1], [0, 4, 1, 1]]],
        [[[0, 4, 1, 1], [0, 4, 1, 1]]],
    ]


def test_a_page_lost_mid_prefix_on_one_rank_shortens_the_prefix_on_both(ranks: Results) -> None:
    run = agreed(ranks, "read_loses")
    assert run["during"] == [0, 6 * PAGE]  # both stores said six pages
    assert [r["read_loses"]["hits"] for r in ranks] == [[[[0, 6, 1, 1], [0, 6, 1, 1]]]] * 2
    assert [row[2:] for row in run["tree"]] == [[3 * PAGE, "backed", "absent", "stored", 0]]
    fetched = run["events"].index("fetch_done")
    assert run["events"][fetched : fetched + 4] == [
        "fetch_done",
        "fetch_failed",
        "vanish",
        "delete",
    ]
    assert [r["read_loses"]["acks"][0] for r in ranks] == [
        ["poll", [[1, "fetch", 3, "peer_missing"]]],
        ["poll", [[1, "fetch", 3, "missing"]]],
    ]
    assert [r["read_loses"]["bit_exact"] for r in ranks] == [True, True]


def test_a_query_that_failed_on_one_rank_backs_off_every_rank_alike(ranks: Results) -> None:
    run = agreed(ranks, "query_backs_off")
    # per lookup: the queries this rank's store was asked so far, the pages prefetched
    assert [r["query_backs_off"]["seen"] for r in ranks] == [
        [[1, 0], [1, 0], [1, 0], [2, 4 * PAGE]]
    ] * 2
    assert [r["query_backs_off"]["hits"] for r in ranks] == [
        [[[0, 4, 1, 1], [0, 0, 0, 0]], [[0, 4, 1, 1], [0, 4, 1, 1]]],
        [[[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 4, 1, 1], [0, 4, 1, 1]]],
    ]
    assert [r["query_backs_off"]["prefetch"] for r in ranks] == [
        {"query_failed": 1, "backing_off": 2, "started": 1}
    ] * 2
    assert [row[2:] for row in run["tree"]] == [[4 * PAGE, "backed", "absent", "stored", 0]]


def test_a_query_slow_on_one_rank_backs_off_every_rank_alike(ranks: Results) -> None:
    run = agreed(ranks, "slow_query")
    # per lookup: the queries this rank's store was asked so far, the pages prefetched
    assert [r["slow_query"]["seen"] for r in ranks] == [
        [[1, 3 * PAGE], [1, 0], [1, 0], [2, 3 * PAGE]]
    ] * 2
    assert [r["slow_query"]["hits"] for r in ranks] == [
        [[[0, 3, 1, 1], [0, 3, 1, 0]], [[0, 3, 1, 1], [0, 3, 1, 1]]],
        [[[0, 3, 1, 0], [0, 3, 1, 0]], [[0, 3, 1, 1], [0, 3, 1, 1]]],
    ]
    assert [r["slow_query"]["prefetch"] for r in ranks] == [{"started": 2, "backing_off": 2}] * 2
    assert [r["slow_query"]["failures"] for r in ranks] == [{"query:slow": 1}] * 2
    assert [row[2:] for row in run["tree"]] == [
        [3 * PAGE, "backed", "absent", "stored", 0],
        [3 * PAGE, "backed", "absent", "stored", 0],
    ]


def test_a_copy_failed_on_one_rank_backs_off_every_rank_alike(ranks: Results) -> None:
    run = agreed(ranks, "copy_failure")
    assert [r["copy_failure"]["seen"] for r in ranks] == [[[0, 0], [0, 0], [1, 3 * PAGE]]] * 2
    assert [r["copy_failure"]["prefetch"] for r in ranks] == [{"backing_off": 2, "started": 1}] * 2
    assert [r["copy_failure"]["failures"] for r in ranks] == [
        {"store:peer_failed": 1},
        {"store:failed": 1},
    ]
    assert [row[3:] for row in run["tree"]] == [
        ["backed", "absent", "stored", 0],  # fetched after the backoff
        ["backed", "resident", "unstored", 0],  # its store failed (on rank 1)
    ]


def test_one_outage_seen_at_two_steps_backs_every_rank_off_once(ranks: Results) -> None:
    run = agreed(ranks, "one_outage")
    # backing off, failures in a row, seconds left: after the first step, the second, then
    # the queries asked so far and the pages prefetched at the lookup after them, then after
    # that lookup's query failed. The row of failures is the group's: rank 0's second copy
    # landed but rank 1's timed out, so neither ends it, and both wait 2 s after the query
    assert [r["one_outage"]["seen"] for r in ranks] == [
        [[True, 1, 1.0], [False, 1, 0.0], [1, 0], [True, 2, 2.0]]
    ] * 2
    assert [r["one_outage"]["acks"] for r in ranks] == [
        [["poll", [[1, "store", 0, "failed"]]], ["poll", [[2, "store", 0, "peer_failed"]]]],
        [["poll", [[1, "store", 0, "peer_failed"]]], ["poll", [[2, "store", 0, "timeout"]]]],
    ]
    assert [row[5:] for row in run["tree"]] == [["unstored", 0], ["unstored", 0]]


def test_no_backup_starts_on_any_rank_while_the_group_backs_off(ranks: Results) -> None:
    run = agreed(ranks, "no_backup")
    assert [[row[2:] for row in r["no_backup"]["during"]] for r in ranks] == [
        [[2 * PAGE, "backed", "resident", "unstored", 0]] * 2
    ] * 2
    assert [r["no_backup"]["failures"] for r in ranks] == [
        {"store:peer_failed": 1, "store:backing_off": 1},
        {"store:failed": 1, "store:backing_off": 1},
    ]
    assert [r["no_backup"]["acks"][-1] for r in ranks] == [["poll", [[2, "store", 2, "ok"]]]] * 2
    assert [r["no_backup"]["held"] for r in ranks] == [2, 2]
    assert sorted(row[5] for row in run["tree"]) == ["stored", "unstored"]


def test_ranks_that_reach_different_collectives_say_so(ranks: Results) -> None:
    messages = [r["collectives"] for r in ranks]
    assert messages[0] == messages[1]
    assert messages[0].endswith(
        "the ranks reached different collectives: rank 0 a prefetch's hit count, rank 1 a "
        "step (a lookup asked the storage tier on some ranks only)"
    )


def test_a_fetch_one_rank_cannot_write_to_its_host_fails_on_every_rank(ranks: Results) -> None:
    run = agreed(ranks, "fetch_unwritten")
    assert run["during"] == 3 * PAGE
    assert run["tree"] == []
    assert run["free_host"] == 32
    assert [r["fetch_unwritten"]["acks"] for r in ranks] == [
        [["poll", [[1, "fetch", 0, "peer_failed"]]]],
        [["poll", [[1, "fetch", 0, "failed"]]]],
    ]
    assert [r["fetch_unwritten"]["raised"] for r in ranks] == [
        None,
        "storage: fetch 1: its pages could not be written to the host: "
        "NotImplementedError: Cannot copy out of meta tensor; no data!",
    ]


def test_evict_storage_that_one_rank_cannot_drop_evicts_on_every_rank(ranks: Results) -> None:
    run = agreed(ranks, "evict_drop_fails")
    assert [r["evict_drop_fails"]["evicted"] for r in ranks] == [2 * PAGE, 2 * PAGE]
    assert sorted(row[5] for row in run["tree"]) == ["stored", "unstored"]
    assert [r["evict_drop_fails"]["failures"] for r in ranks] == [{}, {"evict:failed": 1}]
    assert [r["evict_drop_fails"]["errors"] for r in ranks] == [
        {},
        {"evict:failed": "faulty: drop failed after 0 of 2 pages: planted"},
    ]
    # rank 1's store keeps the evicted node's pages, unknown to its tree
    assert [r["evict_drop_fails"]["held"] for r in ranks] == [2, 4]


# -- one tier, the other rank made up ---------------------------------------------


def test_a_tier_under_agreement_applies_only_what_the_group_accepted(tmp_path: Path) -> None:
    cache = HiCache(config(), storage=tier(LocalFileStore(tmp_path), ranks=1))
    storage = cache.storage
    assert storage is not None
    storage.agree_by(lambda found, asked: list(found))
    cache.insert(tokens(3))
    cache.poll()  # write_done: the store runs inline
    assert cache.poll() == 0  # finished here, not accepted: nothing applied
    (node,) = cache.tree
    assert node.storage == "storing"
    assert storage.report(4) == [2 * 3 + 1, -1, -1, -1]
    with pytest.raises(InvariantViolation):
        storage.accept([2 * 4 + 1, -1, -1, -1])  # more pages than this rank landed
    assert cache.poll() == 0  # refused: nothing accepted
    storage.report(4)
    assert storage.accept([2 * 1 + 1, -1, -1, -1]) == 1  # another rank landed one page
    assert cache.poll() == 1
    assert [(len(n.key), n.storage, n.pins) for n in cache.tree] == [
        (PAGE, "stored", 0),
        (2 * PAGE, "unstored", 0),
    ]
    assert cache.log.storage_acks() == [("poll", ((1, "store", 1, "peer_failed"),))]


def test_a_read_agreed_shorter_vanishes_past_the_agreed_page(tmp_path: Path) -> None:
    toks = tokens(4)
    writer = HiCache(config(), storage=tier(LocalFileStore(tmp_path), ranks=1))
    writer.insert(toks)
    writer.poll()
    writer.poll()
    reader = HiCache(config(), storage=tier(LocalFileStore(tmp_path), ranks=1))
    storage = reader.storage
    assert storage is not None
    asked: list[tuple[list[int], list[int]]] = []

    def other_rank_holds_three(found: Sequence[int], pages: Sequence[int]) -> list[int]:
        asked.append((list(found), list(pages)))
        return [found[0], min(found[1], 3), found[2], found[3]]

    storage.agree_by(other_rank_holds_three)
    assert reader.match_prefix(toks).storage_len == 3 * PAGE
    assert asked == [([0, 4, 1, 1], [0, 4, 1, 1])]
    assert storage.report(2) == [2 * 3 + 1, -1]
    storage.accept([2 * 2 + 0, -1])  # the other rank's store lost page 2 at the read
    reader.poll()
    assert [(len(n.key), n.host, n.storage) for n in reader.tree] == [
        (2 * PAGE, "backed", "stored")
    ]
    assert events(reader)[-4:] == ["fetch_done", "fetch_failed", "vanish", "delete"]
    assert reader.log.storage_acks() == [("poll", ((1, "fetch", 2, "peer_missing"),))]
    assert reader.tiers.host.allocator.free_pages == 32 - 2


def agreed_reader(store: Store, toks: list[int]) -> HiCache:
    """A cache under a made-up agreement (every rank found what this one did), reading ``toks``."""
    reader = HiCache(config(), storage=tier(store, ranks=1))
    assert reader.storage is not None
    reader.storage.agree_by(lambda found, asked: list(found))
    assert reader.match_prefix(toks).storage_len == len(toks)
    return reader


def test_a_fetch_this_rank_cannot_write_to_its_host_is_reported_as_none(tmp_path: Path) -> None:
    """The group fails it on every rank; this rank raises its error once that is applied.

    It was reported as read, so every rank applied it as landed, and this
    rank's poll then failed it alone (and raised inside the cache's
    operation, a refusal the other ranks' logs lacked).
    """
    toks = tokens(3)
    written_store = LocalFileStore(tmp_path)
    writer = HiCache(config(), storage=tier(written_store, ranks=1))
    writer.insert(toks)
    writer.poll()
    writer.poll()
    store = Faulty(LocalFileStore(tmp_path))
    store.no_data = True
    reader = agreed_reader(store, toks)
    storage = reader.storage
    assert storage is not None
    assert storage.report(2) == [2 * 0 + 1, -1]  # read 3 pages, wrote none to the host
    assert storage.report(2) == [2 * 0 + 1, -1]  # the same at every report
    assert storage.accept([1, -1]) == 1
    assert reader.poll() == 1  # applied as failed; the group's step raises, not the cache
    assert list(reader.tree) == []
    assert reader.tiers.host.allocator.free_pages == 32
    assert reader.log.storage_acks() == [("poll", ((1, "fetch", 0, "failed"),))]
    assert [kind for kind, _, _ in reader.log.since(0)].count("refused") == 0
    with pytest.raises(CopyFailed) as caught:
        storage.raise_unwritten()
    assert str(caught.value) == (
        "storage: fetch 1: its pages could not be written to the host: "
        "NotImplementedError: Cannot copy out of meta tensor; no data!"
    )
    storage.raise_unwritten()  # raised once


def test_a_fetch_reported_is_written_to_the_host_once(tmp_path: Path) -> None:
    """The report writes the pages; applying the group's outcome does not write them again."""
    toks = tokens(3)
    store = LocalFileStore(tmp_path)
    writer = HiCache(config(), storage=tier(store, ranks=1))
    writer.insert(toks)
    writer.poll()
    writer.poll()
    reader = agreed_reader(store, toks)
    storage = reader.storage
    assert storage is not None
    keys = page_keys(storage.namespace(), toks)
    (node,) = reader.tree
    assert storage.report(2) == [2 * 3 + 1, -1]
    host = reader.tiers.host.pages
    assert torch.equal(host[list(node.host_pages)], torch.stack(store.get(keys)))
    (copy,) = storage.in_flight().values()
    assert copy.result is not None
    for page in copy.result.pages:  # a second write would land these zeros
        page.zero_()
    storage.accept([2 * 3 + 1, -1])
    reader.poll()
    assert [(len(n.key), n.host, n.storage) for n in reader.tree] == [
        (3 * PAGE, "backed", "stored")
    ]
    assert torch.equal(host[list(node.host_pages)], torch.stack(store.get(keys)))


def test_a_fetch_another_rank_cannot_write_fails_here_as_peer_failed(tmp_path: Path) -> None:
    toks = tokens(3)
    store = LocalFileStore(tmp_path)
    writer = HiCache(config(), storage=tier(store, ranks=1))
    writer.insert(toks)
    writer.poll()
    writer.poll()
    reader = agreed_reader(store, toks)
    storage = reader.storage
    assert storage is not None
    assert storage.report(2) == [2 * 3 + 1, -1]
    storage.accept([2 * 0 + 1, -1])  # the other rank wrote none
    assert reader.poll() == 1
    assert list(reader.tree) == []
    assert reader.tiers.host.allocator.free_pages == 32
    assert reader.log.storage_acks() == [("poll", ((1, "fetch", 0, "peer_failed"),))]
    storage.raise_unwritten()  # nothing to raise here


def agreed_owner(store: Store) -> tuple[HiCache, TreeNode]:
    """An owned store's cache holding one stored node, under a made-up agreement from then on."""
    cache = HiCache(config(), storage=tier(store, ranks=1, owned=True))
    cache.insert(tokens(2))
    cache.poll()
    cache.poll()
    (node,) = cache.tree
    assert node.storage == "stored"
    assert cache.storage is not None
    cache.storage.agree_by(lambda found, asked: list(found))
    return cache, node


def test_under_agreement_a_drop_this_rank_fails_still_evicts(tmp_path: Path) -> None:
    """What this rank's store does cannot change which nodes the group evicts.

    The node stayed stored here, and evict_storage answered 0 where the
    other ranks answered 8.
    """
    inner = LocalFileStore(tmp_path)
    store = Faulty(inner)
    cache, node = agreed_owner(store)
    keys = list(node.store_keys or ())
    store.drop_fails = True
    assert cache.evict_storage(100) == 2 * PAGE
    assert node.storage == "unstored"
    assert cache.stats().storage_failures == {"evict:failed": 1}
    assert cache.stats().storage_errors == {
        "evict:failed": "faulty: drop failed after 0 of 2 pages: planted"
    }
    assert "evicted" not in cache.stats().storage_pages
    assert inner.exists_prefix(keys) == 2  # left in the store, unknown to the tree


def test_under_agreement_a_page_a_read_holds_still_evicts(tmp_path: Path) -> None:
    """A read of a fetch that timed out here may hold a page: the node is evicted all the same.

    The event itself (``fire``) raised EffectFailed on this rank alone.
    """
    store = LocalFileStore(tmp_path)
    cache, node = agreed_owner(store)
    keys = list(node.store_keys or ())
    with store.reading(keys):
        cache.fire("evict_storage", node)
    assert node.storage == "unstored"
    assert cache.stats().storage_failures == {"evict:failed": 1}
    assert store.exists_prefix(keys) == 2


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_a_storage_tier_whose_distributed_cache_was_dropped_decides_alone(tmp_path: Path) -> None:
    """Its stores and fetches waited for a group's acceptance that no step would give again."""
    store = LocalFileStore(tmp_path / "pages")
    cache = HiCache(config(), storage=tier(store, ranks=1))
    shared = DistributedCache(cache)
    cache.insert(tokens(2))
    shared.step()  # the backup applied; the store starts, and waits for the group
    cache.insert(tokens(2, start=5000))
    assert cache.storage is not None
    assert cache.storage.in_flight()
    del shared
    for _ in range(4):
        cache.poll()
    assert cache.storage.idle()
    assert sorted(n.storage for n in cache.tree) == ["stored", "stored"]
    cache.close()


@pytest.mark.usefixtures("world_of_one")
def test_a_storage_tier_that_leaves_its_ranks_unsaid_is_refused_in_a_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unsaid, ``ranks`` was 1: every rank of a sharded model read the others' heads."""
    store = LocalFileStore(tmp_path / "pages")
    unsaid = StorageConfig(store, model="test", threads=0, io_timeout=5.0)
    assert (unsaid.ranks, unsaid.shards) == (None, 1)
    alone = DistributedCache(HiCache(config(), storage=unsaid))  # a world of one: no shards
    assert alone.cache.storage is not None
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # the other rank of the group of 2 was given the same timeout, and refused alike
    monkeypatch.setattr(Collectives, "all_gather_object", lambda self, mine, what: [mine, mine])
    cache = HiCache(config(), storage=unsaid)
    with pytest.raises(ConfigError) as caught:  # a make-believe group: no sockets to set up
        DistributedCache(cache, local_sockets=False)
    assert str(caught.value) == (
        "distributed: the storage tier does not say its ranks, in a group of 2: pass "
        "StorageConfig(rank=0, ranks=2) where each rank holds its own KV heads, or ranks=1 "
        "where every rank holds the same KV (an MLA latent); unsaid, every rank would key its "
        "shard under one namespace and read the others'"
    )
    assert cache.storage is not None
    assert cache.storage.collect() == []  # refused whole: the tier was not handed to a group
    shared = StorageConfig(store, model="test", ranks=1, threads=0, io_timeout=5.0)
    wrapped = DistributedCache(HiCache(config(), storage=shared), local_sockets=False)
    assert wrapped.cache.storage is not None


@pytest.mark.usefixtures("world_of_one")
def test_a_storage_tier_that_does_not_fit_the_group_is_refused(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path / "pages")
    with pytest.raises(ConfigError) as caught:
        DistributedCache(HiCache(config(), storage=tier(store, rank=1, ranks=2)))
    assert str(caught.value) == (
        "distributed: the storage tier is rank 1 of 2, the group's rank is 0 of 1: pass "
        "StorageConfig(rank=, ranks=) of the group, so each rank keys its own shard (or "
        "ranks=1 where every rank holds the same KV)"
    )
    slow = HiCache(config(), storage=tier(store, ranks=1, io_timeout=30.0))
    with pytest.raises(ConfigError) as caught:
        DistributedCache(slow, timeout=30.0)
    assert str(caught.value) == (
        "distributed: the storage tier's io_timeout (30 s) must be below the agreement "
        "timeout (30 s): a rank waiting for a storage copy must reach the next collective in time"
    )
    assert slow.storage is not None
    assert slow.storage.collect() == []  # refused whole: the tier was not handed to a group
    slow.insert(tokens(2))
    slow.poll()
    slow.poll()
    assert [n.storage for n in slow.tree] == ["stored"]


@pytest.mark.usefixtures("world_of_one")
def test_a_world_of_one_stores_and_prefetches_as_a_cache_alone(tmp_path: Path) -> None:
    toks = tokens(3)
    store = LocalFileStore(tmp_path / "pages")
    shared = DistributedCache(HiCache(config(), storage=tier(store, ranks=1)))
    shared.cache.insert(toks)
    assert shared.drain() == 2  # the host copy, then the store
    assert [n.storage for n in shared.cache.tree] == ["stored"]
    reader = DistributedCache(HiCache(config(), storage=tier(store, ranks=1)))
    assert reader.cache.match_prefix(toks).storage_len == 3 * PAGE
    assert reader.step() == 1
    assert reader.cache.match_prefix(toks).host_len == 3 * PAGE
    assert [name for name, _ in reader.cache.log.operations()].count("agreed_hits") == 1
