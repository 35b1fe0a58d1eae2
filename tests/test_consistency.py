"""The debug-mode checker: each design invariant it covers, broken by hand, is named with its node.

Every test builds a small CPU cache through its public API, then corrupts one
field directly (bypassing the residency machines, as a buggy code path would)
and compares the whole message of the first violation.
"""

from __future__ import annotations

import pytest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.invariants import CHECKED, findings
from fsm_cache.cache.tree import RadixTree, TreeNode
from fsm_cache.errors import BadArgument, InvariantViolation
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.residency import HostState


def cache(policy: str = "write_through", debug: bool = False) -> HiCache:
    """A cache of 8 device and 16 host pages of 4 tokens, on CPU."""
    return HiCache(
        CacheConfig(
            device_pages=8,
            host_pages=16,
            page_size=4,
            layers=1,
            heads=1,
            head_dim=4,
            device="cpu",
            write_policy=policy,
            load_back_threshold=4,
            debug=debug,
        )
    )


def chain(policy: str = "write_through", debug: bool = False) -> tuple[HiCache, TreeNode, TreeNode]:
    """A cache holding a parent node (tokens 0-7) and its child (8-15), copies applied."""
    built = cache(policy, debug)
    built.insert(list(range(8)))
    built.insert(list(range(16)))
    while built.poll():  # write-through backs the child up once the parent's copy is applied
        pass
    parent, child = list(built.tree)
    assert child.parent is parent
    return built, parent, child


def single(policy: str = "write_through", debug: bool = False) -> tuple[HiCache, TreeNode]:
    """A cache holding one node of tokens 0-7, copies applied."""
    built = cache(policy, debug)
    built.insert(list(range(8)))
    built.poll()
    (node,) = list(built.tree)
    return built, node


def drop_device(node: TreeNode) -> None:
    """Take ``node`` off the device by hand, pages and all (the pool keeps them)."""
    node.device, node.device_pages = "absent", ()


def drop_host(node: TreeNode, state: HostState) -> None:
    """Put ``node``'s host side in ``state`` by hand, without host pages."""
    node.host, node.host_pages = state, ()


def violation(broken: HiCache) -> str:
    with pytest.raises(InvariantViolation) as caught:
        broken.check_invariants()
    return str(caught.value)


def test_a_consistent_cache_passes() -> None:
    built, _, _ = chain()
    built.check_invariants()


@pytest.mark.parametrize(("after", "said"), [(None, ""), ("", ""), ("insert", " after insert")])
def test_after_names_the_operation_just_run_or_none(after: str | None, said: str) -> None:
    """``after=None`` names none, as ``""`` does; compiled, it was the call's own TypeError."""
    built, parent, child = chain()
    drop_device(parent)
    with pytest.raises(InvariantViolation) as caught:
        built.check_invariants(after=after)
    assert str(caught.value) == (
        f"invariant 1 broken at node {child.id} (backed/resident (pins=0, locks=0)){said}: "
        f"on the device under node {parent.id}, which is absent"
    )


@pytest.mark.parametrize("after", [42, b"insert", ["insert"]], ids=["int", "bytes", "list"])
def test_an_after_that_is_no_str_is_refused_alike_compiled_or_not(after: object) -> None:
    """The sources named an int in the message; compiled, it was the call's own TypeError."""
    built, parent, _ = chain()
    drop_device(parent)  # broken: the refusal comes before anything is checked
    with pytest.raises(BadArgument) as refused:
        built.check_invariants(after=after)  # type: ignore[call-overload]
    assert str(refused.value) == (
        f"check_invariants: after must be a str or None, got {type(after).__name__}"
    )


def test_invariant_1_device_residency_is_prefix_closed() -> None:
    built, parent, child = chain()
    drop_device(parent)
    assert violation(built) == (
        f"invariant 1 broken at node {child.id} (backed/resident (pins=0, locks=0)): "
        f"on the device under node {parent.id}, which is absent"
    )


