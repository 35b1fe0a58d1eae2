"""Trail mode names the caller's lines through every wrapper, never fsm_cache's own frames.

A double release is the case trail mode exists for: the refusal must name the
earlier release and the refused one where the caller made them. Here each
wrapper over the engine (the cache's leases and ``fire``, SGLang's node
methods, :class:`~fsm_cache.residency.Node`) is driven from small functions of
this file, and each refusal's message is compared whole, sites and all.
"""

from __future__ import annotations

import inspect
import os
from collections import defaultdict
from typing import Any

import pytest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.compat.sglang import ResidencyMixin
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import LeaseError, ReleaseAtZero, UnlockAtZero
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.residency import Node, Residency


HERE = os.path.basename(__file__)


def at(function: Any, offset: int) -> str:
    """Return ``HERE:line in name``: the line ``offset`` lines into ``function``'s body."""
    line = inspect.getsourcelines(function)[1] + offset
    return f"{HERE}:{line} in {function.__name__}"


# The cache: each line below is a call site the messages name (offsets count from the def).


def fill(cache: HiCache) -> Any:
    cache.insert(list(range(8)))
    cache.poll()
    (node,) = list(cache.tree)
    return node


def take(cache: HiCache, node: Any) -> Lease:
    return cache.pin(node)


def give(lease: Lease) -> None:
    lease.release()


def release_directly(cache: HiCache, node: Any) -> None:
    cache.fire("release", node)


def test_the_cache_names_the_callers_of_its_lease_and_of_the_refused_release() -> None:
    config = CacheConfig(
        device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, trail=True
    )
    with HiCache(config) as cache:
        node = fill(cache)
        lease = take(cache, node)
        give(lease)
        with pytest.raises(ReleaseAtZero) as refused:
            release_directly(cache, node)
        assert str(refused.value) == (
            "node 1: release refused in backed (pins=0): release without a matching pin; "
            f"written at {at(fill, 1)}; acknowledged at {at(fill, 2)}; pinned at {at(take, 1)}; "
            f"released at {at(give, 1)}; refused at {at(release_directly, 1)}"
        )
        with pytest.raises(LeaseError) as again:
            give(lease)
        assert str(again.value) == (
            f"node 1: lease (pin taken at {at(take, 1)}) already released at {at(give, 1)}"
        )


# SGLang's node, checked by the mixin.


class TreeNode:
    """SGLang's node, residency part."""

    def __init__(self, ident: int = 0) -> None:
        self.children: Any = defaultdict(TreeNode)
        self.parent: Any = None
        self.value: Any = None
        self.host_value: Any = None
        self.lock_ref = 0
        self.host_ref_counter = 0
        self.id = ident


class Checked(ResidencyMixin, TreeNode):
    residency = Residency(trail=True)


def chain() -> Any:
    root = Checked(0)
    root.value, root.host_value, root.lock_ref = [], [], 1
    node = Checked(1)
    node.parent, node.value = root, [7]
    root.children[1] = node
    return node


def back_up(node: Any) -> None:
    node.machine().write(node)
    node.host_value = [9]
    node.machine().write_done(node)


def protect(node: Any) -> None:
    node.protect_host()


def drain(node: Any) -> None:
    node.release_host()


def abort(node: Any) -> None:
    node.release_host()


def lock(node: Any) -> None:
    node.inc_lock_ref()


def unlock(node: Any) -> None:
    node.dec_lock_ref()


def test_sglangs_node_names_both_cleanup_paths_of_a_double_release() -> None:
    node = chain()
    back_up(node)
    protect(node)
    drain(node)
    with pytest.raises(ReleaseAtZero) as refused:
        abort(node)
    history = (
        f"written at {at(back_up, 1)}; acknowledged at {at(back_up, 3)}; "
        f"pinned at {at(protect, 1)}; released at {at(drain, 1)}"
    )
    assert str(refused.value) == (
        "Host reference counter is already zero. node 1: release refused in backed (pins=0): "
        f"release without a matching pin; {history}; refused at {at(abort, 1)}"
    )
    lock(node)
    unlock(node)
    with pytest.raises(UnlockAtZero) as again:
        unlock(node)
    assert str(again.value) == (
        "node 1: unlock refused in resident (locks=0): unlock without a matching lock; "
        f"{history}; locked at {at(lock, 1)}; unlocked at {at(unlock, 1)}; "
        f"refused at {at(unlock, 1)}"
    )


# The README's node, on an engine in trail mode.

TRACED = Residency(trail=True)


class TracedNode(Node):
    machine = staticmethod(lambda: TRACED)


def hold(node: Node) -> None:
    with node.pin():
        pass


def let_go(node: Node) -> None:
    node.release()


def test_a_residency_node_names_its_lease_and_the_refused_release() -> None:
    node = TracedNode(17, host="backed")
    hold(node)
    with pytest.raises(ReleaseAtZero) as refused:
        let_go(node)
    assert str(refused.value) == (
        "node 17: release refused in backed (pins=0): release without a matching pin; "
        f"pinned at {at(hold, 1)}; released at {at(hold, 1)}; refused at {at(let_go, 1)}"
    )
