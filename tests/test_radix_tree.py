"""RadixTree.retract and split: node ids, a split whose page hand-over fails, split_cut."""

from __future__ import annotations

import pytest

from fsm_cache.cache.tree import Pages, RadixTree
from fsm_cache.errors import InvariantViolation


def test_the_last_leaf_made_is_taken_back_with_its_id() -> None:
    tree = RadixTree(page_size=1)
    a = tree.add_leaf(tree.root(), (1,), (10,))
    b = tree.add_leaf(tree.root(), (2,), (11,))
    tree.retract(b)
    assert set(tree.nodes) == {a.id}
    c = tree.add_leaf(tree.root(), (3,), (12,))
    assert c.id == b.id  # the id b had, as if b had never been made


def test_a_node_made_before_the_last_is_refused_and_nothing_changes() -> None:
    """Its id may be in a log or digest already: giving it out again names two nodes alike."""
    tree = RadixTree(page_size=1)
    a = tree.add_leaf(tree.root(), (1,), (10,))
    b = tree.add_leaf(tree.root(), (2,), (11,))
    with pytest.raises(InvariantViolation) as refused:
        tree.retract(a)
    assert str(refused.value) == (
        "node 1: only the last node made, a leaf, can be retracted (the last made is node 2)"
    )
    assert set(tree.nodes) == {a.id, b.id}
    assert tree.add_leaf(tree.root(), (3,), (12,)).id == 3


def test_a_split_prefix_is_made_too() -> None:
    tree = RadixTree(page_size=1)
    leaf = tree.add_leaf(tree.root(), (1, 2), (10, 11))
    prefix = tree.split(leaf, 1)
    with pytest.raises(InvariantViolation, match=r"^node 1: only the last node made"):
        tree.retract(leaf)  # the prefix, node 2, was made after it
    with pytest.raises(InvariantViolation, match=r"^node 2: only the last node made, a leaf"):
        tree.retract(prefix)  # made last, but the leaf hangs under it
    assert set(tree.nodes) == {leaf.id, prefix.id}


def test_a_split_hands_the_prefix_s_pages_over_before_the_tree_changes() -> None:
    """The hook is told the prefix's pages and id to be while the node is still whole."""
    seen: list[tuple[Pages, Pages, int, int, int]] = []

    def hand_over(device: Pages, host: Pages, owner: int, new: int) -> None:
        seen.append((device, host, owner, new, len(leaf.key)))

    tree = RadixTree(page_size=1, hand_over=hand_over)
    leaf = tree.add_leaf(tree.root(), (1, 2, 3), (10, 11, 12))
    host: Pages = (20, 21, 22)  # typed: a literal would pin the attribute's type here
    leaf.host_pages = host
    prefix = tree.split(leaf, 2)
    assert seen == [((10, 11), (20, 21), 1, 2, 3)]
    assert (prefix.id, prefix.device_pages, prefix.host_pages) == (2, (10, 11), (20, 21))
    assert (leaf.device_pages, leaf.host_pages) == ((12,), (22,))