def test_invariant_2_every_node_holds_its_data_somewhere() -> None:
    built, node = single("write_back")
    drop_device(node)
    assert violation(built) == (
        f"invariant 2 broken at node {node.id} (unbacked/absent (pins=0, locks=0)): "
        "neither tier holds its KV"
    )


def test_invariant_2_names_a_host_eviction_that_kept_a_node_off_the_device() -> None:
    built, node = single()
    drop_device(node)
    drop_host(node, "evicted")
    assert violation(built) == (
        f"invariant 2 broken at node {node.id} (evicted/absent (pins=0, locks=0)): "
        "neither tier holds its KV"
    )


def test_invariant_3_backup_is_prefix_closed_in_write_through() -> None:
    built, parent, child = chain()
    drop_host(parent, "unbacked")
    assert violation(built) == (
        f"invariant 3 broken at node {child.id} (backed/resident (pins=0, locks=0)): "
        f"backed under node {parent.id}, which is unbacked"
    )


def test_invariant_4_no_lock_on_a_node_off_the_device() -> None:
    built, node = single()
    drop_device(node)
    node.locks = 1
    assert violation(built) == (
        f"invariant 4 broken at node {node.id} (backed/absent (pins=0, locks=1)): "
        "off the device while locked: device eviction takes only unlocked nodes"
    )


def test_invariant_4_no_pin_on_a_node_evicted_from_the_host() -> None:
    built, node = single()
    drop_host(node, "evicted")
    node.pins = 2
    assert violation(built) == (
        f"invariant 4 broken at node {node.id} (evicted/resident (pins=2, locks=0)): "
        "evicted from the host while pinned: host eviction takes only unpinned nodes"
    )


def test_invariant_4_no_host_copy_below_a_host_eviction_in_write_through() -> None:
    built, parent, child = chain()
    drop_host(parent, "evicted")
    assert violation(built) == (
        f"invariant 4 broken at node {parent.id} (evicted/resident (pins=0, locks=0)): "
        f"evicted from the host while child node {child.id} holds a host copy (backed): "
        "host eviction takes only host leaves"
    )


def test_invariant_4_allows_a_backup_below_a_host_eviction_in_write_back() -> None:
    """Under write-back a child is backed up when it leaves the device, whatever its parent."""
    built, parent, child = chain("write_back")
    assert built.backup([child]) == 1
    built.poll()
    parent.host = "evicted"  # it held no host pages: unbacked before
    assert (parent.host, child.host) == ("evicted", "backed")
    built.check_invariants()


def test_invariant_5_no_page_freed_while_a_copy_uses_it() -> None:
    built = cache()
    built.insert(list(range(8)))  # the device-to-host copy is in flight until poll
    (node,) = list(built.tree)
    assert node.host == "writing"
    built.tree.remove_leaf(node)
    built.tiers.device.allocator.free(node.device_pages, node.id)
    assert violation(built) == (
        f"invariant 5 broken at device page {min(node.device_pages)}: "
        "freed while a copy still uses it"
    )


def test_invariant_6_locks_propagate_to_ancestors() -> None:
    built, parent, child = chain()
    child.locks = 1
    assert violation(built) == (
        f"invariant 6 broken at node {parent.id} (backed/resident (pins=0, locks=0)): "
        "0 locks but its children hold 1"
    )


def test_invariant_7_every_used_page_belongs_to_the_node_holding_it() -> None:
    built = cache()
    for start in (0, 100):
        built.insert(list(range(start, start + 8)))
    built.poll()
    checked, other = built.tree  # in the order the checker visits them
    checked.device_pages, other.device_pages = other.device_pages, checked.device_pages
    assert violation(built) == (
        f"invariant 7 broken at device page {checked.device_pages[0]}: "
        f"held by node {checked.id}, owned by {other.id}"
    )


def test_invariant_7_pages_used_equal_pages_held() -> None:
    built, node = single()
    built.tiers.host.allocator.alloc(4, owner=node.id)
    assert violation(built) == (
        "invariant 7 broken at host pool: 3 pages used, 2 held by nodes and 0 by requests"
    )


