"""CPU fakes for what SGLang's radix caches are built with, written for these tests.

``RadixCache`` needs a ``token_to_kv_pool_allocator`` (``device``, ``free``, and
in 0.5.23 ``free_segment``); ``HiRadixCache`` (0.5.6) also asks it for its KV
cache (``get_kvcache``), builds a host pool from it (``MHATokenToKVPoolHost``)
and a ``HiCacheController`` that copies between the two on CUDA streams. The
fakes keep only the slot bookkeeping: a free list per tier, a log of every
slot freed, and a controller whose copies "finish" when the test says so.
"""

from __future__ import annotations

import itertools
import queue
import types
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class SlotPool:
    """A free list of slot indices with a log of frees (device or host tier)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots: list[int] = list(range(size))
        self.freed: list[list[int]] = []

    def alloc(self, need: int) -> torch.Tensor | None:
        """Take ``need`` slots, lowest first; None when too few are free."""
        if need > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return torch.tensor(taken, dtype=torch.int64)

    def take(self, need: int) -> torch.Tensor:
        """Take ``need`` slots that the test knows are free."""
        taken = self.alloc(need)
        assert taken is not None, f"only {len(self.free_slots)} slots free, {need} needed"
        return taken

    def free(self, indices: Any) -> None:
        """Give slots back (SGLang passes tensors, or ``[]`` for the root)."""
        slots = [int(i) for i in indices]
        if not slots:
            return
        held = set(range(self.size)) - set(self.free_slots)
        assert set(slots) <= held, f"double free of {sorted(set(slots) - held)}"
        self.freed.append(slots)
        self.free_slots = sorted(self.free_slots + slots)

    def available_size(self) -> int:
        """Free slots left."""
        return len(self.free_slots)

    def clear(self) -> None:
        """Free everything (``HiRadixCache.reset`` clears the host pool)."""
        self.free_slots = list(range(self.size))


class FakeAllocator(SlotPool):
    """``token_to_kv_pool_allocator``: device slots, on the CPU.

    Slots are handed out one token each whatever ``page_size`` says; SGLang's
    caches take them as opaque indices.
    """

    def __init__(self, size: int, kvcache: object | None = None, page_size: int = 1) -> None:
        super().__init__(size)
        self.device = "cpu"
        self.kvcache = kvcache
        self.page_size = page_size

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """0.5.23's page-exact free (``RadixCache.evict``)."""
        del start_pos
        self.free(indices)

    def free_segments(self, segments: list[tuple[Any, int]]) -> None:
        """0.5.23's free of a request's KV row in pieces (``free_kv_row``)."""
        for indices, start_pos in segments:
            self.free_segment(indices, start_pos)

    def mamba_full_cache_donor(self) -> None:
        """0.5.23's shared-pool donor (``evict_for_alloc``): none, as SGLang's plain allocators."""

    def get_kvcache(self) -> object | None:
        """The KV cache ``HiRadixCache`` sizes its host pool from."""
        return self.kvcache


class FakeHostPool(SlotPool):
    """Stands in for ``MHATokenToKVPoolHost``: host slots, same constructor."""

    def __init__(
        self, device_pool: object, ratio: float, size: int, page_size: int, layout: str
    ) -> None:
        del device_pool, size, page_size, layout
        super().__init__(int(HOST_SLOTS * ratio))


HOST_SLOTS = 64
"""Host slots per 1.0 of ``hicache_ratio``."""


@dataclass
class Event:
    """A CUDA event stand-in: done when the test completes the copy."""

    done: bool = False

    def query(self) -> bool:
        """Whether the copy finished (``writing_check``/``loading_check`` poll this)."""
        return self.done

    def synchronize(self) -> None:
        """Wait for the copy: on the CPU it finishes at once."""
        self.done = True

    def record(self) -> None:
        """Nothing to record on the CPU."""


class Ack(NamedTuple):
    """SGLang's ``HiCacheAck``: ``(start_event, finish_event, node_ids)``."""

    start_event: Event
    finish_event: Event
    node_ids: list[int]


@dataclass
class Copy:
    """One copy the controller started: which slots, for which node."""

    host: list[int]
    device: list[int]
    node_id: int


