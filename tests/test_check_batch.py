"""fsm-cache check: one event that starts and acknowledges a copy in each of two regions.

A user spec may batch copies: ``sync`` loads a node's host copy to the
device and stores it at once under one pin, and ``sync_done`` (or
``sync_failed``) ends both. The pages account keeps each acknowledgement of
such an event, and a holder kind that starts two copies holds both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.modelcheck import check, copies, invariants
from fsm_cache.modelcheck.copies import H2D, H2S, Ack
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout
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

SYNC = """\
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
"""The batch's composition: a load's or a store's own acknowledgement is refused while a batch is in flight."""

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
    and ``sync_failed`` freed the device pages the load still filled. One
    node: the cache's split gives a prefix a load's pin and a store's, not a
    batch's, so a batch is split as no cache splits it.
    """
    result = check.check_spec(sync, 1, Bounds({"pins": 3, "locks": 1}))
    assert (result.violation, result.stopped, result.states) == (None, None, 84)
