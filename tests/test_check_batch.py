"""fsm-cache check: one event that starts and acknowledges a copy in each of two regions.

A user spec may batch copies: ``sync`` loads a node's host copy to the
device and stores it at once under one pin, and ``sync_done`` (or
``sync_failed``) ends both. The pages account keeps each acknowledgement of
such an event, and a holder kind that starts two copies holds both. A split
gives the prefix the batch's one pin, not one per copy, and a batch lands
its prefix first, as a store's pages land in order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.modelcheck import check, copies, invariants, state, treeops
from fsm_cache.modelcheck.copies import H2D, H2S, Ack
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Choices, Layout
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import spec_dir


def _ends(ends: str) -> str:
    """Return ``ends`` (a TOML template naming ``{event}``) for ``sync_done`` and ``sync_failed``."""
    return "".join(ends.format(event=event) for event in ("sync_done", "sync_failed"))


SYNC_HOST = """\
[machine]
extends = "host_storage_residency.toml"
name = "host_sync"

[counters]
syncs = 0   # batches in flight that load the host copy and store it at once

[events]
sync        = { doc = "Start one batch that loads the host copy and stores it, under one pin.", past = "synced" }
sync_done   = { doc = "Both copies landed; the batch's pin is given back.", past = "sync acknowledged" }
sync_failed = { doc = "The batch failed; its pin is given back.", past = "sync failed" }

[[transition]]
event = "sync"
source = ["backed", "pinned"]
dest = "pinned"
update = "pins += 1, syncs += 1"

[[forbid]]
event = "sync"
source = ["unbacked", "writing", "evicted", "fetching"]
error = "NoHostCopy"
reason = "no valid host copy to load and store"
""" + _ends(
    """
[[transition]]
event = "{event}"
source = "pinned"
dest = "backed"
guard = "pins == 1 and syncs >= 1"
update = "pins -= 1, syncs -= 1"

[[transition]]
event = "{event}"
source = "pinned"
dest = "pinned"
guard = "pins >= 2 and syncs >= 1"
update = "pins -= 1, syncs -= 1"

[[forbid]]
event = "{event}"
source = "pinned"
guard = "syncs == 0"
error = "NotSyncing"
reason = "no batch in flight"

[[forbid]]
event = "{event}"
source = ["unbacked", "writing", "backed", "evicted", "fetching"]
error = "NotSyncing"
reason = "no batch in flight"
""",
)
"""The host side of a batch: one pin, counted in ``syncs`` so that a load's own acknowledgements can tell."""

SYNC_DEVICE = """\
[machine]
extends = "device_residency.toml"
name = "device_sync"

[events]
sync        = { doc = "The batch starts the host-to-device copy.", past = "synced" }
sync_done   = { doc = "The host-to-device copy landed.", past = "sync acknowledged" }
sync_failed = { doc = "The host-to-device copy failed; the device slots are freed.", past = "sync failed" }

[[transition]]
event = "sync"
source = "absent"
dest = "loading"
effect = "start_load"

[[forbid]]
event = "sync"
source = ["resident", "loading"]
error = "AlreadyResident"
reason = "the device holds this node or is loading it"

[[transition]]
event = "sync_done"
source = "loading"
dest = "resident"

[[transition]]
event = "sync_failed"
source = "loading"
dest = "absent"
guard = "locks == 0"
effect = "free_device"

[[forbid]]
event = "sync_failed"
source = "loading"
guard = "locks >= 1"
error = "DeviceLocked"
reason = "a running request holds the loading device copy"
""" + _ends(
    """
[[forbid]]
event = "{event}"
source = ["resident", "absent"]
error = "NotSyncing"
reason = "no batch in flight"
""",
)

