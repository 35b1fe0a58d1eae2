"""Regression tests of the defects of issue 13, one per defect, numbered as the issue does.

Each was found by adversarial testing of the cache (random workloads with
faulty copies, hypothesis against a plain model, bad input to every public
call) while every invariant check passed. What callers rely on is checked
directly: the pages a lookup hands out hold exactly its tokens' KV, nothing is
stuck with no copy in flight, and a refused call leaves every page, pin and
lock as it was.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref
from collections.abc import Callable

import pytest
import torch

from fsm_cache import native
from fsm_cache.cache.hicache import HiCache, MatchResult
from fsm_cache.cache.replay import replay
from fsm_cache.distributed.digest import TransitionDigest
from fsm_cache.errors import (
    BadArgument,
    CacheClosed,
    ConcurrentUse,
    ConfigError,
    DuplicateAck,
    EffectFailed,
    ForeignSlot,
    NotASlot,
    PoolExhausted,
    StaleNode,
)
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.tickets import Completion, Direction, Ticket
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.testing.faults import FaultyCopyEngine


POLICIES = ("write_through", "write_through_selective", "write_back")


def make(copier: Callable[[KVPool, KVPool], object] | None = None, **overrides: object) -> HiCache:
    """A small debug-mode cache with 2-token pages, loading anything worth loading."""
    settings: dict[str, object] = {
        "device_pages": 16,
        "host_pages": 32,
        "page_size": 2,
        "layers": 1,
        "heads": 1,
        "head_dim": 4,
        "device": "cpu",
        "load_back_threshold": 0,
        "selective_threshold": 1,
        "debug": True,
        "copier": copier,
    }
    settings.update(overrides)
    return HiCache(CacheConfig(**settings))  # type: ignore[arg-type]


def assert_kv(cache: HiCache, tokens: list[int], match: MatchResult) -> None:
    """The pages handed out hold exactly the KV of the device-matched tokens."""
    got = cache.tiers.read_device(match.device_pages).view(torch.uint8)
    want = synthetic_kv(cache.tiers.device.layout, tokens[: match.device_len])
    assert torch.equal(got, want.contiguous().view(torch.uint8))


def snapshot(cache: HiCache) -> tuple[object, ...]:
    """Everything a refused call must leave as it was."""
    dev, host = cache.tiers.device.allocator, cache.tiers.host.allocator
    nodes = tuple(sorted((n.id, n.residency(), n.device_pages, n.host_pages) for n in cache.tree))
    return nodes, dev.owners, host.owners, cache.issued(), cache.transfers.queued()


def drain(cache: HiCache) -> None:
    for _ in range(20):
        if not cache.issued() and not cache.transfers.queued():
            return
        cache.poll()
    raise AssertionError("copies never finished")


def settled(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


# -- 1: wrong KV handed out ----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_1_a_lookup_never_hands_out_a_childs_kv_for_a_loading_parent(policy: str) -> None:
    cache = make(write_policy=policy)
    cache.insert([1, 2])
    cache.poll()
    cache.evict(2)
    cache.poll()
    assert cache.load_back(cache.match_prefix([1, 2]).last_host_node)
    cache.insert([1, 2, 3, 4])  # under the node still loading
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.device_len == 4
    assert_kv(cache, [1, 2, 3, 4], match)


@pytest.mark.parametrize("policy", POLICIES)
def test_1_with_late_acknowledgements_the_insert_waits_for_the_load(policy: str) -> None:
    cache = make(FaultyCopyEngine.copier(delay=3), write_policy=policy)
    cache.insert([1, 2])
    drain(cache)
    cache.evict(2)
    drain(cache)
    (node,) = cache.load_back(cache.match_prefix([1, 2]).last_host_node) or []
    assert node.device == "loading"
    early = cache.match_prefix([1, 2, 3, 4])
    assert (early.device_len, early.host_len) == (0, 2)  # stops at the loading node
    cache.insert([1, 2, 3, 4])
    assert node.residency() == "backed/resident (pins=0, locks=0)"
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.device_len == 4
    assert_kv(cache, [1, 2, 3, 4], match)


# -- 2-4: loads that fail ------------------------------------------------------


def chain_cache(copier: Callable[[KVPool, KVPool], object]) -> HiCache:
    """Two nodes [1,2] <- [3,4], both backed and evicted from the device (copies 1-2 written)."""
    cache = make(copier)
    cache.insert([1, 2])
    cache.insert([1, 2, 3, 4])
    drain(cache)
    cache.evict(4)
    drain(cache)
    assert settled(cache) == [
        (1, "backed/absent (pins=0, locks=0)"),
        (2, "backed/absent (pins=0, locks=0)"),
    ]
    return cache


def test_2_a_chain_load_refused_at_start_fails_every_node_cleanly() -> None:
    cache = chain_cache(FaultyCopyEngine.copier(refuse={3}))
    free = cache.tiers.device.allocator.free_pages
    cache.load_back(cache.tree.nodes[2])
    assert settled(cache) == [
        (1, "backed/absent (pins=0, locks=0)"),
        (2, "backed/absent (pins=0, locks=0)"),
    ]
    assert cache.tiers.device.allocator.free_pages == free
    assert cache.issued() == []
    assert cache.transfers.queued() == 0


def test_3_a_refused_retry_inside_poll_applies_every_other_completion() -> None:
    cache = chain_cache(FaultyCopyEngine.copier(fail={3}, refuse={5}))
    chain = cache.load_back(cache.tree.nodes[2]) or []  # copy 3: it will fail
    leaf = chain[-1]
    lock = cache.lock(leaf)  # a locked load cannot fail: it is copied again
    cache.insert([7, 7])  # copy 4: its write is in flight beside the failing load
    cache.poll()  # the load failed; its retry (copy 5) was refused: queued again
    assert [n.device for n in chain] == ["loading", "loading"]
    assert cache.tree.walk((7, 7)).path[-1].host == "backed"  # applied despite the retry
    cache.check_invariants()  # invariant 12: the retry is queued, nothing is stuck
    assert cache.transfers.queued() == 2
    drain(cache)
    assert [n.device for n in chain] == ["resident", "resident"]
    assert_kv(cache, [1, 2, 3, 4], cache.match_prefix([1, 2, 3, 4]))
    cache.unlock(lock)


def test_3_a_pinned_backup_whose_retry_is_refused_waits_queued_for_the_next_poll() -> None:
    """A backup pinned while it was written cannot fail: a refused retry leaves it queued.

    The insert's backup (copy 1) fails after a lookup split its node and
    pinned the prefix; the suffix gives its backup up, the pinned prefix is
    copied again, and that start (copy 2) is refused: the prefix waits in
    the queue, not stuck, and the next poll starts it (copy 3).
    """
    cache = make(FaultyCopyEngine.copier(fail={1}, refuse={2}), host_pages=8, device_pages=8)
    cache.insert([1, 2] * 6)  # copy 1: it will fail
    match = cache.match_prefix([1, 2, 3])  # splits the node writing: [1, 2] and the rest
    prefix = match.last_host_node
    pin = cache.pin(prefix)
    cache.poll()  # copy 1 failed; the prefix's retry (copy 2) was refused: queued again
    assert settled(cache) == [
        (1, "unbacked/resident (pins=0, locks=0)"),
        (2, "writing/resident (pins=1, locks=0)"),
    ]
    assert cache.transfers.queued_nodes() == [("d2h", [2])]
    assert [start[:3] for start in cache.log.refused_starts()] == [(2, "d2h", (2,))]
    cache.check_invariants()  # invariant 12: the retry is queued, nothing is stuck
    cache.poll()  # copy 3 starts; the next poll lands it
    drain(cache)
    assert prefix.residency() == "pinned/resident (pins=1, locks=0)"
    assert_kv(cache, [1, 2], cache.match_prefix([1, 2]))
    pin.release()


def test_4_a_failed_load_of_a_chain_fails_cleanly_once() -> None:
    cache = chain_cache(FaultyCopyEngine.copier(fail={3}))
    cache.load_back(cache.tree.nodes[2])
    cache.poll()
    assert settled(cache) == [
        (1, "backed/absent (pins=0, locks=0)"),
        (2, "backed/absent (pins=0, locks=0)"),
    ]
    assert cache.issued() == []
    assert cache.transfers.queued() == 0
    assert cache.stats().transitions["load_failed"] == 2


# -- 5: eviction that never polls ----------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("delay", [0, 3])
def test_5_a_caller_that_never_polls_is_never_refused_room(policy: str, delay: int) -> None:
    cache = make(
        FaultyCopyEngine.copier(delay=delay), write_policy=policy, device_pages=8, host_pages=64
    )
    for i in range(40):
        cache.insert([100 + 2 * i, 101 + 2 * i, 1, 1])
    assert cache.tiers.device.allocator.free_pages >= 0
    match = cache.match_prefix([178, 179, 1, 1])
    assert match.device_len == 4
    assert_kv(cache, [178, 179, 1, 1], match)


# -- 6, 18: bad input ----------------------------------------------------------


class _BadRepr:
    """A namespace that hashes and compares (equal to itself or not), whose ``repr`` raises."""

    def __init__(self, *, equal: bool = True) -> None:
        self.equal = equal

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return self.equal and isinstance(other, _BadRepr)

    def __repr__(self) -> str:
        raise ValueError("no repr today")


class _BadHash:
    """A namespace whose ``__hash__`` raises something else than TypeError."""

    def __hash__(self) -> int:
        raise ValueError("no hash today")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.insert("ab"), "insert: tokens must be a sequence of ints, got str"),
        (lambda c: c.insert(None), "insert: tokens must be a sequence of ints, got NoneType"),
        (lambda c: c.insert([[1, 2], [3, 4]]), "insert: tokens[0] is [1, 2], not an int"),
        (lambda c: c.insert([1, 2.0]), "insert: tokens[1] is 2.0, not an int"),
        (lambda c: c.insert([1, -2]), "insert: tokens[1] is -2; ids and slots are 0 <= id < 2**64"),
        (
            lambda c: c.insert([2**64]),
            f"insert: tokens[0] is {2**64}; ids and slots are 0 <= id < 2**64",
        ),
        (lambda c: c.insert([1, 2], namespace=[]), "insert: namespace must be hashable, got list"),
        (lambda c: c.insert([1, 2], "xy"), "insert: slots must be a sequence of ints, got str"),
        (lambda c: c.match_prefix(5), "match_prefix: tokens must be a sequence of ints, got int"),
        (lambda c: c.lock(None), "lock: expected a tree node, got NoneType"),
        (lambda c: c.pin("node"), "pin: expected a tree node, got str"),
        (lambda c: c.unlock(None), "unlock: expected a lock receipt, got NoneType"),
        (lambda c: c.evict(None), "evict: num_tokens must be an int, got None"),
        (lambda c: c.evict(-1), "evict: num_tokens must be >= 0, got -1"),
        (lambda c: c.evict(True), "evict: num_tokens must be an int, got True"),
        (
            lambda c: c.evict(torch.tensor([1.0])),
            "evict: num_tokens must be an int, got tensor([1.])",
        ),
        (lambda c: c.evict_host(1.5), "evict_host: num_tokens must be an int, got 1.5"),
        (lambda c: c.alloc_slots(2.5), "alloc_slots: num_tokens must be an int, got 2.5"),
        (lambda c: c.free_slots([1.5]), "free_slots: slots[0] is 1.5, not an int"),
        (lambda c: c.load_back(7), "load_back: expected a tree node, got int"),
        (lambda c: c.backup(None), "backup: expected a sequence of tree nodes, got NoneType"),
        (lambda c: c.backup([None]), "backup: expected a tree node, got NoneType"),
        (lambda c: c.backup(""), "backup: expected a sequence of tree nodes, got str"),
        (lambda c: c.wait_loaded(""), "wait_loaded: expected a sequence of tree nodes, got str"),
        (
            lambda c: c.evict(torch.tensor(True)),
            "evict: num_tokens must be an int, got tensor(True)",
        ),
        (
            lambda c: c.insert(bytearray(b"ab")),
            "insert: tokens must be a sequence of ints, got bytearray",
        ),
        (
            lambda c: c.match_prefix(memoryview(b"ab")),
            "match_prefix: tokens must be a sequence of ints, got memoryview",
        ),
        (
            lambda c: c.insert([1, 2], namespace=(float("nan"),)),
            "insert: namespace must equal itself, got (nan,)",
        ),
        (
            lambda c: c.insert([1, 2], namespace=torch.tensor([1, 2])),
            "insert: namespace must compare as one bool, got Tensor (RuntimeError)",
        ),
        (
            lambda c: c.match_prefix([1, 2], namespace=_BadHash()),
            "match_prefix: namespace's hash raised ValueError: no hash today",
        ),
        (  # accepted, it broke the next poll and lookup: the storage keys are its repr
            lambda c: c.insert([1, 2], namespace=_BadRepr()),
            "insert: namespace's repr raised ValueError: no repr today",
        ),
        (  # the refusal of one unequal to itself showed its repr
            lambda c: c.insert([1, 2], namespace=_BadRepr(equal=False)),
            "insert: namespace's repr raised ValueError: no repr today",
        ),
        (lambda c: c.fire("nope", c.tree.nodes[1]), "fire: 'nope' is not a residency event"),
        (
            lambda c: c.apply_completions(3),
            "apply_completions: expected a sequence of completions, got int",
        ),
        (lambda c: c.apply_completions([3]), "apply_completions: expected a Completion, got 3"),
    ],
)
def test_6_18_bad_input_is_a_typed_error_and_changes_nothing(
    call: Callable[[HiCache], object], message: str
) -> None:
    cache = make()
    cache.insert([1, 2, 3, 4])
    before = snapshot(cache)
    with pytest.raises(BadArgument) as caught:
        call(cache)
    assert str(caught.value) == message
    assert isinstance(caught.value, TypeError)
    assert isinstance(caught.value, ValueError)
    assert snapshot(cache) == before


# -- 7, 16: stale nodes --------------------------------------------------------


def test_7_a_node_kept_across_reset_is_refused() -> None:
    cache = make()
    cache.insert([1, 2])
    drain(cache)
    cache.evict(2)
    old = cache.match_prefix([1, 2]).last_host_node
    cache.reset()
    cache.insert([5, 6])
    before = snapshot(cache)
    with pytest.raises(StaleNode) as caught:
        cache.load_back(old)
    assert str(caught.value) == (
        "node 1: load_back refused: the node is not in this cache"
        " (deleted by eviction, from before a reset, or another cache's)"
    )
    assert snapshot(cache) == before


def test_7_another_caches_node_is_refused_as_not_in_this_cache() -> None:
    """The message guessed only eviction or a reset, neither of which happened."""
    mine, other = make(), make()
    mine.insert([1, 2])
    other.insert([1, 2])
    theirs = other.match_prefix([1, 2]).last_device_node
    before = snapshot(mine)
    with pytest.raises(StaleNode) as caught:
        mine.pin(theirs)
    assert str(caught.value) == (
        f"node {theirs.id}: pin refused: the node is not in this cache"
        " (deleted by eviction, from before a reset, or another cache's)"
    )
    assert snapshot(mine) == before


def test_16_lock_of_a_node_deleted_by_eviction_is_refused() -> None:
    cache = make(host_pages=0)  # write-through with no host: eviction deletes
    cache.insert([1, 2])
    cache.insert([1, 2, 3, 4])
    (leaf,) = [n for n in cache.tree if n.key == (3, 4)]
    cache.evict(2)
    parent = cache.tree.nodes[1]
    with pytest.raises(StaleNode):
        cache.lock(leaf)
    assert parent.locks == 0


# -- 8: tensors ----------------------------------------------------------------


def test_18_an_integer_tensor_or_numpy_int_counts_as_an_int() -> None:
    cache = make()
    cache.insert([1, 2, 3, 4])
    cache.poll()
    assert cache.evict(torch.tensor(2)) == 4


def test_8_tokens_as_a_tensor_match_as_a_list_would() -> None:
    cache = make()
    cache.insert(torch.tensor([1, 2, 3, 4]))
    match = cache.match_prefix(torch.tensor([1, 2, 3, 4, 5, 6]))
    assert match.device_len == 4
    assert cache.match_prefix([1, 2, 3, 4]).device_len == 4
    assert_kv(cache, [1, 2, 3, 4], match)


# -- 11: threads ---------------------------------------------------------------


class Blocking:
    """A copy engine whose poll waits until released: keeps a thread inside the cache."""

    def __init__(self, inner: CopyEngine) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def poll(self) -> list[Completion]:
        self.entered.set()
        self.go.wait(10)
        return self.inner.poll()


class CallingBack:
    """A copy engine whose poll calls back into its cache (``call(cache)``), and keeps the error."""

    def __init__(self, inner: CopyEngine, call: Callable[[HiCache], object]) -> None:
        self.inner, self.call = inner, call
        self.cache: HiCache | None = None
        self.raised: list[BaseException] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def poll(self) -> list[Completion]:
        if self.cache is not None:
            try:
                self.call(self.cache)
            except ConcurrentUse as exc:
                self.raised.append(exc)
        return self.inner.poll()


@pytest.mark.parametrize("call", ["reset", "close", "insert"])
def test_11_a_call_back_into_the_cache_from_inside_an_operation_is_refused(call: str) -> None:
    engines: list[CallingBack] = []
    calls: dict[str, Callable[[HiCache], object]] = {
        "reset": HiCache.reset,
        "close": HiCache.close,
        "insert": lambda cache: cache.insert([7, 8]),
    }

    def build(device: KVPool, host: KVPool) -> CallingBack:
        engines.append(CallingBack(CopyEngine(device, host), calls[call]))
        return engines[-1]

    cache = make(build)
    cache.insert([1, 2])
    engines[0].cache = cache
    assert cache.poll() == 1
    (refused,) = engines[0].raised
    assert str(refused).startswith(f"{call}: another operation of this cache is running")
    engines[0].cache = None
    assert settled(cache) == [(1, "backed/resident (pins=0, locks=0)")]
    cache.close()


def test_11_a_second_thread_inside_the_cache_is_refused() -> None:
    engines: list[Blocking] = []

    def build(device: KVPool, host: KVPool) -> Blocking:
        engines.append(Blocking(CopyEngine(device, host)))
        return engines[-1]

    cache = make(build)
    worker = threading.Thread(target=cache.poll)
    worker.start()
    assert engines[0].entered.wait(10)
    before = snapshot(cache)
    with pytest.raises(ConcurrentUse) as caught:
        cache.insert([1, 2])
    assert str(caught.value) == (
        "insert: another operation of this cache is running (on another thread, or one that"
        " called back into the cache); a cache is single-threaded and its operations do not"
        " nest (serialise calls with a lock of your own)"
    )
    assert snapshot(cache) == before
    engines[0].go.set()
    worker.join(10)
    cache.insert([1, 2])  # free again once the first thread left
    # each thread's operation kept its own name and arguments: the refused one logged nothing
    assert [name for name, _ in cache.log.operations()] == ["poll", "insert"]


def test_11_operations_after_a_reset_are_logged_in_the_new_log() -> None:
    cache = make()
    cache.insert([1, 2])
    cache.reset()
    cache.match_prefix([1, 2])
    assert cache.log.operations() == [("match_prefix", ((1, 2), None))]


# -- 12: write-back with no host -----------------------------------------------


def test_12_write_back_with_no_host_pages_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        make(write_policy="write_back", host_pages=0)
    assert str(caught.value) == (
        "config: write_back needs host pages: with none, no device page could be evicted"
    )


# -- 13: which slots are the caller's ------------------------------------------


def test_13_the_return_value_names_the_slots_to_free_when_host_nodes_are_adopted() -> None:
    cache = make()
    cache.insert([1, 2, 3, 4])
    drain(cache)
    cache.evict(4)
    drain(cache)
    slots = cache.alloc_slots(6)
    cache.tiers.device.write(
        sorted({s // 2 for s in slots}), synthetic_kv(cache.tiers.device.layout, [1, 2, 3, 4, 5, 6])
    )
    returned = cache.insert([1, 2, 3, 4, 5, 6], slots)
    assert returned == 0
    cache.free_slots(slots[:returned])  # SGLang's free(slots[prefix:returned]): nothing here
    assert cache.tiers.device.allocator.free_pages == 16 - 3
    assert_kv(cache, [1, 2, 3, 4, 5, 6], cache.match_prefix([1, 2, 3, 4, 5, 6]))


def test_13_a_resident_prefix_is_what_the_return_value_counts() -> None:
    cache = make()
    cache.insert([1, 2, 3, 4])
    slots = cache.alloc_slots(6)
    returned = cache.insert([1, 2, 3, 4, 5, 6], slots)
    assert returned == 4
    cache.free_slots(slots[:returned])
    assert cache.tiers.device.allocator.free_pages == 16 - 3


# -- 14: a repeated acknowledgement --------------------------------------------


def test_14_a_repeated_acknowledgement_is_a_duplicate_ack_and_applies_nothing() -> None:
    cache = make(FaultyCopyEngine.copier(delay=0))
    cache.insert([1, 2])
    done = cache.transfers.collect(wait=True)
    cache.apply_completions(done)
    before = snapshot(cache)
    with pytest.raises(DuplicateAck) as caught:
        cache.apply_completions(done)
    ticket = done[0].ticket.id
    assert str(caught.value) == (
        f"ticket {ticket}: ack refused in not in flight:"
        " a duplicate or stray acknowledgement; nothing was applied"
    )
    assert snapshot(cache) == before


def test_14_a_completion_listed_twice_applies_neither() -> None:
    cache = make()
    cache.insert([1, 2])
    done = cache.transfers.collect(wait=True)
    with pytest.raises(DuplicateAck):
        cache.apply_completions([done[0], done[0]])
    assert cache.issued() == [done[0].ticket.id]
    cache.apply_completions(done)
    assert settled(cache) == [(1, "backed/resident (pins=0, locks=0)")]


def test_14_a_poll_refused_for_a_stray_acknowledgement_keeps_the_other_copies() -> None:
    """A poll whose engine reports a copy applied by hand refused the batch and lost the rest.

    The copy engine reports each copy once; the poll took copy 1 (applied
    already with ``apply_completions``) and copy 2 from it, refused both, and
    copy 2's node stayed ``writing`` for good, through ``close()`` too.
    """
    cache = make()
    cache.insert([1, 2])
    (first,) = cache.tiers.copier.in_flight()
    cache.apply_completions([Completion(first)])  # by hand: the engine still reports it
    cache.insert([5, 6])
    before = snapshot(cache)
    with pytest.raises(DuplicateAck) as caught:
        cache.poll()
    assert str(caught.value) == (
        f"ticket {first.id}: ack refused in not in flight:"
        " a duplicate or stray acknowledgement; nothing was applied"
    )
    assert snapshot(cache) == before
    assert cache.poll() == 1  # copy 2, held back for the next poll; the stray one is gone
    assert settled(cache) == [
        (1, "backed/resident (pins=0, locks=0)"),
        (2, "backed/resident (pins=0, locks=0)"),
    ]


def test_a_log_with_a_poll_refused_for_a_stray_acknowledgement_replays() -> None:
    """The refused poll applied nothing and logged no batch: the replay's took the next one.

    It was refused on replay with ``poll was refused in the recording, not
    on replay``: its copies, held back, were the next poll's batch.
    """
    cache = make()
    cache.insert([1, 2])
    (first,) = cache.tiers.copier.in_flight()
    cache.apply_completions([Completion(first)])
    cache.insert([5, 6])
    with pytest.raises(DuplicateAck):
        cache.poll()
    cache.poll()
    cache.insert([1, 2, 3, 4])
    cache.poll()
    replayed = replay(cache.log, cache.config)
    assert snapshot(replayed) == snapshot(cache)
    assert replayed.log.transitions() == cache.log.transitions()


@pytest.mark.parametrize("kind", ["another cache's", "built by hand"])
def test_a_completion_of_another_copy_under_the_same_id_applies_nothing(kind: str) -> None:
    """Every copy engine numbers its tickets from 1: an id alone does not name this copy."""
    cache, other = make(FaultyCopyEngine.copier(delay=3)), make()
    cache.insert([1, 2])
    other.insert([7, 8])
    (mine,) = cache.issued()
    if kind == "built by hand":
        wrong = [Completion(Ticket(mine, Direction.H2D, (0,), (0,)))]
    else:
        wrong = other.transfers.collect(wait=True)
    assert wrong[0].ticket.id == mine
    before = snapshot(cache)
    with pytest.raises(DuplicateAck) as caught:
        cache.apply_completions(wrong)
    assert str(caught.value) == (
        f"ticket {mine}: ack refused in flight: the completion's ticket is not the copy this"
        " cache started under that id (another cache's, or one built by hand); nothing was"
        " applied"
    )
    assert snapshot(cache) == before
    cache.apply_completions(cache.transfers.collect(wait=True))
    assert settled(cache) == [(1, "backed/resident (pins=0, locks=0)")]


@pytest.mark.parametrize("event", ["evict_device", "evict_host", "write", "lock", "load_done"])
def test_fire_refuses_a_namespace_root(event: str) -> None:
    """A root stands for the empty prefix: evicted, every node under it would be unlockable."""
    cache = make()
    cache.insert([1, 2])
    root = cache.match_prefix([9, 9]).last_device_node
    before = snapshot(cache)
    with pytest.raises(BadArgument) as caught:
        cache.fire(event, root)  # type: ignore[call-overload]
    assert str(caught.value) == (
        f"fire: node 0 is a namespace root, resident for good; {event} is for the nodes under it"
    )
    assert snapshot(cache) == before
    with cache.lock(cache.match_prefix([1, 2]).last_device_node):
        pass


def test_pin_refuses_a_namespace_root_and_lock_takes_it() -> None:
    """A pin of a root held no host page and counted in no figure; a lock is a zero-length hit's."""
    cache = make()
    cache.insert([1, 2])
    root = cache.match_prefix([9, 9]).last_device_node
    before = snapshot(cache)
    with pytest.raises(BadArgument) as caught:
        cache.pin(root)
    assert str(caught.value) == (
        "pin: node 0 is a namespace root, resident for good; pin is for the nodes under it"
    )
    assert snapshot(cache) == before
    assert cache.stats().pins == 0
    with cache.lock(root):
        assert cache.stats().locks == 1  # SGLang locks the root on a zero-length hit: counted
    assert snapshot(cache) == before


