"""Tensor-parallel agreement over caches that served before they were wrapped, and node states.

A cache may serve on its own, each rank applying its copies' acknowledgements
as they came (in its own order), before it is wrapped: agreement starts from
where the caches are, once the construction checked they are alike. Two gloo
ranks (spawned as in ``tests/test_distributed.py``) run each scenario on a
gloo group of its own and write what each call said as JSON; the tests compare
the ranks' reports. The unit tests at the end need no process group.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch.distributed as dist
    from torch.multiprocessing.spawn import start_processes

    from fsm_cache.bench.tp import bench_config, chat_trace, serve_request
    from fsm_cache.cache.eventlog import EventLog
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.cache.tree import TreeNode
    from fsm_cache.distributed.agreement import DistributedCache, node_state
    from fsm_cache.distributed.digest import (
        TransitionDigest,
        state_difference,
        state_fingerprint,
    )
    from fsm_cache.errors import FsmCacheError
    from fsm_cache.memory.tiers import CacheConfig
    from fsm_cache.storage import LocalFileStore

TIMEOUT = 20.0  # seconds the default group's collectives wait
DEADLINE = 240.0  # seconds the spawned ranks may run before the test kills them
Results = list[dict[str, Any]]
PROMPTS = [tuple(range(1000 * k, 1000 * k + 16)) for k in range(1, 5)]


def said(call: Callable[[], object]) -> str:
    """What ``call`` raised, as ``Class: message``, or ``returned``."""
    try:
        call()
    except FsmCacheError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def side_group() -> dist.ProcessGroup:
    """A gloo group of its own, so that one scenario's collectives never pair with another's."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    assert isinstance(group, dist.ProcessGroup)
    return group


def apply_all(cache: HiCache, reverse: bool) -> None:
    """Apply every copy in flight on an unwrapped cache, in issue order or reversed."""
    done = cache.tiers.copier.drain()
    cache.apply_completions(done[::-1] if reverse else done)


def served_then_wrapped(rank: int, warm: int = 0, **config: object) -> list[Any]:
    """Each rank serves, applying the copies in its own order, then wraps its cache.

    Four prompts, then ``warm`` requests, the copies applied after each (rank
    1 applies them in the reverse order); the trees are then alike. After the
    wrap both serve in agreed steps.
    """
    cache = HiCache(bench_config(debug=True, **config))
    for prompt in PROMPTS:
        cache.insert(prompt)
    apply_all(cache, reverse=rank == 1)
    for tokens in chat_trace(warm, seed=5):
        serve_request(cache, tokens)
        apply_all(cache, reverse=rank == 1)
    shared = DistributedCache(cache, side_group(), timeout=TIMEOUT)
    counted = shared.transitions  # from the wrap on
    first = said(shared.step)
    for tokens in chat_trace(6, seed=2):
        serve_request(cache, tokens)
        shared.step()
    return [counted, first, said(shared.drain), said(shared.verify_agreement)]


def wrapped_unlike(rank: int) -> list[Any]:
    """Rank 1 inserted a prompt more, then a copy of one is applied on rank 1 only.

    Each wrap is refused on both ranks, naming the difference, and changes
    nothing: once the caches are alike they wrap and agree.
    """
    group = side_group()
    cache = HiCache(bench_config(debug=True))
    cache.insert(PROMPTS[0])
    if rank == 1:
        cache.insert(PROMPTS[1])
    apply_all(cache, reverse=False)
    extra = said(lambda: DistributedCache(cache, group, timeout=TIMEOUT))
    untouched = not cache.transfers.acks_taken
    if rank == 0:
        cache.insert(PROMPTS[1])
        apply_all(cache, reverse=False)
    cache.insert(PROMPTS[2])  # its copy in flight on both ranks ...
    if rank == 1:
        apply_all(cache, reverse=False)  # ... and applied on rank 1 only
    in_flight = said(lambda: DistributedCache(cache, group, timeout=TIMEOUT))
    if rank == 0:
        apply_all(cache, reverse=False)
    shared = DistributedCache(cache, group, timeout=TIMEOUT)
    serve_request(cache, PROMPTS[3])
    return [extra, untouched, in_flight, said(shared.step), said(shared.verify_agreement)]


def storage_evicted_on_one_rank(rank: int, folder: Path) -> str:
    """Rank 1 drops a stored node from its store alone: the message names the storage states."""
    config = CacheConfig(
        device_pages=16,
        host_pages=32,
        page_size=4,
        layers=1,
        heads=1,
        head_dim=4,
        device="cpu",
        debug=True,
        load_back_threshold=0,
    )
    tier = StorageConfig(
        LocalFileStore(folder / f"wrap-store{rank}"),
        model="test",
        rank=rank,
        ranks=2,
        threads=0,
        owned=True,
        io_timeout=5.0,
        prefetch_threshold=4,
    )
    shared = DistributedCache(HiCache(config, storage=tier), side_group(), timeout=TIMEOUT)
    shared.cache.insert(list(range(100, 108)))
    shared.cache.insert(list(range(200, 208)))
    shared.drain()
    if rank == 1:
        shared.cache.evict_storage(8)
    return said(shared.step)


def worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )
    report: dict[str, Any] = {
        "served_then_wrapped": served_then_wrapped(rank),
        "log_dropped_then_wrapped": served_then_wrapped(rank, warm=20, log_limit=64),
        "wrapped_unlike": wrapped_unlike(rank),
        "storage_evicted_on_one_rank": storage_evicted_on_one_rank(rank, Path(out)),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    folder = tmp_path_factory.mktemp("wrap")
    ctx = start_processes(
        worker, args=(2, str(folder / "store"), str(folder)), nprocs=2, join=False
    )  # type: ignore[no-untyped-call]
    ends = time.monotonic() + DEADLINE
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with a rank's traceback
        if time.monotonic() > ends:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"2 ranks still running after {DEADLINE:g} s")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_caches_alike_after_acknowledgements_in_other_orders_wrap_and_agree(
    ranks: Results,
) -> None:
    for report in ranks:
        assert report["served_then_wrapped"] == [0, "returned", "returned", "returned"]


def test_a_cache_whose_log_dropped_entries_before_the_wrap_agrees(ranks: Results) -> None:
    for report in ranks:
        assert report["log_dropped_then_wrapped"] == [0, "returned", "returned", "returned"]


def test_caches_unlike_when_wrapped_are_refused_on_every_rank_and_named(
    ranks: Results,
) -> None:
    refused = (
        "RankDivergence: distributed: rank {} of 2: the ranks' caches differ, so they cannot "
        "start to agree: {}; wrap caches that served the same operations, once every copy is "
        "applied on every rank (poll each until none is in flight), or new ones"
    )
    extra = "node 2: rank 0 not in the tree, rank 1 in the tree"
    in_flight = (
        "node 3 state: rank 0 writing/resident (pins=0, locks=0), "
        "rank 1 backed/resident (pins=0, locks=0)"
    )
    for rank, report in enumerate(ranks):
        assert report["wrapped_unlike"] == [
            refused.format(rank, extra),
            True,
            refused.format(rank, in_flight),
            "returned",
            "returned",
        ]


def test_a_divergence_names_the_storage_state_of_its_nodes(ranks: Results) -> None:
    expected = (
        "RankDivergence: rank divergence at transition 8: rank 0 applied nothing (only 8 "
        "transitions), rank 1 applied node 1 evict_storage in evict_storage(8); node 1 now: "
        "rank 0 backed/resident/stored (pins=0, locks=0), "
        "rank 1 backed/resident/unstored (pins=0, locks=0)"
    )
    assert [r["storage_evicted_on_one_rank"] for r in ranks] == [expected, expected]


def test_node_state_shows_the_storage_state_only_with_a_storage_tier() -> None:
    node = TreeNode(3, (1, 2, 3, 4), None)
    node.storage = "stored"
    assert node_state(node, storage=False) == "unbacked/resident (pins=0, locks=0)"
    assert node_state(node, storage=True) == "unbacked/resident/stored (pins=0, locks=0)"


def test_state_difference_names_a_missing_part_first_then_the_first_field() -> None:
    node = ("node 1", (("parent", "a root"), ("state", "backed/resident (pins=0, locks=0)")))
    other = ("node 1", (("parent", "a root"), ("state", "writing/resident (pins=0, locks=0)")))
    tree = ("the tree", (("last node id", "1"),))
    more = ("the tree", (("last node id", "2"),))
    assert state_difference([[node, tree], [node, tree]]) is None
    assert state_fingerprint([node, tree]) == state_fingerprint([node, tree])
    assert state_fingerprint([node, tree]) != state_fingerprint([other, tree])
    assert state_difference([[node, tree], [other, more], [node, tree]]) == (
        "node 1 state: rank 0 backed/resident (pins=0, locks=0), "
        "rank 1 writing/resident (pins=0, locks=0), rank 2 backed/resident (pins=0, locks=0)"
    )
    second = ("node 2", node[1])
    assert state_difference([[node, tree], [node, second, more]]) == (
        "node 2: rank 0 not in the tree, rank 1 in the tree"
    )


def test_a_digest_started_at_a_position_folds_only_what_follows() -> None:
    before, after = EventLog(), EventLog()
    for log in (before, after):
        log.op("insert", (9, 9), None, None)
    before.transition(1, "write_done")  # applied here alone, before the wrap
    for log in (before, after):
        log.op("insert", (1, 2), None, None)
        log.transition(2, "write")
    late = TransitionDigest(before, start=2)  # after the insert and the transition
    whole = TransitionDigest(after)
    assert late.update() != whole.update()  # the first insert is not in ``late``
    fresh = EventLog()
    fresh.op("insert", (1, 2), None, None)
    fresh.transition(2, "write")
    assert late.update() == TransitionDigest(fresh).update()
    assert (late.count, late.tail()) == (1, [(2, "write")])
