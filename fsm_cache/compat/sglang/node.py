"""The checked node: SGLang's ``TreeNode`` fields, each change routed through the machines.

SGLang's ``TreeNode`` keeps residency in ``value``/``host_value`` nullity,
``lock_ref`` and ``host_ref_counter``, changed from many code paths, with one
check: ``release_host()`` at zero raises ``RuntimeError("Host reference
counter is already zero.")`` long after the wrong release. Mixing
:class:`ResidencyMixin` into the node class keeps its fields and methods but
makes each change an event of the residency machines, checked where it is made:

* An assignment to ``value`` or ``host_value`` that is exactly one event's
  effect fires that event, checked (``value = None`` on a resident node is
  ``evict_device``; slots on an absent node are ``adopt``, KV recomputed;
  host slots on an unbacked node are ``write``), refused before the field
  changes. An assignment that agrees with the state is no event: a load is
  fired before its copy allocates (:func:`~fsm_cache.compat.sglang.scope.loading`),
  a backup before its controller call, and slicing slots (a radix split) is none.
* ``lock_ref`` moves by one only inside a
  :func:`~fsm_cache.compat.sglang.scope.walk` that checked the whole path
  first (SGLang's ``inc_lock_ref``/``dec_lock_ref`` loops); ``host_ref_counter``
  moves only through ``protect_host()``/``release_host()``. Any other
  assignment raises :class:`ReadOnlyCounter`.
* A node is *fresh* from construction until it is put into a sealed
  parent's ``children`` (or the first event fires at it; a root, which
  nothing attaches, is sealed by the cache's ``reset``): its fields describe
  it as they are assigned, as SGLang builds nodes field by field. A fresh
  node that already has a child when it is attached is the prefix of a radix
  split and takes :func:`fsm_cache.residency.split_prefix` of that child; its
  copy in flight, if any, is acknowledged with the child's. Sealing makes the
  node's ``children`` a :class:`Children`, which checks what is attached to
  and removed from it.
* ``evicted`` and ``backuped`` read the fields, as SGLang defines them.
"""

from __future__ import annotations

from abc import ABCMeta
from collections import defaultdict
from collections.abc import Iterator
from operator import attrgetter
from typing import Any, ClassVar, NoReturn

from fsm_cache.compat.sglang import scope
from fsm_cache.engine import trail
from fsm_cache.errors import FsmCacheError, ReleaseAtZero, error_class
from fsm_cache.residency import (
    DEVICE_HELD,
    HOST_HELD,
    DeviceState,
    HostState,
    Residency,
    default_residency,
    split_prefix,
)


trail.internal(__file__)

SGLANG_ZERO = "Host reference counter is already zero."


class HostRefCounterZero(ReleaseAtZero):
    """SGLang's release-at-zero, with the node, its state and the call sites involved."""

    def render(self) -> str:
        """Return SGLang's message followed by fsm_cache's account of the refusal."""
        return f"{SGLANG_ZERO} {super().render()}"


class ReadOnlyCounter(FsmCacheError, AttributeError):
    """A counter the residency machines own was assigned outside the walk that drives it."""


class SlotsOutOfStep(FsmCacheError, AttributeError):
    """A slot field was assigned in a way no single event of the node's state allows."""


class RemovedInUse(FsmCacheError, RuntimeError):
    """A node left the tree while locked, pinned, or with a copy in flight.

    A node whose child still holds a copy is refused with the spec's own
    ``NotADeviceLeaf``/``NotAHostLeaf`` instead (see ``Children``).
    """


class PatchUndone(ReadOnlyCounter):
    """A node built under a :func:`~fsm_cache.compat.sglang.patch` was driven after its ``undo()``.

    Its counters are still the machines' (it is a checked node), but the cache
    methods that drove them are SGLang's own again.
    """


_LOAD_PIN_HELD = error_class("LoadPinHeld")

_NO_DEFAULT: Any = object()
"""``Children.pop`` called without a default."""


