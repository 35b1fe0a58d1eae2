"""Checks placed before SGLang's code moves memory: walks, loads, acknowledgements.

SGLang's cache methods change many nodes in a loop, or move memory first and
record it in a field afterwards. Each helper here checks the whole change
before the first step, so a refusal changes nothing:

* :func:`walk` checks a lock or unlock on every node of the path to the root
  (the root excluded, as SGLang's loops stop there), then lets the loop move
  each node's ``lock_ref`` by one, once.
* :func:`loading` fires ``load`` on the chain an ``load_back`` is about to
  copy, before the controller allocates device slots; :func:`back_out` fails
  those loads again when SGLang gives up (device memory short).
* :class:`AckBook` is SGLang's ``ongoing_write_through`` / ``ongoing_load_back``
  dict: taking a node out of it is the copy's acknowledgement, which fires
  ``write_done`` / ``load_done`` on the node and on every node whose copy rode
  on the same one (split prefixes, the rest of a loaded chain).

The helpers serve both doors: :func:`fsm_cache.compat.sglang.patch` wraps
SGLang's methods with them, and a fork adds them by hand (docs/sglang.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fsm_cache.engine import trail
from fsm_cache.residency import Event


if TYPE_CHECKING:
    from fsm_cache.compat.sglang.node import ResidencyMixin

trail.internal(__file__)


Step = tuple[tuple[str, Any], ...]
"""The attribute assignments of one node's step, as :meth:`Engine.plan` returns them."""
Armed = tuple[int, "Step | None", "Walk"]
"""What a walk arms a node with: its ``locks`` after the step, the step's other changes, the walk."""


class Walk:
    """A checked walk of ``event`` up a path: each node's step, checked before the first is taken.

    Use it as a context manager (``with Walk(node, "lock") as path:``) or
    :meth:`open` / :meth:`close` it around SGLang's loop. While open, each
    node of the path may move ``lock_ref`` by one in the event's direction,
    once; the step applied is the one checked. The armed step is kept on the
    node itself (``node.pending``), so the hot ``lock_ref`` setter reads one
    field.

    Raises:
        IllegalTransition: ``event`` is refused at a node of the path; nothing changed.
    """

    __slots__ = ("event", "path", "steps", "trail")

    def __init__(self, node: ResidencyMixin, event: Event) -> None:
        self.event = event
        self.path: list[ResidencyMixin] = []
        self.steps: list[Armed] = []
        engine = node.machine().engine
        self.trail = engine.trail
        plan = engine.planner(event)
        at: Any = node
        while at.parent is not None:  # SGLang's loops stop at the root
            if not at.sealed:
                at.seal()
            self.path.append(at)
            self.steps.append(self._armed(at, plan(at)[0]))
            at = at.parent

    def _armed(self, node: ResidencyMixin, step: Step) -> Armed:
        """``(locks after the step, its other changes, this walk)``; None: no others, no trail."""
        locks = node.locks
        others: list[tuple[str, Any]] = []
        for attr, value in step:
            if attr == "locks":
                locks = value
            elif getattr(node, attr) != value:
                others.append((attr, value))
        return (locks, tuple(others) if others or self.trail else None, self)

    def open(self) -> Walk:
        """Arm each node of the path with its checked step (until :meth:`close`).

        The node's ``lock_ref`` setter takes the fast path when the step
        changes nothing but ``locks`` and no trail is kept.
        """
        for node, armed in zip(self.path, self.steps, strict=True):
            node.pending = armed
        return self

    def close(self) -> None:
        """Disarm the steps not taken: no node of the walk may step any more."""
        for node in self.path:
            node.pending = None

    def __enter__(self) -> list[ResidencyMixin]:
        self.open()
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


def walk(node: ResidencyMixin, event: Event) -> Walk:
    """Check ``event`` (``lock``/``unlock``) on ``node`` and its ancestors; a :class:`Walk`.

    Raises:
        IllegalTransition: ``event`` is refused at a node of the path; nothing changed.
    """
    return Walk(node, event)


def absent_chain(node: ResidencyMixin) -> list[ResidencyMixin]:
    """Return ``node`` and the ancestors above it that hold no device slots, top down.

    The nodes SGLang's ``load_back`` copies in one load: it walks up while
    ``node.evicted``.
    """
    chain: list[ResidencyMixin] = []
    at: Any = node
    while at is not None and at.evicted and getattr(at, "parent", None) is not None:
        chain.append(at)
        at = at.parent
    return chain[::-1]


