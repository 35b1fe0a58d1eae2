"""What :func:`fsm_cache.compat.sglang.patch` costs SGLang's own ``RadixCache``.

One run builds a chat-like trace once (requests sharing system prompts and
conversation prefixes: match the prefix, lock it while the request runs,
insert the whole sequence, unlock; the tree evicts when its pool is full),
then replays it on SGLang's installed ``RadixCache``, stock and patched,
interleaved (which goes first alternates by round), best of ``repeat``, in
CPU time of the replaying thread: on a shared machine, time spent waiting
for a core is no cost of either. It also measures the memory of one tree
node built the way ``insert`` builds it, stock and patched.

Targets (issue 14): patched within 1.15x the stock time per operation and
1.3x the stock node's memory.

It needs an SGLang wheel importable (``make bench-sglang`` runs it in the
side environment of ``make test-sglang``); SGLang's GPU-only imports are
stood in by :mod:`fsm_cache.testing.sglang`.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import random
import time
import tracemalloc
import warnings
from array import array
from dataclasses import dataclass
from typing import Any


TIME_TARGET = 1.15
"""Patched over stock, time per operation, at most."""
MEMORY_TARGET = 1.3
"""Patched over stock, bytes per node, at most."""


class Allocator:
    """The slot allocator SGLang's ``RadixCache`` frees into: a free count, on the CPU."""

    device = "cpu"

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_count = size

    def free(self, indices: Any) -> None:
        """Give slots back."""
        self.free_count += len(indices)

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """0.5.23's page-exact free."""
        del start_pos
        self.free(indices)


@dataclass(frozen=True)
class SGLangBench:
    """Measured costs of SGLang's ``RadixCache``, stock and patched.

    Attributes:
        version: The SGLang version measured.
        operations: Cache calls in the trace.
        repeat: Replays per mode.
        ns_per_op: Per mode, the trace's best CPU time over its operations.
        node_bytes: Per mode, bytes allocated per node built as ``insert`` builds one.
    """

    version: str
    operations: int
    repeat: int
    ns_per_op: dict[str, float]
    node_bytes: dict[str, float]

    def time_ratio(self) -> float:
        """Patched time per operation over stock."""
        return self.ns_per_op["patched"] / self.ns_per_op["stock"]

    def memory_ratio(self) -> float:
        """Patched bytes per node over stock."""
        return self.node_bytes["patched"] / self.node_bytes["stock"]

    def format(self) -> str:
        """Return the figures as a plain-text table."""
        time_ok = self.time_ratio() <= TIME_TARGET
        memory_ok = self.memory_ratio() <= MEMORY_TARGET
        return "\n".join(
            [
                f"SGLang {self.version} RadixCache, stock vs fsm_cache.compat.sglang.patch(), "
                f"{self.operations} operations, best of {self.repeat} in CPU time",
                "",
                f"{'':<22}{'stock':>12}{'patched':>12}{'ratio':>8}",
                f"{'CPU ns per operation':<22}{self.ns_per_op['stock']:>12.0f}"
                f"{self.ns_per_op['patched']:>12.0f}{self.time_ratio():>7.2f}x",
                f"{'bytes per node':<22}{self.node_bytes['stock']:>12.0f}"
                f"{self.node_bytes['patched']:>12.0f}{self.memory_ratio():>7.2f}x",
                f"target: time <= {TIME_TARGET}x: {'met' if time_ok else 'NOT met'}; "
                f"memory <= {MEMORY_TARGET}x: {'met' if memory_ok else 'NOT met'}",
            ]
        )