@pytest.mark.parametrize("event", ["write_done", "write_failed"])
def test_fire_refuses_the_acknowledgement_of_a_copy_in_flight(event: str) -> None:
    cache = make(FaultyCopyEngine.copier(delay=3))
    cache.insert([1, 2])
    node = cache.match_prefix([1, 2]).last_device_node
    before = snapshot(cache)
    with pytest.raises(BadArgument) as caught:
        cache.fire(event, node)  # type: ignore[call-overload]
    assert str(caught.value) == (
        f"fire: {event} acknowledges node {node.id}'s copy, which is in flight: the copy's own"
        " acknowledgement fires it (poll or apply_completions)"
    )
    assert snapshot(cache) == before
    cache.apply_completions(cache.transfers.collect(wait=True))
    assert settled(cache) == [(1, "backed/resident (pins=0, locks=0)")]
    with pytest.raises(DuplicateAck):  # no copy in flight: the spec's own refusal
        cache.fire("write_done", node)


# -- 21: close -----------------------------------------------------------------


def test_21_close_waits_for_every_copy_and_refuses_later_calls() -> None:
    with make(FaultyCopyEngine.copier(delay=5)) as cache:
        cache.insert([1, 2])
        assert cache.issued()
    assert cache.issued() == []
    assert settled(cache) == [(1, "backed/resident (pins=0, locks=0)")]
    with pytest.raises(CacheClosed) as caught:
        cache.match_prefix([1, 2])
    assert str(caught.value) == "match_prefix: the cache was closed"
    cache.close()  # idempotent