SYNC_STORAGE = """\
[machine]
extends = "storage_residency.toml"
name = "storage_sync"

[events]
sync        = { doc = "The batch starts the host-to-storage copy.", past = "synced" }
sync_done   = { doc = "The host-to-storage copy landed.", past = "sync acknowledged" }
sync_failed = { doc = "The host-to-storage copy failed.", past = "sync failed" }

[[transition]]
event = "sync"
source = "unstored"
dest = "storing"
effect = "start_store"

[[forbid]]
event = "sync"
source = ["storing", "stored", "reading"]
error = "AlreadyStored"
reason = "the store holds this node's pages or a copy to it is in flight"

[[transition]]
event = "sync_done"
source = "storing"
dest = "stored"

[[transition]]
event = "sync_failed"
source = "storing"
dest = "unstored"
""" + _ends(
    """
[[forbid]]
event = "{event}"
source = ["unstored", "stored", "reading"]
error = "NotSyncing"
reason = "no batch in flight"
""",
)

CHILD_UNDER_BATCH = """
[[forbid]]
event = "{event}"
when = ["parent device in [loading]", "parent storage in [storing]"]
error = "ParentSyncing"
reason = "the parent's store may fail for good, and its batch cannot fail with a child on the device"
"""
"""What makes the batch sound on two nodes: no child goes onto the device under a batch in flight.

Its ``sync_failed`` is refused with a child on the device (it frees the
device pages), and its store may fail for good: a child loaded under it
would leave the batch neither to land nor to fail.
"""

SYNC_ALONE = """\
[composition]
extends = "residency_storage.toml"
name = "sync"
doc = "residency_storage with a batch that loads a host copy and stores it at once, under one pin."

[composition.regions]
host = "host.toml"
device = "device.toml"
storage = "storage.toml"

[[forbid]]
event = "sync"
when = "parent device in [absent]"
error = "ParentNotResident"
reason = "the parent is not on the device"

[[forbid]]
event = "sync_failed"
when = "any child device in [resident, loading]"
error = "NotADeviceLeaf"
reason = "a child is on the device"
""" + "".join(
    f"""
[[forbid]]
event = "{event}"
guard = "syncs >= 1"
error = "SyncInFlight"
reason = "the copy in flight is the batch's: sync_done or sync_failed ends it"
"""
    for event in ("load_done", "load_failed", "store_done", "store_failed")
)
"""The batch's composition without :data:`CHILD_UNDER_BATCH`: sound on one node only."""

SYNC = SYNC_ALONE + "".join(CHILD_UNDER_BATCH.format(event=event) for event in ("load", "sync"))
"""The batch's composition: a load's or a store's own acknowledgement is refused while a batch is
in flight, and no child goes onto the device under one."""

BOUNDS = Bounds({"pins": 3, "locks": 1})

BOTH_PINS = 'when = ["storage in [storing]", "device in [loading]"]\nguard = "pins == 2"\n'
"""``StorePinHeld``'s rule for a store and a load in flight: a batch in flight is one pin, not two."""


