"""The report of ``fsm-cache bench cache --against sglang`` (measured where SGLang is installed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsm_cache.bench import against
from fsm_cache.bench.against import AgainstBench, cached_tokens
from fsm_cache.bench.cache import (
    BaselineRadix,
    UnequalWork,
    Work,
    compare,
    serve_trace,
    trace,
    trace_config,
)
from fsm_cache.bench.sglang import Allocator
from fsm_cache.cache.arguments import TokenKey
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine.lease import Lease, open_leases


def figures(write_through: float) -> dict[str, float]:
    return {
        "sglang": 10_000.0,
        "held": 20_000.0,
        "writes": 13_000.0,
        "write-through": write_through,
    }


def test_the_report_gives_each_ratio_the_write_through_cost_and_the_targets() -> None:
    work = {"page 1": Work(50, 0), "page 16": Work(48, 2)}
    bench = AgainstBench(
        "0.5.23", 2000, {"page 1": figures(9_000.0), "page 16": figures(4_000.0)}, work
    )
    assert bench.ratio("page 1", "write-through") == 0.9
    text = bench.format().splitlines()
    assert text[3].split() == ["page", "1", "10,000", "2.00x", "1.30x", "0.90x"]
    assert text[4].split() == ["page", "16", "10,000", "2.00x", "1.30x", "0.40x"]
    # 1/9,000 - 1/20,000 s and 1/4,000 - 1/20,000 s per request
    assert text[5] == "write-through over held, microseconds per request: page 1 61, page 16 200"
    assert text[6] == (
        "the same work on each side: page 1 50 tokens hit, 0 evicted; "
        "page 16 48 tokens hit, 2 evicted"
    )
    assert text[7] == (
        "targets: held >= 1.8x met, writes >= 1.3x met, write-through >= 0.9x NOT met"
    )


class _HiCacheAsSGLang:
    """The bench's SGLang driver, served by HiCache itself: the same work as HiCache's side."""

    version = "stand-in"

    def __init__(self, command: str = "fsm-cache bench sglang") -> None:
        self.command = command  # as the real Driver takes it, for its message

    def build(self, slots: int, page_size: int = 1) -> tuple[HiCache, Allocator]:
        return HiCache(trace_config(slots // page_size, 0, page_size)), Allocator(slots)

    def key(self, ids: list[int]) -> TokenKey:
        return TokenKey(ids)

    def match_insert(self, cache: HiCache, allocator: Allocator, seqs: list[Any]) -> int:
        hits = serve_trace(cache, [key for key, _ in seqs], None)
        allocator.free_count = cache.tiers.device.allocator.free_slots
        return hits


class _NothingCached(_HiCacheAsSGLang):
    """A driver whose tree never holds anything: every token of every request is new."""

    def match_insert(self, cache: HiCache, allocator: Allocator, seqs: list[Any]) -> int:
        return 0


def test_the_report_says_what_work_both_sides_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens hit and evicted per trace: the page 1 trace evicts nothing, the eviction trace does."""
    monkeypatch.setattr(against, "Driver", _HiCacheAsSGLang)
    keys = trace(against.QUICK_REQUESTS)  # fewer, and write-through evicts other leaves
    bench = against.run_against_sglang(num_requests=len(keys), rounds=1)
    hits = sum(len(k) for k in keys) - cached_tokens(keys)  # all but what the tree holds
    assert bench.work["page 1"] == bench.work["page 16"] == Work(hits, 0)
    assert bench.work["page 1 + evictions"].evicted_tokens > 0
    assert f"page 1 {hits:,} tokens hit, 0 evicted; " in bench.format()