# -- 10: the event log ---------------------------------------------------------


def test_10_the_event_log_is_bounded_by_the_config() -> None:
    cache = make(log_limit=50)
    for i in range(200):
        cache.match_prefix([i, i + 1])
    assert len(cache.log.entries) == 50
    assert cache.log.dropped == cache.log.recorded - 50 > 0
    assert not cache.log.complete
    cache.reset()
    assert cache.log.limit == 50
    assert CacheConfig().log_limit == 100_000


def test_15_a_cache_of_something_that_is_no_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        HiCache({"device_pages": 4})  # type: ignore[arg-type]
    assert str(caught.value) == "config: expected a CacheConfig, got dict"
    with pytest.raises(ConfigError) as caught:
        HiCache(CacheConfig(device="cpu"), acks=3)  # type: ignore[arg-type]
    assert str(caught.value) == "config: acks must build an acknowledgement source, got 3"


# -- page numbers the argument check takes as ints ------------------------------


@pytest.mark.parametrize(
    ("given", "culprit"),
    [([False, True], "slots[0] is False"), ([0, True], "slots[1] is True")],
)
def test_slots_given_as_bools_are_refused_and_change_nothing(
    given: list[bool], culprit: str
) -> None:
    """A bool equals page 0 or 1 but is no slot: a BadArgument, as among token ids.

    The log keeps a refused call's slots as given, so the refusal replays: packed,
    a bool is page 0 or 1, which the pool would take.
    """
    config = CacheConfig(page_size=1, device_pages=8, host_pages=8)
    cache = HiCache(config)
    cache.alloc_slots(2)  # slots 0 and 1
    before = snapshot(cache), cache.tiers.device.allocator.free_list
    logged = len(cache.log.entries)
    for name, call in (
        ("free_slots", lambda: cache.free_slots(given)),
        ("insert", lambda: cache.insert([5, 6], given)),
    ):
        with pytest.raises(NotASlot) as caught:  # the pool's check of every slot it reads
            call()
        assert isinstance(caught.value, BadArgument)  # as the docs promise
        assert str(caught.value) == f"{name}: {culprit}, not an int"
    assert (snapshot(cache), cache.tiers.device.allocator.free_list) == before
    assert [entry[:2] for entry in cache.log.entries[logged:]] == [
        ("op", "free_slots"),
        ("refused", "free_slots"),
        ("op", "insert"),
        ("refused", "insert"),
    ]
    assert snapshot(replay(cache.log, config)) == snapshot(cache)
    cache.free_slots([0, 1])  # still the request's
    cache.check_invariants()


