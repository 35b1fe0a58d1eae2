"""``fsm-cache bench copies``: backups and load-backs driven by the residency machines.

One run, the same tensors, both directions:

* **device to host**: N device-resident nodes are backed up through HiCache
  (every node fires ``write``, the effects allocate host pages and queue the
  node, one batched copy runs, ``poll`` fires ``write_done``), against a raw
  torch gather-and-copy of the same device slots into host memory
  (:mod:`fsm_cache.bench.memory`);
* **host to device**: the same nodes, evicted from the device, are loaded back
  (``load_back`` of each chain of nodes, ``poll`` until every ``load_done``).

On CUDA each direction is also set against one large pinned ``copy_`` of the
same bytes in that direction: the link's ceiling, where the target is 85%
(reported as met or missed: a figure, not a pass or fail). Median of several
repetitions, interleaved. The first repetition's round trip (backup, evict,
load back) is also checked for byte equality, untimed: a fast copy of the
wrong bytes is a failure, which ``fsm-cache bench copies`` exits 1 on.
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
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.tiers import CacheConfig


CEILING_TARGET = 0.85
"""Machine-driven copies over one large pinned ``copy_``, each direction, on CUDA."""
RAW_TARGET = 0.90
"""Machine-driven backups over a raw gather-and-copy, on CPU."""
CHAIN = 64
"""Nodes per chain: a load-back loads a chain in one copy, as a request's prefix would be."""


@dataclass(frozen=True)
class CopyBenchResult:
    """Bandwidths in GB/s (10^9 bytes/s) of one run.

    Attributes:
        device: Where the device pool lives.
        nodes: Nodes copied per repetition, one page each.
        nbytes: Bytes copied per repetition, each direction.
        machine_gbps: Backups (device to host) through the machines.
        raw_gbps: A raw gather-and-copy of the same slots, device to host.
        load_gbps: Load-backs (host to device) through the machines.
        ceiling_gbps: One large pinned ``copy_``, device to host (CUDA only).
        ceiling_load_gbps: One large pinned ``copy_``, host to device (CUDA only).
        round_trip_exact: Whether the nodes' pages held the same bytes after a
            backup, an eviction and a load-back; None: not checked.
    """

    device: str
    nodes: int
    nbytes: int
    machine_gbps: float
    raw_gbps: float
    load_gbps: float
    ceiling_gbps: float | None
    ceiling_load_gbps: float | None = None
    round_trip_exact: bool | None = None

    def shares(self) -> dict[str, float]:
        """Machine-driven copies over the ceiling, per direction (empty without CUDA)."""
        out = {}
        if self.ceiling_gbps:
            out["d2h"] = self.machine_gbps / self.ceiling_gbps
        if self.ceiling_load_gbps:
            out["h2d"] = self.load_gbps / self.ceiling_load_gbps
        return out

    def format(self) -> str:
        """Render the figures with the ratios the issue targets."""
        mib = self.nbytes / 2**20
        lines = [
            f"{self.nodes} nodes ({mib:,.0f} MiB) each way on {self.device}",
            f"  backups (write -> copy -> poll -> write_done)        {self.machine_gbps:8.2f} GB/s",
            f"  raw torch gather-and-copy of the same slots          {self.raw_gbps:8.2f} GB/s",
            f"  machine / raw = {self.machine_gbps / self.raw_gbps:.2f} "
            f"(target >= {RAW_TARGET:.2f} on CPU)",
            f"  load-backs (load -> copy -> poll -> load_done)       {self.load_gbps:8.2f} GB/s",
        ]
        ceilings = {"d2h": self.ceiling_gbps, "h2d": self.ceiling_load_gbps}
        for way, share in self.shares().items():
            met = "met" if share >= CEILING_TARGET else "MISSED"
            lines.append(
                f"  {way}: one large pinned copy_ (ceiling) {ceilings[way] or 0:8.2f} GB/s; "
                f"machine = {share:.0%} (target >= {CEILING_TARGET:.0%}): {met}"
            )
        if self.round_trip_exact is not None:
            same = "bytes equal" if self.round_trip_exact else "BYTES DIFFER"
            lines.append(f"  round trip (backup, evict, load back): {same}")
        return "\n".join(lines)