def test_invariant_7_counts_the_slots_a_request_holds() -> None:
    built, _ = single(debug=True)  # debug mode checks after alloc_slots and free_slots too
    held = built.alloc_slots(8)  # a request between its allocation and its insert
    built.check_invariants()
    built.free_slots(held)
    built.check_invariants()
    stray = built.tiers.device.allocator.alloc(4)
    built.tiers.device.allocator.reassign(stray, 0, 99)  # owned by no node and no request
    assert violation(built) == (
        "invariant 7 broken at device pool: 3 pages used, 2 held by nodes and 0 by requests"
    )


def test_invariant_8_counts_never_go_negative() -> None:
    built, node = single()
    node.pins = -1
    assert violation(built) == (
        f"invariant 8 broken at node {node.id} (backed/resident (pins=-1, locks=0)): "
        "a count is negative"
    )


def test_invariant_8_pinned_iff_pins() -> None:
    built, node = single()
    node.pins = 1
    assert violation(built) == (
        f"invariant 8 broken at node {node.id} (backed/resident (pins=1, locks=0)): "
        "host backed requires pins == 0"
    )


def test_invariant_9_keys_are_whole_pages() -> None:
    built, node = single()
    node.key = node.key[:-1]
    assert violation(built) == (
        f"invariant 9 broken at node {node.id} (backed/resident (pins=0, locks=0)): "
        "key of 7 tokens is not whole pages of 4"
    )


def test_invariant_9_slot_runs_match_the_key() -> None:
    built, node = single()
    node.device_pages = node.device_pages[:1]
    assert violation(built) == (
        f"invariant 9 broken at node {node.id} (backed/resident (pins=0, locks=0)): "
        "1 device pages for 2 pages of key"
    )


def test_invariant_11_no_device_node_under_a_node_still_loading() -> None:
    built, parent, child = chain()
    parent.device = "loading"  # as if an insert had hung the child under a load in flight
    found = [f for f in findings(built) if f[0] == 11]
    assert found == [
        (
            11,
            f"node {child.id} (backed/resident (pins=0, locks=0))",
            f"on the device under node {parent.id}, which is still loading",
        )
    ]


def test_invariant_12_no_copy_state_without_a_copy() -> None:
    built, node = single()
    node.device = "loading"  # no load was ever started
    assert violation(built) == (
        f"invariant 12 broken at node {node.id} (backed/loading (pins=0, locks=0)): "
        "loading with no copy in flight or queued: it can never finish"
    )


def test_invariant_12_a_write_in_flight_is_not_stuck() -> None:
    built = cache()
    built.insert(list(range(8)))
    (node,) = list(built.tree)
    assert node.host == "writing"
    built.check_invariants()


def test_every_checked_invariant_has_a_test_here() -> None:
    """CHECKED is what the demo reports; each number in it is broken by a test above."""
    tested = {int(name.split("_")[2]) for name in globals() if name.startswith("test_invariant_")}
    assert tested == set(CHECKED) == {*range(1, 10), 11, 12}


def test_debug_mode_raises_after_the_call_that_broke_the_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split that drops the lock count (an SGLang bug) is named when ``match_prefix`` returns."""
    built, node = single(debug=True)
    lock = built.lock(node)
    split = RadixTree.split

    def split_dropping_locks(tree: RadixTree, target: TreeNode, at: int) -> TreeNode:
        prefix = split(tree, target, at)
        prefix.locks = 0
        return prefix

    monkeypatch.setattr(RadixTree, "split", split_dropping_locks)
    with pytest.raises(InvariantViolation) as caught:
        built.match_prefix(list(range(4)))  # ends inside the node: splits it
    prefix = node.parent
    assert prefix is not None
    assert str(caught.value) == (
        f"invariant 6 broken at node {prefix.id} (backed/resident (pins=0, locks=0)) "
        "after match_prefix: 0 locks but its children hold 1"
    )
    prefix.locks = 1  # repaired by hand, so that the lock can be given back
    built.unlock(lock)