@pytest.mark.parametrize("given", [[False, True], [0, True], [2, 3, False, 1]])
def test_slots_given_as_bools_are_refused_at_a_page_size_above_one(given: list[int]) -> None:
    """Slots become pages by division (``True // 2`` is 0): the pool never saw the bool."""
    config = CacheConfig(page_size=2, device_pages=4, host_pages=4)
    cache = HiCache(config)
    assert cache.alloc_slots(4) == [0, 1, 2, 3]
    before = snapshot(cache), cache.tiers.device.allocator.free_list
    at, culprit = next((i, slot) for i, slot in enumerate(given) if type(slot) is bool)
    with pytest.raises(NotASlot) as caught:
        cache.free_slots(given)
    assert str(caught.value) == f"free_slots: slots[{at}] is {culprit!r}, not an int"
    assert (snapshot(cache), cache.tiers.device.allocator.free_list) == before
    assert snapshot(replay(cache.log, config)) == snapshot(cache)
    cache.free_slots([0, 1, 2, 3])


BOOLS_AMONG_FAULTY_SLOTS: dict[str, tuple[Callable[[HiCache], object], str]] = {
    "not whole pages": (lambda c: c.free_slots([True] * 4), "free_slots: slots[0] is True"),
    "too few for a page": (lambda c: c.free_slots([4, True]), "free_slots: slots[1] is True"),
    "a free page first": (
        lambda c: c.free_slots([8, 9, 10, 11, False, True, 2, 3]),
        "free_slots: slots[4] is False",
    ),
    "a numpy array": (
        lambda c: c.free_slots(__import__("numpy").array([False, True, True, True])),
        "free_slots: slots[0] is False",
    ),
    "too few for the tokens": (
        lambda c: c.insert(list(range(8)), [0, 1, 2, True]),
        "insert: slots[3] is True",
    ),
    "a page given twice": (
        lambda c: c.insert(list(range(8)), [0, 1, 2, 3, 0, True, 2, 3]),
        "insert: slots[5] is True",
    ),
}


