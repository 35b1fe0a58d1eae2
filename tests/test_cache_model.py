"""HiCache against a plain model, under every write policy, small pools and a faulty copier.

Hypothesis drives a :class:`~fsm_cache.cache.hicache.HiCache` the way a serving
engine does (inserts with and without request slots, lookups, locks and pins
taken from lookups, evictions, load-backs, polls, acknowledgements applied by
hand, resets) and feeds it bad input (wrong types, double releases, nodes that
are gone). Beside it runs a plain model: the token sequences inserted per
namespace, the leases held and what each guards, and the slots each request
holds. It knows nothing of the cache's internals.

After every step the test asserts what callers rely on: every lookup is
page-aligned, never claims more than was inserted, and its device pages hold
exactly the KV of the tokens it matched; no page is leaked or owned twice;
every lock and pin the model holds is in force, and none other; every node
copying has its copy in flight; and the design invariants hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fsm_cache.cache.hicache import HiCache, MatchResult
from fsm_cache.cache.transfers import IssuedCopies
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import ConfigError, CopyFailed, FsmCacheError, LeaseError, PoolExhausted
from fsm_cache.memory.pages import FREE, REQUEST
from fsm_cache.memory.tickets import Completion, Copier
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.residency import DEVICE_HELD, HOST_VALID
from fsm_cache.testing.faults import FaultyCopyEngine


PAGE = 2
# Sequences are built from a few page-sized words so that prefixes are shared often.
WORDS = [(1, 2), (3, 4), (5, 6), (7, 8)]
NAMESPACES: list[Hashable] = [None, "lora"]
Tokens = tuple[int, ...]

aligned_seqs = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(
    lambda ws: tuple(t for w in ws for t in w)
)
long_seqs = st.lists(st.sampled_from(WORDS), min_size=6, max_size=14).map(
    lambda ws: tuple(t for w in ws for t in w)
)
# a trailing token that does not fill a page is cut off by the cache
any_seqs = st.tuples(aligned_seqs, st.sampled_from([(), (9,)])).map(lambda p: p[0] + p[1])
namespaces = st.sampled_from(NAMESPACES)
indices = st.integers(0, 63)
actions = st.sampled_from(["none", "lock", "pin", "load_back"])


# -- the plain model ---------------------------------------------------------------


@dataclass
class Held:
    """A lease the model holds and what it guards."""

    lease: Lease
    node: TreeNode
    prefix: Tokens  # the tokens from the root through the node
    namespace: Hashable

    @property
    def kind(self) -> str:
        return self.lease.event


@dataclass
class Request:
    """Device slots a request holds (from alloc_slots), filled with the KV of its tokens."""

    tokens: Tokens
    namespace: Hashable
    slots: list[int]


@dataclass
class Model:
    """What a caller knows: what it inserted, what it holds, what it was handed."""

    inserted: dict[Hashable, set[Tokens]] = field(default_factory=dict)
    held: list[Held] = field(default_factory=list)
    released: list[Lease] = field(default_factory=list)  # released once, or voided by reset
    requests: list[Request] = field(default_factory=list)
    matches: list[tuple[MatchResult, Tokens, Hashable]] = field(default_factory=list)
    applied: list[Completion] = field(default_factory=list)  # applied, or dropped by reset

    def longest(self, tokens: Sequence[int], namespace: Hashable) -> int:
        """The longest page-aligned prefix of ``tokens`` that some insert covered."""
        return max((_common(tokens, s) for s in self.inserted.get(namespace, ())), default=0)

    def request_pages(self) -> int:
        return sum(len(r.slots) // PAGE for r in self.requests)

    def remember(self, result: MatchResult, tokens: Tokens, namespace: Hashable) -> None:
        self.matches.append((result, tokens, namespace))
        del self.matches[:-8]

    def note_released(self, lease: Lease) -> None:
        self.released.append(lease)
        del self.released[:-8]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % PAGE


def _aligned(tokens: Sequence[int]) -> Tokens:
    return tuple(tokens[: len(tokens) - len(tokens) % PAGE])


# -- reading the cache (public attributes only) --------------------------------------


def _prefix(node: TreeNode) -> Tokens:
    """The tokens from the root through ``node``."""
    parts: list[Tokens] = []
    walk: TreeNode | None = node
    while walk is not None:
        parts.append(walk.key)
        walk = walk.parent
    return tuple(t for part in reversed(parts) for t in part)


def _walk(cache: HiCache, key: Tokens, namespace: Hashable) -> list[tuple[TreeNode, int]]:
    """``(node, tokens of it matched)`` along ``key``, without splitting or touching anything."""
    node = cache.tree.roots.get(namespace)
    out: list[tuple[TreeNode, int]] = []
    pos = 0
    while node is not None and pos < len(key):
        child = node.children.get(key[pos : pos + PAGE])
        if child is None:
            break
        n = _common(child.key, key[pos:])
        out.append((child, n))
        pos += n
        if n < len(child.key):
            break
        node = child
    return out


def _in_tree(cache: HiCache, node: TreeNode) -> bool:
    if node.parent is None:
        return any(r is node for r in cache.tree.roots.values())
    return any(n is node for n in cache.tree)


def _fingerprint(cache: HiCache) -> tuple[object, ...]:
    """Everything a refused call must leave as it was (the event log and refusal counts aside)."""
    nodes = sorted(
        (
            n.id,
            n.key,
            -1 if n.parent is None else n.parent.id,
            n.host,
            n.device,
            n.pins,
            n.locks,
            n.device_pages,
            n.host_pages,
            n.hit_count,
        )
        for n in cache.tree
    )
    roots = sorted(
        (repr(ns), r.locks, r.pins) for ns, r in cache.tree.roots.items() if r.children or r.locks
    )
    stats = cache.stats()
    return (
        nodes,
        roots,
        _pools(cache),
        tuple(cache.issued()),
        tuple(t.id for t in cache.tiers.copier.in_flight()),
        cache.transfers.queued(),
        sorted(cache.evictor.waiting()),
        stats.transitions,
        stats.copies_in_flight,
    )


def _pools(cache: HiCache) -> tuple[object, ...]:
    out: list[object] = []
    for pool in (cache.tiers.device, cache.tiers.host):
        alloc = pool.allocator
        out.append((sorted(alloc.free_list), alloc.owners))
    return tuple(out)


def _page_view(cache: HiCache) -> tuple[object, ...]:
    """The cache page by page, blind to radix splits (which a refused insert may leave)."""
    names = {id(r): repr(ns) for ns, r in cache.tree.roots.items()}
    pages = []
    for n in cache.tree:
        root = n
        while root.parent is not None:
            root = root.parent
        before = _prefix(n)[: -len(n.key)]
        host = "backed" if n.host == "pinned" else n.host
        for j in range(len(n.key) // PAGE):
            pages.append(
                (
                    names.get(id(root)),
                    before + n.key[: (j + 1) * PAGE],
                    host,
                    n.device,
                    n.device_pages[j] if n.device_pages else None,
                    n.host_pages[j] if n.host_pages else None,
                    n.locks,
                )
            )

    def kinds(owners: Sequence[int]) -> tuple[str, ...]:
        return tuple("free" if o == FREE else "request" if o == REQUEST else "node" for o in owners)

    return (
        sorted(pages, key=repr),
        tuple(
            (sorted(p.allocator.free_list), kinds(p.allocator.owners))
            for p in (cache.tiers.device, cache.tiers.host)
        ),
        tuple(cache.issued()),
        cache.transfers.queued(),
    )


class HeldAcks:
    """Where the cache reads finished copies: held back until the test lets them through.

    As a tensor-parallel group's agreement does, it takes completions from the
    copy engine and keeps them (:attr:`held`) for the test to apply by hand in
    any order; a poll gets whatever is held, and a wait gets everything.
    """

    def __init__(self, copier: Copier, copies: IssuedCopies) -> None:
        self.copier = copier
        self.copies = copies
        self.held: list[Completion] = []

    def take(self) -> None:
        """Take what the engine reports finished, to hold."""
        self.held.extend(self.copier.poll())

    def collect(self, wait: bool) -> list[Completion]:
        out, self.held = self.held, []
        if not wait:
            return out + self.copier.poll()
        out += self.copier.drain()
        order = {ident: i for i, ident in enumerate(self.copies.issued())}
        return sorted(out, key=lambda c: order.get(c.ticket.id, len(order)))


@dataclass(frozen=True)
class Holdings:
    """Which pages of which prefixes each tier holds: ``(namespace, tokens through the page)``."""

    device: frozenset[tuple[str, Tokens]]
    loading: frozenset[tuple[str, Tokens]]
    host: frozenset[tuple[str, Tokens]]


def _holdings(cache: HiCache) -> Holdings:
    names = {id(r): repr(ns) for ns, r in cache.tree.roots.items()}
    device, loading, host = set(), set(), set()
    for n in cache.tree:
        root = n
        while root.parent is not None:
            root = root.parent
        full = _prefix(n)
        start = len(full) - len(n.key)
        for end in range(start + PAGE, len(full) + 1, PAGE):
            page = (names.get(id(root), "?"), full[:end])
            if n.device in DEVICE_HELD:
                device.add(page)
            if n.device == "loading":
                loading.add(page)
            if n.host in HOST_VALID:
                host.add(page)
    return Holdings(frozenset(device), frozenset(loading), frozenset(host))


# -- bad input -----------------------------------------------------------------------

BAD_TOKENS: list[object] = [
    None,
    "abcd",
    [1.5, 2.5],
    [[1, 2], [3, 4]],
    7,
    torch.tensor([1.0, 2.0]),
    torch.tensor([[1, 2], [3, 4]]),
]
BAD_COUNTS: list[object] = [None, "3", 2.5, [2], torch.tensor([1.0])]
BAD_SLOTS: list[object] = ["abcd", [0.0, 1.0, 2.0, 3.0], [[0, 1], [2, 3]], 7]
BAD_NODES: list[object] = [None, "node", 3, 2.5, [1]]
BAD_ACKS: list[object] = [None, "ack", [None], [1], 3]
BAD_CALLS: list[tuple[str, object]] = (
    [("insert", v) for v in BAD_TOKENS]
    + [("insert_namespace", [1])]
    + [("match_prefix", v) for v in BAD_TOKENS]
    + [("match_namespace", [1])]
    + [("insert_slots", v) for v in BAD_SLOTS]
    + [("evict", v) for v in BAD_COUNTS]
    + [("evict_host", v) for v in BAD_COUNTS]
    + [("alloc_slots", v) for v in BAD_COUNTS]
    + [("free_slots", v) for v in [None, "ab", [0.0, 1.0], 3, [[0, 1]]]]
    + [(op, v) for op in ("lock", "pin", "load_back") for v in BAD_NODES]
    + [("unlock", v) for v in [None, "lock", 3]]
    + [("apply_completions", v) for v in BAD_ACKS]
)


def _call_bad(cache: HiCache, op: str, value: Any) -> None:
    if op == "insert":
        cache.insert(value)
    elif op == "insert_namespace":
        cache.insert([1, 2], namespace=value)
    elif op == "match_prefix":
        cache.match_prefix(value)
    elif op == "match_namespace":
        cache.match_prefix([1, 2], namespace=value)
    elif op == "insert_slots":
        cache.insert([1, 2, 3, 4], device_slots=value)
    elif op == "free_slots":
        cache.free_slots(value)
    elif op == "apply_completions":
        cache.apply_completions(value)
    else:
        getattr(cache, op)(value)


# -- the machine ---------------------------------------------------------------------


class ModelMachine(RuleBasedStateMachine):
    """HiCache and the plain model, stepped together."""

    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.cache: HiCache
        self.source: HeldAcks

    # -- setup ---------------------------------------------------------------

    @initialize(
        device_pages=st.sampled_from([8, 6, 10, 12]),
        host_pages=st.sampled_from([8, 16, 4, 12, 2, 0]),
        fail=st.frozensets(st.integers(1, 40), max_size=4),
        refuse=st.frozensets(st.integers(1, 40), max_size=3),
        delay=st.integers(0, 2),
        shuffle=st.booleans(),
        seed=st.integers(0, 1000),
    )
    def build(
        self,
        *,
        device_pages: int,
        host_pages: int,
        fail: frozenset[int],
        refuse: frozenset[int],
        delay: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        def config(host: int) -> CacheConfig:
            return CacheConfig(
                device_pages=device_pages,
                host_pages=host,
                page_size=PAGE,
                layers=1,
                heads=1,
                head_dim=2,
                write_policy=self.policy,
                selective_threshold=2,
                load_back_threshold=2,
                debug=True,
                copier=FaultyCopyEngine.copier(
                    fail=fail, refuse=refuse, delay=delay, shuffle=shuffle, seed=seed
                ),
            )

        def acks(copier: Copier, copies: IssuedCopies) -> HeldAcks:
            self.source = HeldAcks(copier, copies)
            return self.source

        try:
            self.cache = HiCache(config(host_pages), acks=acks)
        except ConfigError:  # a configuration may refuse a policy with no host tier
            self.cache = HiCache(config(max(host_pages, 1)), acks=acks)

    # -- what the model may assert about memory ------------------------------

    @property
    def device_only(self) -> bool:
        return self.cache.tiers.host.num_pages == 0

    @property
    def evicts_without_host(self) -> bool:
        """Whether an unlocked device leaf can always be evicted without host room."""
        return self.policy != "write_back" or self.device_only

    def _locked_nodes(self) -> dict[int, TreeNode]:
        """Nodes the model's locks hold on the device, and their ancestors."""
        stuck = [h.node for h in self.model.held if h.kind == "lock"]
        out: dict[int, TreeNode] = {}
        for node in stuck:
            walk: TreeNode | None = node
            while walk is not None and walk.parent is not None:
                if walk.device in DEVICE_HELD:
                    out[id(walk)] = walk
                walk = walk.parent
        return out

    def _kept_pages(self, key: Tokens, namespace: Hashable | None, keep: bool) -> int:
        """Device pages no eviction may free: stuck paths and (``keep``) the key's own path."""
        locked = self._locked_nodes()
        pages = {i: len(n.key) // PAGE for i, n in locked.items()}
        if keep:
            for node, n in _walk(self.cache, key, namespace):
                if node.device not in DEVICE_HELD:
                    break
                pages[id(node)] = max(pages.get(id(node), 0), n // PAGE)
        return sum(pages.values())

    def _needed_pages(self, key: Tokens, namespace: Hashable) -> int:
        held = 0
        for node, n in _walk(self.cache, key, namespace):
            if node.device not in DEVICE_HELD:
                break
            held += n
        return (len(key) - held) // PAGE

    def _check_refused_allocation(self, needed: int, keep: int, before: Holdings) -> None:
        """An allocation refused: it could not have fit, and one that never fits evicted nothing.

        (Copies it waited for may have been applied meanwhile: a load that failed
        leaves the device, a write that finished holds the host copy.)
        """
        total = self.cache.tiers.device.num_pages
        if needed > total:
            after = _holdings(self.cache)
            lost = (before.device - after.device - before.loading) | (before.host - after.host)
            assert not lost, (
                f"an allocation of {needed} pages can never fit in {total}, "
                f"yet it evicted {sorted(lost, key=repr)} before refusing"
            )
        if self.evicts_without_host:
            room = total - self.model.request_pages() - keep
            assert needed > room, (
                f"PoolExhausted for {needed} pages, but {room} pages are evictable or free "
                f"({total} pages, {self.model.request_pages()} held by requests, {keep} kept)"
            )

    # -- inserts -------------------------------------------------------------

    @rule(data=st.data(), namespace=namespaces, as_tensor=st.booleans())
    def insert(self, data: st.DataObject, namespace: Hashable, as_tensor: bool) -> None:
        self._insert(self._draw_seq(data, namespace, any_seqs), namespace, as_tensor)

    @rule(data=st.data(), namespace=namespaces)
    def serve(self, data: st.DataObject, namespace: Hashable) -> None:
        """One request as a scheduler runs it: look up, load back the host hit, insert, read."""
        seq = self._draw_seq(data, namespace, any_seqs)
        result = self.cache.match_prefix(seq, namespace)
        self._check_match(result, seq, namespace)
        if result.host_len:
            self._load_back(result.last_host_node)
        self._insert(seq, namespace, as_tensor=False)
        self._check_match(self.cache.match_prefix(seq, namespace), seq, namespace)

    def _insert(self, seq: Tokens, namespace: Hashable, as_tensor: bool) -> None:
        key = _aligned(seq)
        known = self.model.longest(key, namespace)
        needed = self._needed_pages(key, namespace)
        keep = self._kept_pages(key, namespace, keep=True)
        before = _holdings(self.cache)
        loading = self._loading_on(key, namespace)
        tokens: Any = torch.tensor(seq, dtype=torch.int64) if as_tensor else list(seq)
        try:
            cached = self.cache.insert(tokens, namespace=namespace)
        except PoolExhausted:
            self._check_refused_allocation(needed, keep, before)
            return
        except CopyFailed:
            assert loading, "insert raised CopyFailed, yet nothing on its path was loading"
            return
        assert cached % PAGE == 0, cached
        assert 0 <= cached <= len(key), (cached, key)
        assert cached <= known, f"insert says {cached} tokens were cached; {known} ever were"
        if key:
            self.model.inserted.setdefault(namespace, set()).add(key)
        self._check_on_device(key, namespace)

    def _loading_on(self, key: Tokens, namespace: Hashable) -> bool:
        return any(node.device == "loading" for node, _ in _walk(self.cache, key, namespace))

    def _check_on_device(self, key: Tokens, namespace: Hashable) -> None:
        """Right after an insert, the whole key is in the tree and on the device."""
        path = _walk(self.cache, key, namespace)
        assert sum(n for _, n in path) == len(key), f"{key} not in the tree after its insert"
        off = [node for node, _ in path if node.device not in DEVICE_HELD]
        assert not off, f"{key} inserted, but {off} are not on the device"

    @rule(data=st.data(), namespace=namespaces)
    def alloc_request(self, data: st.DataObject, namespace: Hashable) -> None:
        seq = self._draw_seq(data, namespace, aligned_seqs)
        needed = len(seq) // PAGE
        keep = self._kept_pages(seq, namespace, keep=False)
        before = _holdings(self.cache)
        try:
            slots = self.cache.alloc_slots(len(seq))
        except PoolExhausted:
            self._check_refused_allocation(needed, keep, before)
            return
        assert len(slots) == len(seq), (len(slots), seq)
        pages = sorted({s // PAGE for s in slots})
        assert len(pages) * PAGE == len(slots)
        owners = self.cache.tiers.device.allocator.owners
        assert all(owners[p] == REQUEST for p in pages)
        # the request's forward pass writes the KV of its tokens into its slots
        self.cache.tiers.device.write(
            [s // PAGE for s in slots[::PAGE]], synthetic_kv(self.cache.tiers.device.layout, seq)
        )
        self.model.requests.append(Request(seq, namespace, slots))

    @precondition(lambda self: self.model.requests)
    @rule(i=indices)
    def insert_request(self, i: int) -> None:
        req = self.model.requests.pop(i % len(self.model.requests))
        known = self.model.longest(req.tokens, req.namespace)
        loading = self._loading_on(req.tokens, req.namespace)
        try:
            cached = self.cache.insert(req.tokens, req.slots, req.namespace)
        except CopyFailed:
            assert loading, "insert raised CopyFailed, yet nothing on its path was loading"
            owners = self.cache.tiers.device.allocator.owners
            assert all(owners[s // PAGE] == REQUEST for s in req.slots), (
                "a refused insert took slots"
            )
            self.model.requests.append(req)
            return
        assert cached % PAGE == 0, cached
        assert 0 <= cached <= known, f"insert says {cached} tokens were cached; {known} ever were"
        self.model.inserted.setdefault(req.namespace, set()).add(req.tokens)
        # SGLang: the slots of the part already cached are the request's to free, the rest
        # now belong to the cache
        mine = req.slots[:cached]
        try:
            self.cache.free_slots(mine)
        except FsmCacheError as exc:
            raise AssertionError(
                f"insert returned {cached}, but freeing slots[:{cached}] is refused: {exc}"
            ) from exc
        owners = self.cache.tiers.device.allocator.owners
        kept = [s // PAGE for s in req.slots[cached::PAGE] if owners[s // PAGE] in (FREE, REQUEST)]
        assert not kept, (
            f"insert returned {cached}: slots[{cached}:] should now be the cache's, "
            f"but pages {kept} are not"
        )
        self._check_on_device(req.tokens, req.namespace)

    @precondition(lambda self: self.model.requests)
    @rule(i=indices)
    def abort_request(self, i: int) -> None:
        req = self.model.requests.pop(i % len(self.model.requests))
        self.cache.free_slots(req.slots)
        self._refused(lambda: self.cache.free_slots(req.slots), "free_slots twice")

    # -- lookups -------------------------------------------------------------

    @rule(data=st.data(), namespace=namespaces, as_tensor=st.booleans(), then=actions)
    def match(self, data: st.DataObject, namespace: Hashable, as_tensor: bool, then: str) -> None:
        """A lookup, then what a scheduler does with it: lock, pin or load back what it found."""
        seq = self._draw_seq(data, namespace, any_seqs)
        result = self.cache.match_prefix(list(seq), namespace)
        self._check_match(result, seq, namespace)
        if as_tensor:
            tensor: Any = torch.tensor(seq, dtype=torch.int64)
            again = self.cache.match_prefix(tensor, namespace)
            self._check_match(again, seq, namespace)
            assert (again.device_len, again.host_len) == (result.device_len, result.host_len), (
                f"tokens as a tensor matched {again.device_len}+{again.host_len}, "
                f"as a list {result.device_len}+{result.host_len}"
            )
        self.model.remember(result, seq, namespace)
        self._act(result, namespace, then)

    @precondition(lambda self: self.model.matches)
    @rule(i=indices, then=actions)
    def use_old_match(self, i: int, then: str) -> None:
        """Act on an earlier lookup, whose nodes may since have been evicted, deleted or reset."""
        result, _, namespace = self.model.matches[i % len(self.model.matches)]
        self._act(result, namespace, then)

    def _draw_seq(
        self, data: st.DataObject, namespace: Hashable, fresh: st.SearchStrategy[Tokens]
    ) -> Tokens:
        """A new sequence, or one inserted before, cut short or carried on by a word."""
        known = sorted(self.model.inserted.get(namespace, ()))
        kind = data.draw(st.sampled_from(["known", "known", "known", "new", "long"]))
        if kind == "long":  # as long as the device pool, or longer: it may never fit
            return data.draw(long_seqs)
        if not known or kind == "new":
            return data.draw(fresh)
        base = data.draw(st.sampled_from(known))
        cut = data.draw(st.integers(1, len(base) // PAGE)) * PAGE
        more = data.draw(st.sampled_from([(), *WORDS]))
        return base[:cut] + more

    def _check_match(self, result: MatchResult, seq: Tokens, namespace: Hashable) -> None:
        key = _aligned(seq)
        d, h = result.device_len, result.host_len
        assert d % PAGE == 0, d
        assert h % PAGE == 0, h
        assert d + h <= self.model.longest(key, namespace), (
            f"matched {d}+{h} of {seq}; at most {self.model.longest(key, namespace)} were inserted"
        )
        assert len(result.device_pages) * PAGE == d, (d, result.device_pages)
        layout = self.cache.tiers.device.layout
        if d:
            got = self.cache.tiers.read_device(list(result.device_pages))
            want = synthetic_kv(layout, key[:d])
            same = torch.equal(got, want)
            assert same, (
                f"device pages {result.device_pages} of the match of {seq} do not hold "
                f"the KV of its first {d} tokens"
            )
        # every prefix a lease guards is still in the tree
        for held in self.model.held:
            if held.namespace == namespace and key[: len(held.prefix)] == held.prefix:
                assert d + h >= len(held.prefix), (
                    f"{held.kind} on {held.prefix} held, yet a match of {seq} found only {d}+{h}"
                )

    # -- locks, pins and load-backs of what a lookup found --------------------

    def _act(self, result: MatchResult, namespace: Hashable, then: str) -> None:
        if then == "lock":
            self._lock(result.last_device_node, namespace)
        elif then == "pin":
            self._pin(result.last_host_node, namespace)
        elif then == "load_back":
            self._load_back(result.last_host_node)

    def _lock(self, node: TreeNode, namespace: Hashable) -> None:
        if _in_tree(self.cache, node) and node.device in DEVICE_HELD:
            lease = self.cache.lock(node)
            self.model.held.append(Held(lease, node, _prefix(node), namespace))
        else:
            self._refused(lambda: self.cache.lock(node), f"lock of {node!r}")

    def _pin(self, node: TreeNode, namespace: Hashable) -> None:
        if node.parent is None:
            return
        # a copy still being written may be pinned too: the pin holds it once it lands (issue 14)
        if _in_tree(self.cache, node) and (node.host in HOST_VALID or node.host == "writing"):
            lease = self.cache.pin(node)
            self.model.held.append(Held(lease, node, _prefix(node), namespace))
        else:
            self._refused(lambda: self.cache.pin(node), f"pin of {node!r}")

    def _load_back(self, node: TreeNode) -> None:
        if not _in_tree(self.cache, node):
            self._refused(lambda: self.cache.load_back(node), f"load_back of {node!r}, gone")
            return
        chain_pages = 0
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and walk.device == "absent":
            chain_pages += len(walk.key) // PAGE
            walk = walk.parent
        # a chain under a node still loading waits for that load, which may fail
        under_load = walk is not None and walk.device == "loading"
        free = self.cache.tiers.device.allocator.free_pages
        failed = self.cache.stats().transitions.get("load_failed", 0)
        loading = self.cache.load_back(node)
        if loading is None:
            # a copy the engine refused to start fails its loads at once: host-only again
            refused = self.cache.stats().transitions.get("load_failed", 0) > failed
            assert chain_pages == 0 or chain_pages > free or under_load or refused, (
                f"load_back of {chain_pages} pages refused with {free} pages free"
            )
            assert not refused or not _in_tree(self.cache, node) or node.device == "absent"
            return
        assert loading, loading
        assert loading[-1] is node, loading
        if not under_load:  # else the load it waited for may have failed, and starts again
            assert sum(len(n.key) for n in loading) == chain_pages * PAGE, loading
        # what it returns is loading: a refused start returns None (above)
        states = {n.device for n in loading}
        assert states == {"loading"}, states

    @precondition(lambda self: self.model.held)
    @rule(i=indices, by_unlock=st.booleans())
    def give_back(self, i: int, by_unlock: bool) -> None:
        held = self.model.held.pop(i % len(self.model.held))
        if held.kind == "lock" and by_unlock:
            self.cache.unlock(held.lease)
        else:
            if held.kind == "pin" and by_unlock:
                self._refused(lambda: self.cache.unlock(held.lease), "unlock of a pin receipt")
            held.lease.release()
        self.model.note_released(held.lease)
        self._refused(held.lease.release, "a second release", LeaseError)

    # -- memory pressure -----------------------------------------------------

    @rule(n=st.integers(0, 12), host=st.booleans(), quiet=st.booleans())
    def evict(self, n: int, host: bool, quiet: bool) -> None:
        """Evict from one tier; ``quiet``: once every copy has finished (backups are valid)."""
        if quiet:
            self._settle()
        if host:
            self._evict_host(n)
            return
        alloc = self.cache.tiers.device.allocator
        before = alloc.free_slots
        freed = self.cache.evict(n)
        assert freed >= 0
        assert alloc.free_slots - before == freed, (
            f"evict({n}) says {freed} tokens freed; {alloc.free_slots - before} slots were"
        )
        if freed < n and self.evicts_without_host:
            left = [
                x
                for x in self.cache.tree
                if x.device == "resident"
                and x.locks == 0
                and x.host != "writing"
                and not any(c.device in DEVICE_HELD for c in x.children.values())
            ]
            assert not left, f"evict({n}) freed {freed} and left evictable leaves {left}"

    def _evict_host(self, n: int) -> None:
        alloc = self.cache.tiers.host.allocator
        before = alloc.free_slots
        freed = self.cache.evict_host(n)
        assert freed >= 0
        assert alloc.free_slots - before == freed, (
            f"evict_host({n}) says {freed} tokens freed; {alloc.free_slots - before} slots were"
        )

    # -- copies --------------------------------------------------------------

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @rule(data=st.data(), kind=st.sampled_from(["acks", "acks", "settle", "reset"]))
    def copies(self, data: st.DataObject, kind: str) -> None:
        """Finished copies are applied by hand, waited for, or dropped by a reset."""
        if kind == "acks":
            self._acks(data)
        elif kind == "settle":
            self._settle()
        else:
            self._reset()

    def _acks(self, data: st.DataObject) -> None:
        """Take finished copies from the engine and apply some, in any order."""
        self.source.take()
        acks = self.source.held
        if not acks:
            return
        chosen = data.draw(st.permutations(range(len(acks))))
        chosen = chosen[: data.draw(st.integers(0, len(acks)))]
        completions = [acks[j] for j in chosen]
        self.source.held = [a for j, a in enumerate(acks) if j not in chosen]
        assert self.cache.apply_completions(completions) == len(completions)
        self.model.applied.extend(completions)
        del self.model.applied[:-8]

    def _settle(self) -> None:
        """Apply every acknowledgement until no copy is left: then nothing is in between."""
        for _ in range(40):  # a poll also starts the copies a refused start left queued
            if self.cache.transfers.idle():
                break
            self.cache.poll()
        assert self.cache.transfers.idle(), "copies still in flight or queued after 40 polls"
        busy = [n for n in self.cache.tree if n.host == "writing" or n.device == "loading"]
        assert not busy, f"no copy in flight, yet {busy} are copying"
        self._check_all_kv()

    # -- reset and bad input -------------------------------------------------

    def _reset(self) -> None:
        stale = list(self.source.held)
        self.cache.reset()
        self.source.held = []
        for held in self.model.held:
            self.model.note_released(held.lease)
        self.model.held = []
        self.model.requests = []
        self.model.inserted = {}
        self.model.applied = (self.model.applied + stale)[-8:]
        # matches stay: their nodes are from before the reset, which nothing may accept

    @rule(data=st.data(), kind=st.sampled_from(["call", "slots", "release", "ack"]))
    def misuse(self, data: st.DataObject, kind: str) -> None:
        """Bad input: each is refused with a typed error and changes nothing."""
        if kind == "call":
            op, value = data.draw(st.sampled_from(BAD_CALLS))
            self._refused(lambda: _call_bad(self.cache, op, value), f"{op}({value!r})")
        elif kind == "slots" and self.model.requests:
            req = data.draw(st.sampled_from(self.model.requests))
            self._refused(
                lambda: self.cache.insert(req.tokens, req.slots[:-PAGE], req.namespace),
                "insert with fewer slots than tokens",
            )
        elif kind == "release" and self.model.released:
            lease = data.draw(st.sampled_from(self.model.released))
            if lease.event == "lock":
                self._refused(lambda: self.cache.unlock(lease), "a repeated unlock", LeaseError)
            else:
                self._refused(lease.release, "a repeated release", LeaseError)
        elif kind == "ack" and self.model.applied:
            ack = data.draw(st.sampled_from(self.model.applied))
            self._refused(lambda: self.cache.apply_completions([ack]), "a repeated acknowledgement")

    def _refused(
        self,
        call: Callable[[], object],
        what: str,
        kind: type[FsmCacheError] = FsmCacheError,
    ) -> None:
        """``call`` must raise ``kind`` and change nothing."""
        before = _fingerprint(self.cache)
        view = _page_view(self.cache)
        try:
            call()
        except kind:
            pass
        except Exception as exc:
            raise AssertionError(
                f"{what} raised {type(exc).__name__}: {exc}, not an {kind.__name__}"
            ) from exc
        else:
            raise AssertionError(f"{what} was accepted; it must raise {kind.__name__}")
        if what.startswith("insert"):  # an insert may split a node at a page boundary
            assert _page_view(self.cache) == view, f"refused {what} changed the cache"
        else:
            assert _fingerprint(self.cache) == before, f"refused {what} changed the cache"

    # -- after every step ----------------------------------------------------

    @invariant()
    def design_invariants(self) -> None:
        self.cache.check_invariants()
        # Every operation starts the copies it queued. Only a copy the engine refused to start
        # waits for the next operation's flush: its nodes the spec may not fail yet (a pinned
        # backup, a locked load) are copied again then (tests/test_defects.py, defect 3).
        waiting = {i for _, ids in self.cache.transfers.queued_nodes() for i in ids}
        refused = {i for _, _, ids, _ in self.cache.log.refused_starts() for i in ids}
        assert waiting <= refused, (
            f"nodes {sorted(waiting - refused)} wait for a copy no engine refused to start"
        )

    @invariant()
    def no_page_leaked(self) -> None:
        for pool, extra in (
            (self.cache.tiers.device, self.model.request_pages()),
            (self.cache.tiers.host, 0),
        ):
            attr = "device_pages" if pool is self.cache.tiers.device else "host_pages"
            owned = sum(len(getattr(n, attr)) for n in self.cache.tree)
            free = pool.allocator.free_pages
            assert free + owned + extra == pool.num_pages, (
                f"{pool.name}: {free} free + {owned} held by nodes + {extra} by requests "
                f"!= {pool.num_pages} pages"
            )

    @invariant()
    def leases_in_force(self) -> None:
        """Every lease the model holds guards what it took, and no node holds any other."""
        locks: Counter[int] = Counter()
        pins: Counter[int] = Counter()
        for held in self.model.held:
            node = held.node
            assert _in_tree(self.cache, node), f"{held.kind}ed {node!r} left the tree"
            assert _prefix(node) == held.prefix, (node, held.prefix)
            if held.kind == "pin":
                # a pin may wait on a copy being written (issue 14): held, not yet valid
                held_host = node.host in HOST_VALID or node.host == "writing"
                assert held_host, f"pinned {node!r} lost its host copy"
                pins[id(node)] += 1
            else:
                assert node.device in DEVICE_HELD, f"locked {node!r} left the device"
                walk: TreeNode | None = node
                while walk is not None and walk.parent is not None:
                    locks[id(walk)] += 1
                    walk = walk.parent
        for n in self.cache.tree:
            assert n.locks == locks[id(n)], f"{n!r}: the model holds {locks[id(n)]} locks on it"
            load_pin = 1 if n.device == "loading" else 0
            assert n.pins == pins[id(n)] + load_pin, (
                f"{n!r}: the model holds {pins[id(n)]} pins on it (+{load_pin} of a load)"
            )

    @invariant()
    def nothing_stuck(self) -> None:
        """A node copying has its copy in flight, or waits for it after a refused start."""
        flying = {id(n) for batch in self.cache.transfers.in_flight().values() for n in batch.nodes}
        waiting = {i for _, ids in self.cache.transfers.queued_nodes() for i in ids}
        stuck = [
            n
            for n in self.cache.tree
            if (n.host == "writing" or n.device == "loading")
            and id(n) not in flying
            and n.id not in waiting
        ]
        assert not stuck, f"{stuck} are copying with no copy in flight or queued"

    def _check_all_kv(self) -> None:
        layout = self.cache.tiers.device.layout
        for n in self.cache.tree:
            want = synthetic_kv(layout, n.key)
            if n.device == "resident":
                got = self.cache.tiers.read_device(list(n.device_pages))
                same = torch.equal(got, want)
                assert same, f"{n!r}: device KV is not its tokens'"
            if n.host in HOST_VALID:
                got = self.cache.tiers.host.read(list(n.host_pages))
                same = torch.equal(got, want)
                assert same, f"{n!r}: host KV is not its tokens'"

    def teardown(self) -> None:
        cache = getattr(self, "cache", None)
        if cache is None:
            return
        errors = []
        for held in self.model.held:
            try:
                held.lease.release()
            except FsmCacheError as exc:
                errors.append(exc)
        self.model = Model()
        cache.reset()  # drains the copies and voids whatever the releases above could not give back
        assert not errors, errors


class WriteThroughSelective(ModelMachine):
    policy = "write_through_selective"


class WriteBack(ModelMachine):
    policy = "write_back"


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestWriteThrough = ModelMachine.TestCase
TestWriteThrough.settings = SETTINGS
TestWriteThroughSelective = WriteThroughSelective.TestCase
TestWriteThroughSelective.settings = SETTINGS
TestWriteBack = WriteBack.TestCase
TestWriteBack.settings = SETTINGS
