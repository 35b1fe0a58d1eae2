"""The radix tree: token prefixes to nodes, each node a residency record.

Keys are tuples of token ids whose lengths are multiples of ``page_size``;
a node owns one device page and one host page per ``page_size`` tokens of its
key in each tier it occupies. Children are keyed by their first page of
tokens. Namespaces (a LoRA id, say) get separate roots, so equal token
prefixes under different namespaces never share nodes.

The tree changes shape (new leaves, splits, deletions); residency changes go
through the residency machines in :mod:`fsm_cache.cache.hicache`. A split is the one
place both meet: :meth:`RadixTree.split` carries states, pins and locks to the
new prefix node so that every count stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fsm_cache.errors import InvariantViolation
from fsm_cache.residency import ResidencyRecord, StorageState, split_prefix


Key = tuple[int, ...]
Pages = tuple[int, ...]
# NOTE: leaves share one empty, read-only mapping; a node gets its own dict with its first
# child. Most nodes are leaves, and an empty dict per leaf would cost 64 bytes each.
NO_CHILDREN: Mapping[Key, TreeNode] = MappingProxyType({})


class TreeNode(ResidencyRecord):
    """A radix-tree node: a run of tokens, its pages in each tier, and its residency.

    Attributes:
        key: The node's tokens (a multiple of ``page_size`` long; empty at a root).
        parent: The parent node, None at a root.
        children: Children keyed by their first page of tokens.
        device_pages: Device pages while the device holds (or is loading) the KV.
        host_pages: Host pages while the host holds (or is writing) the KV.
        last_access: Logical time of the last match, for LRU eviction.
        hit_count: Matches and inserts through this node, for selective write-through.
        storage: Storage residency (``unstored`` unless the cache has a storage tier).
        store_keys: The page keys of the node's pages in a storage tier, chained
            from its parent's last key; None until a storage tier computes them.
    """

    __slots__ = (
        "children",
        "device_pages",
        "hit_count",
        "host_pages",
        "key",
        "last_access",
        "parent",
        "storage",
        "store_keys",
    )

    def __init__(
        self, ident: int, key: Key, parent: TreeNode | None, device_pages: Pages = ()
    ) -> None:
        self._start(ident, "unbacked", "resident", 0, 0)  # fresh: no check to pay per insert
        self.key = key
        self.parent = parent
        self.children: Mapping[Key, TreeNode] = NO_CHILDREN
        self.device_pages = device_pages
        self.host_pages: Pages = ()
        self.last_access = 0
        self.hit_count = 0
        self.storage: StorageState = "unstored"
        self.store_keys: tuple[str, ...] | None = None

    @property
    def is_root(self) -> bool:
        """Whether this is a namespace root (holds no tokens, never evicted)."""
        return self.parent is None

    def __repr__(self) -> str:
        return f"<TreeNode {self.id} len={len(self.key)} {self.residency()}>"


@dataclass(frozen=True)
class Walk:
    """The nodes a key runs through from the root, and how many tokens matched.

    Attributes:
        path: The nodes matched, from the root's child down.
        matched: Tokens matched, in whole pages.
        cut: 0, or (a :meth:`RadixTree.find` only) the tokens matched of the
            last node of ``path``, where the match ends inside it: the split
            :meth:`RadixTree.walk` would make there (:meth:`RadixTree.split_cut`
            makes it).
    """

    path: tuple[TreeNode, ...]
    matched: int
    cut: int = 0


@dataclass(frozen=True)
class NamespaceRoot:
    """How the event log names the root of ``namespace`` in a lock or an unlock.

    Every root's id is 0, but each root counts its own locks (a miss hands
    back its namespace's root, and SGLang-style callers lock it), so a replay
    must know which root a lock took. Plain data that compares by value, so
    the log pickles, and a tensor-parallel digest renders it alike on every
    rank (:func:`~fsm_cache.distributed.digest.operation_text`).

    Attributes:
        namespace: The namespace whose root it is (None: the default one).
    """

    namespace: Hashable


SplitHook = Callable[[TreeNode, TreeNode], None]
HandOver = Callable[[Pages, Pages, int, int], None]
"""Called as ``hand_over(device_pages, host_pages, owner, new_owner)`` before a split."""


class RadixTree:
    """Nodes indexed by token prefix, per namespace.

    Args:
        page_size: Tokens per page; keys and splits are multiples of it.
        on_split: Called as ``on_split(prefix, suffix)`` after a split, so the
            owner can re-home in-flight copies.
        hand_over: Called before a split changes the tree, with the prefix's
            pages and the ids of the node split and of the prefix to be, so
            the owner hands page ownership over; if it raises, the tree is
            unchanged.
    """

    def __init__(
        self,
        page_size: int,
        on_split: SplitHook | None = None,
        hand_over: HandOver | None = None,
    ) -> None:
        self.page_size = page_size
        self.roots: dict[Hashable, TreeNode] = {}
        self.nodes: dict[int, TreeNode] = {}
        self._made = 0  # the last node id handed out; ids are never reused but by retract
        self._on_split = on_split
        self._hand_over = hand_over
        self._last: tuple[Hashable, Key, Walk] | None = None  # dropped when it may be stale

    @property
    def last_id(self) -> int:
        """The id of the last node made (0 before any): the next one gets the id after it."""
        return self._made

    def root(self, namespace: Hashable = None) -> TreeNode:
        """Return the root of ``namespace``, creating it on first use."""
        found = self.roots.get(namespace)
        if found is None:
            found = TreeNode(0, (), None)
            found.host = "backed"  # the empty prefix is trivially backed and resident
            self.roots[namespace] = found
        return found

    def namespace_of(self, root: TreeNode) -> Hashable:
        """Return the namespace whose root ``root`` is (None if it is no root of this tree)."""
        for name, found in self.roots.items():
            if found is root:
                return name
        return None

    def lease_name(self, node: TreeNode) -> int | NamespaceRoot:
        """Return how the log names ``node`` in a lock or unlock: its id, or its namespace's root.

        A root's id, 0, is every root's (see :class:`NamespaceRoot`).
        """
        return node.id if node.parent is not None else NamespaceRoot(self.namespace_of(node))

    def aligned(self, tokens: Key) -> Key:
        """Return ``tokens`` cut down to a whole number of pages (``tokens`` if they are)."""
        extra = len(tokens) % self.page_size
        return tokens[: len(tokens) - extra] if extra else tokens

    def walk(self, key: Key, namespace: Hashable = None) -> Walk:
        """Follow ``key`` down the tree, splitting a node where a match ends inside it.

        The last walk is kept until the tree changes where it went (a new leaf,
        a split, the removal of a node on its path): an insert walks the key
        its request's ``match_prefix`` just walked.
        """
        return self._follow(key, namespace, split=True)

    def find(self, key: Key, namespace: Hashable = None) -> Walk:
        """Follow ``key`` down the tree as :meth:`walk` does, changing nothing.

        Where the match ends inside a node, that node ends the path, unsplit,
        and :attr:`Walk.cut` says how many of its tokens matched: an operation
        checks what it is about to do before :meth:`walk` splits it (check,
        then act). Elsewhere the walk is the one :meth:`walk` returns.
        """
        return self._follow(key, namespace, split=False)

    def split_cut(self, walk: Walk, key: Key, namespace: Hashable = None) -> Walk:
        """Make the split a :meth:`find` with a cut said :meth:`walk` would make; return its walk.

        ``walk`` is what :meth:`find` just returned for ``key`` in
        ``namespace``, with the tree unchanged since: its last node is split
        at :attr:`Walk.cut` and the walk :meth:`walk` would have returned
        comes back (and is kept as the last walk), without following the key
        from the root again. The prefix takes the split node's place on the
        path; the key cannot go on below it, since its only child, the
        suffix, is where the match ended.

        Raises:
            InvariantViolation: ``walk`` has no cut: it ends where a node does. Nothing changes.
            Exception: Whatever the page hand-over raises, as for :meth:`split`;
                nothing changes.
        """
        if not walk.cut:
            msg = f"a walk of {walk.matched} tokens that ends where a node does has no cut to split"
            raise InvariantViolation(msg)
        path = walk.path
        found = Walk((*path[:-1], self.split(path[-1], walk.cut)), walk.matched)
        self._last = (namespace, key, found)
        return found

    def _follow(self, key: Key, namespace: Hashable, *, split: bool) -> Walk:
        """:meth:`walk` (``split``), or :meth:`find`."""
        last = self._last
        if last is not None and last[1] == key and last[0] == namespace:
            return last[2]
        node, pos, path = self.root(namespace), 0, []
        page = self.page_size
        while pos < len(key):
            child = node.children.get(key[pos : pos + page])
            if child is None:
                break
            common = len(child.key)
            if key[pos : pos + common] != child.key:  # the match ends inside the child
                common = _common_pages(child.key, key[pos : pos + common], page)
                if not split:  # kept unsplit, and not as the last walk: it is none of walk's
                    path.append(child)
                    return Walk(tuple(path), pos + common, common)
                child = self.split(child, common)
            path.append(child)
            pos += common
            node = child
        found = Walk(tuple(path), pos)
        self._last = (namespace, key, found)
        return found

    def add_leaf(self, parent: TreeNode, key: Key, device_pages: Pages) -> TreeNode:
        """Create a device-resident, unbacked leaf under ``parent``."""
        self._made = made = self._made + 1
        node = TreeNode(made, key, parent, device_pages)
        _children(parent)[key[: self.page_size]] = node
        self._last = None
        self.nodes[node.id] = node
        return node

    def remove_leaf(self, node: TreeNode) -> None:
        """Detach a leaf from the tree.

        Raises:
            InvariantViolation: ``node`` is a root or still has children.
        """
        if node.parent is None or node.children:
            msg = f"node {node.id}: only a leaf can be removed ({len(node.children)} children)"
            raise InvariantViolation(msg)
        del _children(node.parent)[node.key[: self.page_size]]
        del self.nodes[node.id]
        last = self._last
        if last is not None and node in last[2].path:  # a walk elsewhere went the same way
            self._last = None

    def retract(self, node: TreeNode) -> None:
        """Take back the leaf :meth:`add_leaf` made last, and its id, as if it had never been.

        For an insert whose next step failed from outside the cache before
        anything else saw the leaf: the next node gets the id it would have
        had, so an event log, which names nodes by id, reads as if the failed
        insert had changed nothing (a replay skips it), and so does a
        tensor-parallel digest.

        Raises:
            InvariantViolation: ``node`` is not the last node made, or not a
                leaf: its id may be known elsewhere, and giving it out again
                would name two nodes alike. Nothing changes.
        """
        if node.id != self._made or node.children or node.parent is None:
            msg = (
                f"node {node.id}: only the last node made, a leaf, can be retracted "
                f"(the last made is node {self._made})"
            )
            raise InvariantViolation(msg)
        self.remove_leaf(node)
        self._made = node.id - 1

    def unsplit(self, prefix: TreeNode) -> TreeNode:
        """Take back the split that made ``prefix``, the last node made, as if it had never been.

        For an operation that split a node and then failed from outside the
        cache before anything else saw the two halves: the suffix gets the
        prefix's tokens, pages and page keys back, and the next node made
        gets the prefix's id, as :meth:`retract` does for a leaf. The pages
        are handed back (the ``hand_over`` hook) before the tree changes, so
        a hand-over that raises leaves the split as it is. Residency is the
        caller's to have checked: the suffix keeps its own, which the split
        left as it was.

        Returns:
            The suffix, whole again.

        Raises:
            InvariantViolation: ``prefix`` is not the last node made, or has
                not exactly one child. Nothing changes.
        """
        children = tuple(prefix.children.values())
        parent = prefix.parent
        if prefix.id != self._made or len(children) != 1 or parent is None:
            msg = (
                f"node {prefix.id}: only the last node made, with one child, can be unsplit "
                f"(the last made is node {self._made})"
            )
            raise InvariantViolation(msg)
        (suffix,) = children
        if self._hand_over is not None:
            self._hand_over(prefix.device_pages, prefix.host_pages, prefix.id, suffix.id)
        _children(parent)[prefix.key[: self.page_size]] = suffix
        suffix.key, suffix.parent = prefix.key + suffix.key, parent
        suffix.device_pages = prefix.device_pages + suffix.device_pages
        suffix.host_pages = prefix.host_pages + suffix.host_pages
        if prefix.store_keys is not None and suffix.store_keys is not None:
            suffix.store_keys = prefix.store_keys + suffix.store_keys
        del self.nodes[prefix.id]
        self._made = prefix.id - 1
        self._last = None
        return suffix

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens; return the new prefix node (the old one's parent).

        The prefix's residency is :func:`~fsm_cache.residency.split_prefix`'s,
        the rule ``fsm-cache check`` model-checks: both states and the lock
        count (it is now an ancestor of every lock holder below ``node``);
        pins stay with their holders on ``node``, except the pin of a load in
        flight, which the prefix needs too because the same copy fills it,
        and (with a storage tier) the pin of a store in flight, which is
        acknowledged for the prefix on its own. The storage state and the page
        keys are sliced like the pages.

        The prefix's pages are handed over (the ``hand_over`` hook) before
        the tree changes, so a hand-over that raises (an allocator that
        broke) leaves the tree as it was, and the next node made gets the id
        the prefix would have had.

        Raises:
            InvariantViolation: ``at`` is not a page boundary inside ``node``,
                or ``node`` is a root. Nothing changes.
        """
        page = self.page_size
        if at <= 0 or at >= len(node.key) or at % page or node.parent is None:
            msg = f"node {node.id}: cannot split {len(node.key)} tokens at {at}"
            raise InvariantViolation(msg)
        cut = at // page
        made = self._made + 1
        device_pages, host_pages = node.device_pages[:cut], node.host_pages[:cut]
        residency = split_prefix(node.host, node.device, node.locks, node.storage)
        if self._hand_over is not None:
            self._hand_over(device_pages, host_pages, node.id, made)
        self._made = made
        prefix = TreeNode(made, node.key[:at], node.parent, device_pages)
        prefix.host_pages = host_pages
        prefix.host, prefix.device, prefix.pins, prefix.locks = residency
        prefix.storage = node.storage
        if node.store_keys is not None:
            prefix.store_keys, node.store_keys = node.store_keys[:cut], node.store_keys[cut:]
        prefix.last_access, prefix.hit_count = node.last_access, node.hit_count
        _children(node.parent)[node.key[:page]] = prefix
        node.key, node.parent = node.key[at:], prefix
        node.device_pages, node.host_pages = node.device_pages[cut:], node.host_pages[cut:]
        prefix.children = {node.key[:page]: node}
        self.nodes[prefix.id] = prefix
        self._last = None
        if self._on_split is not None:
            self._on_split(prefix, node)
        return prefix

    def __iter__(self) -> Iterator[TreeNode]:
        """Yield every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())


def _children(node: TreeNode) -> dict[Key, TreeNode]:
    """Return ``node``'s own children dict, giving it one if it still shares the empty one."""
    if node.children is NO_CHILDREN:
        node.children = {}
    return node.children  # type: ignore[return-value]


def _common_pages(a: Key, b: Key, page: int) -> int:
    """Return the length of the common prefix of ``a`` and ``b`` in whole pages.

    Both start with the same page (that is how the child was found).
    """
    n = min(len(a), len(b))
    n -= n % page
    if a[:n] == b[:n]:
        return n
    i = page
    while a[i : i + page] == b[i : i + page]:
        i += page
    return i