@pytest.mark.parametrize("case", list(BOOLS_AMONG_FAULTY_SLOTS))
def test_a_bool_among_slots_is_named_whatever_else_is_wrong(case: str) -> None:
    """docs/hicache.md: a bool among slots is BadArgument, though the slots fail other checks too.

    The pool refused them as ``ForeignSlot`` for the other fault, or for the
    bool with a message naming no position.
    """
    if case == "a numpy array":
        pytest.importorskip("numpy")
    config = CacheConfig(page_size=4, device_pages=4, host_pages=4)
    cache = HiCache(config)
    assert cache.alloc_slots(8) == list(range(8))  # pages 0 and 1
    before = snapshot(cache), cache.tiers.device.allocator.free_list
    call, message = BOOLS_AMONG_FAULTY_SLOTS[case]
    with pytest.raises(BadArgument) as caught:
        call(cache)
    assert (type(caught.value), str(caught.value)) == (NotASlot, f"{message}, not an int")
    assert (snapshot(cache), cache.tiers.device.allocator.free_list) == before
    assert snapshot(replay(cache.log, config)) == snapshot(cache)  # refused again on replay
    cache.free_slots(list(range(8)))
    cache.check_invariants()


def test_a_node_inserted_with_numpy_slots_can_be_evicted() -> None:
    np = pytest.importorskip("numpy")
    cache = HiCache(CacheConfig(page_size=1, device_pages=8, host_pages=0))
    slots = cache.alloc_slots(2)
    cache.insert([5, 6], [np.int64(s) for s in slots])  # accepted by the argument check
    assert cache.evict(2) == 2
    cache.insert(list(range(10, 18)))
    assert cache.tiers.device.allocator.free_pages == 0