def chat_trace(requests: int, seed: int = 0) -> list[list[int]]:
    """Token sequences of ``requests`` chat turns: shared system prompts, growing conversations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30_000) for _ in range(rng.randrange(16, 64))] for _ in range(8)]
    talks: list[list[int]] = []
    out = []
    for _ in range(requests):
        if talks and rng.random() < 0.6:
            talk = rng.choice(talks)
            talk.extend(rng.randrange(1, 30_000) for _ in range(rng.randrange(8, 48)))
        else:
            talk = [*rng.choice(prompts), *(rng.randrange(1, 30_000) for _ in range(24))]
            talks.append(talk)
        out.append(list(talk))
    return out


class Driver:
    """SGLang's ``RadixCache`` calls, spelled for the installed version (0.5.6 or 0.5.23)."""

    def __init__(self, command: str = "fsm-cache bench sglang") -> None:
        """Import SGLang's cache modules, its GPU-only imports stood in.

        Args:
            command: The command that needs SGLang, for the message when it is missing.

        Raises:
            ModuleNotFoundError: SGLang is not installed: the message names
                ``command`` and ``make bench-sglang``, which runs it where SGLang
                is. Told before the stand-ins go in, so nothing is left installed.
        """
        from fsm_cache.testing import sglang as standins

        if not standins.sglang_present():
            msg = (
                f"{command} needs SGLang's RadixCache importable (sglang is not an "
                "installed package); in this repository run `make bench-sglang`"
            )
            raise ModuleNotFoundError(msg, name="sglang")
        standins.install()
        self.rc: Any = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        self.base: Any = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        self.params: Any = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        self.new = hasattr(self.base, "InsertParams")
        self.version = importlib.metadata.version("sglang")

    def build(self, slots: int, page_size: int = 1) -> tuple[Any, Allocator]:
        """A ``RadixCache`` of ``page_size`` over an allocator of ``slots`` slots."""
        allocator = Allocator(slots)
        params = self.params.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
        return self.rc.RadixCache(params), allocator

    def match(self, cache: Any, key: Any) -> tuple[int, Any]:
        """``match_prefix``: the device hit's length and its last node."""
        if self.new:
            found = cache.match_prefix(self.base.MatchPrefixParams(key=key))
            return int(found.device_prefix_len), found.last_device_node
        found = cache.match_prefix(key)
        return len(found.device_indices), found.last_device_node

    def evict_insert(
        self, cache: Any, allocator: Allocator, key: Any, value: Any, hit: int
    ) -> None:
        """Evict what the new part of ``value`` needs, take it from the allocator, insert."""
        need = len(value) - hit - allocator.free_count
        if need > 0:
            cache.evict(self.base.EvictParams(num_tokens=need) if self.new else need)
        allocator.free_count -= len(value) - hit
        if self.new:
            cache.insert(self.base.InsertParams(key=key, value=value))
        else:
            cache.insert(key, value)

    def match_insert(self, cache: Any, allocator: Allocator, seqs: list[tuple[Any, Any]]) -> int:
        """Serve each request as a scheduler does: match, lock, evict if short, insert, unlock.

        The matched prefix is locked while the request runs (``inc_lock_ref`` at
        admission, ``dec_lock_ref`` once its sequence is cached), so an eviction
        it causes cannot take its own prefix.

        Returns:
            The tokens the requests found cached, summed: what a benchmark
            compares with the other side's, which must do the same work.
        """
        hits = 0
        for key, value in seqs:
            hit, node = self.match(cache, key)
            hits += hit
            cache.inc_lock_ref(node)
            try:
                self.evict_insert(cache, allocator, key, value, hit)
            finally:
                cache.dec_lock_ref(node)
        return hits

    def key(self, ids: list[int]) -> Any:
        """A ``RadixKey`` over ``ids``."""
        return self.rc.RadixKey(array("q", ids) if self.new else ids)

    def serve(self, cache: Any, allocator: Allocator, seqs: list[tuple[Any, Any]]) -> int:
        """Run every request: match, lock, evict if short, insert, unlock. Return the calls made."""
        calls = 0
        for key, value in seqs:
            hit, node = self.match(cache, key)
            cache.inc_lock_ref(node)
            try:  # the matched part is the tree's own: the scheduler frees its duplicate
                self.evict_insert(cache, allocator, key, value, hit)
            finally:
                cache.dec_lock_ref(node)
            calls += 4
        return calls


def run_sglang_bench(requests: int = 2000, repeat: int = 5, nodes: int = 5000) -> SGLangBench:
    """Replay one chat trace on SGLang's ``RadixCache``, stock and patched, interleaved.

    Args:
        requests: Chat turns in the trace.
        repeat: Replays per mode, the mode that goes first alternating; the
            best (least CPU time) is kept.
        nodes: Nodes built per mode for the memory figure.
    """
    import torch

    driver = Driver()
    trace = chat_trace(requests)
    seqs = [(driver.key(t), torch.arange(len(t), dtype=torch.int64)) for t in trace]
    slots = sum(len(t) for t in trace) // 4  # the pool holds a quarter: the tree evicts
    best = {"stock": float("inf"), "patched": float("inf")}
    calls = 0
    for round_ in range(repeat):
        for mode in ("stock", "patched") if round_ % 2 == 0 else ("patched", "stock"):
            applied = _patch_radix_cache() if mode == "patched" else None
            try:
                cache, allocator = driver.build(slots)
                gc.collect()
                start = time.thread_time()
                calls = driver.serve(cache, allocator, seqs)
                best[mode] = min(best[mode], time.thread_time() - start)
            finally:
                if applied is not None:
                    applied.undo()
    sizes = {"stock": _node_bytes(driver, nodes), "patched": 0.0}
    with _patch_radix_cache():
        sizes["patched"] = _node_bytes(driver, nodes)
    return SGLangBench(
        version=driver.version,
        operations=calls,
        repeat=repeat,
        ns_per_op={m: best[m] / calls * 1e9 for m in best},
        node_bytes=sizes,
    )


def _patch_radix_cache() -> Any:
    """``patch()``, without its warning that the server's default cache is another class.

    This benchmark drives ``RadixCache`` itself, which the patch checks.
    """
    from fsm_cache.compat.sglang import UncheckedCacheWarning, patch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedCacheWarning)
        return patch()


def _node_bytes(driver: Driver, count: int) -> float:
    """Bytes allocated per node built as ``_insert_helper`` builds one (the slots tensor shared)."""
    root = driver.rc.TreeNode()
    value, key = object(), driver.key([1])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    made = []
    for i in range(count):
        node = driver.rc.TreeNode()
        node.parent, node.key, node.value = root, key, value
        root.children[i] = node
        made.append(node)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del made
    return used / count
