"""A request loop over HiCache, as a serving engine drives it.

:func:`serve` is what the demo and the cache benchmark run: per request,
match the prefix, load back what only the host holds (the compute waits for
that copy on its stream, not the host: :meth:`HiCache.wait_loaded`), lock the
matched path, make room, "compute" the rest of the KV into fresh device slots,
insert, free the slots the cache did not take, and unlock; copies are polled
once per request. Only load-backs whose pages the request used are counted. A simulated storage backup pins
backed nodes for a few requests, as SGLang's L3 backup does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fsm_cache.bench.workload import Request
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine.lease import Lease
from fsm_cache.memory.pages import pages_of, slots_of
from fsm_cache.residency import HOST_VALID


@dataclass
class ServeReport:
    """What a run served."""

    requests: int = 0
    tokens: int = 0
    load_backs: int = 0
    evicted_tokens: int = 0
    """Tokens evicted from the device during the run, by every path (explicit evictions,
    allocations, load-backs, inserts, write-backs applied at an acknowledgement)."""
    invariant_checks: int = 0
    backups_pinned: int = 0


def serve(
    cache: HiCache,
    trace: Iterable[Request],
    *,
    check_every: int = 0,
    backup_every: int = 0,
    backup_hold: int = 4,
    on_request: Callable[[], None] | None = None,
) -> ServeReport:
    """Serve ``trace`` through ``cache``.

    Args:
        cache: The cache.
        trace: Requests in arrival order.
        check_every: Check design invariants 1-9 after this many requests (0: never).
        backup_every: Pin a backed node for a storage backup every this many requests (0: never).
        backup_hold: Requests a backup pin is held for.
        on_request: Called after each request (progress bars).
    """
    report = ServeReport()
    evicted = cache.counters.evicted_tokens["device"]
    backups: deque[tuple[int, Lease]] = deque()
    for i, request in enumerate(trace, 1):
        node = _serve_one(cache, request.tokens, report)
        cache.poll()
        while backups and backups[0][0] <= i:
            backups.popleft()[1].release()
        if backup_every and i % backup_every == 0 and node is not None and node.host in HOST_VALID:
            backups.append((i + backup_hold, cache.pin(node)))
            report.backups_pinned += 1
        if check_every and i % check_every == 0:
            cache.check_invariants()
            report.invariant_checks += 1
        if on_request is not None:
            on_request()
    for _, lease in backups:
        lease.release()
    report.evicted_tokens = cache.counters.evicted_tokens["device"] - evicted
    return report


def _serve_one(cache: HiCache, tokens: tuple[int, ...], report: ServeReport) -> TreeNode | None:
    page = cache.config.page_size
    key = tokens[: len(tokens) - len(tokens) % page]
    match = cache.match_prefix(key)
    prefix, cached, lock = match.device_pages, match.device_len, None
    if match.host_len:
        loaded = _load(cache, key, match.last_host_node)
        if loaded is not None:
            prefix, cached, lock = loaded
            report.load_backs += 1
    if lock is None and match.last_device_node.parent is not None:
        lock = cache.lock(match.last_device_node)
    need = len(key) - cached
    free = cache.tiers.device.allocator.free_slots
    if need > free:
        cache.evict(need - free)
    fresh = cache.alloc_slots(need)
    cache.tiers.write_tokens(pages_of(fresh, page), key[cached:])
    given = slots_of(prefix, page) + fresh
    returned = cache.insert(key, given)
    if returned > cached:  # tokens the device had meanwhile: their fresh slots are ours to free
        cache.free_slots(given[cached:returned])
    if lock is not None:
        cache.unlock(lock)
    report.requests += 1
    report.tokens += len(key)
    walk = cache.tree.walk(key)
    return walk.path[-1] if walk.path else None


def _load(
    cache: HiCache, key: tuple[int, ...], last: TreeNode
) -> tuple[tuple[int, ...], int, Lease] | None:
    """Load back the host-only part of ``key``'s prefix and use it without waiting on the host.

    Returns the device pages and length of the prefix the request can use (the
    resident part and the chain now loading), and the lock that keeps them, or
    None when nothing was loaded (too short, no room, or the copy must run again).
    """
    chain = cache.load_back(last)
    if not chain:
        return None
    lock = cache.lock(chain[-1])
    above = cache.match_prefix(key)  # the resident part above the chain
    if chain[0].parent is not above.last_device_node or not cache.wait_loaded(chain):
        cache.unlock(lock)
        return None
    pages = above.device_pages + tuple(p for n in chain for p in n.device_pages)
    return pages, above.device_len + sum(len(n.key) for n in chain), lock
