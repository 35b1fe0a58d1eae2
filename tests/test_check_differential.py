"""Every tree the cache reaches is one the model checker explores: no state it misses.

``fsm-cache check`` explores every state of a small tree that the spec, the
tree operations and (under a write policy) the cache's choices allow. A state
the real cache reaches that the explorer never visits is a false negative: a
bug there would pass the check. Here :class:`~fsm_cache.cache.hicache.HiCache`
is driven by seeded random operations (inserts that split and adopt, lookups
that lock, pin and load back, releases, evictions on both tiers, copies
acknowledged by hand in any order and failed or refused by a faulty engine,
events fired by hand, and with a storage tier: stores, prefetches that hang
nodes found in the store, pages the store loses or tears, another server's
stores), and after every operation its tree is put in the model's terms:
per node its region states, its counters and who holds them (client pins
and locks, the pin of a load or a store in flight). Runs are cut where the
tree outgrows the model's slots or a counter its ceiling (the cache is reset
there), so every tree compared was reached within the bounds, and each must
be among the explored states of the same spec and bounds.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from clocks import HandClock

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.cache.transfers import IssuedCopies
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import FsmCacheError
from fsm_cache.memory.tickets import Completion, Copier
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes
from fsm_cache.policy import WritePolicy
from fsm_cache.spec.shipped import spec_dir
from fsm_cache.storage import RedisStore
from fsm_cache.testing.faults import FaultyCopyEngine


Label = tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]
"""A node in the model's terms: its region states, its counters and its holds."""
Tree = tuple[Any, ...]
"""A tree in the model's terms, siblings sorted: ``((label, children), ...)`` per root."""

BY_HAND = ("write", "evict_device", "evict_host", "pin")
BY_HAND_STORAGE = (*BY_HAND, "store", "discover", "vanish", "fetch", "evict_storage")


def _tree(kids: dict[object, list[object]], label: Callable[[Any], Label], top: object) -> Tree:
    def sub(node: object) -> tuple[Label, Tree]:
        return label(node), tuple(sorted(sub(c) for c in kids.get(node, ())))

    return tuple(sorted(sub(r) for r in kids.get(top, ())))


def explored(
    spec: Path, nodes: int, bounds: Bounds, policy: WritePolicy | None = None
) -> set[Tree]:
    """Every state the checker explores, in the model's terms (ghost memory left out)."""
    explorer, start = check.prepare(spec, nodes, bounds, policy=policy)
    result, states = explorer.reachable(start)
    assert (result.violation, result.stopped) == (None, None)
    layout = explorer.layout
    return {_model_tree(layout, state) for state in states}


def _model_tree(layout: Layout, state: Nodes) -> Tree:
    kids: dict[object, list[object]] = {}
    for i, entry in enumerate(state):
        if entry is not None:
            kids.setdefault(int(entry[0]), []).append(i)

    def label(i: Any) -> Label:
        entry: NodeEntry | None = state[i]
        assert entry is not None
        return (
            tuple(layout.state(entry, r) for r in layout.regions),
            tuple(layout.counter(entry, c) for c in layout.counters),
            tuple(layout.hold(entry, k) for k in layout.holders.kinds),
        )

    return _tree(kids, label, -1)


class Acks:
    """Where the cache reads finished copies: held until the run lets some through, in any order."""

    def __init__(self, copier: Copier, copies: IssuedCopies) -> None:
        self.copier = copier
        self.copies = copies
        self.held: list[Completion] = []

    def collect(self, wait: bool) -> list[Completion]:
        out, self.held = self.held, []
        if not wait:
            return out + self.copier.poll()
        out += self.copier.drain()
        order = {ident: i for i, ident in enumerate(self.copies.issued())}
        return sorted(out, key=lambda c: order.get(c.ticket.id, len(order)))


