"""``fsm-cache bench copies``: write-through driven by the residency machines vs a raw copy.

One run, the same tensors: N device-resident nodes are backed up through
HiCache (every node fires ``write``, the effects allocate host pages and
queue the node, one batched copy runs, ``poll`` fires ``write_done``), against
a raw torch gather-and-copy of the same device slots into host memory
(:mod:`fsm_cache.bench.memory`). On CUDA, one large pinned ``copy_`` of the pool
gives the link's ceiling. Median of several repetitions, interleaved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsm_cache.bench.memory import _raw_gather_copy, ceiling_copy
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import TreeNode
from fsm_cache.memory.tiers import CacheConfig


@dataclass(frozen=True)
class CopyBenchResult:
    """Bandwidths in GB/s (10^9 bytes/s) of one run."""

    device: str
    nodes: int
    nbytes: int
    machine_gbps: float
    raw_gbps: float
    ceiling_gbps: float | None

    def format(self) -> str:
        """Render the figures with the ratios the issue targets."""
        lines = [
            f"write-through of {self.nodes} nodes ({self.nbytes / 2**20:,.0f} MiB) on {self.device}",
            f"  machine-driven (write -> copy -> poll -> write_done)  {self.machine_gbps:8.2f} GB/s",
            f"  raw torch gather-and-copy of the same slots          {self.raw_gbps:8.2f} GB/s",
            f"  machine / raw = {self.machine_gbps / self.raw_gbps:.2f} (target >= 0.90 on CPU)",
        ]
        if self.ceiling_gbps:
            share = self.machine_gbps / self.ceiling_gbps
            lines.append(
                f"  one large pinned copy_ (ceiling) {self.ceiling_gbps:8.2f} GB/s; machine = {share:.0%} (target >= 85%)"
            )
        return "\n".join(lines)


def run_copy_bench(quick: bool = False, reps: int = 5) -> CopyBenchResult:
    """Measure machine-driven write-through against a raw gather-and-copy."""
    cuda = torch.cuda.is_available()
    nodes = 32 if quick else (4096 if cuda else 512)
    config = CacheConfig(
        device_pages=nodes,
        host_pages=nodes,
        page_size=16,
        layers=32,
        heads=8,
        head_dim=128,
        write_policy="write_back",
    )
    cache = HiCache(config)
    tree_nodes = _fill(cache, nodes)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    nbytes = nodes * cache.tiers.device.layout.page_bytes
    raw = _raw_gather_copy(
        cache.tiers.device, cache.tiers.host, [n.device_pages[0] for n in tree_nodes]
    )
    machine_times, raw_times = [], []
    for _ in range(reps):
        machine_times.append(_time(lambda: _machine_write(cache, tree_nodes), sync))
        _reset(cache, tree_nodes)
        raw_times.append(_time(raw, sync))
    ceiling = None
    if cuda:
        one_copy = ceiling_copy(cache.tiers.device, cache.tiers.host, nbytes)
        ceiling = nbytes / statistics.median(_time(one_copy, sync) for _ in range(reps)) / 1e9
    return CopyBenchResult(
        device=str(cache.tiers.device.device),
        nodes=nodes,
        nbytes=nbytes,
        machine_gbps=nbytes / statistics.median(machine_times) / 1e9,
        raw_gbps=nbytes / statistics.median(raw_times) / 1e9,
        ceiling_gbps=ceiling,
    )


def _fill(cache: HiCache, nodes: int) -> list[TreeNode]:
    page = cache.config.page_size
    for i in range(nodes):
        cache.insert([i * page + t for t in range(page)])
    return sorted(cache.tree, key=lambda n: n.id)


def _machine_write(cache: HiCache, nodes: list[TreeNode]) -> None:
    cache.backup(nodes)
    while cache.issued():
        cache.poll()


def _reset(cache: HiCache, nodes: list[TreeNode]) -> None:
    for node in nodes:
        cache.fire("evict_host", node)


def _time(fn: Callable[[], object], sync: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