class Children(defaultdict[Any, Any]):
    """A node's ``children`` mapping: attaching a node seals it, removing one checks it is idle.

    Idle: not locked, pinned or copying, and no child of it still holding a
    copy in a tier (SGLang deletes a node with its subtree).

    A ``defaultdict`` like SGLang's (``defaultdict(TreeNode)``): the patch has
    SGLang's ``TreeNode.__init__`` build one in its place, and sealing a node
    wraps any other mapping (the plain dict ``_split_node`` assigns) into one.
    Reads are the C ``dict``'s; only attaching and removing run Python.
    """

    __slots__ = ()

    # The checks below read ``sealed`` rather than ask ``isinstance``: a checked
    # node class is a virtual subclass of ResidencyMixin (the patch's is), and
    # ABCMeta's check is a Python call on the hot path; any other child raises
    # AttributeError here and is stored unchecked.

    def __setitem__(self, key: Any, child: Any) -> None:
        try:
            fresh = not child.sealed
        except AttributeError:  # not a checked node
            fresh = False
        if fresh:
            children = child.children
            if not children and type(children) is Children:  # a new leaf: seal() inlined
                child.sealed = True
            else:
                child.seal()
            try:
                if not child.parent.sealed:
                    child.parent.seal()  # a root, sealed with its first child
            except AttributeError:  # no parent yet, or not a checked node
                pass
        dict.__setitem__(self, key, child)

    # Removal: SGLang 0.5.6's ``_delete_leaf`` deletes, 0.5.23's pops. The check
    # is written out in both (a call would cost what the check does).

    def __delitem__(self, key: Any) -> None:
        child: Any = self.get(key)
        try:
            held = child.sealed and (
                child.locks
                or child.pins
                or child.host == "writing"
                or child.device == "loading"
                or child.children
            )
        except AttributeError:  # not a checked node (or no child under ``key``)
            held = False
        if held:
            _check_removal(child)
        dict.__delitem__(self, key)

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """Remove and return the child under ``key`` (checked as :meth:`__delitem__`)."""
        child: Any = self.get(key)
        try:
            held = child.sealed and (
                child.locks
                or child.pins
                or child.host == "writing"
                or child.device == "loading"
                or child.children
            )
        except AttributeError:  # not a checked node (or no child under ``key``)
            held = False
        if held:
            _check_removal(child)
        if default is _NO_DEFAULT:
            return dict.pop(self, key)
        return dict.pop(self, key, default)


def _checked(mapping: Any) -> Children:
    """``mapping`` as a :class:`Children`, with its default factory if it has one."""
    factory = getattr(mapping, "default_factory", None)
    return Children(factory, mapping) if mapping else Children(factory)


def _check_removal(child: ResidencyMixin) -> None:
    """Refuse to take a node out of the tree while it, or a child of it, is still held.

    A node is held by its locks, pins and copies in flight; a child still
    holding a copy in a tier would leave the tree with it
    (:func:`~fsm_cache.compat.sglang.scope.check_below`), whoever deletes
    the node: SGLang's eviction, or a fork's own call of ``_delete_leaf``.

    Raises:
        RemovedInUse: The node is locked, pinned, or has a copy in flight.
        IllegalTransition: ``NotADeviceLeaf`` or ``NotAHostLeaf``: a child
            still holds a copy.
    """
    if child.locks or child.pins or child.host == "writing" or child.device == "loading":
        _refuse_removal(child)
    scope.check_below(child)


def _refuse_removal(child: ResidencyMixin) -> NoReturn:
    """Refuse to take a node out of the tree while something still holds it."""
    msg = (
        f"node {getattr(child, 'id', '?')}: removed from the tree in "
        f"{child.host}/{child.device} (pins={child.pins}, locks={child.locks}); "
        "release its holders and wait for its copies first"
    )
    raise RemovedInUse(msg)