def test_a_split_whose_hand_over_fails_leaves_the_tree_as_it_was() -> None:
    """An allocator that broke: no prefix, the node whole, and its id not spent."""
    calls = 0

    def hand_over(device: Pages, host: Pages, owner: int, new: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("allocator broke")

    split: list[int] = []
    tree = RadixTree(page_size=1, hand_over=hand_over, on_split=lambda p, s: split.append(p.id))
    root = tree.root()
    leaf = tree.add_leaf(root, (1, 2, 3), (10, 11, 12))
    leaf.host_pages = (20, 21, 22)
    with pytest.raises(RuntimeError, match="allocator broke"):
        tree.walk((1, 2, 9))
    assert split == []
    assert root.children == {(1,): leaf}
    assert leaf.parent is root
    assert (leaf.key, leaf.device_pages, leaf.host_pages) == ((1, 2, 3), (10, 11, 12), (20, 21, 22))
    assert set(tree.nodes) == {leaf.id}
    walk = tree.walk((1, 2, 9))
    assert split == [2]  # the id the failed split would have given
    assert [n.id for n in walk.path] == [2]
    assert leaf.parent is walk.path[0]


def test_find_changes_nothing_and_says_where_walk_would_split() -> None:
    tree = RadixTree(page_size=1)
    leaf = tree.add_leaf(tree.root(), (1, 2, 3), (10, 11, 12))
    found = tree.find((1, 2, 9))
    assert ([n.id for n in found.path], found.matched, found.cut) == ([1], 2, 2)
    assert (leaf.key, set(tree.nodes)) == ((1, 2, 3), {1})
    walk = tree.walk((1, 2, 9))
    assert ([n.id for n in walk.path], walk.matched, walk.cut) == ([2], 2, 0)
    assert tree.find((1, 2, 9)) is walk  # no split left to make: the walk itself


def _shape(tree: RadixTree) -> list[tuple[int, int | None, tuple[int, ...], Pages, Pages]]:
    return sorted(
        (n.id, n.parent.id if n.parent is not None else None, n.key, n.device_pages, n.host_pages)
        for n in tree
    )


@pytest.mark.parametrize(
    "key",
    [(1, 2, 3, 9, 9), (1, 2, 3, 4, 5, 9), (1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 7)],
    ids=["inside the child", "inside the grandchild", "key ends inside", "ends deeper", "mid"],
)
@pytest.mark.parametrize("namespace", [None, "lora"])
def test_split_cut_makes_the_split_and_returns_the_walk_walk_would(
    key: tuple[int, ...], namespace: str | None
) -> None:
    """A find's cut split where it is, not by following the key again: what walk() does."""

    def grown() -> tuple[RadixTree, list[tuple[object, ...]]]:
        seen: list[tuple[object, ...]] = []
        tree = RadixTree(
            page_size=1,
            hand_over=lambda d, h, o, n: seen.append(("hand_over", d, h, o, n)),
            on_split=lambda p, s: seen.append(("split", p.id, s.id)),
        )
        top = tree.add_leaf(tree.root(namespace), (1, 2, 3, 4), (10, 11, 12, 13))
        top.host_pages = (20, 21, 22, 23)
        tree.add_leaf(top, (5, 6, 7), (14, 15, 16))
        tree.add_leaf(top, (8,), (17,))
        return tree, seen

    walked, walked_seen = grown()
    cut, cut_seen = grown()
    expected = walked.walk(key, namespace)
    found = cut.find(key, namespace)
    assert found.cut
    got = cut.split_cut(found, key, namespace)
    assert [n.id for n in got.path] == [n.id for n in expected.path]
    assert (got.matched, got.cut) == (expected.matched, expected.cut)
    assert _shape(cut) == _shape(walked)
    assert cut_seen == walked_seen  # the same pages handed over, the same split hook calls
    assert cut.find(key, namespace) is got  # kept as the last walk, as walk() keeps its own
    assert cut.walk(key, namespace) is got


def test_split_cut_refuses_a_walk_without_a_cut_and_changes_nothing() -> None:
    tree = RadixTree(page_size=1)
    leaf = tree.add_leaf(tree.root(), (1, 2, 3), (10, 11, 12))
    for key in [(1, 2, 3, 9), (9,)]:
        found = tree.find(key)
        with pytest.raises(InvariantViolation) as refused:
            tree.split_cut(found, key)
        assert str(refused.value) == (
            f"a walk of {found.matched} tokens that ends where a node does has no cut to split"
        )
    assert (_shape(tree), leaf.parent) == ([(1, 0, (1, 2, 3), (10, 11, 12), ())], tree.root())


def test_an_unsplit_gives_the_suffix_back_its_prefix_and_the_next_node_its_id() -> None:
    seen: list[tuple[Pages, Pages, int, int]] = []
    tree = RadixTree(page_size=1, hand_over=lambda *args: seen.append(args))
    root = tree.root()
    leaf = tree.add_leaf(root, (1, 2, 3), (10, 11, 12))
    host: Pages = (20, 21, 22)
    leaf.host_pages = host
    prefix = tree.split(leaf, 2)
    assert tree.unsplit(prefix) is leaf
    assert seen[-1] == ((10, 11), (20, 21), 2, 1)  # handed back before the tree changed
    assert root.children == {(1,): leaf}
    assert leaf.parent is root
    assert (leaf.key, leaf.device_pages, leaf.host_pages) == ((1, 2, 3), (10, 11, 12), (20, 21, 22))
    assert set(tree.nodes) == {leaf.id}
    assert [n.id for n in tree.walk((1, 2, 9)).path] == [2]  # the id the prefix had


def test_only_the_last_node_made_is_unsplit_and_a_failed_hand_back_changes_nothing() -> None:
    broken = False

    def hand_over(device: Pages, host: Pages, owner: int, new: int) -> None:
        if broken:
            raise RuntimeError("allocator broke")

    tree = RadixTree(page_size=1, hand_over=hand_over)
    leaf = tree.add_leaf(tree.root(), (1, 2, 3), (10, 11, 12))
    prefix = tree.split(leaf, 2)
    other = tree.add_leaf(tree.root(), (5,), (13,))
    with pytest.raises(InvariantViolation) as refused:
        tree.unsplit(prefix)
    assert str(refused.value) == (
        "node 2: only the last node made, with one child, can be unsplit (the last made is node 3)"
    )
    tree.retract(other)
    broken = True
    with pytest.raises(RuntimeError, match="allocator broke"):
        tree.unsplit(prefix)
    assert (prefix.children, leaf.parent, leaf.key) == ({(3,): leaf}, prefix, (3,))
    assert set(tree.nodes) == {1, 2}