@pytest.mark.parametrize("kind", ["numpy", "numpy, page 2"])
def test_slots_that_equal_pages_become_the_pages_themselves(kind: str) -> None:
    """A node keeps the pool's own page ints, so its write-through copy and its match work."""
    page = 2 if kind.endswith("page 2") else 1
    cache = HiCache(CacheConfig(page_size=page, device_pages=8, host_pages=8))
    held = cache.alloc_slots(2 * page)  # pages 0 and 1
    np = pytest.importorskip("numpy")
    given = [np.int64(s) for s in held]
    tokens = list(range(5, 5 + 2 * page))
    cache.insert(tokens, given)
    cache.poll()
    match = cache.match_prefix(tokens)
    node = match.last_device_node
    assert node.host == "backed"  # the write-through copy read the pages
    assert [type(p) for p in node.device_pages] == [int, int]
    assert list(match.device_pages) == [0, 1]
    cache.check_invariants()


def test_a_fault_among_numpy_slots_is_named_as_among_ints() -> None:
    np = pytest.importorskip("numpy")
    cache = HiCache(CacheConfig(page_size=1, device_pages=16, host_pages=0))
    held = cache.alloc_slots(6)
    given = [np.int64(s) for s in [*held[:-1], 8]]  # page 8 is free
    with pytest.raises(ForeignSlot) as caught:
        cache.insert(list(range(6)), given)
    assert str(caught.value) == (
        "insert: device page 8 is free; a request's slots come from alloc_slots"
    )