def run_copy_bench(quick: bool = False, reps: int = 5) -> CopyBenchResult:
    """Measure machine-driven backups and load-backs against a raw copy and the ceilings."""
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
    chains = _fill(cache, nodes)
    tree_nodes = [n for chain in chains for n in chain]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dev, host = cache.tiers.device, cache.tiers.host
    nbytes = nodes * dev.layout.page_bytes
    raw = _raw_gather_copy(dev, host, [n.device_pages[0] for n in tree_nodes])
    writes, loads, raws = [], [], []
    before = _node_words(dev, tree_nodes)
    exact = None
    for _ in range(reps):
        writes.append(_time(lambda: _machine_write(cache, tree_nodes), sync))
        cache.evict(nodes * config.page_size)  # backed leaves, chain by chain: host-only now
        loads.append(_time(lambda: _machine_load(cache, chains), sync))
        if exact is None:  # once, untimed: the pages the load-backs gave the nodes
            exact = torch.equal(before, _node_words(dev, tree_nodes))
            del before
        _reset(cache, tree_nodes)
        raws.append(_time(raw, sync))
    ceiling = ceiling_load = None
    if cuda:
        ceiling = _gbps(nbytes, [_time(ceiling_copy(dev, host, nbytes), sync) for _ in range(reps)])
        upload = _ceiling_load(dev, host, nbytes)
        ceiling_load = _gbps(nbytes, [_time(upload, sync) for _ in range(reps)])
    cache.close()
    return CopyBenchResult(
        device=str(dev.device),
        nodes=nodes,
        nbytes=nbytes,
        machine_gbps=_gbps(nbytes, writes),
        raw_gbps=_gbps(nbytes, raws),
        load_gbps=_gbps(nbytes, loads),
        ceiling_gbps=ceiling,
        ceiling_load_gbps=ceiling_load,
        round_trip_exact=exact,
    )


def _fill(cache: HiCache, nodes: int) -> list[list[TreeNode]]:
    """Insert chains of :data:`CHAIN` one-page nodes (each insert one page longer)."""
    page = cache.config.page_size
    chains = []
    for start in range(0, nodes, CHAIN):
        key = [
            (start + i) * page + t for i in range(min(CHAIN, nodes - start)) for t in range(page)
        ]
        for end in range(page, len(key) + 1, page):
            cache.insert(key[:end])
        chains.append(_path(cache, key))
    return chains


def _path(cache: HiCache, key: list[int]) -> list[TreeNode]:
    node = cache.match_prefix(key).last_device_node
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def _node_words(dev: KVPool, nodes: list[TreeNode]) -> torch.Tensor:
    """The words of the nodes' device pages, in node order, gathered where they are."""
    pages = torch.tensor([n.device_pages[0] for n in nodes], device=dev.device)
    return dev.words.index_select(0, pages)


def _machine_write(cache: HiCache, nodes: list[TreeNode]) -> None:
    cache.backup(nodes)
    while cache.issued():
        cache.poll()


def _machine_load(cache: HiCache, chains: list[list[TreeNode]]) -> None:
    for chain in chains:
        cache.load_back(chain[-1])
    while cache.issued():
        cache.poll()


def _reset(cache: HiCache, nodes: list[TreeNode]) -> None:
    for node in reversed(nodes):  # leaves first: a node's children give up their host copy first
        cache.fire("evict_host", node)


def _ceiling_load(dev: KVPool, host: KVPool, nbytes: int) -> Callable[[], None]:
    """One host-to-device ``copy_`` of ``nbytes`` contiguous pinned bytes (CUDA only)."""
    src = host.tensor.view(-1).view(torch.uint8)[:nbytes]
    dst = dev.tensor.view(-1).view(torch.uint8)[:nbytes]
    return lambda: _copy(dst, src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _time(fn: Callable[[], object], sync: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
