"""``fsm-cache bench cache``: HiCache against a minimal unchecked radix tree, one trace.

Both replay the same chat-like trace (match + insert per request, eviction
when the device pool runs short), side by side in one run: HiCache with every
transition checked and only the device tier in use; the baseline, a radix
tree written for this benchmark in the style of SGLang's Python
``RadixCache`` (torch slot tensors, ``lock_ref`` ints, LRU leaf heap, no
checks); and HiCache with write-through to the host tier, to show what the
copies add. Memory per node is the resident memory of many nodes of each kind.
"""

from __future__ import annotations

import gc
import heapq
import multiprocessing
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fsm_cache.bench.workload import ChatWorkload, requests
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import TreeNode
from fsm_cache.errors import BadArgument, FsmCacheError
from fsm_cache.memory.tiers import CacheConfig


PAGE = 16


class UnequalWork(FsmCacheError):
    """Two sides of a benchmark's ratio did different work on one trace; no ratio is given."""


@dataclass(frozen=True)
class Work:
    """What one replay of a trace did, read after its clock stopped.

    Attributes:
        hit_tokens: Tokens the requests found cached on the device, summed.
        evicted_tokens: Tokens evicted from the device to make room.
    """

    hit_tokens: int
    evicted_tokens: int

    def __str__(self) -> str:
        return f"{self.hit_tokens:,} tokens hit, {self.evicted_tokens:,} evicted"


def work_of(keys: Sequence[Sequence[int]], hits: int, pool: int, free: int) -> Work:
    """The work of a replay of ``keys`` that hit ``hits`` tokens and left ``free`` of ``pool`` slots.

    Every token a request did not find was allocated, so what the pool does
    not hold at the end was evicted: the same sum for either tree.
    """
    allocated = sum(len(k) for k in keys) - hits
    return Work(hits, allocated - (pool - free))


def same_work(where: str, side: str, reference: str, expected: Work, got: Work) -> None:
    """Refuse a replay by ``side`` that did other work than ``reference``'s of the same trace.

    Raises:
        UnequalWork: Naming the trace (``where``), both sides and their work.
    """
    if got != expected:
        raise UnequalWork(
            f"{where}: {side} did other work than {reference} ({got}; {reference} {expected}), "
            "so their ratio would compare different work"
        )


class _BaseNode:
    """The fields SGLang's TreeNode keeps (radix_cache.py), without its behaviour."""

    counter = 0

    def __init__(self) -> None:
        self.children: defaultdict[Any, _BaseNode] = defaultdict(_BaseNode)
        self.parent: _BaseNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0
        self.host_ref_counter = 0
        self.host_value: torch.Tensor | None = None
        self.hash_value: list[str] | None = None
        self.id = _BaseNode.counter
        _BaseNode.counter += 1