def test_token_ids_of_the_top_bit_get_their_kv() -> None:
    """Ids up to 2**64 - 1 pass the argument check; the cache writes their KV too."""
    cache = make()
    tokens = [2**64 - 1, 2**63, 2**63 - 1, 5]
    cache.insert(tokens)
    match = cache.match_prefix(tokens)
    assert match.device_len == 4
    assert_kv(cache, tokens, match)
    want = synthetic_kv(cache.tiers.device.layout, [2**64 - 1, 2**63])
    assert not torch.equal(want, synthetic_kv(cache.tiers.device.layout, [2**63 - 1, 5]))
    cache.check_invariants()


def test_a_kv_write_that_fails_gives_its_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make()
    cache.insert([1, 2])
    before = snapshot(cache)

    def refuse(pages: object, tokens: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(cache.tiers, "write_tokens", refuse)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.insert([1, 2, 3, 4, 5, 6])
    assert snapshot(cache) == before
    cache.check_invariants()


def test_the_same_short_request_as_numpy_scalars_folds_in_alike() -> None:
    np = pytest.importorskip("numpy")
    one = HiCache(CacheConfig(page_size=1, device_pages=8, host_pages=8))
    two = HiCache(CacheConfig(page_size=1, device_pages=8, host_pages=8))
    one.match_prefix([1, 2, 3])
    two.match_prefix([np.int64(1), np.int64(2), np.int64(3)])  # accepted by the check
    assert TransitionDigest(one.log).update() == TransitionDigest(two.log).update()


# -- what a public operation's spare guard keeps alive ---------------------------


class _Watched:
    """A namespace the test can watch (hashable by identity)."""


def test_reset_releases_the_old_log_and_what_it_recorded() -> None:
    cache = HiCache(CacheConfig(page_size=1, device_pages=8, host_pages=8))
    namespace = _Watched()
    cache.insert([1, 2], namespace=namespace)  # the log records the namespace
    cache.reset()
    watched = weakref.ref(namespace)
    del namespace
    gc.collect()
    assert watched() is None


def test_a_dropped_debug_cache_is_freed_without_the_cyclic_collector() -> None:
    """Nothing the cache holds refers back to it, so dropping it frees it at once.

    A compiled cache takes no weak reference (docs/architecture.md, compiled
    modules), so both kinds are first asked who refers to them.
    """
    gc.collect()
    gc.disable()
    try:
        cache = HiCache(CacheConfig(page_size=1, device_pages=8, host_pages=8, debug=True))
        cache.insert([1, 2])
        referrers = [r for r in gc.get_referrers(cache) if not isinstance(r, types.FrameType)]
        assert referrers == []
        if "fsm_cache.cache.hicache" not in native.compiled():
            watched = weakref.ref(cache)
            del cache
            assert watched() is None
    finally:
        gc.enable()
        gc.collect()


def test_fire_refuses_a_write_below_a_parent_with_no_host_copy() -> None:
    """backup() skips such a node (invariant 3); fire wrote it, and a later poll broke."""
    cache = make(write_policy="write_through_selective", selective_threshold=5)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 3, 4, 7, 8])  # the split leaves the parent [1..4] unbacked
    child = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_device_node
    parent = child.parent
    assert parent is not None
    assert (parent.host, child.host, cache.backup([child])) == ("unbacked", "unbacked", 0)
    before = snapshot(cache)
    with pytest.raises(BadArgument) as caught:
        cache.fire("write", child)
    assert str(caught.value) == (
        f"fire: write would back node {child.id} up before its parent, node {parent.id}, which"
        " holds no host copy (unbacked): under write_through_selective a parent is backed up"
        " first, and backup() leaves the node until then"
    )
    assert snapshot(cache) == before
    cache.poll()
    cache.check_invariants()


