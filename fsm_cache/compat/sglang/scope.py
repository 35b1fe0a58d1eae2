"""Checks placed before SGLang's code moves memory: walks, loads, acknowledgements.

SGLang's cache methods change many nodes in a loop, or move memory first and
record it in a field afterwards. Each helper here checks the whole change
before the first step, so a refusal changes nothing:

* :func:`walked` (a decorator for ``inc_lock_ref``/``dec_lock_ref``) and
  :func:`walk` (a context manager around the loop) check a lock or unlock on
  every node of the path to the root (the root excluded, as SGLang's loops
  stop there), then let the loop move each node's ``lock_ref`` by one, once.
* :func:`loading` fires ``load`` on the chain an ``load_back`` is about to
  copy, before the controller allocates device slots; :func:`back_out` fails
  those loads again when SGLang gives up (device memory short).
* :func:`deleting` checks a victim ``evict`` is about to free and delete
  (a locked one is refused, and one with a child still holding a copy,
  :func:`check_below`) and marks it deleted, so it cannot be locked again.
* :func:`device_evictions` lets a write-back ``evict`` free a parent after
  the child it is writing back, as the spec requires, with SGLang's loop
  seeing the order it expects.
* :class:`AckBook` is SGLang's ``ongoing_write_through`` / ``ongoing_load_back``
  dict: taking a node out of it is the copy's acknowledgement, which fires
  ``write_done`` / ``load_done`` on the node and on every node whose copy rode
  on the same one (split prefixes, the rest of a loaded chain).

The helpers serve both doors: :func:`fsm_cache.compat.sglang.patch` wraps
SGLang's methods with them, and a fork adds them by hand (docs/sglang.md).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from fsm_cache.engine import trail
from fsm_cache.engine.codegen import Refusal
from fsm_cache.engine.core import Engine, Plan
from fsm_cache.errors import FsmCacheError, IllegalTransition, StaleNode, error_class
from fsm_cache.residency import HOST_HELD, DeviceState, Event, HostState, Residency
from fsm_cache.spec.machine import Forbid
from fsm_cache.spec.meaning import composed_refusal, condition_holds
from fsm_cache.spec.validate import representatives


trail.internal(__file__)


class CheckedNode(Protocol):
    """What the checks here read and write of a checked node.

    :class:`~fsm_cache.compat.sglang.node.ResidencyMixin` holds it all; the
    checks take this reader rather than import the node class that imports them.
    """

    host: HostState
    device: DeviceState
    pins: int
    locks: int
    lock_ref: int
    trail: trail.Trail | None
    pending: int | Armed | None
    ack_with: CheckedNode | None
    evicting: bool
    deleted: bool
    parent: Any
    value: Any
    host_value: Any
    children: Any

    @property
    def evicted(self) -> bool:
        """Whether the node holds no device slots, or soon will."""

    def machine(self) -> Residency:
        """Return the residency engine the node fires through."""

    def seal(self) -> None:
        """End the node's construction: from now on every change is an event."""

    def path_to_root(self) -> Iterator[CheckedNode]:
        """Yield the node and its ancestors, the root excluded."""


class BuiltBeforePatch(FsmCacheError, TypeError):
    """A checked cache method was given a node SGLang built before the patch.

    A cache built before :func:`~fsm_cache.compat.sglang.patch` keeps SGLang's
    own nodes: they have no residency to check, and nodes attached to them are
    never sealed. Its lock walks and memory moves are refused before they
    change anything; build the cache after patching.
    """


Step = tuple[tuple[str, Any], ...]
"""The attribute assignments of one node's step, as :meth:`Engine.plan` returns them."""
Armed = tuple[int, Step, Event, "trail.Spot | None"]
"""What a walk arms a node with when its step changes more than ``locks`` or
trail mode notes it: its ``locks`` after the step, the step's other changes,
the event, and the call site to note it at in the node's trail (None: not
noted). Any other step is armed with the bare ``locks`` after it."""
Planner = Callable[[Any], Plan]
"""An engine's :meth:`~fsm_cache.engine.core.Engine.planner` for one event."""
Method = Callable[..., Any]
"""A cache method, as :func:`walked` decorates it."""


