"""Tensor-parallel agreement: what a divergence message says of a node's state.

Two gloo ranks (spawned as in ``tests/test_distributed.py``) run each scenario
on a gloo group of its own and write what each call said as JSON; the tests
compare the ranks' reports. The unit tests at the end need no process group.
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

    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.cache.tree import TreeNode
    from fsm_cache.distributed.agreement import DistributedCache, node_state
    from fsm_cache.errors import FsmCacheError
    from fsm_cache.memory.tiers import CacheConfig
    from fsm_cache.storage import LocalFileStore

TIMEOUT = 20.0  # seconds the default group's collectives wait
DEADLINE = 240.0  # seconds the spawned ranks may run before the test kills them
Results = list[dict[str, Any]]


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