def loading(chain: Sequence[ResidencyMixin]) -> None:
    """Fire ``load`` on ``chain`` top down, before any memory is allocated for it.

    All or none: if a node refuses, the loads already fired are failed again
    and the refusal is raised.

    Raises:
        IllegalTransition: A node of the chain refuses the load.
    """
    done: list[ResidencyMixin] = []
    try:
        for n in chain:
            n.seal()
            n.machine().load(n)
            done.append(n)
    except BaseException:
        back_out(done)
        raise


def back_out(chain: Sequence[ResidencyMixin]) -> None:
    """Fail the loads of ``chain`` that never got device slots, deepest first."""
    for n in reversed(chain):
        if n.device == "loading" and n.value is None:
            n.machine().load_failed(n)


def ride(chain: Sequence[ResidencyMixin], end: ResidencyMixin) -> None:
    """Mark the nodes of ``chain`` above ``end`` as acknowledged with ``end``'s copy."""
    for n in chain:
        if n is not end:
            n.ack_with = end


class AckBook(dict[Any, Any]):
    """SGLang's record of copies in flight by node id; taking a node out acknowledges its copy.

    ``pop(node_id)`` and ``del book[node_id]`` (how ``writing_check`` and
    ``loading_check`` consume an acknowledgement) fire ``event`` on the node
    and on each ancestor whose copy rides on it (``ack_with``), top down, all
    checked before any is applied.

    Args:
        event: ``write_done`` or ``load_done``.
        entries: What the dict already holds.
    """

    def __init__(self, event: Event, entries: dict[Any, Any] | None = None) -> None:
        super().__init__(entries or {})
        self.event = event

    def pop(self, key: Any, *default: Any) -> Any:
        """Remove ``key`` and acknowledge its node's copy; as ``dict.pop`` otherwise."""
        if key in self:
            self.acknowledge(self[key])
        return super().pop(key, *default)

    def __delitem__(self, key: Any) -> None:
        self.acknowledge(self[key])
        super().__delitem__(key)

    def acknowledge(self, node: ResidencyMixin) -> None:
        """Fire the acknowledgement on ``node`` and its riders, every one checked first.

        Raises:
            IllegalTransition: A node refuses it (a duplicate or stray ack); nothing changed.
        """
        chain = [node]
        at: Any = node.parent
        while at is not None and getattr(at, "ack_with", None) is node:
            chain.append(at)
            at = at.parent
        chain.reverse()
        for n in chain:
            n.seal()
            n.machine().engine.plan(n, self.event)
        for n in chain:
            n.machine().verb(self.event)(n)
            n.ack_with = None


class _HostEvictions(threading.local):
    """Per thread: the nodes an ``evict_host`` in progress may free, by their host slots' id."""

    def __init__(self) -> None:
        self.open: list[dict[int, Any]] = []


_HOST = _HostEvictions()


@contextmanager
def host_evictions(root: Any) -> Iterator[None]:
    """Let :func:`host_eviction` find, by its slots, each node the block may evict from the host.

    SGLang's ``evict_host`` loop frees a victim's host slots through its
    controller (``evict_host(x.host_value)``) and then drops the node; the
    controller call is where ``evict_host`` must be checked, and all it gets
    is the slots.
    """
    owners: dict[int, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.host_value is not None and node.evicted:
            owners[id(node.host_value)] = node
    _HOST.open.append(owners)
    try:
        yield
    finally:
        _HOST.open.remove(owners)


def host_eviction(slots: Any) -> None:
    """Fire ``evict_host`` on the node whose host slots ``slots`` are, if one is being evicted.

    Raises:
        IllegalTransition: The node refuses it (pinned, written, loaded); nothing was freed.
    """
    for owners in reversed(_HOST.open):
        node = owners.get(id(slots))
        if node is not None:
            node.seal()
            node.machine().evict_host(node)
            return


def check(path: Sequence[ResidencyMixin], event: Event) -> None:
    """Check ``event`` at every node of ``path``, changing nothing.

    Raises:
        IllegalTransition: A node refuses it.
    """
    for n in path:
        n.seal()
        n.machine().engine.plan(n, event)