class Run:
    """One seeded run of a cache, collecting the trees it reaches within the bounds."""

    def __init__(self, layout: Layout, policy: str, seed: int, slots: int, bounds: Bounds) -> None:
        self.layout = layout
        self.rng = random.Random(seed)
        self.slots = slots
        self.most = {name: bounds.ceiling(name) for name in layout.counters}
        self.leases: list[tuple[Lease, TreeNode]] = []
        self.acks: Acks | None = None
        rng = self.rng
        copier = FaultyCopyEngine.copier(
            fail=set(rng.sample(range(1, 200), rng.randint(0, 60))),
            refuse=set(rng.sample(range(1, 200), rng.randint(0, 10))),
            delay=rng.randint(0, 2),
            shuffle=True,
            seed=seed,
        )
        self.storage = layout.has("storage")
        # never moved: no query is slow and no wait passes however loaded the machine, so a
        # run takes the same path every time
        self.clock = HandClock().monotonic
        self.store: RedisStore | None = None
        extra: dict[str, Any] = {}
        if self.storage:
            self.store = RedisStore(fakeredis.FakeRedis(), batch_pages=2)
            extra["storage"] = self._storage(self.store)
        self.cache = HiCache(self._config(policy, copier), acks=self._acks, **extra)
        self.other: HiCache | None = None
        if self.store is not None:  # another server storing into the same store
            config = StorageConfig(
                self.store, model="m", threads=0, prefetch_threshold=10_000, clock=self.clock
            )
            self.other = HiCache(self._config("write_through", None, 8), storage=config)
        self.hands = BY_HAND_STORAGE if self.storage else BY_HAND

    def _config(self, policy: str, copier: Any, pages: int | None = None) -> CacheConfig:
        rng = self.rng
        return CacheConfig(
            device_pages=pages or rng.choice([2, 3, 4, 6]),
            host_pages=pages or rng.choice([1, 2, 3, 4, 6]),
            page_size=1,
            layers=1,
            heads=1,
            head_dim=2,
            write_policy=policy,
            selective_threshold=2,
            load_back_threshold=1,
            copier=copier,
        )

    def _storage(self, store: RedisStore) -> StorageConfig:
        policy = self.rng.choice(["write_through", "write_through", "off"])
        return StorageConfig(
            store,
            model="m",
            threads=0,
            prefetch_threshold=1,
            owned=True,
            policy=policy,
            clock=self.clock,
        )

    def _acks(self, copier: Copier, copies: IssuedCopies) -> Acks:
        self.acks = Acks(copier, copies)
        return self.acks

    def trees(self, steps: int) -> dict[Tree, int]:
        """Run ``steps`` operations; return each tree reached in bounds, with the step it came at."""
        seen: dict[Tree, int] = {}
        try:
            for step in range(steps):
                with contextlib.suppress(FsmCacheError):  # a refusal changes nothing
                    self._operation()
                if self._in_bounds():
                    seen.setdefault(self._tree(), step)
                else:  # later trees may be reachable only through this one: start again
                    self.cache.reset()
                    self.leases = []
                    if self.acks is not None:
                        self.acks.held = []
        finally:
            self.cache.reset()  # voids the leases still held: none is dropped unreleased
            self.cache.close()
            if self.other is not None:
                self.other.close()
        return seen

    def _in_bounds(self) -> bool:
        nodes = list(self.cache.tree)
        if len(nodes) > self.slots:
            return False
        return all(n.pins <= self.most["pins"] and n.locks <= self.most["locks"] for n in nodes)

    def _tree(self) -> Tree:
        held: dict[str, Counter[int]] = {"pin": Counter(), "lock": Counter()}
        for lease, node in self.leases:
            held[lease.event][id(node)] += 1
        storage = self.storage

        def holders(node: TreeNode) -> dict[str, int]:
            return {
                "pin": held["pin"][id(node)],
                "lock": held["lock"][id(node)],
                "load": int(node.device == "loading"),
                "store": int(node.storage == "storing"),
            }

        def label(node: Any) -> Label:
            states = (node.host, node.device, *((node.storage,) if storage else ()))
            mine = holders(node)
            return (
                states,
                (node.pins, node.locks),
                tuple(mine[self.layout.holders.acquirers(k)] for k in self.layout.holders.kinds),
            )

        root = self.cache.tree.roots.get(None)
        kids: dict[object, list[object]] = {}
        for node in self.cache.tree:
            kids.setdefault(node.parent, []).append(node)
        return _tree(kids, label, root)

    def _seq(self) -> tuple[int, ...]:
        return tuple(self.rng.choice((1, 2, 3)) for _ in range(self.rng.randint(1, 3)))

    def _operation(self) -> None:
        """One operation, chosen at random; a refusal raises and changes nothing."""
        kinds = [self._insert, self._match, self._match, self._release, self._evict]
        kinds += [self._poll, self._acknowledge, self._by_hand]
        if self.storage:
            kinds += [self._elsewhere, self._lose]
        self.rng.choice(kinds)()

    def _insert(self) -> None:
        self.cache.insert(self._seq())

    def _release(self) -> None:
        if self.leases:
            self.leases.pop(self.rng.randrange(len(self.leases)))[0].release()

    def _evict(self) -> None:
        tiers = ["evict", "evict_host", *(["evict_storage"] if self.storage else [])]
        getattr(self.cache, self.rng.choice(tiers))(self.rng.randint(1, 3))

    def _poll(self) -> None:
        self.cache.poll()

    def _acknowledge(self) -> None:
        """Apply some of the copies finished so far, in any order; hold the rest."""
        assert self.acks is not None
        held = self.acks.held + self.acks.copier.poll()
        self.rng.shuffle(held)
        some = self.rng.randint(0, len(held))
        self.acks.held = held[some:]
        self.cache.apply_completions(held[:some])

    def _by_hand(self) -> None:
        """A backup, or an event a tool may fire, at any node."""
        nodes = list(self.cache.tree)
        if not nodes:
            return
        node, event = self.rng.choice(nodes), self.rng.choice(("backup", *self.hands))
        if event == "backup":
            self.cache.backup([node])
        elif event == "pin":
            self.leases.append((self.cache.pin(node), node))
        else:
            self.cache.fire(event, node)

    def _elsewhere(self) -> None:
        """Another server stores a prefix into the same store: what a lookup discovers."""
        assert self.other is not None
        self.other.reset()
        self.other.insert(self._seq())
        for _ in range(4):
            self.other.poll()

    def _lose(self) -> None:
        """The store drops a node's pages behind the cache's back."""
        assert self.store is not None
        keyed = [n for n in self.cache.tree if n.store_keys]
        if keyed:
            self.store.drop(list(self.rng.choice(keyed).store_keys or ()))

    def _match(self) -> None:
        """A lookup, then what a scheduler does with it: lock, pin or load back what it found."""
        found = self.cache.match_prefix(self._seq())
        then = self.rng.choice(["lock", "pin", "load_back", "none"])
        if then == "lock":
            self.leases.append((self.cache.lock(found.last_device_node), found.last_device_node))
        elif then == "pin":
            self.leases.append((self.cache.pin(found.last_host_node), found.last_host_node))
        elif then == "load_back":
            self.cache.load_back(found.last_host_node)