@dataclass(frozen=True)
class CounterStep:
    """Where an event's step moves one counter by a fixed amount and changes nothing else.

    What a lock walk checks at each node, read off the compiled spec once
    (:func:`counter_step`), so the walk checks a node with one lookup and one
    comparison instead of planning the whole step.

    Attributes:
        region: The one region that declares the event.
        counter: The counter the step moves.
        delta: By how much.
        least: Per state of ``region`` in which that is the whole step: the least
            counter value from which it is (every value from it up is accepted,
            every value below refused or a different step).
    """

    region: str
    counter: str
    delta: int
    least: dict[str, int]


def counter_step(engine: Engine, event: Event) -> CounterStep | None:
    """Read off ``engine``'s compiled spec where ``event`` only moves a counter, or None.

    Fires nothing: plans ``event`` on a probe record in every combination of
    region states and every counter's
    :func:`~fsm_cache.spec.validate.representatives`, which meet every class
    of values no guard tells apart, so what holds at them holds for all values.
    None when the event is declared by more than one region, has rules that
    read other regions or the tree (the probe could not see those), its region
    has more than one counter, or it is nowhere a pure counter step.
    """
    system = engine.system
    regions = system.regions_of(event)
    if len(regions) != 1 or system.forbids_for(event):
        return None
    region, plan = regions[0], engine.planner(event)
    counters = system.machines[region].counter_names
    if len(counters) != 1:
        return None
    axes: list[tuple[str, tuple[Any, ...]]] = [(n, m.state_names) for n, m in system.regions]
    for _, machine in system.regions:
        axes += list(representatives(machine).items())
    outcomes: dict[tuple[str, int], set[tuple[str, int] | None]] = {}
    for values in itertools.product(*(axis for _, axis in axes)):
        probe = engine.new()
        for (name, _), value in zip(axes, values, strict=True):
            setattr(probe, name, value)
        key = (getattr(probe, region), getattr(probe, counters[0]))
        outcomes.setdefault(key, set()).add(_moved(probe, plan))
    return _least(region, outcomes)


def _moved(probe: Any, plan: Planner) -> tuple[str, int] | None:
    """``(counter, delta)`` when ``plan`` accepts and moves one counter only; else None."""
    try:
        assigns, effects, _ = plan(probe)
    except IllegalTransition:
        return None
    changed = [(attr, value) for attr, value in assigns if getattr(probe, attr) != value]
    if effects or len(changed) != 1 or not isinstance(changed[0][1], int):
        return None
    attr, value = changed[0]
    return attr, value - getattr(probe, attr)


def _least(
    region: str, outcomes: dict[tuple[str, int], set[tuple[str, int] | None]]
) -> CounterStep | None:
    """Keep the states where the outcome is one counter step from some value up, for all values."""
    moves = {o for found in outcomes.values() for o in found if o is not None}
    if len(moves) != 1 or any(len(found) != 1 for found in outcomes.values()):
        return None  # two different steps, or one that depends on another region
    ((counter, delta),) = moves
    least: dict[str, int] = {}
    for state in {state for state, _ in outcomes}:
        values = sorted(v for s, v in outcomes if s == state)
        pure = [v for v in values if outcomes[state, v] == {(counter, delta)}]
        if pure and pure == [v for v in values if v >= pure[0]]:
            least[state] = pure[0]
    return CounterStep(region, counter, delta, least) if least else None