def test_a_write_no_eviction_can_make_room_for_evicts_nothing() -> None:
    """The write failed after the host copy of another prefix was evicted and its node deleted."""
    cache = make(host_pages=2, write_policy="write_through_selective", selective_threshold=5)
    cache.insert([1, 2])
    kept = cache.match_prefix([1, 2]).last_device_node
    cache.backup([kept])
    drain(cache)
    cache.evict(2)
    assert kept.residency() == "backed/absent (pins=0, locks=0)"
    big = [11, 12, 13, 14, 15, 16]  # three pages: never fits the two-page host pool
    cache.insert(big)
    node = cache.match_prefix(big).last_device_node
    before = snapshot(cache)
    with pytest.raises(EffectFailed) as caught:
        cache.fire("write", node)
    assert isinstance(caught.value.__cause__, PoolExhausted)
    assert snapshot(cache) == before
    assert cache.match_prefix([1, 2]).host_len == 2  # the host-only prefix is still cached


def test_write_through_of_a_request_larger_than_the_host_pool_keeps_the_host_tier() -> None:
    cache = make(host_pages=2, write_policy="write_through")
    cache.insert([1, 2])
    drain(cache)
    cache.evict(2)
    cache.insert([11, 12, 13, 14, 15, 16])  # its backup cannot fit: none starts, none evicted
    drain(cache)
    assert cache.match_prefix([1, 2]).host_len == 2
    cache.check_invariants()