def reached(
    spec: Path, policy: str, seeds: range, *, steps: int, slots: int, bounds: Bounds
) -> dict[Tree, tuple[int, int]]:
    """Every tree seeded runs of a cache reach within the bounds, with the seed and step of its first."""
    layout = check.prepare(spec, slots, bounds)[0].layout
    out: dict[Tree, tuple[int, int]] = {}
    for seed in seeds:
        for tree, step in Run(layout, policy, seed, slots, bounds).trees(steps).items():
            out.setdefault(tree, (seed, step))
    return out


RESIDENCY = spec_dir() / "residency.toml"
STORAGE = spec_dir() / "residency_storage.toml"
BOUNDS = Bounds({"pins": 2, "locks": 2})
STORAGE_BOUNDS = Bounds({"pins": 2, "locks": 1})


@pytest.fixture(scope="module")
def residency() -> set[Tree]:
    return explored(RESIDENCY, 3, BOUNDS)


@pytest.fixture(scope="module")
def write_through() -> set[Tree]:
    """What ``--policy write_through`` explores: the steps narrowed to the cache's choices."""
    return explored(RESIDENCY, 3, BOUNDS, policy=WritePolicy.WRITE_THROUGH)


@pytest.fixture(scope="module")
def storage() -> set[Tree]:
    """What ``check`` explores of the storage composition on 2 nodes (each policy's test reads it)."""
    return explored(STORAGE, 2, STORAGE_BOUNDS)


def _missing(found: dict[Tree, tuple[int, int]], states: set[Tree]) -> list[str]:
    """The trees the cache reached that the checker never explored, with the seed and step."""
    return [
        f"seed {at[0]} step {at[1]}: {tree}" for tree, at in found.items() if tree not in states
    ]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_every_tree_the_cache_reaches_is_explored(residency: set[Tree], policy: str) -> None:
    """Under any write policy the cache reaches only states ``check`` explores with none."""
    found = reached(RESIDENCY, policy, range(40), steps=250, slots=3, bounds=BOUNDS)
    assert len(found) > 200  # splits, loads, locks, pins and failed copies, in many shapes
    assert _missing(found, residency) == []


def test_under_write_through_every_tree_is_explored_under_its_choices(
    write_through: set[Tree],
) -> None:
    """``--policy write_through`` narrows the steps to the cache's own choices, and loses none."""
    found = reached(RESIDENCY, "write_through", range(40, 80), steps=250, slots=3, bounds=BOUNDS)
    assert _missing(found, write_through) == []


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_every_tree_a_cache_with_a_storage_tier_reaches_is_explored(
    storage: set[Tree], policy: str
) -> None:
    states = storage
    found = reached(STORAGE, policy, range(30), steps=250, slots=2, bounds=STORAGE_BOUNDS)
    assert any(len(tree) == 1 and tree[0][0][0][2] == "reading" for tree in found)  # a fetch
    assert _missing(found, states) == []


def test_an_explorer_narrowed_to_write_through_misses_what_write_back_reaches(
    write_through: set[Tree],
) -> None:
    """The comparison has teeth: states a narrower search leaves out are named.

    Write-through backs a node up only under a backed parent; write-back
    backs up whatever it evicts, so it reaches a backed child under an
    unbacked parent, which the write-through search never explores.
    """
    assert _missing(
        reached(RESIDENCY, "write_back", range(10), steps=250, slots=3, bounds=BOUNDS),
        write_through,
    )