def walked(event: Event, machine: Residency) -> Callable[[Method], Method]:
    """Decorate a cache's lock walk (``inc_lock_ref``/``dec_lock_ref``) to check it first.

    Before the method runs, ``event`` is checked at its node and every
    ancestor below the root and each node is armed with its step; the
    method's own loop then takes each step (``node.lock_ref += 1``), once;
    afterwards every node is disarmed. One check per node, per call, and no
    object built for the walk: where the step only moves ``locks`` (the spec
    says where, :func:`counter_step`), the check is one lookup and one
    comparison and the node is armed with its count after the step. In trail
    mode each step is noted at the call of the method, not at the line of its
    loop that takes it: a lock released twice names both releases.

    Args:
        event: ``lock`` or ``unlock``.
        machine: The engine the nodes fire through (their class's).

    Returns:
        A decorator for ``method(self, node, ...)``; a cache whose ``disable``
        is true runs the method unchecked, as SGLang's returns at once.

    Raises:
        IllegalTransition: (from the decorated method) ``event`` is refused at
            a node of the path, before the method runs; nothing changed.
        StaleNode: (from the decorated method) the path ends at a root that
            is not the cache's ``root_node`` (a node from before its
            ``reset()``, or another cache's), or the node is one SGLang's
            eviction deleted; before the method runs.
    """
    engine = machine.engine
    plan, trail_on = engine.planner(event), engine.trail
    fast = None if trail_on else counter_step(engine, event)
    # Per device state, the least ``locks`` from which the step only moves it
    # (a floor no count reaches where it never does): one subscript per node.
    least: dict[str, int] = {}
    delta = 0
    if fast is not None and (fast.region, fast.counter) == ("device", "locks"):
        least = dict.fromkeys(engine.system.machines["device"].state_names, _NEVER)
        least.update(fast.least)
        delta = fast.delta

    def decorate(original: Method) -> Method:
        @functools.wraps(original)
        def method(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "disable", False):
                return original(self, node, *args, **kwargs)
            # Trail mode notes each step at the call of the walk, not at SGLang's loop line.
            spot = trail.caller_spot() if trail_on else None
            at = node
            try:
                if node.deleted:
                    _refuse_deleted(node, original.__name__)
                while (up := at.parent) is not None:  # SGLang's loops stop at the root
                    if not at.sealed:
                        at.seal()
                    locks = at.locks
                    try:
                        floor = least[at.device]
                    except KeyError:  # no fast check (trail mode, another spec)
                        floor = _NEVER
                    if locks >= floor:
                        at.pending = locks + delta
                    else:  # the full check: refuses, or arms a step that changes more
                        at.pending = _armed(at, plan, event, spot)
                    at = up
            except BaseException as exc:
                _abandon(node, at, exc, original.__name__)
                raise
            if at is not getattr(self, "root_node", at):
                _disarm(node, at)
                _refuse_foreign(node, at, original.__name__)
            try:
                if args or kwargs:
                    return original(self, node, *args, **kwargs)
                return original(self, node)
            finally:
                while node.parent is not None:  # disarm what the method left armed
                    node.pending = None
                    node = node.parent

        return method

    return decorate


_NEVER = sys.maxsize
"""A floor no lock count reaches: the state takes the full check."""


def require_checked(node: Any, call: str) -> None:
    """Refuse ``call`` on a node of SGLang's that the patch did not build (its cache predates it).

    Anything that is not an SGLang node (no ``lock_ref``) is let through, to
    fail as it would stock.

    Raises:
        BuiltBeforePatch: ``node`` is SGLang's own ``TreeNode``; nothing changed.
    """
    if hasattr(node, "lock_ref") and not hasattr(node, "sealed"):
        msg = (
            f"node {getattr(node, 'id', '?')}: {call} of a node built before patch() "
            "(SGLang's own TreeNode, unchecked); build the cache after patching; nothing changed"
        )
        raise BuiltBeforePatch(msg)


BOOKS = ("ongoing_write_through", "ongoing_load_back")
"""SGLang's records of copies in flight, which the patched ``__init__`` makes :class:`AckBook`."""


def require_books(cache: Any, call: str) -> None:
    """Refuse ``call`` (a copy) in a cache whose records of copies in flight are SGLang's dicts.

    A cache whose ``__init__`` ran before the patch (another thread patched
    while it was being built) can hold checked nodes with plain dicts for its
    records: the copy would be fired, and its acknowledgement never, so the
    node would stay ``writing`` or ``loading`` and a later step would be
    refused far from the cause.

    Raises:
        BuiltBeforePatch: One of :data:`BOOKS` is a plain dict; nothing changed.
    """
    for name in BOOKS:
        book = getattr(cache, name, None)
        if isinstance(book, dict) and not isinstance(book, AckBook):
            msg = (
                f"{type(cache).__name__}: {call} in a cache built before patch() ({name} is "
                "SGLang's dict, which acknowledges no copy); build the cache after patching; "
                "nothing changed"
            )
            raise BuiltBeforePatch(msg)


