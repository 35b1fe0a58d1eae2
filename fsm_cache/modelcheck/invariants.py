"""The design's invariants, as checks on a model state of the whole tree.

Numbers refer to the invariants of the residency design (shared design
notes, "Invariants"). Counter invariants come from the spec objects (each
state's ``invariant``); the tree-level ones are the design's statements about
the ``host`` and ``device`` regions and are skipped for specs without them.

Every invariant is a statement about one node, read with its parent's and its
children's entries and nothing else, so each check takes the node: the
explorer checks a node once per distinct neighbourhood
(:func:`violation_at`), and :func:`violation` reports the first violation of
a whole tree, check by check, node by node. Each returns a one-line
description of the violation, or None.

Clients give back only what they hold, so invariant 6 can also break where
no client goes: a give-back of one holder kind that the spec accepts while
only another kind holds the counter. :func:`unheld_give_back` asks the
engine (a dry run) about each. Its other half is :func:`refused_give_back`:
a give-back its holder does hold must be accepted.

Memory is checked against the ghost account of pages and copies in flight
(:mod:`fsm_cache.modelcheck.copies`): a step that freed pages a copy still
reads or writes, took pages twice or marked a failed copy valid left a fault
(:func:`memory_faults`), and every state's claim about its tier must match
the pages (:func:`memory_claims`, "valid data").
"""

from __future__ import annotations

from collections.abc import Callable

from fsm_cache.modelcheck.copies import FAILED, FILLING, FREE, VALID, Copy, copy_into, kind
from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes, children
from fsm_cache.modelcheck.treeops import dataless, descendants, forgettable
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import DEVICE_HELD, FETCHING, HOST_HELD, HOST_VALID
from fsm_cache.spec.holders import Hold


READING = "reading"
"""The storage state of the same copy, on the side it reads (``storage_residency.toml``)."""

Check = Callable[[Layout, Nodes, int, NodeEntry], "str | None"]
Accepts = Callable[[int, str], bool]
"""Whether the engine would accept an event fired at a node (a dry run): node, event."""