@pytest.fixture
def sync(tmp_path: Path) -> Path:
    """Return the batch spec, beside a copy of the shipped specs it extends."""
    for path in spec_dir().glob("*.toml"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    composed = tmp_path / "residency_storage.toml"
    text = composed.read_text(encoding="utf-8")
    assert BOTH_PINS in text
    composed.write_text(
        text.replace(BOTH_PINS, BOTH_PINS.replace("pins == 2", "pins == 2 and syncs == 0"))
    )
    for name, text in (
        ("host.toml", SYNC_HOST),
        ("device.toml", SYNC_DEVICE),
        ("storage.toml", SYNC_STORAGE),
        ("sync.toml", SYNC),
    ):
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path / "sync.toml"


def test_an_event_acknowledging_a_copy_in_two_regions_keeps_both(sync: Path) -> None:
    """Keyed by event alone, ``sync_done`` kept the store's acknowledgement and lost the load's."""
    layout = Layout.of(as_system(load_spec(sync)))
    memory = layout.memory
    assert memory.acks["sync_done"] == (Ack(H2D, "device", True), Ack(H2S, "storage", True))
    assert memory.acks["sync_failed"] == (Ack(H2D, "device", False), Ack(H2S, "storage", False))
    assert memory.acks["load_done"] == (Ack(H2D, "device", True),)
    assert memory.acknowledging(H2D) == ["load_done", "load_failed", "sync_done", "sync_failed"]
    assert memory.failure("sync_failed")
    assert not memory.failure("sync_done")
    assert memory.final_successes == {"store_done", "fetch_done", "sync_done"}
    flying = ("valid", H2D.filling, H2S.filling, "")
    landed = {"host": "backed", "device": "resident", "storage": "stored"}
    assert memory.step(flying, "sync_done", [], landed) == ("valid", "valid", "valid", "")
    failed = {"host": "backed", "device": "absent", "storage": "unstored"}
    # Each copy fails first: free_device then frees failed pages, none a copy still fills.
    assert memory.step(flying, "sync_failed", ["free_device"], failed) == (
        "valid",
        copies.FREE,
        copies.FREE,
        "",
    )


def test_a_holder_kind_starting_two_copies_holds_both(sync: Path) -> None:
    """Read as one copy per kind, the batch's hold was no copy's: its load lacked the load's pin."""
    layout = Layout.of(as_system(load_spec(sync)))
    batch = ("host", "device", "storage")
    assert layout.copy_holds == {
        ("pins", ("host", "device")): (H2D,),
        ("pins", ("host", "storage")): (H2S,),
        ("pins", batch): (H2D, H2S),
        ("syncs", batch): (H2D, H2S),
    }
    # host, device, storage; pins, syncs, locks; holds of pin, load, store, sync (pins, syncs), lock
    loading = layout.entry(-1, "pinned", "loading", "unstored", 1, 0, 0, 0, 0, 0, 0, 0, 0)
    assert invariants.copies_held(layout, (loading,), 0, loading) == (
        "invariant 6: node 0: a host-to-device copy is in flight but none of its holders holds "
        "it there (load pins, sync pins, sync syncs)"
    )
    synced = layout.entry(-1, "pinned", "loading", "storing", 1, 1, 0, 0, 0, 0, 1, 1, 0)
    assert invariants.copies_held(layout, (synced,), 0, synced) is None
    idle = layout.entry(-1, "pinned", "resident", "stored", 1, 1, 0, 0, 0, 0, 1, 1, 0)
    assert invariants.copies_held(layout, (idle,), 0, idle) == (
        "invariant 6: node 0: sync holds pins but no host-to-device or host-to-storage copy is "
        "in flight"
    )


def test_a_batch_that_loads_and_stores_at_once_holds(sync: Path) -> None:
    """The batch spec is sound; read one acknowledgement per event, ``sync_done`` broke it.

    It left the load in flight under a ``resident`` device (``valid data``),
    and ``sync_failed`` freed the device pages the load still filled.
    """
    result = check.check_spec(sync, 1, BOUNDS)
    assert (result.violation, result.stopped, result.states) == (None, None, 84)


def test_a_batch_split_on_two_nodes_holds(sync: Path) -> None:
    """Split with a pin per copy in flight, the prefix of a batch held a pin nobody gave back.

    ``split_prefix`` counted the load's pin and the store's, the batch's one
    ``sync_done`` gave back one: ``invariant 6: node 1: pins is 2 but its
    holders account for 1``.
    """
    result = check.check_spec(sync, 2, BOUNDS)
    assert (result.violation, result.stopped, result.states) == (None, None, 7877)


def test_a_split_gives_the_prefix_the_batchs_pin_once(sync: Path) -> None:
    """The prefix keeps the batch's hold and the one pin and one sync it holds, both copies in flight."""
    layout = Layout.of(as_system(load_spec(sync)))
    # host, device, storage; pins, syncs, locks; holds of pin, load, store, sync (pins, syncs), lock
    synced = layout.entry(-1, "pinned", "loading", "storing", 1, 1, 0, 0, 0, 0, 1, 1, 0)
    split = treeops.split(layout, (synced, None), 0, 1)
    assert split is not None
    assert split[1] == synced
    assert split[0] == (1, *synced[1:])
    # A load and a store of their own: a pin each, as the cache's split_prefix gives.
    both = layout.entry(-1, "pinned", "loading", "storing", 2, 0, 0, 0, 1, 1, 0, 0, 0)
    split = treeops.split(layout, (both, None), 0, 1)
    assert split is not None
    assert split[1] == both


def test_a_split_giving_a_batch_a_pin_per_copy_is_caught(
    sync: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split before the fix, as a control: a prefix with a pin nobody holds is invariant 6."""
    monkeypatch.setattr(treeops, "_shared", lambda _layout, _entry: 0)
    result = check.check_spec(sync, 2, BOUNDS)
    assert result.violation == "invariant 6: node 1: pins is 2 but its holders account for 1"
    assert result.trace[-2:] == ["node 1: evict_host", "split node 0: prefix node 1"]


def test_a_batch_lands_its_prefix_first(sync: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Landed at a suffix first, a batch left its prefix unable to fail: no cache lands it so.

    The cache lands a copy's nodes prefix first and a store's pages in
    order; ``sync_done`` at the suffix, then a store that fails for good at
    the prefix, whose ``sync_failed`` a child on the device refuses.
    """
    layout = Layout.of(as_system(load_spec(sync)))
    choices = Choices.of(layout, None)
    assert (choices.ordered, choices.ordered_in) == (
        {"fetch_done": "fetching", "sync_done": "storing"},
        {"sync_done": "storage"},
    )
    shipped = Choices.of(
        Layout.of(as_system(load_spec(spec_dir() / "residency_storage.toml"))), None
    )
    assert (shipped.ordered, shipped.ordered_in) == ({"fetch_done": "fetching"}, {})
    only_fetch = {"fetch_done": ("host", "fetching")}
    monkeypatch.setattr(state, "_in_order", lambda _layout: only_fetch)
    result = check.check_spec(sync, 2, BOUNDS)
    assert result.violation == (
        "liveness: node 1: its host-to-device copy can never fail (load_done: SyncInFlight; "
        "load_failed: NotADeviceLeaf; sync_failed: NotADeviceLeaf)"
    )
    assert result.trace[-2:] == ["split node 0: prefix node 1", "node 0: sync_done"]


def test_a_child_loaded_under_a_batch_is_caught_on_two_nodes(sync: Path) -> None:
    """Without :data:`CHILD_UNDER_BATCH` the batch is sound on one node and stuck on two.

    A child loaded under a batch in flight refuses the batch's failure, and
    its store may fail for good: it can neither land nor fail.
    """
    sync.write_text(SYNC_ALONE, encoding="utf-8")
    assert check.check_spec(sync, 1, BOUNDS).violation is None
    result = check.check_spec(sync, 2, BOUNDS)
    assert result.violation == (
        "liveness: node 0: its host-to-device copy can never fail (load_done: SyncInFlight; "
        "load_failed: NotADeviceLeaf; sync_failed: NotADeviceLeaf)"
    )
    assert result.trace[-3:] == ["node 0: sync", "node 1: load", "node 1: load_done"]


def test_a_batch_giving_back_two_pins_is_caught_on_two_nodes(sync: Path) -> None:
    """A batch whose acknowledgement gives back two pins past three is still caught on two nodes."""
    host = sync.parent / "host.toml"
    text = host.read_text(encoding="utf-8")
    old = 'guard = "pins >= 2 and syncs >= 1"\nupdate = "pins -= 1, syncs -= 1"\n'
    assert text.count(old) == 2
    head, *ends = text.split(old)
    new = old.replace(">= 2", "== 2")
    for event, rest in zip(("sync_done", "sync_failed"), ends, strict=True):
        head += (
            f'{new}\n[[transition]]\nevent = "{event}"\nsource = "pinned"\ndest = "pinned"\n'
            f'guard = "pins >= 3 and syncs >= 1"\nupdate = "pins -= 2, syncs -= 1"\n{rest}'
        )
    host.write_text(head, encoding="utf-8")
    result = check.check_spec(sync, 2, BOUNDS)
    assert result.violation == (
        "invariant 6: node 1: pins is 0 but its holders account for 1 (sync_done, sync_failed "
        "move pins by other steps than one up or one down, so the check counts them as neither "
        "a hold nor a give-back)"
    )