def _refuse_foreign(node: Any, top: Any, walk: str) -> NoReturn:
    """Refuse a lock walk whose path ends at a root that is not its cache's.

    SGLang's loop would run on up to its cache's root and never meet it: it
    moves the counts of every node on the way (and the cache's
    ``evictable_size_``) before failing past the stale root, as after a
    ``reset()`` (``flush_cache``) or with another cache's node.

    Raises:
        StaleNode: Always; nothing was changed.
    """
    msg = (
        f"node {getattr(node, 'id', '?')}: {walk} walks up to node {getattr(top, 'id', '?')}, "
        "which is not this cache's root: the node is from before a reset() or from another "
        "cache; nothing changed"
    )
    raise StaleNode(_with_sites(msg, node))


def _with_sites(msg: str, node: Any) -> str:
    """``msg``, followed in trail mode by ``node``'s recent call sites and the refused call's."""
    engine = node.machine().engine
    if not engine.trail:
        return msg
    past = engine.system.past_tenses
    return f"{msg}; {trail.account(trail.sites(node.trail), past, trail.caller_site())}"


def _abandon(node: Any, at: Any, exc: BaseException, walk: str) -> None:
    """Disarm what a walk armed below ``at``, where it stopped; refuse ``at`` if SGLang built it.

    Raises:
        BuiltBeforePatch: The walk stopped for want of a checked node's field
            at ``at``, one of SGLang's own nodes.
    """
    _disarm(node, at)
    if isinstance(exc, AttributeError):
        require_checked(at, walk)


def _disarm(node: Any, stop: Any) -> None:
    """Disarm ``node`` and its ancestors below ``stop``: no step not taken may be taken later."""
    at = node
    while at is not stop and at.parent is not None:
        at.pending = None
        at = at.parent


def _armed(node: CheckedNode, plan: Planner, event: Event, spot: trail.Spot | None) -> int | Armed:
    """``node``'s checked step as it is armed: the ``locks`` after it, or an :data:`Armed`.

    ``spot`` is the call site trail mode notes the step at; None outside trail mode.
    """
    locks = node.locks
    others: Step = ()
    for attr, value in plan(node)[0]:
        if attr == "locks":
            locks = value  # type: ignore[assignment]
        elif getattr(node, attr) != value:
            others = (*others, (attr, value))
    if others or spot is not None:
        return (locks, others, event, spot)
    return locks


def noted(past: trail.Trail | None, event: Event, spot: trail.Spot, length: int) -> trail.Trail:
    """Append ``event`` at the call site ``spot`` to a node's trail (creating it); return it.

    :func:`fsm_cache.engine.trail.note` with the site given: a lock walk's
    step is taken inside SGLang's loop, but noted where the walk was called.
    """
    if past is None:
        past = deque(maxlen=length)
    past.append((event, *spot))
    return past