def counts(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 8: counters are never negative and every state's invariant holds."""
    for name in layout.counters:
        if layout.counter(entry, name) < 0:
            return f"invariant 8: node {i}: {name} is negative ({layout.counter(entry, name)})"
    values = {name: layout.counter(entry, name) for name in layout.counters}
    for region, machine in layout.system.regions:
        state = machine.state(layout.state(entry, region))
        if not state.invariant.holds(values):
            return f"invariant 8: node {i}: {region} {state.name} requires {state.invariant} ({_shown(values)})"
    return None


def accounted(layout: Layout, nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 6: each holder count equals its holders (plus its children's, if it propagates).

    Only counters that count holders (:attr:`~fsm_cache.spec.holders.Holders.counts`)
    are accounted: a count of tokens or retries has no holders.
    """
    for name in layout.holders.counts:
        want = layout.held(entry, name)
        if name in layout.holders.propagating:
            want += sum(layout.counter(_at(nodes, c), name) for c in children(nodes, i))
        have = layout.counter(entry, name)
        if have != want:
            found = f"invariant 6: node {i}: {name} is {have} but its holders account for {want}"
            uneven = layout.holders.uneven.get(name, ())
            if uneven:
                found += (
                    f" ({', '.join(uneven)} {'moves' if len(uneven) == 1 else 'move'} {name} by "
                    "other steps than one up or one down, so the check counts "
                    f"{'it' if len(uneven) == 1 else 'them'} as neither a hold nor a give-back)"
                )
            return found
    return None


def prefix_closed(layout: Layout, nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 1: a device-resident (or loading) node's parent is device-resident too."""
    if not layout.has("device"):
        return None
    parent = int(entry[0])
    if parent < 0 or layout.state(entry, "device") not in DEVICE_HELD:
        return None
    if layout.state(_at(nodes, parent), "device") not in DEVICE_HELD:
        return f"invariant 1: node {i} is on the device but its parent node {parent} is not"
    return None


def held_somewhere(layout: Layout, nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 2: every node that is not deleted holds its data on the device, the host or in storage.

    A node whose data is nowhere is deleted (with the nodes below it that
    hold nothing but pages in the store, :func:`~fsm_cache.modelcheck.treeops.prune`);
    one that cannot be, because a node below it holds a copy of its own, is
    a violation. So is one the tree operations could have deleted but kept
    (an ``--ops`` module whose ``prune`` deletes less): the reason says which,
    so a kept leaf is not blamed on children it does not have.
    """
    if not dataless(layout, entry):
        return None
    below = descendants(nodes, i)
    if any(not forgettable(layout, _at(nodes, d)) for d in below):
        return (
            f"invariant 2: node {i} holds its data nowhere but cannot be deleted (it has children)"
        )
    kept = "a leaf" if not below else "nothing below it holds a copy of its own"
    return (
        f"invariant 2: node {i} holds its data nowhere but the tree operations did not "
        f"delete it ({kept})"
    )


def copies_safe(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 5: no slot is freed while a copy reads it.

    A device-to-host copy (host ``writing``) reads the device copy, which
    must stay resident; a host-to-device copy (device ``loading``) reads the
    host copy, which must stay valid and pinned.
    """
    if not (layout.has("device") and layout.has("host")):
        return None
    host, device = layout.state(entry, "host"), layout.state(entry, "device")
    if host == "writing" and device != "resident":
        return f"invariant 5: node {i}: a device-to-host copy reads a device copy that is {device}"
    if device == "loading" and host != "pinned":
        return f"invariant 5: node {i}: a host-to-device copy reads a host copy that is {host}"
    return None


def storage_copies_safe(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 5 with a storage tier: a copy to or from the store keeps what it reads.

    A host-to-storage copy (storage ``storing``) reads the host copy, which
    must stay valid and pinned; a storage-to-host copy is one read on each
    side: the host is ``fetching`` exactly when the storage is ``reading``.
    """
    if not (layout.has("storage") and layout.has("host")):
        return None
    host, storage = layout.state(entry, "host"), layout.state(entry, "storage")
    if storage == "storing" and host != "pinned":
        return f"invariant 5: node {i}: a host-to-storage copy reads a host copy that is {host}"
    if host == FETCHING and storage != READING:
        return (
            f"invariant 5: node {i}: a storage-to-host copy reads a storage copy that is {storage}"
        )
    if storage == READING and host != FETCHING:
        return f"invariant 5: node {i}: storage {READING}, but no storage-to-host copy fills the host (host {host})"
    return None


def copies_held(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 6, for copies: a copy that holds a count (a load's pin, a store's) holds it while in flight.

    A holder kind whose acquiring event starts a copy (``load``: a
    host-to-device copy; ``store``: a host-to-storage copy) is held at a
    node exactly while that copy is in flight there, by the ghost account of
    copies: a copy in flight without its hold could lose its pages to an
    eviction, and a hold without its copy could never be given back. Where
    several kinds start the same copy (a ``load``, and a batch that loads
    and stores under one pin), the copy needs one of them held; a kind that
    starts several copies is held while one of them is in flight.
    """
    memory = layout.memory
    if not memory.tiers:
        return None
    flying = memory.in_flight(layout.pages(entry))
    for key, started in layout.copy_holds.items():
        held = layout.hold(entry, key)
        by = layout.holders.acquirers(key)
        for copy in started:
            starters = [k for k, copies in layout.copy_holds.items() if copy in copies]
            if copy not in flying or any(layout.hold(entry, k) for k in starters):
                continue
            if len(starters) == 1:
                return f"invariant 6: node {i}: a {copy.name} copy is in flight but {by} holds no {key[0]} there"
            named = ", ".join(f"{layout.holders.acquirers(k)} {k[0]}" for k in starters)
            return f"invariant 6: node {i}: a {copy.name} copy is in flight but none of its holders holds it there ({named})"
        if held and not any(c in flying for c in started):
            names = " or ".join(c.name for c in started)
            return f"invariant 6: node {i}: {by} holds {key[0]} but no {names} copy is in flight"
    return None


def memory_faults(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariants 5 and 7, and valid data, at the step that broke them.

    A step freed pages that a copy in flight still reads or writes (5), took
    pages the node already held or freed pages it did not hold (7), started a
    copy from pages holding no valid KV (5), acknowledged a copy not in flight
    or marked a failed copy valid (valid data).
    """
    fault = layout.pages(entry)[-1:]
    if not fault or not fault[0]:
        return None
    name, _, text = str(fault[0]).partition("|")
    return f"{name}: node {i}: {text}"


def memory_claims(layout: Layout, _nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Valid data (and invariant 7): what each state claims about its tier is what the pages hold.

    A state claiming a valid copy (``backed``, ``pinned``, ``resident``,
    ``stored``, ``reading``) has pages whose last copy completed; a copying
    state (``writing``, ``loading``, ``storing``, ``fetching``) has its copy
    in flight filling them; any other holds no pages (else they leaked:
    invariant 7).
    """
    memory = layout.memory
    for tier, have in zip(memory.tiers, layout.pages(entry), strict=False):
        state = layout.state(entry, tier)
        claim = memory.claims(tier, state)
        if have == claim:
            continue
        said, status = f"{tier} {state}", kind(have)
        copy = copy_into(tier, have)
        if claim == VALID:
            why = {
                FILLING: f"the {_name(copy)} copy filling them has not completed",
                FAILED: f"the {_name(copy)} copy that filled them failed",
                FREE: f"the node holds no {tier} pages",
            }[status]
            return f"valid data: node {i}: {said} claims valid {tier} pages, but {why}"
        if kind(claim) == FILLING:
            wanted = copy_into(tier, claim)
            return f"valid data: node {i}: {said} claims a {_name(wanted)} copy in flight, but none is (the {tier} pages are {status})"
        return f"invariant 7: node {i}: {said} claims no {tier} pages, but the node still holds {status} ones"
    return None


def _name(copy: Copy | None) -> str:
    return copy.name if copy is not None else "unknown"


def backup_prefix_closed(layout: Layout, nodes: Nodes, i: int, entry: NodeEntry) -> str | None:
    """Invariant 3 (write-through policies): host backup is prefix-closed.

    A node whose host copy is valid (``backed``, ``pinned``) has a parent
    whose host copy is valid too, or is under the root. A node being written
    has a parent whose copy is valid or being written by the same copy (a
    split of a node being written puts the prefix in that copy, and one
    acknowledgement settles both).
    """
    if not layout.residency:
        return None
    parent = int(entry[0])
    host = layout.state(entry, "host")
    if parent < 0 or host not in HOST_HELD:
        return None
    above = layout.state(_at(nodes, parent), "host")
    if above not in HOST_VALID and (host in HOST_VALID or above != host):
        return (
            f"invariant 3: node {i} is {host} on the host but its parent node {parent} is {above}"
        )
    return None


CHECKS: tuple[Check, ...] = (
    counts,
    accounted,
    prefix_closed,
    held_somewhere,
    copies_safe,
    storage_copies_safe,
    memory_faults,
    memory_claims,
    copies_held,
)
"""The invariants every policy keeps."""

WRITE_THROUGH = frozenset({WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE})
"""The policies under which backups are prefix-closed (design invariant 3)."""


def checks(policy: WritePolicy | None = None) -> tuple[Check, ...]:
    """Return the invariants to check under ``policy`` (None: no policy, any legal step)."""
    return (*CHECKS, backup_prefix_closed) if policy in WRITE_THROUGH else CHECKS


def violation(layout: Layout, nodes: Nodes, policy: WritePolicy | None = None) -> str | None:
    """Return the first violated invariant of a model state (check by check), or None."""
    present = [(i, e) for i, e in enumerate(nodes) if e is not None]
    for check in checks(policy):
        for i, entry in present:
            found = check(layout, nodes, i, entry)
            if found is not None:
                return found
    return None


NODE_ONLY: frozenset[Check] = frozenset(
    {
        counts,
        held_somewhere,
        copies_safe,
        storage_copies_safe,
        memory_faults,
        memory_claims,
        copies_held,
    }
)
"""The checks that read the node's own entry alone (not its parent's or children's)."""


def violation_at(
    layout: Layout,
    nodes: Nodes,
    i: int,
    policy: WritePolicy | None = None,
    *,
    only: Callable[[Check], bool] | None = None,
) -> str | None:
    """Return the first invariant violated at node ``i`` (it reads only its parent and children).

    ``only`` picks the checks to run (default: all), so a caller may run the
    :data:`NODE_ONLY` checks once per node entry and the others once per neighbourhood.
    """
    entry = _at(nodes, i)
    for check in checks(policy):
        if only is not None and not only(check):
            continue
        found = check(layout, nodes, i, entry)
        if found is not None:
            return found
    return None


def unheld_give_back(layout: Layout, nodes: Nodes, accepts: Accepts) -> str | None:
    """Invariant 6 where clients never go: a give-back taking another holder's count.

    For each node and each give-back its clients hold none of while holders
    of another kind hold the counter, or nothing does
    (:meth:`~fsm_cache.modelcheck.state.Layout.unheld`), the spec must refuse
    it: accepted, it would take, say, the pin a load holds, and the load could
    not give it back; or it gives back what nobody took (a ``release`` at
    zero, a client's double release). Returns the first accepted.
    """
    for i, entry in enumerate(nodes):
        if entry is None:
            continue
        for event, key in layout.unheld(entry):
            if accepts(i, event):
                return _taken(layout, i, entry, event, key)
    return None


Refusal = Callable[[int, str], "str | None"]
"""The error class the engine refuses an event at a node with (a dry run): node, event; None if accepted."""


def refused_give_back(layout: Layout, nodes: Nodes, refusal: Refusal) -> str | None:
    """Invariant 6, the other half: a give-back its holder does hold is accepted.

    For each node and each kind of hold its holders hold, one of the
    give-backs of that kind (:meth:`~fsm_cache.modelcheck.state.Layout.owed`)
    must be accepted: refused, a client cannot give back its pin or its lock,
    or a finished copy cannot be acknowledged. One suffices: where one
    machine alone cannot tell two holders apart (a pin and a load both hold
    ``pins`` in the host machine), each gives back its own way. Returns the
    first refusal of a kind none of whose give-backs is accepted.
    """
    for i, entry in enumerate(nodes):
        if entry is None:
            continue
        refused: dict[Hold, tuple[str, str]] = {}
        accepted: set[Hold] = set()
        for event, key in layout.owed(entry):
            error = refusal(i, event)
            if error is None:
                accepted.add(key)
            else:
                refused.setdefault(key, (event, error))
        for key, (event, error) in refused.items():
            if key in accepted:
                continue
            counter = key[0]
            by = layout.holders.acquirers(key)
            value = layout.counter(entry, counter)
            return f"invariant 6: node {i}: {event} is refused ({error}) though {by} holds {counter} there ({counter}={value})"
    return None


def _taken(layout: Layout, i: int, entry: NodeEntry, event: str, key: Hold) -> str:
    """Describe ``event`` at node ``i`` giving back ``key``, which its clients do not hold."""
    counter = key[0]
    others = [
        k
        for k in layout.holders.kinds
        if k[0] == counter and k != key and layout.hold(entry, k) > 0
    ]
    mine = layout.holders.acquirers(key)
    value = layout.counter(entry, counter)
    if not others:
        return f"invariant 6: node {i}: {event} is accepted though nothing holds {counter} there ({counter}={value}, no {mine} to give back)"
    by = " and ".join(layout.holders.acquirers(k) for k in others)
    return f"invariant 6: node {i}: {event} would take {counter} held by {by} ({counter}={value}, none held by {mine})"


def _at(nodes: Nodes, index: int) -> NodeEntry:
    entry = nodes[index]
    assert entry is not None
    return entry


def _shown(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())