class BaselineRadix:
    """A minimal unchecked radix tree: match, insert with splits, LRU leaf eviction."""

    def __init__(self, slots: int) -> None:
        self.root = _BaseNode()
        self.root.lock_ref = 1
        self.last_node = self.root
        self.free = list(range(slots - 1, -1, -1))

    def match_prefix(self, key: list[int]) -> int:
        """Return the matched length, splitting where a match ends inside a node.

        The deepest matched node is left in :attr:`last_node`, for the request to lock.
        """
        node, pos = self.root, 0
        node.last_access_time = time.monotonic()
        while pos < len(key) and tuple(key[pos : pos + PAGE]) in node.children:
            child = node.children[tuple(key[pos : pos + PAGE])]
            n = _common(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = time.monotonic()
            pos += n
            node = child
        self.last_node = node
        return pos

    def inc_lock_ref(self, node: _BaseNode) -> None:
        """Lock ``node`` and its ancestors against eviction, as SGLang's ``inc_lock_ref``."""
        walk: _BaseNode | None = node
        while walk is not None and walk is not self.root:
            walk.lock_ref += 1
            walk = walk.parent

    def dec_lock_ref(self, node: _BaseNode) -> None:
        """Undo :meth:`inc_lock_ref`."""
        walk: _BaseNode | None = node
        while walk is not None and walk is not self.root:
            walk.lock_ref -= 1
            walk = walk.parent

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert ``key`` with slot tensor ``value``; return the length already cached."""
        node, pos = self.root, 0
        while pos < len(key) and tuple(key[pos : pos + PAGE]) in node.children:
            child = node.children[tuple(key[pos : pos + PAGE])]
            n = _common(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        if pos < len(key):
            leaf = _BaseNode()
            leaf.parent, leaf.key, leaf.value = node, key[pos:], value[pos:].clone()
            node.children[tuple(key[pos : pos + PAGE])] = leaf
        return pos

    def _split(self, child: _BaseNode, n: int) -> _BaseNode:
        new = _BaseNode()
        parent = child.parent
        assert parent is not None
        new.parent, new.key, new.lock_ref = parent, child.key[:n], child.lock_ref
        new.value = child.value[:n].clone() if child.value is not None else None
        new.children[tuple(child.key[n : n + PAGE])] = child
        parent.children[tuple(child.key[:PAGE])] = new
        child.parent, child.key = new, child.key[n:]
        child.value = child.value[n:].clone() if child.value is not None else None
        return new

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots as an int64 tensor."""
        taken = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        return torch.tensor(taken, dtype=torch.int64)

    def evict(self, tokens: int) -> None:
        """Free at least ``tokens`` slots from least recently used unlocked leaves."""
        leaves = [
            (n.last_access_time, n.id, n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens and leaves:
            _, _, node = heapq.heappop(leaves)
            assert node.value is not None
            assert node.parent is not None
            self.free.extend(node.value.tolist())
            freed += len(node.key)
            del node.parent.children[tuple(node.key[:PAGE])]
            parent = node.parent
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access_time, parent.id, parent))

    def _nodes(self) -> list[_BaseNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]


def _common(a: list[int], b: list[int]) -> int:
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i - i % PAGE


@dataclass(frozen=True)
class CacheBench:
    """Figures of one run."""

    requests: int
    baseline_rps: float
    hicache_rps: float
    write_through_rps: float
    hicache_node_bytes: float
    baseline_node_bytes: float
    work: Work
    """What each side did on the trace (the same: the run refuses otherwise)."""

    def format(self) -> str:
        """Render the figures as a table with the ratios the issue targets."""
        lines = [
            f"chat trace: {self.requests} requests, each one match_prefix + one insert "
            f"(requests/s = match+insert pairs/s), page {PAGE}; best of interleaved rounds",
            f"  baseline radix tree (unchecked)     {self.baseline_rps:10,.0f} requests/s",
            f"  HiCache, device tier only, checked  {self.hicache_rps:10,.0f} requests/s "
            f"({self.hicache_rps / self.baseline_rps:.2f}x baseline)",
            f"  HiCache, write-through to host      {self.write_through_rps:10,.0f} requests/s "
            f"(copies cost {1 - self.write_through_rps / self.hicache_rps:.0%})",
            f"  bytes per node: HiCache {self.hicache_node_bytes:,.0f}, "
            f"SGLang-style TreeNode {self.baseline_node_bytes:,.0f} "
            f"({self.hicache_node_bytes / self.baseline_node_bytes:.2f}x)",
            f"  the same work on each side: {self.work}",
        ]
        return "\n".join(lines)


def trace(n: int) -> list[list[int]]:
    """Return the chat trace of ``n`` requests, each cut down to whole pages."""
    page = PAGE
    return [
        list(r.tokens[: len(r.tokens) - len(r.tokens) % page])
        for r in requests(ChatWorkload(requests=n))
    ]


def _run_baseline(trace: list[list[int]], slots: int) -> tuple[float, Work]:
    tree = BaselineRadix(slots)
    hits = 0
    started = time.perf_counter()
    for key in trace:
        hit = tree.match_prefix(key)
        hits += hit
        node = tree.last_node
        tree.inc_lock_ref(node)  # the request holds its prefix while it runs
        try:
            need = len(key) - hit
            if need > len(tree.free):
                tree.evict(need - len(tree.free))
            fresh = tree.alloc(need)
            tree.insert(key, torch.cat([torch.zeros(hit, dtype=torch.int64), fresh]))
        finally:
            tree.dec_lock_ref(node)
    rps = len(trace) / (time.perf_counter() - started)
    return rps, work_of(trace, hits, slots, len(tree.free))


def trace_config(device_pages: int, host_pages: int, page_size: int = PAGE) -> CacheConfig:
    """The cache ``bench cache`` measures: page 16, a tiny KV (the tree is what is timed)."""
    return CacheConfig(
        device_pages=device_pages,
        host_pages=host_pages,
        page_size=page_size,
        layers=1,
        heads=1,
        head_dim=8,
    )


def serve_trace(
    cache: HiCache,
    keys: Sequence[Sequence[int]],
    poll: Callable[[], object] | None,
    *,
    cache_writes: bool = False,
) -> int:
    """Serve ``keys`` as a scheduler would: match, lock, evict if short, insert, unlock, ``poll``.

    The request locks its matched prefix while it runs, as SGLang's scheduler
    does (``inc_lock_ref`` at admission, ``dec_lock_ref`` when it is cached).
    It holds its slots (``alloc_slots``, then ``insert(tokens, slots)``), or
    with ``cache_writes`` the cache allocates them and writes the KV itself.

    Returns:
        The tokens the requests found on the device, summed: what a benchmark
        compares with the other side's, which must do the same work.
    """
    hits = 0
    for key in keys:
        match = cache.match_prefix(key)
        hits += match.device_len
        with cache.lock(match.last_device_node):  # unlocked however the request ends
            need = len(key) - match.device_len
            free = cache.tiers.device.allocator.free_slots
            if need > free:
                cache.evict(need - free)
            if cache_writes:
                cache.insert(key)
            else:  # the prefix's slots are the tree's own: placeholders, as the baseline's zeros
                cache.insert(key, [0] * match.device_len + cache.alloc_slots(need))
        if poll is not None:
            poll()
    return hits


def _run_hicache(keys: list[list[int]], pages: int, host_pages: int) -> tuple[float, Work]:
    cache = HiCache(trace_config(pages, host_pages))
    started = time.perf_counter()
    hits = serve_trace(cache, keys, cache.poll if host_pages else None)
    rps = len(keys) / (time.perf_counter() - started)
    return rps, work_of(keys, hits, pages * PAGE, cache.tiers.device.allocator.free_slots)


def node_bytes(make: Callable[[int], object], count: int = 50_000) -> float:
    """Return resident memory per object of ``count`` objects built by ``make``.

    Resident set size, not tracemalloc: torch allocates tensor storage and its
    C++ tensor objects outside Python's allocator, where tracemalloc cannot see.
    """
    gc.collect()
    before = _rss()
    kept = [make(i) for i in range(count)]
    after = _rss()
    del kept
    return (after - before) / count


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Token ids and page numbers exist before a node is built (in the request), so both
# node kinds reference shared int objects and only the node's own memory is counted.
_TOKENS = list(range(40_000, 40_000 + 64 * 1024))


def _hicache_node(i: int) -> object:
    at = (i * 2 * PAGE) % (len(_TOKENS) - 2 * PAGE)
    node = TreeNode(i, tuple(_TOKENS[at : at + 2 * PAGE]), None, (_TOKENS[i], _TOKENS[i + 1]))
    node.host_pages = (_TOKENS[i + 2], _TOKENS[i + 3])
    return node


def _sglang_node(i: int) -> object:
    at = (i * 2 * PAGE) % (len(_TOKENS) - 2 * PAGE)
    node = _BaseNode()
    node.key = _TOKENS[at : at + 2 * PAGE]
    node.value = torch.arange(at, at + 2 * PAGE)  # SGLang keeps slot indices as int64 tensors
    node.host_value = torch.arange(at, at + 2 * PAGE)
    return node


def run_cache_bench(
    num_requests: int = 2000, device_pages: int = 512, rounds: int = 3
) -> CacheBench:
    """Replay one trace through all three, interleaved ``rounds`` times; best of each."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        # a fresh process each, so freed memory of earlier work does not hide new nodes
        hicache_bytes = fresh.submit(node_bytes, _hicache_node).result()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        baseline_bytes = fresh.submit(node_bytes, _sglang_node).result()
    keys = trace(num_requests)
    best, work = compare(keys, device_pages, rounds)
    return CacheBench(
        requests=len(keys),
        baseline_rps=best["baseline"],
        hicache_rps=best["hicache"],
        write_through_rps=best["write_through"],
        hicache_node_bytes=hicache_bytes,
        baseline_node_bytes=baseline_bytes,
        work=work,
    )


def compare(keys: list[list[int]], device_pages: int, rounds: int) -> tuple[dict[str, float], Work]:
    """Replay ``keys`` on the baseline, HiCache and HiCache with write-through, interleaved.

    Returns:
        The best requests per second of each (``baseline``, ``hicache``,
        ``write_through``), and the work each did, the same.

    Raises:
        UnequalWork: A side hit or evicted other tokens than the baseline.
    """
    runs: dict[str, list[float]] = {"baseline": [], "hicache": [], "write_through": []}
    replays: dict[str, Callable[[], tuple[float, Work]]] = {
        "baseline": lambda: _run_baseline(keys, device_pages * PAGE),
        "hicache": lambda: _run_hicache(keys, device_pages, 0),
        "write_through": lambda: _run_hicache(keys, device_pages, device_pages * 4),
    }
    work: Work | None = None
    for _ in range(rounds):  # interleaved, so a noisy neighbour slows all three alike
        for name, replay in replays.items():
            rps, done = replay()
            work = work or done  # the baseline's, which runs first
            same_work("bench cache", _SIDES[name], _SIDES["baseline"], work, done)
            runs[name].append(rps)
    if work is None:
        raise BadArgument(f"bench cache: rounds must be >= 1, got {rounds}")
    return {name: max(figures) for name, figures in runs.items()}, work


_SIDES = {
    "baseline": "the baseline tree",
    "hicache": "HiCache",
    "write_through": "HiCache with write-through",
}
"""How :class:`UnequalWork` names each side of ``bench cache``."""