class Walk:
    """A checked walk of ``event`` up a path: each node's step, checked before the first is taken.

    Use it as a context manager (``with Walk(node, "lock") as path:``) or
    :meth:`open` / :meth:`close` it around SGLang's loop. While open, each
    node of the path may move ``lock_ref`` by one in the event's direction,
    once; the step applied is the one checked, noted in trail mode where the
    walk was opened. The armed step is kept on the
    node itself (``node.pending``), so the hot ``lock_ref`` setter reads one
    field.

    Raises:
        IllegalTransition: ``event`` is refused at a node of the path; nothing changed.
    """

    __slots__ = ("event", "path", "steps")

    def __init__(self, node: CheckedNode, event: Event) -> None:
        self.event = event
        self.path: list[CheckedNode] = []
        self.steps: list[int | Armed] = []
        engine = node.machine().engine
        plan = engine.planner(event)
        if node.deleted:
            _refuse_deleted(node, event)
        spot = trail.caller_spot() if engine.trail else None  # where the walk was opened
        at: Any = node
        while at.parent is not None:  # SGLang's loops stop at the root
            if not at.sealed:
                at.seal()
            self.path.append(at)
            self.steps.append(_armed(at, plan, event, spot))
            at = at.parent

    def open(self) -> Walk:
        """Arm each node of the path with its checked step (until :meth:`close`)."""
        for node, armed in zip(self.path, self.steps, strict=True):
            node.pending = armed
        return self

    def close(self) -> None:
        """Disarm the steps not taken: no node of the walk may step any more."""
        for node in self.path:
            node.pending = None

    def __enter__(self) -> list[CheckedNode]:
        self.open()
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


def walk(node: CheckedNode, event: Event) -> Walk:
    """Check ``event`` (``lock``/``unlock``) on ``node`` and its ancestors; a :class:`Walk`.

    Raises:
        IllegalTransition: ``event`` is refused at a node of the path; nothing changed.
    """
    return Walk(node, event)


def absent_chain(node: CheckedNode) -> list[CheckedNode]:
    """Return ``node`` and the ancestors above it that hold no device slots, top down.

    The nodes SGLang's ``load_back`` copies in one load: it walks up while
    ``node.evicted``.
    """
    chain: list[CheckedNode] = []
    at: Any = node
    while at is not None and at.evicted and getattr(at, "parent", None) is not None:
        chain.append(at)
        at = at.parent
    return chain[::-1]


def loading(chain: Sequence[CheckedNode]) -> None:
    """Fire ``load`` on ``chain`` top down, before any memory is allocated for it.

    All or none: if a node refuses, the loads already fired are failed again
    and the refusal is raised.

    Raises:
        IllegalTransition: A node of the chain refuses the load.
        BuiltBeforePatch: A node of the chain is SGLang's own; nothing fired.
    """
    for n in chain:
        require_checked(n, "load_back")
    done: list[CheckedNode] = []
    try:
        for n in chain:
            n.seal()
            n.machine().load(n)
            done.append(n)
    except BaseException:
        back_out(done)
        raise


def back_out(chain: Sequence[CheckedNode]) -> None:
    """Fail the loads of ``chain`` that never got device slots, deepest first."""
    for n in reversed(chain):
        if n.device == "loading" and n.value is None:
            n.machine().load_failed(n)


def ride(chain: Sequence[CheckedNode], end: CheckedNode) -> None:
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

    def acknowledge(self, node: CheckedNode) -> None:
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


class _DeviceEvictions(threading.local):
    """Per thread: for each ``evict`` in progress, the nodes whose device eviction waits for its end."""

    def __init__(self) -> None:
        self.open: list[list[Any]] = []


_DEVICE = _DeviceEvictions()


@contextmanager
def device_evictions() -> Iterator[list[Any]]:
    """Let a node's device eviction inside the block wait while a child is still on the device.

    SGLang 0.5.6's write-back ``evict`` starts a leaf's write-back, goes on
    up to its parent and frees the parent's device slots in the same loop,
    and frees the leaf's only after the loop, once the write-backs are
    acknowledged. The spec refuses the parent's ``evict_device`` while the
    child is on the device (device residency is prefix-closed). Inside the
    block such a parent is put on the yielded list (:func:`defer_eviction`)
    and reads as evicted, so SGLang's loop goes on as it does stock; the
    caller evicts the listed nodes, checked, after the block, in the order
    of :func:`deepest_first` (not the list's: a write-back child freed after
    the loop may itself wait for a grandchild). Leaving the block clears the
    marks whether or not it raised.

    Yields:
        The nodes whose eviction was deferred, in the order they came.
    """
    deferred: list[Any] = []
    _DEVICE.open.append(deferred)
    try:
        yield deferred
    finally:
        _DEVICE.open.remove(deferred)
        for node in deferred:
            node.evicting = False