def test_a_side_that_did_other_work_than_sglang_is_refused_not_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ratio of two replays that hit different tokens compares different work: no figure."""
    monkeypatch.setattr(against, "Driver", _NothingCached)
    keys = trace(30)
    total, hits = sum(len(k) for k in keys), sum(len(k) for k in keys) - cached_tokens(keys)
    with pytest.raises(UnequalWork) as refused:
        against.run_against_sglang(num_requests=30, rounds=1)
    assert str(refused.value) == (
        "bench cache --against sglang, page 1 trace: held did other work than SGLang "
        f"({hits:,} tokens hit, 0 evicted; SGLang 0 tokens hit, {total:,} evicted), "
        "so their ratio would compare different work"
    )


def test_cached_tokens_counts_shared_prefixes_once() -> None:
    assert cached_tokens([[1, 2, 3], [1, 2, 4], [1, 2], [5]]) == 5  # 1, 12, 123, 124, 5
    assert cached_tokens([[7, 8], [7, 8]]) == 2
    assert cached_tokens([]) == 0


class _Spy:
    """The cache as ``serve_trace`` sees it, with some of its methods replaced.

    A compiled cache's methods cannot be replaced on the instance.
    """

    def __init__(self, cache: HiCache, **replaced: Callable[..., Any]) -> None:
        self._cache, self._replaced = cache, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name) or getattr(self._cache, name)


def test_the_eviction_trace_evicts() -> None:
    keys = trace(200)
    pool = cached_tokens(keys) // 4
    cache = HiCache(trace_config(pool, 0, 1))
    evicted = []
    evict = cache.evict

    def counting(tokens: int) -> int:
        evicted.append(evict(tokens))
        return evicted[-1]

    serve_trace(_Spy(cache, evict=counting), keys, None)  # type: ignore[arg-type]
    assert sum(evicted) >= pool  # at least a pool's worth went, as the trace's name says


def test_each_request_locks_its_matched_prefix_while_it_runs() -> None:
    """As SGLang's scheduler does (inc_lock_ref at admission, dec_lock_ref once cached)."""
    keys = trace(60)
    cache = HiCache(trace_config(cached_tokens(keys) // 4, 0, 1))
    held: list[int] = []
    lock, evict = cache.lock, cache.evict

    def locking(node: TreeNode) -> Lease:
        held.append(node.id)
        return lock(node)

    def evicting(tokens: int) -> int:
        assert held  # an eviction runs while the request holds its prefix
        return evict(tokens)

    serve_trace(_Spy(cache, lock=locking, evict=evicting), keys, None)  # type: ignore[arg-type]
    assert len(held) == len(keys)
    assert open_leases() == []  # every lock was given back


def test_the_baseline_tree_locks_and_unlocks_the_matched_path() -> None:
    tree = BaselineRadix(64)
    key = list(range(32))
    tree.insert(key, torch.arange(32))
    assert tree.match_prefix(key) == 32
    node = tree.last_node
    tree.inc_lock_ref(node)
    assert node.lock_ref == 1
    tree.evict(64)  # nothing is evictable while the path is locked
    assert tree.match_prefix(key) == 32
    tree.dec_lock_ref(node)
    assert node.lock_ref == 0
    tree.evict(64)
    assert tree.match_prefix(key) == 0


def test_bench_cache_reports_the_work_its_three_sides_did_alike() -> None:
    """``bench cache --quick``'s trace and pool: every side hits and evicts the same tokens."""
    keys = trace(200)
    best, work = compare(keys, 512, 1)
    assert set(best) == {"baseline", "hicache", "write_through"}
    assert work.evicted_tokens > 0  # the pool of 512 pages is short: the sides evict
    assert work.hit_tokens > 0


def test_bench_cache_refuses_a_side_that_did_other_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A baseline that never finds its prefix allocates every token: no ratio of that."""

    def nothing_found(tree: BaselineRadix, key: list[int]) -> int:
        tree.last_node = tree.root
        return 0

    monkeypatch.setattr(BaselineRadix, "match_prefix", nothing_found)
    keys = trace(30)
    total, hits = sum(len(k) for k in keys), sum(len(k) for k in keys) - cached_tokens(keys)
    with pytest.raises(UnequalWork) as refused:
        compare(keys, total // 16, 1)  # room for every token: nothing is evicted
    assert str(refused.value) == (
        f"bench cache: HiCache did other work than the baseline tree ({hits:,} tokens hit, "
        "0 evicted; the baseline tree 0 tokens hit, 0 evicted), so their ratio would compare "
        "different work"
    )