@dataclass
class CpuController:
    """The parts of ``HiCacheController`` that ``HiRadixCache`` calls, on the CPU.

    ``write`` allocates host slots and queues its ack at once (SGLang's
    ``start_writing`` runs inside ``write``); ``load`` allocates device slots
    and ``start_loading`` queues the ack. Acks finish only when the test calls
    :meth:`finish_writes` / :meth:`finish_loads`, so a test can act while a
    copy is in flight.
    """

    mem_pool_device_allocator: FakeAllocator
    mem_pool_host: FakeHostPool
    page_size: int
    write_policy: str
    ack_write_queue: list[Ack] = field(default_factory=list)
    ack_load_queue: list[Ack] = field(default_factory=list)
    load_queue: list[Copy] = field(default_factory=list)
    writes: list[Copy] = field(default_factory=list)
    loads: list[Copy] = field(default_factory=list)
    tp_rank: int = 0
    dp_rank: int = 0
    storage_backend: object | None = None

    @classmethod
    def build(
        cls,
        allocator: FakeAllocator,
        host_pool: FakeHostPool,
        page_size: int,
        tp_group: object,
        **kwargs: Any,
    ) -> CpuController:
        """Take ``HiCacheController``'s constructor arguments."""
        del tp_group
        return cls(
            allocator, host_pool, page_size, str(kwargs.get("write_policy", "write_through"))
        )

    def reset(self) -> None:
        """Drop every queued operation (``HiRadixCache.reset``)."""
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self.load_queue.clear()

    def write(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> torch.Tensor | None:
        """Allocate host slots and start the device-to-host copy; None when the host is full."""
        del priority
        host = self.mem_pool_host.alloc(len(device_indices))
        if host is None:
            return None
        copy = Copy(host.tolist(), [int(i) for i in device_indices], node_id)
        self.writes.append(copy)
        self.ack_write_queue.append(Ack(Event(True), Event(), [node_id]))
        return host

    def load(
        self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> torch.Tensor | None:
        """Allocate device slots for a host-to-device copy; None when the device is full."""
        del priority
        device = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device is None:
            return None
        self.load_queue.append(Copy(host_indices.tolist(), device.tolist(), node_id))
        return device

    def start_loading(self) -> int:
        """Start the queued loads as one copy; -1 when none are queued."""
        if not self.load_queue:
            return -1
        ids = [c.node_id for c in self.load_queue]
        self.loads.extend(self.load_queue)
        self.load_queue.clear()
        self.ack_load_queue.append(Ack(Event(True), Event(), ids))
        return len(self.loads)

    def evict_device(self, device_indices: torch.Tensor) -> int:
        """Free device slots whose data has a host copy."""
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        """Free host slots."""
        assert backup_only
        self.mem_pool_host.free(host_indices)
        return len(host_indices)

    def finish_writes(self) -> None:
        """Every device-to-host copy started so far lands."""
        for ack in self.ack_write_queue:
            ack.finish_event.done = True

    def finish_loads(self) -> None:
        """Every host-to-device copy started so far lands."""
        for ack in self.ack_load_queue:
            ack.finish_event.done = True


@dataclass
class Prefetch:
    """One prefetch from storage (SGLang's ``PrefetchOperation``): its host slots and progress."""

    req_id: str
    host_indices: torch.Tensor
    token_ids: list[int]
    completed_tokens: int = 0
    hash_value: list[str] = field(default_factory=list)
    terminated: bool = False

    def is_terminated(self) -> bool:
        """Whether ``terminate_prefetch`` ended it."""
        return self.terminated

    def land(self, tokens: int) -> None:
        """The first ``tokens`` tokens arrive from storage (one hash a page of one token)."""
        self.completed_tokens = tokens
        self.hash_value = [f"h{i}" for i in range(tokens)]


@dataclass
class StorageController(CpuController):
    """:class:`CpuController` with a storage tier (L3): prefetches land when the test says.

    The queues are those ``drain_storage_control_queues`` reads; no prefetch
    is revoked and no storage backup is acknowledged unless the test does it.
    """

    prefetch_revoke_queue: queue.Queue[str] = field(default_factory=queue.Queue)
    ack_backup_queue: queue.Queue[Any] = field(default_factory=queue.Queue)
    host_mem_release_queue: queue.Queue[torch.Tensor] = field(default_factory=queue.Queue)
    prefetch_tokens_occupied: int = 0
    prefetches: list[Prefetch] = field(default_factory=list)
    backups: list[int] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def prefetch_rate_limited(self) -> bool:
        """Never: every prefetch asked for starts."""
        return False

    def prefetch(
        self,
        req_id: str,
        host_indices: torch.Tensor,
        new_input_tokens: list[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
    ) -> Prefetch:
        """Start reading ``new_input_tokens`` from storage into ``host_indices``."""
        del last_hash, prefix_keys
        operation = Prefetch(req_id, host_indices, list(new_input_tokens))
        self.prefetches.append(operation)
        return operation

    def terminate_prefetch(self, operation: Prefetch) -> tuple[int, list[str]]:
        """End ``operation``; what has landed so far."""
        operation.terminated = True
        return operation.completed_tokens, operation.hash_value

    def append_host_mem_release(self, host_indices: torch.Tensor) -> None:
        """Queue host slots a prefetch did not fill, for ``drain_storage_control_queues``."""
        if host_indices.numel():
            self.host_mem_release_queue.put(host_indices)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Any,
        hash_value: Any = None,
        prefix_keys: Any = None,
    ) -> int:
        """Start a host-to-storage backup; its operation id."""
        del host_indices, token_ids, hash_value, prefix_keys
        ident = next(self._ids)
        self.backups.append(ident)
        return ident


def server_args(
    write_policy: str = "write_through", storage: bool = False
) -> types.SimpleNamespace:
    """The ``ServerArgs`` fields ``HiRadixCache.__init__`` reads; with ``storage``, an L3 tier.

    With a storage tier a prefetch of one token or more starts (SGLang's
    default threshold is 256).
    """
    return types.SimpleNamespace(
        hicache_io_backend="kernel",
        hicache_mem_layout="layer_first",
        hicache_ratio=1.0,
        hicache_size=0,
        hicache_storage_backend="cpu-fake" if storage else None,
        hicache_storage_backend_extra_config='{"prefetch_threshold": 1}' if storage else None,
        hicache_storage_prefetch_policy="best_effort",
        hicache_write_policy=write_policy,
        served_model_name="fake",
    )


class HybridHostPool(SlotPool):
    """0.5.23's host pool group's KV pool, as ``UnifiedRadixCache`` reads it.

    Its anchor entry shares no allocation domain with another pool, so the
    cache evicts host leaves itself before a backup (``_execute_kv_backup``).
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.anchor_entry = types.SimpleNamespace(
            host_pool=types.SimpleNamespace(shared_allocation_domain=None), host_evict_fn=None
        )


class HostPoolGroup:
    """``HostPoolGroup`` of a ``FULL``-only tree: the one KV pool (``free_host_values`` frees into it)."""

    def __init__(self, pool: HybridHostPool) -> None:
        self.pool = pool

    def free(self, indices: Any, pool: object = None) -> None:
        """Give host slots back."""
        del pool
        self.pool.free(indices)

    def get_pool(self, name: object) -> None:
        """No SWA or Mamba host pool."""
        del name

    def destroy(self) -> None:
        """Nothing to release on the CPU."""


@dataclass
class LayerDoneCounter:
    """How many loads may be in flight at once (``has_free_load_back_slot`` reads it)."""

    num_counters: int


@dataclass
class HybridController:
    """The parts of 0.5.23's ``HybridCacheController`` a ``FULL``-only ``UnifiedRadixCache`` calls.

    As :class:`CpuController`: ``write`` allocates host slots (queued until
    ``start_writing`` unless flushed), ``load`` allocates device slots and
    ``start_loading`` starts them as one copy; an ack finishes only when the
    test calls :meth:`finish_writes` / :meth:`finish_loads`. No storage tier.
    """

    mem_pool_device_allocator: FakeAllocator
    mem_pool_host: HybridHostPool
    write_policy: str
    ack_write_queue: list[Ack] = field(default_factory=list)
    ack_load_queue: list[Ack] = field(default_factory=list)
    write_queue: list[Copy] = field(default_factory=list)
    load_queue: list[Copy] = field(default_factory=list)
    writes: list[Copy] = field(default_factory=list)
    loads: list[Copy] = field(default_factory=list)
    enable_storage: bool = False
    pp_prefetch_command_group: object | None = None
    layer_done_counter: LayerDoneCounter = field(default_factory=lambda: LayerDoneCounter(3))

    def write(
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        *,
        node_id: int = -1,
        extra_pools: object = None,
        flush: bool = True,
        start_owner: int | None = None,
    ) -> torch.Tensor | None:
        """Allocate host slots for a device-to-host copy; None when the host is full."""
        del priority, extra_pools, start_owner
        host = self.mem_pool_host.alloc(len(device_indices))
        if host is None:
            return None
        self.write_queue.append(Copy(host.tolist(), [int(i) for i in device_indices], node_id))
        if flush:
            self.start_writing()
        return host

    def start_writing(self) -> None:
        """Start the queued writes as one copy."""
        if not self.write_queue:
            return
        self.writes.extend(self.write_queue)
        ids = [c.node_id for c in self.write_queue]
        self.write_queue.clear()
        self.ack_write_queue.append(Ack(Event(True), Event(), ids))

    def load(
        self,
        host_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        extra_pools: object = None,
        *,
        device_indices: torch.Tensor | None = None,
        anchor_indices: object = None,
    ) -> torch.Tensor | None:
        """Allocate device slots for a host-to-device copy; None when the device is full."""
        del priority, extra_pools, anchor_indices
        if device_indices is None:
            device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(Copy(host_indices.tolist(), device_indices.tolist(), node_id))
        return device_indices

    def start_loading(self) -> int:
        """Start the queued loads as one copy; -1 when none are queued."""
        if not self.load_queue:
            return -1
        ids = [c.node_id for c in self.load_queue]
        self.loads.extend(self.load_queue)
        self.load_queue.clear()
        self.ack_load_queue.append(Ack(Event(True), Event(), ids))
        return len(self.loads) % self.layer_done_counter.num_counters

    def reset(self) -> None:
        """Drop every queued copy and acknowledgement (``UnifiedRadixCache.reset``)."""
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self.write_queue.clear()
        self.load_queue.clear()

    def finish_writes(self) -> None:
        """Every device-to-host copy started so far lands."""
        for ack in self.ack_write_queue:
            ack.finish_event.done = True

    def finish_loads(self) -> None:
        """Every host-to-device copy started so far lands."""
        for ack in self.ack_load_queue:
            ack.finish_event.done = True


class FakeReqToTokenPool:
    """``req_to_token_pool``: one row of device slots per running request."""

    def __init__(self, rows: int, width: int) -> None:
        self.width = width
        self.req_to_token = torch.zeros((rows, width), dtype=torch.int32)
        self.free_rows = list(range(rows))

    def alloc(self) -> int | None:
        """A free row, lowest first; None when every row is taken."""
        return self.free_rows.pop(0) if self.free_rows else None

    def free(self, row: Any) -> None:
        """Give a row back (0.5.6 passes its index, 0.5.23 the request)."""
        index = row if isinstance(row, int) else row.req_pool_idx
        assert index not in self.free_rows, f"row {index} freed twice"
        self.free_rows = sorted([*self.free_rows, index])

    def write(self, indices: tuple[int, slice], values: torch.Tensor) -> None:
        """``req_to_token[row, cols] = values`` (``cache_unfinished_req``/``checkpoint``)."""
        self.req_to_token[indices] = values.to(torch.int32)


class FakeReq:
    """The fields of SGLang's ``Req`` its radix caches read and write, for both releases.

    0.5.6 keeps the KV row's fields on the request; 0.5.23 on ``req.kv``,
    which is the request itself here, and wants its token ids as ``array('q')``.
    0.5.23's ``UnifiedRadixCache`` also reads a streaming session (none here:
    ``session`` is None), a rotation base (None: no logical-page sharding)
    and whether the request has finished, and its ``free_kv_row`` asks the KV
    record where the request's SWA window ends (nothing evicted: no SWA); a
    load back reads its Mamba slot and SWA and Mamba host hits (none).
    """

    def __init__(
        self, rid: int, tokens: list[int], extra_key: str | None, last_node: Any, arrays: bool
    ) -> None:
        self.rid = f"r{rid}"
        self.arrays = arrays
        self.origin_input_ids = self._ids(tokens)
        self.output_ids = self._ids([])
        self.fill_ids = self.full_untruncated_fill_ids = self._ids(tokens)
        self.extra_key = extra_key
        self.cache_salt: str | None = None
        self.last_node = last_node
        self.priority: int | None = None
        self.lock: Any = None
        self.req_pool_idx = -1
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.swa_evict_floor = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.prefix_indices: Any = None
        self.prefix_len = 0
        self.extend_end = 0
        self.session: Any = None
        self.session_id: str | None = None
        self.kv_rotation_base: int | None = None
        self.finished_reason: str | None = None
        self.mamba_pool_idx: Any = None
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0

    def _ids(self, ids: list[int]) -> Any:
        return array("q", ids) if self.arrays else list(ids)

    @property
    def kv(self) -> FakeReq:
        """0.5.23's per-request KV record: the request itself."""
        return self

    def length(self) -> int:
        """Tokens with KV in the request's row."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def refresh(self) -> None:
        """``fill_ids`` catch up with the output (``refresh_fill_ids``)."""
        self.fill_ids = self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids

    def pop_committed_kv_cache(self) -> int:
        """0.5.6: the KV length ``cache_finished_req`` takes over."""
        return self.kv_committed_len

    def finished(self) -> bool:
        """Whether the request has a finish reason (0.5.23's ``checkpoint`` reads it)."""
        return self.finished_reason is not None

    def get_evicted_seqlen(self, component_type: Any) -> int:
        """0.5.23: how far a component (SWA) has evicted the row; nothing here."""
        del component_type
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        """0.5.23: the lowest row position the request frees itself, as SGLang's ``ReqKvInfo``."""
        low = max(self.cache_protected_len, self.swa_evict_floor)
        if page_size > 1 and low > self.cache_protected_len:
            low = -(-low // page_size) * page_size
        return low
