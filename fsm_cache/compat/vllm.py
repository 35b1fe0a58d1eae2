"""A checked vLLM offloading manager: vLLM's CPU block lifecycle run by the host machine.

vLLM's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``) keeps the
lifecycle of each offloaded block in one integer: ``-1`` while a store is in
flight, ``0`` once it is ready, ``N`` while N loads read it. Misuse is caught
by ``assert`` far from its cause (a second ``complete_load`` fails on the
count, a load of a pending block fails in ``prepare_load``), or not at all.
That integer is the host residency machine of ``specs/host_residency.toml``:
no entry is no record (``unbacked``), ``-1`` (store pending) is ``writing``,
``0`` (ready) is ``backed``, ``N`` (N loads) is ``pinned`` with ``pins = N``.

:class:`CheckedOffloadingManager` keeps one flat :class:`OffloadRecord` per
offload key (no tree: vLLM's manager is flat and prefix order comes from the
scheduler's calls) and fires the machine's events on it: ``write`` in
``prepare_store``, ``write_done`` / ``write_failed`` in ``complete_store``,
``load`` / ``load_done`` in ``prepare_load`` / ``complete_load``, ``evict_host``
when LRU eviction or ``reset_cache`` frees a ready block. Every call checks all
its keys before it changes anything, so a refused call changes nothing, and the
refusal is the spec's typed error (``NotLoading``, ``NoHostCopy``,
``DuplicateAck``, ``HostCopyPinned``, ``CopyInFlight``) naming the block, its
state and, in trail mode, the call sites of its recent events.

Everything else follows vLLM's manager exactly, so the two answer alike on
every legal call sequence (``tests/vllm_real`` holds them to it): lookups, the
keys chosen to store, the chunk ids handed out, the LRU victims (vLLM's order:
request-scoped ranks from 0.33 on, one global counter before), the offers
counted toward ``store_threshold`` (once per request from 0.34 on) and the
event stream (0.34's stored events name their request). Two of vLLM's
tolerated cases are choices, both kept as vLLM has them by default and
refused in ``strict`` mode: a ``complete_store`` of a block that is not being
stored (earlier vLLM schedulers completed a preempted request's stores at
once and again when the job reported) and a ``reset_cache`` while copies are
in flight (vLLM relies on the scheduler never delivering their completions).
Loads and stores belong to the request that prepared them, as vLLM's
scheduler completes them: a ``complete_load`` beyond the request's own loads
is refused (``NotLoading``), and a ``complete_store`` of a block another
request is storing counts as a duplicate (ignored, refused in strict mode),
where vLLM would unpin, publish or drop the other request's block.

This module imports neither vLLM nor torch. The vLLM-facing classes,
``FsmOffloadingManager`` (vLLM's ``OffloadingManager`` over this one) and
``FsmCpuOffloadingSpec`` (vLLM's ``CPUOffloadingSpec`` with only
``get_manager`` replaced, so vLLM's GPU<->CPU worker stays), are built from
the installed vLLM on first access, which is what vLLM's
``kv_connector_extra_config`` ``{"spec_name": "FsmCpuOffloadingSpec",
"spec_module_path": "fsm_cache.compat.vllm"}`` does. They have the installed
vLLM's calls: ``touch`` up to 0.33, none from 0.34 on.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import importlib
import inspect
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NoReturn, Protocol, TypeVar

from fsm_cache.engine import trail
from fsm_cache.engine.codegen import Refusal
from fsm_cache.engine.core import Engine, Verb
from fsm_cache.errors import (
    BadArgument,
    DuplicateAck,
    IllegalTransition,
    InvariantViolation,
    NotLoading,
)
from fsm_cache.numeric import as_index, whole
from fsm_cache.spec.machine import System
from fsm_cache.spec.shipped import host_machine


trail.internal(__file__)

__all__ = [
    "CheckedOffloadingManager",
    "Lookup",
    "OffloadEvent",
    "OffloadRecord",
    "Recency",
    "RequestContext",
    "StoreOutput",
    "block_label",
    "offload_system",
]

_T = TypeVar("_T")
_Key = bytes
_Rank = tuple[int, int]


def offload_system() -> System:
    """Return the shipped host machine as a one-region system whose instances are ``block``s.

    The region is ``host`` (records read ``rec.host`` as tree nodes do) and the
    label is ``block``, so refusals read ``block <hash>/<group>: load_done
    refused in backed (pins=0): ...``.
    """
    machine = host_machine()
    return System(
        "vllm_offload",
        (("host", machine),),
        doc="vLLM's CPU offloading block lifecycle: the host residency machine, one record per key.",
        label="block",
        source=machine.source,
    )


def block_label(key: object) -> str:
    """Name an offload key in messages: ``<block hash hex>/<KV group>``.

    vLLM's ``OffloadKey`` is the block hash followed by the 4-byte big-endian
    KV-group index; a key of 4 bytes or fewer is shown as plain hex, and
    anything that is no key by its ``repr``, so a refusal naming it is made.
    """
    if not isinstance(key, bytes):
        return repr(key)
    if len(key) <= 4:
        return key.hex()
    return f"{key[:-4].hex()}/{int.from_bytes(key[-4:], 'big')}"


class OffloadRecord:
    """The lifecycle of one offloaded block: a host state, its pins, its chunk.

    Attributes:
        key: The offload key.
        host: Host residency state (``writing``, ``backed``, ``pinned``; ``unbacked``
            before the first store and for keys the manager does not hold).
        pins: Loads in flight (vLLM's ``ref_cnt`` when ready).
        chunk: The CPU chunk id holding the block's KV.
        trail: Recent events with call sites in trail mode, else None.
    """

    __slots__ = ("chunk", "host", "key", "pins", "trail")

    def __init__(self, key: bytes, chunk: int = -1) -> None:
        self.key = key
        self.host = "unbacked"
        self.pins = 0
        self.chunk = chunk
        self.trail: trail.Trail | None = None

    @property
    def id(self) -> str:
        """The block's name in refusals (:func:`block_label`), made only when one is raised."""
        return block_label(self.key)

    def __repr__(self) -> str:
        return f"OffloadRecord({block_label(self.key)}, {self.host}, pins={self.pins}, chunk={self.chunk})"


class Lookup(enum.Enum):
    """What :meth:`CheckedOffloadingManager.lookup` answers (vLLM's ``LookupResult``)."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"


@dataclass(frozen=True)
class StoreOutput:
    """What a successful ``prepare_store`` returns (vLLM's ``PrepareStoreOutput``).

    Attributes:
        keys_to_store: The offered keys the manager did not hold, in offer order.
        chunk_ids: The chunk each of them is stored into.
        evicted_keys: Ready blocks evicted to make room, in eviction order.
    """

    keys_to_store: list[bytes]
    chunk_ids: list[int]
    evicted_keys: list[bytes]


@dataclass(frozen=True)
class OffloadEvent:
    """A batch of blocks stored or removed (vLLM's ``OffloadingEvent``, medium CPU).

    Attributes:
        keys: The blocks.
        removed: True for evictions and failed stores, False for completed stores.
        metadata_only: A failed store's cleanup, not a public eviction (vLLM 0.33+).
    """

    keys: list[bytes]
    removed: bool
    metadata_only: bool = False


class ReqContextLike(Protocol):
    """What the manager reads of a request context (vLLM's ``ReqContext`` has all three)."""

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the request's scratch value of type ``cls``, if any."""

    def set_state(self, val: Any) -> None:
        """Keep ``val`` as the request's scratch value of its type."""

    def get_offload_key_position(self, key: bytes) -> int | None:
        """Return the end-token position of ``key`` in the request, if known."""


class RequestContext:
    """A minimal request context for use without vLLM (tests, the benchmark).

    Args:
        req_id: The request id.
        positions: End-token position per key, as vLLM's scheduler records them.
    """

    def __init__(self, req_id: str, positions: dict[bytes, int] | None = None) -> None:
        self.req_id = req_id
        self.positions = dict(positions or {})
        self.scratch: dict[type, Any] = {}

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the scratch value of type ``cls``, if any."""
        found: _T | None = self.scratch.get(cls)
        return found

    def set_state(self, val: Any) -> None:
        """Keep ``val`` as the scratch value of its type."""
        self.scratch[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> int | None:
        """Return the end-token position of ``key``, if known."""
        return self.positions.get(key)


@dataclass(slots=True)
class _Request:
    """What the manager remembers of one request, kept in its context (vLLM's scratch)."""

    owner: object
    generation: int
    groups: dict[int, list[bytes]] = field(default_factory=dict)
    seen: set[bytes] = field(default_factory=set)
    counted: set[bytes] = field(default_factory=set)
    loads: dict[bytes, int] = field(default_factory=dict)
    storing: set[bytes] = field(default_factory=set)
    rank: int | None = None
    finished: bool = False


class _Requests(dict[int, _Request]):
    """What each manager remembers of one request, by the manager's ``id``: the context's scratch.

    A request context keeps one scratch value per type. Kept as the
    :class:`_Request` itself, a second manager over the same contexts (an
    audit or shadow manager) replaced the first's, whose own completions were
    then taken as another request's: a store ignored, its block ``writing``
    for good.
    """


class Recency:
    """vLLM's LRU order: the evictable block of the smallest ``(rank, key)`` goes first.

    A rank is ``(counter, 0)`` from one counter that every insertion and every
    touch advances; with ``request_ranks`` (vLLM 0.33+) a request's keys with a
    known token position share the request's rank ``(counter, -position)``, so
    tails go before heads. Ranks live for every held block; only ``backed``
    blocks are evictable. Victims come off a lazily invalidated heap.

    Args:
        request_ranks: Rank keys by request and position, as vLLM 0.33's LRU does.
    """

    def __init__(self, *, request_ranks: bool = True) -> None:
        self.request_ranks = request_ranks
        self.ranks: dict[bytes, _Rank] = {}
        self.evictable: set[bytes] = set()
        self.heap: list[tuple[_Rank, bytes]] = []
        self.counter = 0

    def next_rank(self) -> int:
        """Advance the counter and return it."""
        self.counter += 1
        return self.counter

    def insert(self, key: bytes, position: int | None, request: _Request) -> None:
        """Rank a newly stored block (not evictable until its store completes)."""
        if position is None or not self.request_ranks:
            self.ranks[key] = (self.next_rank(), 0)
        else:
            self.ranks[key] = (self.request_rank(request), -position)

    def request_rank(self, request: _Request) -> int:
        """Return the request's shared rank, taking the next one on first use."""
        if request.rank is None:
            request.rank = self.next_rank()
        return request.rank

    def remove(self, key: bytes) -> None:
        """Forget a block."""
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Make held blocks the most recent, the first of ``keys`` most of all."""
        for key in reversed(list(keys)):
            if key in self.ranks:
                self.ranks[key] = rank = (self.next_rank(), 0)
                if key in self.evictable:
                    heapq.heappush(self.heap, (rank, key))
        self.compact()

    def access(
        self, keys: Iterable[bytes], positions: Sequence[int | None], request: _Request
    ) -> None:
        """A request saw ``keys`` first (vLLM 0.33+): raise them to its rank by position."""
        if not self.request_ranks:
            return
        base = self.request_rank(request)
        for key, position in zip(keys, positions, strict=True):
            if position is None or key not in self.ranks:
                continue
            rank = (base, -position)
            if self.ranks[key] >= rank:
                continue
            self.ranks[key] = rank
            if key in self.evictable:
                heapq.heappush(self.heap, (rank, key))
        self.compact()

    def mark_evictable(self, key: bytes) -> None:
        """The block became ``backed``: it may be chosen."""
        self.evictable.add(key)
        heapq.heappush(self.heap, (self.ranks[key], key))
        self.compact()

    def mark_held(self, key: bytes) -> None:
        """The block left ``backed`` (a load pinned it)."""
        self.evictable.discard(key)

    def select(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        """Take the ``n`` least recent evictable blocks outside ``protected``; None if too few.

        Taking nothing when there are too few leaves the order as it was.
        """
        if n == 0:
            return []
        chosen: list[tuple[_Rank, bytes]] = []
        seen: set[bytes] = set()
        deferred: list[tuple[_Rank, bytes]] = []
        while self.heap and len(chosen) < n:
            entry = heapq.heappop(self.heap)
            rank, key = entry
            if key not in self.evictable or self.ranks.get(key) != rank or key in seen:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            chosen.append(entry)
            seen.add(key)
        for entry in deferred:
            heapq.heappush(self.heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(self.heap, entry)
            return None
        for _, key in chosen:
            self.evictable.discard(key)
            del self.ranks[key]
        self.compact()
        return [key for _, key in chosen]

    def compact(self) -> None:
        """Rebuild the heap once stale entries outnumber the live ones."""
        if len(self.heap) >= max(64, 2 * len(self.evictable)):
            self.heap = [(self.ranks[key], key) for key in self.evictable]
            heapq.heapify(self.heap)

    def clear(self) -> None:
        """Forget every block and restart the counter (``reset_cache``)."""
        self.ranks.clear()
        self.evictable.clear()
        self.heap.clear()
        self.counter = 0


# The least value of each of the manager's counts. vLLM's manager takes any int and
# misbehaves below these: negative chunks store nothing, a tracker of no entries never
# lets a block reach a store_threshold of 2 or more.
_LEAST = {"num_chunks": 0, "store_threshold": 0, "max_tracker_size": 1}


def _accepting(engine: Engine, event: str) -> frozenset[str]:
    """Return the host states in which the spec accepts ``event`` (pinned probed with one pin).

    The manager checks a whole call's keys against these sets before it fires
    anything, so a refused call changes nothing; the refusal itself is always
    the engine's, fired on the offending record.
    """
    accepted = set()
    for state in engine.system.machines["host"].state_names:
        probe = OffloadRecord(b"")
        probe.host, probe.pins = state, 1 if state == "pinned" else 0
        if engine.allowed(probe, event):
            accepted.add(state)
    return frozenset(accepted)


class CheckedOffloadingManager:
    """vLLM's CPU offloading manager with each block's lifecycle run by the host machine.

    Args:
        num_chunks: CPU chunks available to offloaded blocks.
        events: Collect store and removal events for :meth:`take_events`.
        strict: Refuse what vLLM tolerates: a ``complete_store`` of a block that
            is not being stored (``DuplicateAck``) and a ``reset_cache`` while a
            store or a load is in flight (``CopyInFlight`` / ``HostCopyPinned``).
        trail: Trail mode: refusals name the call sites of the block's recent
            events and of the refused call; defaults to ``FSM_CACHE_TRAIL``.
        store_threshold: Store a block only once it has been offered this many
            times (vLLM's ``store_threshold``; below 2 every offer is stored).
        max_tracker_size: Offer counts kept for ``store_threshold``.
        request_ranks: vLLM 0.33's LRU (request-scoped ranks by token position);
            False for vLLM 0.32's single counter.
        failure_events: Announce a failed store's cleanup as a ``metadata_only``
            removal, as vLLM 0.33 does; 0.32 announces nothing.
        count_offers_once: vLLM 0.34's ``store_threshold``: a request's offers of
            a key count once (a retry, or a re-offer after preemption, is not
            another use); False for 0.32 and 0.33, where every offer counts.

    Attributes:
        engine: The compiled host machine (:func:`offload_system`).
        duplicate_acks: ``complete_store`` keys ignored because no store of them
            was in flight (vLLM's tolerated duplicates; refused in strict mode).

    Raises:
        BadArgument: ``num_chunks`` or ``store_threshold`` is not an int >= 0,
            or ``max_tracker_size`` not an int >= 1 (bools are not ints here).
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        events: bool = False,
        strict: bool = False,
        trail: bool | None = None,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        request_ranks: bool = True,
        failure_events: bool = True,
        count_offers_once: bool = True,
    ) -> None:
        counts = {
            "num_chunks": num_chunks,
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
        }
        for name, value in counts.items():
            if not whole(value, _LEAST[name]):
                msg = (
                    f"{type(self).__name__}: {name} must be an int >= {_LEAST[name]}, "
                    f"got {value!r} ({type(value).__name__})"
                )
                raise BadArgument(msg)
        flags = {
            "events": events,
            "strict": strict,
            "request_ranks": request_ranks,
            "failure_events": failure_events,
            "count_offers_once": count_offers_once,
        }
        for name, flag in flags.items():  # strict="false" is truthy: it turned strict mode on
            _need_bool(type(self).__name__, name, flag)
        self.num_chunks = num_chunks
        self.strict = strict
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.failure_events = failure_events
        self.count_offers_once = count_offers_once
        self.engine = Engine(offload_system(), trail=trail)
        self.records: dict[bytes, OffloadRecord] = {}
        self.recency = Recency(request_ranks=request_ranks)
        self.events: list[OffloadEvent] | None = [] if events else None
        self.counts: OrderedDict[bytes, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self.allocated = 0
        self.free: list[int] = []
        self.generation = 0
        self.duplicate_acks = 0
        self.writing = 0
        self.stores_skipped = 0
        self.allocation_sizes: list[int] = []
        verb = self.engine.verb
        self._write, self._write_done, self._write_failed = (
            verb("write"),
            verb("write_done"),
            verb("write_failed"),
        )
        self._load, self._load_done, self._evict = (
            verb("load"),
            verb("load_done"),
            verb("evict_host"),
        )
        self._readable = _accepting(self.engine, "load")
        self._loading = _accepting(self.engine, "load_done")
        self._storing = _accepting(self.engine, "write_done")
        self._failing = _accepting(self.engine, "write_failed")
        self._evictable = _accepting(self.engine, "evict_host")

    # -- answers in vLLM's types (the vLLM subclass overrides these) ----------

    def _answer(self, found: Lookup) -> Any:
        return found

    def _load_spec(self, chunks: list[int]) -> Any:
        return chunks

    def _store_output(self, keys: list[bytes], chunks: list[int], evicted: list[bytes]) -> Any:
        return StoreOutput(keys, chunks, evicted)

    def _event(
        self, keys: list[bytes], removed: bool, metadata_only: bool, req_context: Any = None
    ) -> Any:
        del req_context  # vLLM 0.34's stored events carry it; ours need not
        return OffloadEvent(keys, removed, metadata_only)

    def _request_offloading_context(self) -> Any:
        return None

    # -- the OffloadingManager calls -------------------------------------------

    def on_new_request(self, req_context: ReqContextLike) -> Any:
        """Start remembering a request's accesses; return vLLM's default offloading context.

        Raises:
            BadArgument: ``req_context`` is not a request context.
        """
        self._request("on_new_request", req_context)
        return self._request_offloading_context()

    def lookup(self, key: bytes, req_context: ReqContextLike) -> Any:
        """``MISS`` without a record, ``HIT_PENDING`` while ``writing``, else ``HIT``.

        Raises:
            BadArgument: ``req_context`` is not a request context.
        """
        _check_context("lookup", req_context)
        if not isinstance(key, bytes):  # a list raised TypeError; None or a str was a MISS
            msg = f"lookup: key must be an offload key (bytes), got {key!r} ({type(key).__name__})"
            raise BadArgument(msg)
        rec = self.records.get(key)
        if rec is None:
            return self._answer(Lookup.MISS)
        if rec.host in self._readable:
            return self._answer(Lookup.HIT)
        return self._answer(Lookup.HIT_PENDING)

    def prepare_load(self, keys: Iterable[bytes], req_context: ReqContextLike) -> Any:
        """Fire ``load`` on every key (pins += 1) and return their chunks.

        ``keys`` is walked once, as vLLM walks it: checking every key before
        changing anything needs them twice, so they are listed first.

        Raises:
            NoHostCopy: A key has no record or its store is still in flight
                (vLLM asserts "not found" / "not ready"); nothing changed.
            BadArgument: ``keys`` is no iterable of keys (one key, say), the
                request was already finished, or ``req_context`` is not a
                request context; nothing changed.
        """
        keys, records = _listed_keys("prepare_load", keys), self.records
        for key in keys:
            rec = records.get(key)
            if rec is None or rec.host not in self._readable:
                self._refuse("load", key, rec)
        request = self._request("prepare_load", req_context)
        self._check_open("prepare_load", keys, request)
        positions = _positions("prepare_load", keys, req_context)
        chunks, loads = [], request.loads
        for key in keys:
            rec = records[key]
            if rec.pins == 0:
                self.recency.mark_held(key)
            self._load(rec)
            loads[key] = loads.get(key, 0) + 1
            chunks.append(rec.chunk)
        self._record(keys, positions, request)
        return self._load_spec(chunks)

    def touch(self, keys: Iterable[bytes], req_context: ReqContextLike) -> None:
        """Make the held ``keys`` the most recently used (no state changes).

        vLLM 0.32 and 0.33's call; 0.34 removed it (``FsmOffloadingManager``
        bound to 0.34 has none).

        Raises:
            BadArgument: ``keys`` is no iterable of keys, or ``req_context`` is
                not a request context; nothing changed.
        """
        _check_context("touch", req_context)
        self.recency.touch(_listed_keys("touch", keys))

    def complete_load(self, keys: Iterable[bytes], req_context: ReqContextLike) -> None:
        """Fire ``load_done`` on every key; a block whose last load ends becomes evictable.

        Each load is its request's: vLLM's scheduler completes a load job with
        the context of the request that prepared it, so a key this request has
        no load of in flight is refused even while other requests' loads pin
        the block (vLLM would take their pin and let the block be evicted,
        its chunk reused, under their copies).

        Raises:
            NotLoading: A key has no load in flight (a second ``complete_load``,
                or one for a block never loaded; vLLM asserts "ref_cnt is
                already 0" or "not found"), or none of this request's (vLLM
                accepts it); nothing changed.
            BadArgument: ``keys`` is no iterable of keys, or ``req_context`` is
                not a request context; nothing changed.
        """
        _check_context("complete_load", req_context)
        keys, records = _listed_keys("complete_load", keys), self.records
        wanted = Counter(keys)
        if len(wanted) != len(keys):
            self._check_repeated(keys, self._load_done)
        for key in keys:
            rec = records.get(key)
            if rec is None or rec.host not in self._loading:
                self._refuse("load_done", key, rec)
        request = self._held(req_context)
        loads: dict[bytes, int] = request.loads if request is not None else {}
        for key in keys:
            if loads.get(key, 0) < wanted[key]:
                self._refuse_foreign_load(records[key], req_context, loads.get(key, 0), wanted[key])
        for key in keys:
            rec = records[key]
            self._load_done(rec)
            if loads[key] == 1:
                del loads[key]
            else:
                loads[key] -= 1
            if rec.pins == 0:
                self.recency.mark_evictable(key)

    def prepare_store(self, keys: Iterable[bytes], req_context: ReqContextLike) -> Any:
        """Choose the offered keys to store, evict LRU ready blocks to fit, fire ``write``.

        Returns None when too few ready blocks can be evicted (nothing changes
        then but the access bookkeeping, as in vLLM).

        Raises:
            BadArgument: ``keys`` is no iterable of keys, a key offered
                twice, the request was already finished and a key it never
                saw would be recorded (vLLM asserts), or ``req_context`` is
                not a request context; nothing changed.
        """
        keys = _listed_keys("prepare_store", keys)
        if len(set(keys)) != len(keys):  # named, not the whole offer (thousands of keys)
            twice = next(k for i, k in enumerate(keys) if k in keys[:i])
            msg = (
                f"prepare_store offered a key twice: {block_label(twice)} "
                f"(in an offer of {len(keys)} keys)"
            )
            raise BadArgument(msg)
        records, to_store, ready = self.records, [], []
        for key in keys:
            rec = records.get(key)
            if rec is None:
                to_store.append(key)
            elif rec.host in self._readable:
                ready.append(key)
        request = self._request("prepare_store", req_context)
        positions = _positions("prepare_store", keys, req_context)
        # What vLLM records, and its finished-request assert covers: the ready keys and the
        # new ones this offer brings to the threshold (read lazily: only a finished request
        # needs them).
        passing = (k for k in to_store if self._passes(k, request))
        self._check_open("prepare_store", chain(ready, passing), request)
        if self.counts is not None:
            to_store = self._admit(keys, to_store, request)
        recorded = set(to_store)
        recorded.update(ready)
        self._record([k for k in keys if k in recorded], positions, request)
        if not to_store:
            return self._store_output([], [], [])
        self.allocation_sizes.append(len(to_store))
        evicted = self._make_room(len(to_store) - self._num_free(), keys)
        if evicted is None:
            return None
        chunks = self._allocate(len(to_store))
        self.writing += len(to_store)
        for key, chunk in zip(to_store, chunks, strict=True):
            rec = records[key] = OffloadRecord(key, chunk)
            self._write(rec)
            self.recency.insert(key, positions[key], request)
        request.storing.update(to_store)
        return self._store_output(to_store, chunks, evicted)

    def complete_store(
        self, keys: Iterable[bytes], req_context: ReqContextLike, success: bool = True
    ) -> None:
        """Fire ``write_done`` (``success``) or ``write_failed`` on the keys this request stores.

        A key with no store in flight is ignored, as vLLM ignores it (earlier
        vLLM schedulers completed a preempted request's stores at once and again
        when the job reported); ``duplicate_acks`` counts them. In strict mode
        it is refused instead. So is a key another request is storing: vLLM's
        scheduler completes a store with the context of the request that
        prepared it, and vLLM would publish (or drop) the other request's block
        before its copy lands (a late duplicate for a key stored again since).

        Raises:
            DuplicateAck: Strict mode, and a key has no store of this request's
                in flight; nothing changed.
            BadArgument: ``keys`` is no iterable of keys (one key would count a
                duplicate per byte), or ``req_context`` is not a request context
                (``complete_store(keys, False)`` would otherwise store what
                failed); nothing changed.
        """
        _check_context("complete_store", req_context)
        _need_bool("complete_store", "success", success)  # None dropped it; "False" published it
        accepted = self._storing if success else self._failing
        keys, records = _listed_keys("complete_store", keys), self.records
        request = self._held(req_context)
        storing: set[bytes] = request.storing if request is not None else set()
        if self.strict:
            event = "write_done" if success else "write_failed"
            if len(set(keys)) != len(keys):
                self._check_repeated(keys, self._write_done if success else self._write_failed)
            for key in keys:
                rec = records.get(key)
                if rec is None or rec.host not in accepted:
                    self._refuse(event, key, rec)
                if key not in storing:
                    self._refuse_foreign_store(rec, event, req_context)
        done: list[bytes] = []
        for key in keys:
            rec = records.get(key)
            if rec is None or rec.host not in accepted or key not in storing:
                self.duplicate_acks += 1
                continue
            storing.discard(key)
            if success:
                self._write_done(rec)
                self.recency.mark_evictable(key)
            else:
                self._write_failed(rec)
                del records[key]
                self.recency.remove(key)
                self.free.append(rec.chunk)
            done.append(key)
        self.writing -= len(done)
        if not done or self.events is None:
            return
        if success:
            self.events.append(self._event(done, False, False, req_context))
        elif self.failure_events:
            self.events.append(self._event(done, True, True))

    def on_request_finished(self, req_context: ReqContextLike) -> None:
        """Commit the request's accesses to the LRU order, head of the prefix most recent.

        Raises:
            BadArgument: ``req_context`` is not a request context; nothing changed.
        """
        _check_context("on_request_finished", req_context)
        request = self._held(req_context)
        if request is None or request.finished:
            return
        seen = [key for group in sorted(request.groups) for key in request.groups[group]]
        positions = _positions("on_request_finished", seen, req_context)
        request.finished = True
        ordered: list[bytes] = []
        for group in sorted(request.groups):
            ordered.extend(_by_position(request.groups[group], positions))
        self.recency.touch(_by_position(ordered, positions))

    def take_events(self) -> Iterator[Any]:
        """Yield the events collected since the last call.

        A failed store's cleanup (``metadata_only``) is announced only for keys
        that no retry has stored again meanwhile, as vLLM 0.33 does.
        """
        if self.events is None:
            return
        events, self.events = self.events, []
        for event in events:
            if getattr(event, "metadata_only", False):
                keys = [k for k in event.keys if k not in self.records]
                if keys:
                    yield self._event(keys, True, True)
                continue
            yield event

    def reset_cache(self) -> None:
        """Drop every block and restart chunk numbering, as vLLM's ``reset_cache`` does.

        Ready blocks are evicted through the machine. Blocks with a copy in
        flight are dropped with them by default: vLLM's scheduler never
        delivers the completions of jobs started before a reset, so their
        chunks are free for reuse. A completion that arrives anyway is taken
        as a new job's (a completion names no job, as in vLLM) only from the
        request that stored or loaded the key again since the reset; for a key
        not held again, or from another request, a load's is refused
        (``NotLoading``) and a store's is ignored as a duplicate
        acknowledgement (what a request prepared before the reset is forgotten
        with it). Strict mode, which refuses the reset itself, is the protection.

        Raises:
            CopyInFlight: Strict mode, and a store is in flight; nothing changed.
            HostCopyPinned: Strict mode, and a load is in flight; nothing changed.
        """
        if self.strict:
            for rec in self.records.values():
                if rec.host not in self._evictable:
                    self._refuse("evict_host", rec.key, rec)
        for rec in self.records.values():
            if rec.host in self._evictable:
                self._evict(rec)
        self.records.clear()
        self.recency.clear()
        self.generation += 1
        self.free.clear()
        self.allocated = 0
        self.writing = 0

    def on_reset_flushed(self) -> None:
        """Accept vLLM 0.33's signal that pre-reset jobs are done: nothing here waits on it."""

    # -- bookkeeping ---------------------------------------------------------------

    def usage(self) -> tuple[float, float]:
        """Return the fraction of chunks held by blocks that may not be evicted, and by stores."""
        if self.num_chunks <= 0:
            return 0.0, 0.0
        used = self.allocated - len(self.free) - len(self.recency.evictable)
        return used / self.num_chunks, self.writing / self.num_chunks

    def _num_free(self) -> int:
        return len(self.free) + self.num_chunks - self.allocated

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_chunks - self.allocated)
        chunks = list(range(self.allocated, self.allocated + fresh))
        self.allocated += fresh
        chunks.extend(self.free.pop() for _ in range(n - fresh))
        return chunks

    def _make_room(self, needed: int, protected: Collection[bytes]) -> list[bytes] | None:
        """Evict ``needed`` LRU ready blocks outside ``protected``; None if too few, nothing changed."""
        if needed <= 0:
            return []
        if needed > len(self.recency.evictable):
            return None
        victims = self.recency.select(needed, set(protected))
        if victims is None:
            return None
        records = self.records
        for key in victims:
            rec = records[key]
            self._evict(rec)
            del records[key]
            self.free.append(rec.chunk)
        if self.events is not None:
            self.events.append(self._event(victims, True, False))
        return victims

    def _refuse(self, event: str, key: bytes, rec: OffloadRecord | None) -> NoReturn:
        """Raise the spec's refusal of ``event`` on ``key``'s record, changing nothing.

        The engine's ``plan`` checks the event without applying it, so the
        refusal (its class, message and, in trail mode, call sites) is the
        spec's own. A key without a record is refused as ``unbacked``.

        Raises:
            IllegalTransition: The spec's refusal (always).
            InvariantViolation: The spec accepts what the manager's check refused.
        """
        target = rec if rec is not None else OffloadRecord(key)
        self.engine.plan(target, event)
        msg = f"block {block_label(key)}: {event} in {target.host} passed the spec but not the manager's check"
        raise InvariantViolation(msg)

    def _check_repeated(self, keys: Collection[bytes], verb: Verb) -> None:
        """Fire ``verb`` once per occurrence on scratch copies; raise its refusal, change nothing."""
        copies: dict[bytes, OffloadRecord] = {}
        for key in keys:
            rec = copies.get(key)
            if rec is None:
                held = self.records.get(key)
                rec = copies[key] = OffloadRecord(key)
                if held is not None:
                    rec.host, rec.pins = held.host, held.pins
                    if held.trail is not None:  # a copy: the scratch notes stay off the record
                        rec.trail = deque(held.trail, maxlen=held.trail.maxlen)
            verb(rec)

    def _passes(self, key: bytes, request: _Request) -> bool:
        """Whether this offer of a new ``key`` would bring it to ``store_threshold``.

        Read before the offer is counted. A count is kept only from a threshold
        of 2, so a key without one (its first offer) never passes.
        """
        counts = self.counts
        if counts is None:
            return True
        step = 0 if key in request.counted else 1
        return key in counts and counts[key] + step >= self.store_threshold

    def _admit(self, keys: list[bytes], candidates: list[bytes], request: _Request) -> list[bytes]:
        """Count an offer toward ``store_threshold``; return the new keys it admits.

        A key the request already counted counts neither again nor as another
        skipped store (vLLM 0.34; ``request.counted`` stays empty before).
        """
        counts = self.counts
        assert counts is not None
        self._count_offers(keys, request.counted)
        admitted = []
        for key in candidates:
            if counts.get(key, 0) >= self.store_threshold:
                admitted.append(key)
            elif key not in request.counted:
                self.stores_skipped += 1
        if self.count_offers_once:
            request.counted.update(keys)
        return admitted

    def _count_offers(self, keys: list[bytes], counted: Collection[bytes]) -> None:
        """Count offers toward ``store_threshold``, dropping the oldest unprotected counts.

        Keys in ``counted`` stay tracked (and protected) but do not count again.
        """
        counts = self.counts
        assert counts is not None
        protected = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                if key not in counted:
                    counts[key] += 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def _request(self, call: str, req_context: ReqContextLike) -> _Request:
        _check_context(call, req_context)
        request = self._held(req_context)
        if request is None:
            request = _Request(self, self.generation)
            requests = req_context.get_state(_Requests)
            if requests is None:
                requests = _Requests()
                req_context.set_state(requests)
            requests[id(self)] = request
        return request

    def _held(self, req_context: ReqContextLike) -> _Request | None:
        """Return what this manager remembers of the request since the last reset, if anything."""
        requests = req_context.get_state(_Requests)
        request = None if requests is None else requests.get(id(self))
        if request is None or request.owner is not self or request.generation != self.generation:
            return None  # an id reused by another manager since is not this one's
        return request

    def _refuse_foreign_load(
        self, rec: OffloadRecord, req_context: ReqContextLike, own: int, completes: int
    ) -> NoReturn:
        """Refuse a ``load_done`` beyond the request's ``own`` loads of the block in flight.

        Raises:
            NotLoading: Always.
        """
        req_id = getattr(req_context, "req_id", None)
        if own:
            reason = (
                f"request {req_id!r} has {own} load(s) of it in flight and completes {completes}"
                " (its other pins are other requests' loads)"
            )
        else:
            reason = (
                f"request {req_id!r} has no load of it in flight"
                " (its pins are other requests' loads)"
            )
        self._refuse_foreign(NotLoading, rec, "load_done", reason)

    def _refuse_foreign_store(
        self, rec: OffloadRecord, event: str, req_context: ReqContextLike
    ) -> NoReturn:
        """Refuse (strict mode) a store completion for a block another request is storing.

        Raises:
            DuplicateAck: Always.
        """
        req_id = getattr(req_context, "req_id", None)
        reason = f"request {req_id!r} has no store of it in flight (another request's store is)"
        self._refuse_foreign(DuplicateAck, rec, event, reason)

    def _refuse_foreign(
        self, error: type[IllegalTransition], rec: OffloadRecord, event: str, reason: str
    ) -> NoReturn:
        """Raise a refusal of the request's claim on ``rec``, shaped as the spec's own.

        The spec counts a block's copies, not whose they are, so the refusal is
        the manager's (:meth:`~fsm_cache.engine.core.Engine.refusal`).

        Raises:
            IllegalTransition: ``error``, always.
        """
        raise self.engine.refusal(rec, Refusal("host", event, error.__name__, reason))

    def _check_open(self, call: str, keys: Iterable[bytes], request: _Request) -> None:
        """Refuse new keys for a finished request (vLLM asserts, in these words)."""
        if not request.finished:
            return
        new = next((key for key in keys if key not in request.seen), None)
        if new is not None:
            msg = (
                f"{call}: request finished: new cache keys observed after on_request_finished"
                f" ({block_label(new)})"
            )
            raise BadArgument(msg)

    def _record(
        self, keys: Iterable[bytes], positions: Mapping[bytes, int | None], request: _Request
    ) -> None:
        """Note the keys a request sees first, by KV group, and rank them (vLLM 0.33+).

        ``positions`` are the keys' token positions, read and checked before
        the call changed anything (:func:`_positions`).
        """
        new = []
        for key in keys:
            if key in request.seen:
                continue
            request.groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
            request.seen.add(key)
            new.append(key)
        if new and self.recency.request_ranks:
            self.recency.access(new, [positions[key] for key in new], request)


_ONLY_KEYS = frozenset({bytes})
_NOT_A_KEY_LIST = (bytes, bytearray, memoryview, str)


def _listed_keys(call: str, keys: Iterable[bytes]) -> list[bytes]:
    """List a call's ``keys`` (walked once, as vLLM walks them), refusing what is no keys.

    A bare key is iterable too, its items ints: ``prepare_load(key, ctx)``
    would look its bytes up and ``complete_store(key, ctx)`` count each one
    as a duplicate acknowledgement. The common all-``bytes`` list is checked
    by its items' types alone.

    Raises:
        BadArgument: ``keys`` is one key (bytes, bytearray, memoryview or str)
            or not iterable, or an item is not bytes.
    """
    if isinstance(keys, _NOT_A_KEY_LIST):
        _refuse_keys(call, keys)
    try:
        walk = iter(keys)
    except TypeError:
        _refuse_keys(call, keys)
    listed = list(walk)
    if not _ONLY_KEYS.issuperset(map(type, listed)):
        for position, key in enumerate(listed):
            if not isinstance(key, bytes):
                msg = (
                    f"{call}: keys must be offload keys (bytes), got {key!r} "
                    f"({type(key).__name__}) at position {position}"
                )
                raise BadArgument(msg)
    return listed


def _refuse_keys(call: str, keys: object) -> NoReturn:
    """Refuse ``keys`` that are no iterable of keys (:func:`_listed_keys`).

    Raises:
        BadArgument: Always.
    """
    msg = (
        f"{call}: keys must be an iterable of offload keys (bytes), "
        f"got {keys!r} ({type(keys).__name__})"
    )
    raise BadArgument(msg)


_CONTEXT_METHODS = ("get_state", "set_state", "get_offload_key_position")
"""What the manager calls on a request context (:class:`ReqContextLike`)."""


def _need_bool(call: str, name: str, value: object) -> None:
    """Refuse a flag that is not a bool: a truthy str or count would read as True.

    Raises:
        BadArgument: Naming the call, the flag and the value.
    """
    if not isinstance(value, bool):
        msg = f"{call}: {name} must be a bool, got {value!r} ({type(value).__name__})"
        raise BadArgument(msg)


def _check_context(call: str, req_context: object) -> None:
    """Refuse a ``req_context`` that is not a request context (:class:`ReqContextLike`).

    vLLM passes it second, before ``complete_store``'s ``success``: a call
    written ``complete_store(keys, False)`` would bind ``False`` to it and
    store the blocks whose store failed.

    Raises:
        BadArgument: It lacks one of the three methods, or is a class, not an
            instance of one (each is called on it).
    """
    if isinstance(req_context, type) or not all(
        callable(getattr(req_context, name, None)) for name in _CONTEXT_METHODS
    ):
        msg = (
            f"{call}: req_context must be a request context (get_state, set_state, "
            f"get_offload_key_position), got {req_context!r} ({type(req_context).__name__})"
        )
        raise BadArgument(msg)


def _positions(
    call: str, keys: Iterable[bytes], req_context: ReqContextLike
) -> dict[bytes, int | None]:
    """Return each key's token position as the request context says, checked before any change.

    A position the context answers as something other than an int or None
    (a str, a bool) failed the call half-way: its blocks writing and their
    chunks taken, the request never recorded as the store's owner, so that
    its ``complete_store`` was ignored and the blocks stayed ``writing``.

    Raises:
        BadArgument: A position is neither an int nor None; nothing changed.
    """
    positions: dict[bytes, int | None] = {}
    for key in keys:
        position = req_context.get_offload_key_position(key)
        index = None if position is None else as_index(position)
        if position is not None and index is None:
            msg = (
                f"{call}: req_context.get_offload_key_position({block_label(key)}) must be an"
                f" int token position or None, got {position!r} ({type(position).__name__})"
            )
            raise BadArgument(msg)
        positions[key] = index
    return positions


def _by_position(keys: list[bytes], positions: Mapping[bytes, int | None]) -> list[bytes]:
    """Sort ``keys`` by token position when every key has one; else keep their order."""
    if any(positions[key] is None for key in keys):
        return keys
    return sorted(keys, key=positions.__getitem__)  # type: ignore[arg-type]


# -- the vLLM-facing classes, built from the installed vLLM on first access -----------

_BOUND: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """Build ``FsmOffloadingManager`` and ``FsmCpuOffloadingSpec`` from vLLM on first access.

    Raises:
        AttributeError: Any other name.
        ModuleNotFoundError: vLLM is not installed.
    """
    if name not in ("FsmOffloadingManager", "FsmCpuOffloadingSpec"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _BOUND:
        _BOUND.update(_bind())
    return _BOUND[name]


@dataclass(frozen=True)
class _Behaviour:
    """What differs between the vLLM versions the bound manager follows.

    Attributes:
        request_ranks: The LRU ranks keys by request and position (0.33+).
        failure_events: A failed store's cleanup is a ``metadata_only`` removal (0.33+).
        count_offers_once: A request's offers of a key count once toward
            ``store_threshold`` (0.34+).
        stored_context: Stored events carry their request's context and
            ``removal_expected`` (0.34+).
        touch: ``OffloadingManager`` has ``touch`` (up to 0.33).
    """

    request_ranks: bool
    failure_events: bool
    count_offers_once: bool
    stored_context: bool
    touch: bool


def _behaviour(base: Any, cpu_manager: Any, lru: Any) -> _Behaviour:
    """Read the installed vLLM's behaviour from its classes (and its manager, for the counts)."""
    event_fields = base.OffloadingEvent.__dataclass_fields__
    return _Behaviour(
        request_ranks=hasattr(lru.LRUCachePolicy, "on_request_access"),
        failure_events="metadata_only" in event_fields,
        count_offers_once=_counts_offers_once(base, cpu_manager),
        stored_context="req_context" in event_fields,
        touch=hasattr(base.OffloadingManager, "touch"),
    )


def _counts_offers_once(base: Any, cpu_manager: Any) -> bool:
    """Ask vLLM's own manager whether a request's second offer of a key counts again.

    Nothing public says so (0.34 keeps the counted keys in the manager's
    per-request scratch), so one request offers one key twice under a
    threshold of 2: stored means every offer counts.
    """
    probe = cpu_manager.CPUOffloadingManager(1, store_threshold=2)
    ctx, key = base.ReqContext("fsm-cache-probe"), bytes(12)
    probe.prepare_store([key], ctx)
    return not probe.prepare_store([key], ctx).keys_to_store


def _bind() -> dict[str, type]:
    """Subclass vLLM's ``OffloadingManager`` and ``CPUOffloadingSpec`` (vLLM imported here)."""
    base: Any = importlib.import_module("vllm.v1.kv_offload.base")
    cpu_common: Any = importlib.import_module("vllm.v1.kv_offload.cpu.common")
    cpu_manager: Any = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
    cpu_spec: Any = importlib.import_module("vllm.v1.kv_offload.cpu.spec")
    lru: Any = importlib.import_module("vllm.v1.kv_offload.cpu.policies.lru")
    answers = {
        Lookup.MISS: base.LookupResult.MISS,
        Lookup.HIT: base.LookupResult.HIT,
        Lookup.HIT_PENDING: base.LookupResult.HIT_PENDING,
    }
    behaviour = _behaviour(base, cpu_manager, lru)
    manager = _manager_class(base, cpu_common, answers, behaviour)
    spec = _spec_class(cpu_spec, manager)
    for cls in (manager, spec):
        cls.__qualname__, cls.__module__ = cls.__name__, __name__
    return {"FsmOffloadingManager": manager, "FsmCpuOffloadingSpec": spec}


def _event_maker(base: Any, behaviour: _Behaviour) -> Callable[[list[bytes], bool, bool, Any], Any]:
    """Return a maker of vLLM's ``OffloadingEvent`` with the fields the installed vLLM sets."""
    medium, event_class = base.Medium.CPU, base.OffloadingEvent

    def make_event(keys: list[bytes], removed: bool, metadata_only: bool, req_context: Any) -> Any:
        fields: dict[str, Any] = {"keys": keys, "medium": medium, "removed": removed}
        if behaviour.failure_events:
            fields["metadata_only"] = metadata_only
        if behaviour.stored_context and not removed:
            # vLLM 0.34's events tracker builds the KV event's payload from the request
            # when the scheduler left none for the block, and holds it until the removal.
            fields.update(removal_expected=True, req_context=req_context)
        return event_class(**fields)

    return make_event


class _Withdrawn:
    """A call vLLM removed from ``OffloadingManager``: looking it up raises ``AttributeError``.

    ``hasattr`` then answers as for vLLM's own manager, and a caller written
    for an older vLLM reads what replaced the call.

    Args:
        why: What replaced the call, appended to the error.
    """

    def __init__(self, why: str) -> None:
        self.why = why
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        cls = owner if owner is not None else type(obj)
        msg = f"{cls.__name__!r} object has no attribute {self.name!r}: {self.why}"
        raise AttributeError(msg, name=self.name, obj=obj)


_NO_TOUCH = (
    "vLLM 0.34 removed OffloadingManager.touch; a request's loads and stores are its "
    "accesses, committed to the LRU order by on_request_finished"
)


_OPTIONS = (
    *(
        name
        for name, parameter in inspect.signature(CheckedOffloadingManager).parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY
    ),
    "info",
    "enable_events",
    "cache_policy",
    "cache_policy_module_path",
)
"""What ``FsmOffloadingManager`` takes by keyword: :class:`CheckedOffloadingManager`'s and vLLM's."""


def _vllm_options(options: dict[str, Any]) -> None:
    """Turn vLLM's ``CPUOffloadingManager`` keywords in ``options`` into this manager's, checked.

    Raises:
        BadArgument: A keyword neither manager takes, ``events`` and
            ``enable_events`` both given, or a ``cache_policy`` other than ``"lru"``.
    """
    unknown = [name for name in options if name not in _OPTIONS]
    if unknown:
        msg = (
            f"FsmOffloadingManager: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}; it takes num_chunks and {', '.join(_OPTIONS)}"
        )
        raise BadArgument(msg)
    if "enable_events" in options:
        if "events" in options:
            msg = "FsmOffloadingManager: give events or vLLM's enable_events, not both"
            raise BadArgument(msg)
        options["events"] = options.pop("enable_events")
    policy = options.pop("cache_policy", "lru")
    path = options.pop("cache_policy_module_path", None)
    if policy != "lru":
        msg = (
            f"FsmOffloadingManager supports cache_policy 'lru' only, not {policy!r} "
            f"(cache_policy_module_path {path!r})"
        )
        raise BadArgument(msg)


def _manager_class(
    base: Any, cpu_common: Any, answers: dict[Lookup, Any], behaviour: _Behaviour
) -> type:
    """Build ``FsmOffloadingManager``: the checked manager answering in vLLM's types."""
    make_event = _event_maker(base, behaviour)

    class FsmOffloadingManager(CheckedOffloadingManager, base.OffloadingManager):  # type: ignore[misc]
        """vLLM's ``OffloadingManager`` whose blocks run the host residency machine.

        Takes :class:`CheckedOffloadingManager`'s arguments, and vLLM's
        ``CPUOffloadingManager``'s (``enable_events`` for ``events``;
        ``cache_policy`` ``"lru"`` only, and ``cache_policy_module_path``, which
        vLLM reads only for a policy it has no name for; ``info``), so that
        code building vLLM's manager builds this one; anything else is a
        :class:`~fsm_cache.errors.BadArgument` naming it. ``request_ranks``,
        ``failure_events`` and ``count_offers_once`` default to the installed
        vLLM's behaviour, and ``touch`` exists only where vLLM's has it.
        """

        medium = base.Medium.CPU
        if not behaviour.touch:
            touch = _Withdrawn(_NO_TOUCH)

        def __init__(self, num_chunks: int, **options: Any) -> None:
            _vllm_options(options)
            options.setdefault("request_ranks", behaviour.request_ranks)
            options.setdefault("failure_events", behaviour.failure_events)
            options.setdefault("count_offers_once", behaviour.count_offers_once)
            self.info: Any = options.pop("info", None)
            super().__init__(num_chunks, **options)

        def _answer(self, found: Lookup) -> Any:
            return answers[found]

        def _load_spec(self, chunks: list[int]) -> Any:
            return cpu_common.CPULoadStoreSpec(chunks)

        def _store_output(self, keys: list[bytes], chunks: list[int], evicted: list[bytes]) -> Any:
            return base.PrepareStoreOutput(
                keys_to_store=keys,
                store_spec=cpu_common.CPULoadStoreSpec(chunks),
                evicted_keys=evicted,
            )

        def _event(
            self, keys: list[bytes], removed: bool, metadata_only: bool, req_context: Any = None
        ) -> Any:
            return make_event(keys, removed, metadata_only, req_context)

        def _request_offloading_context(self) -> Any:
            return base.RequestOffloadingContext()

        def get_load_source(self, key: bytes, req_context: Any) -> Any:
            """Where a hit comes from: the host (vLLM's ``CacheHitSource.HOST``).

            Raises:
                BadArgument: ``key`` is no offload key, or ``req_context`` no request context.
            """
            _check_context("get_load_source", req_context)
            if not isinstance(key, bytes):
                msg = (
                    f"get_load_source: key must be an offload key (bytes), got {key!r} "
                    f"({type(key).__name__})"
                )
                raise BadArgument(msg)
            sources: Any = importlib.import_module("vllm.v1.metrics.cache_hit_source")
            return sources.CacheHitSource.HOST

        def get_stats(self) -> Any:
            """The CPU tier's gauges and counters since the last call, as vLLM's manager reports them."""
            metrics: Any = importlib.import_module(
                "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"
            )
            names = cpu_common.CPUOffloadingMetrics
            stats = metrics.OffloadingConnectorStats()
            usage, writing = self.usage()
            stats.set_gauge(names.CPU_CACHE_USAGE_PERC, usage)
            for size in self.allocation_sizes:
                stats.observe_histogram(names.CPU_ALLOCATION_SIZE, size)
            self.allocation_sizes.clear()
            stats.set_gauge(names.CPU_CACHE_WRITE_USAGE_PERC, writing)
            stats.set_gauge(names.CPU_CACHE_READ_USAGE_PERC, max(usage - writing, 0.0))
            if self.store_threshold >= 2:
                stats.increase_counter(names.STORES_SKIPPED, self.stores_skipped)
                self.stores_skipped = 0
            return stats

        def config_info(self) -> Sequence[Any]:
            """The CPU tier's facts for vLLM's info metric (vLLM 0.33+)."""
            return [self.info.as_config_info() if self.info is not None else {}]

    return FsmOffloadingManager


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _flag(extra: Mapping[str, Any], name: str) -> bool | None:
    """Read an on/off key of ``kv_connector_extra_config`` (JSON or CLI strings alike).

    Returns:
        The flag; None when the key is absent (a default applies).

    Raises:
        BadArgument: A value that is neither a bool nor an on/off word.
    """
    value = extra.get(name)
    if value is None or isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    msg = f"kv_connector_extra_config[{name!r}] must be true or false, got {value!r}"
    raise BadArgument(msg)


def _count(extra: Mapping[str, Any], name: str, default: int) -> int:
    """Read a count of ``kv_connector_extra_config`` as vLLM does (``int()``), checked.

    vLLM takes whatever ``int()`` takes: ints, and digits in a string from the
    command line. A whole float is taken as its int; a fraction, another type,
    or a value below the manager's least (``_LEAST``) is refused here, naming
    the key, rather than failing in ``int()`` or in the manager.

    Raises:
        BadArgument: The value is no integer, or below the least.
    """
    value = extra.get(name, default)
    found: object = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            found = int(value)
    elif isinstance(value, float) and value.is_integer():
        found = int(value)
    if not whole(found, _LEAST[name]):
        msg = (
            f"kv_connector_extra_config[{name!r}] must be an integer >= {_LEAST[name]}, "
            f"got {value!r}"
        )
        raise BadArgument(msg)
    return found


def _spec_class(cpu_spec: Any, manager: type) -> type:
    """Build ``FsmCpuOffloadingSpec``: vLLM's CPU spec with the checked manager."""

    class FsmCpuOffloadingSpec(cpu_spec.CPUOffloadingSpec):  # type: ignore[misc]
        """vLLM's ``CPUOffloadingSpec`` whose scheduler-side manager is checked.

        Only ``get_manager`` differs: vLLM's GPU<->CPU worker, sizing and
        metrics definitions are the parent's. ``kv_connector_extra_config``
        keys read here: ``fsm_strict`` (refuse what vLLM tolerates) and
        ``fsm_trail`` (name call sites in refusals), besides vLLM's own
        (``store_threshold`` and ``max_tracker_size`` checked, :func:`_count`).
        """

        def get_manager(self) -> Any:
            """Return the checked manager, built once, sized as vLLM's would be."""
            if getattr(self, "_manager", None) is None:
                extra = self.extra_config
                options: dict[str, Any] = {
                    "events": self.kv_events_config.enable_kv_cache_events,
                    "store_threshold": _count(extra, "store_threshold", 0),
                    "max_tracker_size": _count(extra, "max_tracker_size", 64_000),
                    "strict": _flag(extra, "fsm_strict") is True,
                    "trail": _flag(extra, "fsm_trail"),
                }
                if getattr(self, "cpu_info", None) is not None:
                    options["info"] = self.cpu_info
                policy = extra.get("eviction_policy", "lru")
                # vLLM resolves a registered name before any module path, so with "lru"
                # its own LRU runs whatever cache_policy_module_path says.
                if policy != "lru":
                    msg = (
                        "FsmCpuOffloadingSpec supports eviction_policy 'lru' only, "
                        f"not {policy!r} (cache_policy_module_path "
                        f"{extra.get('cache_policy_module_path')!r})"
                    )
                    raise BadArgument(msg)
                self._manager = manager(self.num_chunks, **options)
            return self._manager

    return FsmCpuOffloadingSpec