def defer_eviction(node: CheckedNode) -> bool:
    """Defer ``node``'s device eviction to the end of the ``evict`` in progress, if it must wait.

    It must wait when a :func:`device_evictions` block is open, the node is
    resident with its host copy complete, and a child is still on the device.
    Anything else is left to ``evict_device``'s own check.

    Returns:
        Whether it was deferred (the caller then frees nothing now).
    """
    if not _DEVICE.open or node.evicting or node.device != "resident" or node.host == "writing":
        return False
    if not any(getattr(c, "device", "absent") != "absent" for c in node.children.values()):
        return False
    node.evicting = True
    _DEVICE.open[-1].append(node)
    return True


def deepest_first(nodes: Sequence[CheckedNode]) -> list[CheckedNode]:
    """Return ``nodes`` ordered so that each comes before its ancestors (deepest first)."""
    return sorted(nodes, key=lambda n: sum(1 for _ in n.path_to_root()), reverse=True)


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
        BuiltBeforePatch: The node is SGLang's own; nothing was freed.
    """
    for owners in reversed(_HOST.open):
        node = owners.get(id(slots))
        if node is not None:
            require_checked(node, "evict_host")
            node.seal()
            free_host(node)
            return


def free_host(node: CheckedNode) -> None:
    """Fire ``evict_host`` on ``node``; a copy a load reads is refused as the load's.

    A load holds a pin on the host copy while it reads it, and the host
    machine refuses to free a pinned copy before the composition is asked
    (the engine checks regions first), so the refusal would say a holder
    pins it: SGLang's ``host_ref_counter`` leaves the load's pin out (it
    reads 0), and SGLang has no such holder. Where a refusal of the
    composition's that reads the node's other regions holds (a
    host-to-device copy in flight), it is raised in the region's place,
    with the same node, state, counters and trail.

    Raises:
        IllegalTransition: The node refuses it (pinned, written, loaded); nothing was freed.
    """
    machine = node.machine()
    try:
        machine.evict_host(node)
    except IllegalTransition as exc:
        raise _as_composed(node, exc) from None


def _as_composed(node: Any, exc: IllegalTransition) -> IllegalTransition:
    """``exc``, or the composition's refusal of its event that holds on ``node``'s own regions.

    Only a refusal that reads the node's own regions is looked for (no parent
    or children are given): the region's refusal names the node's own state,
    and so must the one raised in its place.
    """
    engine = node.machine().engine
    system = engine.system
    states = {region: getattr(node, region) for region, _ in system.regions}
    forbid = composed_refusal(system, exc.event, states, engine.counters(node))
    if forbid is None:
        return exc
    owner = system.regions_of(exc.event)[0]
    return error_class(forbid.error)(
        label=exc.label,
        instance=exc.instance,
        state=exc.state,
        counters=exc.counters,
        event=exc.event,
        reason=forbid.reason,
        history=exc.history,
        site=exc.site,
        sites=exc.sites,
        others={region: states[region] for region in forbid.others(owner)},
    )


def deleting(node: Any) -> None:
    """Check that SGLang may free a resident victim's device slots and delete it; mark it deleted.

    SGLang's ``RadixCache.evict`` (and 0.5.6's ``_evict_regular``) frees a
    victim's device slots and takes it out of the tree without clearing its
    ``value``: stock, nothing says the node is gone, and a handle to it can
    still be locked. Called before the slots are freed, this refuses a victim
    a request still locks (the spec's refusal of its ``evict_device``) while
    nothing has changed. A victim with a host copy fires ``evict_device``;
    one without (the only copy, which no event drops: SGLang deletes the
    node with it) is marked ``deleted``, and the lock walks refuse it.

    Raises:
        IllegalTransition: The victim is locked, has a copy in flight, or
            has a child that still holds a copy (:func:`check_below`);
            nothing was freed.
        BuiltBeforePatch: The victim is SGLang's own node; nothing was freed.
    """
    require_checked(node, "evict")
    if getattr(node, "device", "absent") == "absent" or getattr(node, "parent", None) is None:
        return  # not an SGLang node, off the device already, or a root
    node.seal()
    check_below(node)
    machine = node.machine()
    if node.host in HOST_HELD:
        machine.evict_device(node)
        return
    if node.locks:
        machine.engine.plan(node, "evict_device")  # raises the spec's refusal of a locked copy
    node.deleted = True
    if machine.engine.trail:
        node.trail = trail.note(node.trail, "delete", machine.engine.history)


DROPS: tuple[Event, ...] = ("evict_device", "evict_host")
"""The events that drop a node's copies: deleting the node from the tree drops both at once."""


def below_rules(residency: Residency) -> tuple[Forbid, ...]:
    """The spec's rules along the tree that keep a copy from being dropped above a child's.

    The composition's refusals of :data:`DROPS` whose conditions read the
    node's children only (``NotADeviceLeaf``, ``NotAHostLeaf`` in
    ``specs/residency.toml``): deleting a node breaks what they protect as
    dropping either copy does, whatever the node itself holds.
    """
    system = residency.engine.system
    return tuple(
        forbid
        for event in DROPS
        for forbid in system.forbids_for(event)
        if forbid.when and all(cond.scope == "child" for cond in forbid.when)
    )


def check_below(node: Any) -> None:
    """Refuse deleting ``node`` from the tree while a child of it still holds a copy in a tier.

    SGLang deletes a node with its whole subtree: a child still on the
    device, or holding a host copy (0.5.6's ``_evict_regular`` deleting an
    unbacked device leaf whose child was backed up when the parent's backup
    did not fit), would leave the tree with its slots allocated, never to be
    matched or freed. The refusal is the spec's rule of :func:`below_rules`
    that holds, naming the node, the child and, in trail mode, the node's
    recent call sites and the refused call's.

    Raises:
        IllegalTransition: ``NotADeviceLeaf`` or ``NotAHostLeaf`` (the spec's
            classes); nothing changed.
    """
    children = getattr(node, "children", None)
    if not children:
        return
    engine = node.machine().engine
    system = engine.system
    kids = list(children.values())
    views: list[dict[str, str]] = [
        {region: getattr(kid, region, "") for region, _ in system.regions} for kid in kids
    ]
    counters = engine.counters(node)
    for forbid in below_rules(node.machine()):
        if forbid.guard.holds(counters) and all(
            condition_holds(cond, {}, None, views) for cond in forbid.when
        ):
            first = forbid.when[0]  # the child it names: one the first condition reads
            kid = next(
                k for k, v in zip(kids, views, strict=True) if v[first.region] in first.states
            )
            _refuse_below(node, kid, forbid)


def _refuse_below(node: Any, kid: Any, forbid: Forbid) -> NoReturn:
    """Raise ``forbid``'s refusal of deleting ``node`` above ``kid``, shaped as the spec's own."""
    engine = node.machine().engine
    system = engine.system
    owner = system.regions_of(forbid.event)[0]
    reason = (
        f"{forbid.reason}: node {getattr(kid, 'id', '?')} ({kid.host}/{kid.device}) would "
        "leave the tree with it, its slots never freed; free the copies below it first; "
        "nothing changed"
    )
    others = tuple(r for r, _ in system.regions if r != owner and hasattr(node, r))
    raise engine.refusal(node, Refusal(owner, "delete", forbid.error, reason, others))


def _refuse_deleted(node: Any, walk: str) -> NoReturn:
    """Refuse a lock walk from a node SGLang's eviction deleted (its slots are free)."""
    msg = (
        f"node {getattr(node, 'id', '?')}: {walk} of a node SGLang's eviction deleted from "
        "the tree (its device slots were freed); match the prefix again; nothing changed"
    )
    raise StaleNode(_with_sites(msg, node))


def check(path: Sequence[CheckedNode], event: Event) -> None:
    """Check ``event`` at every node of ``path``, changing nothing.

    Raises:
        IllegalTransition: A node refuses it.
        BuiltBeforePatch: A node is SGLang's own.
    """
    for n in path:
        require_checked(n, event)
        n.seal()
        n.machine().engine.plan(n, event)
