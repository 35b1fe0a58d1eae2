"""RadixTree.retract: only the last node made is taken back, with its id."""

from __future__ import annotations

import pytest

from fsm_cache.cache.tree import RadixTree
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