class ResidencyMixin(metaclass=ABCMeta):
    """Mix into an SGLang-style ``TreeNode`` to make its residency checked.

    Put it first among the bases: ``class TreeNode(ResidencyMixin, OldTreeNode)``
    (:func:`fsm_cache.compat.sglang.patch` builds the same class one level
    flatter for an installed SGLang, and registers it as a subclass). The node
    class must have ``parent``, ``children`` and an instance ``__dict__``, as
    SGLang's has; the cache's ``reset`` seals the root it builds.

    Set ``residency`` on the class to a :class:`Residency` of your own (for
    example one built with ``trail=True``); by default the process-wide one is used.

    Attributes:
        host: Host residency state.
        device: Device residency state.
        pins: Holders of the host copy (SGLang's ``host_ref_counter``, plus a load's pin).
        locks: Locks on the device copy (SGLang's ``lock_ref``).
        trail: Recent events with call sites in trail mode.
        sealed: False while the node is fresh (being built field by field).
        pending: The step a checked walk armed this node with, until taken:
            its ``locks`` after the step when nothing else changes (the fast
            path), else a :data:`~fsm_cache.compat.sglang.scope.Armed`.
        ack_with: The node whose copy's acknowledgement also acknowledges this
            node's copy in flight (a split prefix, a node loaded in the same
            chain); None when its own does.
        evicting: True while the node's device eviction waits for the end of
            the cache's ``evict`` in progress (a child still on the device,
            :func:`~fsm_cache.compat.sglang.scope.device_evictions`); it reads
            as ``evicted`` meanwhile, as in SGLang's loop.
        deleted: True once SGLang's eviction freed the node's device slots
            and took it out of the tree with its only copy
            (:func:`~fsm_cache.compat.sglang.scope.deleting`): its lock walks
            are refused.
        undone: Set on the class when the patch that built it is undone.
    """

    # The residency fields live in the node's ``__dict__`` with these class-level
    # defaults: building a node runs SGLang's own ``__init__`` and no other, and a
    # field takes room once it is written.
    host: HostState = "unbacked"
    device: DeviceState = "resident"
    pins = 0
    locks = 0
    trail: trail.Trail | None = None
    sealed = False
    pending: int | scope.Armed | None = None
    ack_with: scope.CheckedNode | None = None
    evicting = False
    deleted = False
    undone: ClassVar[bool] = False
    _value: Any = None
    _host_value: Any = None

    residency: ClassVar[Residency | None] = None
    parent: Any
    _children: Children

    @classmethod
    def machine(cls) -> Residency:
        """Return the residency engine this node class fires through."""
        return cls.residency or default_residency()

    # -- sealing ---------------------------------------------------------------

    def seal(self) -> None:
        """End the node's construction: from now on every change is an event.

        A node with a child is the prefix of a radix split: it takes the
        residency :func:`~fsm_cache.residency.split_prefix` gives, and its
        fields must agree with it.

        Raises:
            SlotsOutOfStep: A split prefix's slots disagree with the child's residency.
            ReadOnlyCounter: A split prefix's ``lock_ref`` is not the child's.
        """
        if self.sealed:
            return
        children = self.children
        if children and getattr(self, "parent", None) is not None:
            child = next(iter(children.values()))
            if hasattr(child, "sealed"):  # a checked node (see Children)
                child.seal()
                self._take_split(child)
        if type(children) is not Children:  # attaching and removing are checked from now on
            self.children = _checked(children)
        self.sealed = True

    def _take_split(self, child: ResidencyMixin) -> None:
        host, device, pins, locks = split_prefix(child.host, child.device, child.locks)
        if self.locks != locks:
            msg = f"node {getattr(self, 'id', '?')}: split prefix has lock_ref {self.locks}, its child {locks}"
            raise ReadOnlyCounter(msg)
        if (self._value is not None) != (device in DEVICE_HELD):
            self._disagrees("value", device)
        if (self._host_value is not None) != (host in HOST_HELD):
            self._disagrees("host_value", host)
        self.host, self.device, self.pins = host, device, pins
        if child.host == "writing" or child.device == "loading":
            self.ack_with = child.ack_with or child

    def _disagrees(self, field: str, state: str) -> NoReturn:
        msg = f"node {getattr(self, 'id', '?')}: split prefix {field} disagrees with its child's {state}"
        raise SlotsOutOfStep(msg)

    # -- counters --------------------------------------------------------------

    def protect_host(self) -> None:
        """Pin the host copy (SGLang: ``host_ref_counter += 1``), refused without one."""
        self.seal()
        self.machine().pin(self)

    def release_host(self) -> None:
        """Release one pin; at zero raise :class:`HostRefCounterZero` and change nothing.

        A load's own pin is not SGLang's to release (its ``host_ref_counter``
        leaves it out): releasing it is release-at-zero too, as stock SGLang
        reports it.
        """
        self.seal()
        try:
            self.machine().release(self)
        except (ReleaseAtZero, _LOAD_PIN_HELD) as exc:
            raise HostRefCounterZero(
                label=exc.label,
                instance=exc.instance,
                state=exc.state,
                counters=exc.counters,
                event=exc.event,
                reason=exc.reason,
                history=exc.history,
                site=exc.site,
                sites=exc.sites,
                others=exc.others,
            ) from None

    def inc_lock_ref(self) -> None:
        """Lock this node and every ancestor below the root, all or none.

        What SGLang's ``cache.inc_lock_ref(node)`` does to the counts (without
        its ``evictable_size_`` bookkeeping: call the cache's where it has one).
        """
        with scope.walk(self, "lock") as path:
            for node in path:
                node.lock_ref = node.locks + 1

    def dec_lock_ref(self) -> None:
        """Unlock this node and every ancestor below the root; refused at zero (``UnlockAtZero``)."""
        with scope.walk(self, "unlock") as path:
            for node in path:
                node.lock_ref = node.locks - 1

    @property
    def host_ref_counter(self) -> int:
        """Pins on the host copy, a load's own left out (read-only: use protect_host/release_host)."""
        return self.pins - 1 if self.device == "loading" else self.pins

    @host_ref_counter.setter
    def host_ref_counter(self, value: int) -> None:
        # The getter's count, written out: SGLang 0.5.6's __init__ assigns 0 to every node.
        if value != (self.pins - 1 if self.device == "loading" else self.pins):
            self._refuse("host_ref_counter", "protect_host()/release_host()")

    def _set_lock_ref(self, value: int) -> None:
        if value == self.pending:  # the step a walk checked, and nothing else changes
            self.locks = value
            self.pending = None
        elif not self.sealed:  # a fresh node: the field describes it
            self.locks = value
        elif value != self.locks:
            self._step_lock_ref(value)

    def _step_lock_ref(self, value: int) -> None:
        armed = self.pending
        if type(armed) is not tuple or value != armed[0]:
            self._refuse("lock_ref", "cache.inc_lock_ref(node)/cache.dec_lock_ref(node)")
        self.pending = None
        self.locks = value
        for attr, new in armed[1]:  # the rest of the step, checked before the walk began
            setattr(self, attr, new)
        if armed[3] is not None:
            history = self.machine().engine.history
            self.trail = scope.noted(self.trail, armed[2], armed[3], history)

    def _refuse(self, name: str, use: str) -> NoReturn:
        node = f"node {getattr(self, 'id', '?')}"
        if self.undone:
            msg = (
                f"{node}: {name} changed after the patch that built the node was undone; "
                "build the cache again, or undo the patch only when its caches are gone"
            )
            raise PatchUndone(msg)
        msg = f"{node}: {name} is driven by the residency machines; use {use}"
        raise ReadOnlyCounter(msg)

    lock_ref = property(
        attrgetter("locks"),
        _set_lock_ref,
        doc=(
            "Locks on the device copy (SGLang's root keeps the 1 its ``reset`` gives it, "
            "the cache's own); moved by one only inside the cache's lock walks."
        ),
    )

    # -- slot fields -----------------------------------------------------------

    @property
    def evicted(self) -> bool:
        """Whether the node holds no device slots (SGLang: ``value is None``), or soon will.

        A node whose device eviction waits for the end of the ``evict`` in
        progress (``evicting``) reads as evicted, as SGLang's loop expects.
        """
        return self._value is None or self.evicting

    @property
    def backuped(self) -> bool:
        """Whether host slots are held (SGLang: ``host_value is not None``)."""
        return self._host_value is not None

    def _set_value(self, slots: Any) -> None:
        if not self.sealed:
            self.device = "absent" if slots is None else "resident"
        elif self.device in DEVICE_HELD:
            if slots is None:
                self.machine().evict_device(self)
        elif slots is not None:
            self._recomputed()
        self._value = slots

    def _recomputed(self) -> None:
        """Take recomputed KV on an absent node (SGLang's insert over an evicted node).

        ``adopt``, unless the parent is still loading: the spec keeps a
        recomputed node from hanging under a load that may fail (device
        residency is prefix-closed), but SGLang's insert gives it its slots
        there. A load under a loading parent is allowed, so the node takes
        them as a load of its host copy that is done at once (SGLang's loads
        never fail once their slots are allocated). A load is fired before its
        copy allocates (:func:`~fsm_cache.compat.sglang.scope.loading`), so it
        never reaches here.
        """
        machine = self.machine()
        if getattr(self.parent, "device", None) == "loading" and self.host in HOST_HELD:
            machine.load(self)
            machine.load_done(self)
        else:
            machine.adopt(self)

    # The getters are C functions: SGLang reads these fields in every loop.
    value = property(
        attrgetter("_value"),
        _set_value,
        doc="Device slot indices (``None`` once evicted from the device).",
    )

    def _set_host_value(self, slots: Any) -> None:
        if not self.sealed:
            if slots is None and self._host_value is None:
                return  # SGLang's __init__: the class defaults say it already
            self.host = "unbacked" if slots is None else "backed"
        elif self.host in HOST_HELD:
            if slots is None and self.host == "writing":
                self.machine().write_failed(self)
            elif slots is None:
                scope.free_host(self)
        elif slots is not None:
            self.machine().write(self)
        self._host_value = slots

    host_value = property(
        attrgetter("_host_value"),
        _set_host_value,
        doc="Host slot indices (``None`` without a host copy).",
    )

    def _set_children(self, mapping: Any) -> None:
        self._children = mapping if type(mapping) is Children else _checked(mapping)

    children = property(
        attrgetter("_children"),
        _set_children,
        doc=(
            "The child nodes (a :class:`Children`): attaching one seals it, removing one "
            "checks it is idle. The patched SGLang's ``TreeNode`` has no such property: "
            "its ``__init__`` builds a ``Children`` itself."
        ),
    )

    def path_to_root(self) -> Iterator[scope.CheckedNode]:
        """Yield this node and its ancestors, the root (the node without a parent) excluded."""
        node: Any = self
        while node is not None and getattr(node, "parent", None) is not None:
            yield node
            node = node.parent
