"""fsm-cache check on user specs: planted residency bugs are found, correct variants pass.

Users run ``check`` in CI on specs of their own built from ours. Each case
here copies the shipped specs, changes a few lines as a user might, and
checks the result on a small tree: a planted bug (a pin leaked on an error
path, an eviction under a copy in flight, a store acknowledged twice, ...)
must be reported with its finding and a shortest trace to it, and a correct
variant (a renamed state or counter, an extra counter, an event that only
reads, an extra region) must pass. None of these is one of the negative
controls of ``specs/bugs_detected``; together they are the hunt for false
negatives and false positives of the checker.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import pytest

from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.policy import WritePolicy
from fsm_cache.spec.shipped import spec_dir


HOST = "host_residency.toml"
DEVICE = "device_residency.toml"
STORAGE = "storage_residency.toml"
HOST_STORAGE = "host_storage_residency.toml"
RESIDENCY = "residency.toml"
RESIDENCY_STORAGE = "residency_storage.toml"


class Edit(NamedTuple):
    """Replace every ``old`` in ``file`` by ``new`` (``old`` must occur), or append ``new`` if ``old`` is empty."""

    file: str
    old: str
    new: str


def _spec(tmp_path: Path, top: str, edits: list[Edit]) -> Path:
    """Copy the shipped specs to ``tmp_path``, apply ``edits`` and return the path of ``top``."""
    for path in spec_dir().glob("*.toml"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    for edit in edits:
        target = tmp_path / edit.file
        text = target.read_text(encoding="utf-8") if target.exists() else ""
        if edit.old:
            assert edit.old in text, f"{edit.file} no longer has {edit.old!r}"
            text = text.replace(edit.old, edit.new)
        else:
            text += edit.new
        target.write_text(text, encoding="utf-8")
    return tmp_path / top


def _transition(event: str, source: str, dest: str, **keys: str) -> str:
    """Return a ``[[transition]]`` table of ``event`` from ``source`` to ``dest``."""
    extra = "".join(f'{key} = "{value}"\n' for key, value in keys.items())
    return f'\n[[transition]]\nevent = "{event}"\nsource = "{source}"\ndest = "{dest}"\n{extra}'


def _forbid(event: str, when: str, error: str) -> str:
    """Return a composition ``[[forbid]]`` of ``event`` ``when`` a condition holds."""
    return (
        f'\n[[forbid]]\nevent = "{event}"\nwhen = "{when}"\nerror = "{error}"\nreason = "planted"\n'
    )


class Bug(NamedTuple):
    """A planted bug: the spec it edits, how, and what ``check`` must report."""

    top: str
    edits: list[Edit]
    nodes: int
    violation: str
    trace: list[str]


LOAD_FAILED_ONE = 'event = "load_failed"\nsource = "pinned"\ndest = "backed"\nguard = "pins == 1"\nupdate = "pins -= 1"'
STORE_FAILED_ONE = 'event = "store_failed"\nsource = "pinned"\ndest = "backed"\nguard = "pins == 1"\nupdate = "pins -= 1"'
EVICT_LOADING = (
    '[[forbid]]\nevent = "evict_device"\nsource = "loading"\nerror = "CopyInFlight"\n'
    'reason = "a host-to-device copy is still writing the device slots"\n'
)
BACK_UP = ["start: chain", "node 1: write", "node 1: write_done"]
LOAD_BACK = [*BACK_UP, "node 1: evict_device", "node 1: load"]

BUGS: dict[str, Bug] = {
    # An error path that never gives back the pin its copy took.
    "load_failed_keeps_the_load_pin": Bug(
        RESIDENCY,
        [
            Edit(
                HOST,
                LOAD_FAILED_ONE,
                LOAD_FAILED_ONE.replace('dest = "backed"', 'dest = "pinned"').replace(
                    '\nupdate = "pins -= 1"', ""
                ),
            )
        ],
        2,
        "invariant 6: node 1: load holds pins but no host-to-device copy is in flight",
        [*LOAD_BACK, "node 1: load_failed"],
    ),
    "store_failed_keeps_the_store_pin": Bug(
        RESIDENCY_STORAGE,
        [
            Edit(
                HOST_STORAGE,
                STORE_FAILED_ONE,
                STORE_FAILED_ONE.replace('dest = "backed"', 'dest = "pinned"').replace(
                    '\nupdate = "pins -= 1"', ""
                ),
            )
        ],
        2,
        "invariant 6: node 0: store holds pins but no host-to-storage copy is in flight",
        [
            "start: chain",
            "node 0: write",
            "node 0: write_done",
            "node 0: store",
            "node 0: store_failed",
        ],
    ),
    # Evictions under a copy in flight.
    "evict_device_while_loading": Bug(
        RESIDENCY,
        [
            Edit(
                DEVICE,
                EVICT_LOADING,
                _transition(
                    "evict_device", "loading", "absent", guard="locks == 0", effect="free_device"
                )
                + EVICT_LOADING.replace(
                    'source = "loading"\n', 'source = "loading"\nguard = "locks >= 1"\n'
                ),
            )
        ],
        2,
        "invariant 5: node 1: evict_device frees device pages that a host-to-device copy in flight still writes",
        [*LOAD_BACK, "node 1: evict_device"],
    ),
    "evict_storage_while_storing": Bug(
        RESIDENCY_STORAGE,
        [
            Edit(
                STORAGE,
                '[[forbid]]\nevent = "evict_storage"\nsource = "storing"\nerror = "CopyInFlight"\n'
                'reason = "a host-to-storage copy still writes these pages"\n',
                _transition("evict_storage", "storing", "unstored", effect="delete_storage"),
            )
        ],
        2,
        "invariant 5: node 0: evict_storage frees storage pages that a host-to-storage copy in flight still writes",
        [
            "start: chain",
            "node 0: write",
            "node 0: write_done",
            "node 0: store",
            "node 0: evict_storage",
        ],
    ),
    # A failed load that leaves the device marked resident.
    "load_failed_lands_resident": Bug(
        RESIDENCY,
        [
            Edit(
                DEVICE,
                'event = "load_failed"\nsource = "loading"\ndest = "absent"',
                'event = "load_failed"\nsource = "loading"\ndest = "resident"',
            )
        ],
        2,
        "valid data: node 1: load_failed marks a failed host-to-device copy valid (device resident)",
        [*LOAD_BACK, "node 1: load_failed"],
    ),
    # A lock that does not propagate to the ancestors (the unlock still does).
    "lock_skips_ancestors": Bug(
        RESIDENCY,
        [
            Edit(
                DEVICE,
                'update = "locks += 1"\npropagate = "ancestors"\n',
                'update = "locks += 1"\n',
            )
        ],
        2,
        "invariant 6: node 0: locks is 0 but its holders account for 1",
        ["start: chain", "node 1: lock"],
    ),
    # A second store_done for one store, taking a client's pin.
    "store_acknowledged_twice": Bug(
        RESIDENCY_STORAGE,
        [
            Edit(
                STORAGE,
                '[[forbid]]\nevent = "store_done"\nsource = ["unstored", "stored", "reading"]',
                _transition("store_done", "stored", "stored")
                + '\n[[forbid]]\nevent = "store_done"\nsource = ["unstored", "reading"]',
            )
        ],
        2,
        "invariant 6: node 0: store_done would take pins held by pin (pins=1, none held by store)",
        ["start: chain", "node 0: write", "node 0: write_done", "node 0: pin", "node 0: discover"],
    ),
    # The same duplicate accepted as a no-op on the host too: a give-back of nothing.
    "store_acknowledged_twice_as_a_no_op": Bug(
        RESIDENCY_STORAGE,
        [
            Edit(
                STORAGE,
                '[[forbid]]\nevent = "store_done"\nsource = ["unstored", "stored", "reading"]',
                _transition("store_done", "stored", "stored")
                + '\n[[forbid]]\nevent = "store_done"\nsource = ["unstored", "reading"]',
            ),
            Edit(
                HOST_STORAGE,
                '[[forbid]]\nevent = "store_done"\nsource = ["unbacked", "writing", "backed", "evicted", "fetching"]',
                _transition("store_done", "backed", "backed")
                + '\n[[forbid]]\nevent = "store_done"\nsource = ["unbacked", "writing", "evicted", "fetching"]',
            ),
        ],
        2,
        "invariant 6: node 0: store_done is accepted though nothing holds pins there"
        " (pins=0, no store to give back)",
        ["start: chain", "node 0: write", "node 0: write_done", "node 0: discover"],
    ),
    # A child on the device under a parent evicted from it.
    "evict_device_above_a_loading_child": Bug(
        RESIDENCY,
        [
            Edit(
                RESIDENCY,
                'when = "any child device in [resident, loading]"\nerror = "NotADeviceLeaf"\n'
                'reason = "a child is still on the device',
                'when = "any child device in [resident]"\nerror = "NotADeviceLeaf"\n'
                'reason = "a child is still on the device',
            )
        ],
        2,
        "invariant 1: node 1 is on the device but its parent node 0 is not",
        [
            "start: chain",
            "node 0: write",
            "node 0: write_done",
            "node 1: write",
            "node 1: write_done",
            "node 1: evict_device",
            "node 1: load",
            "node 0: evict_device",
        ],
    ),
    "evict_host_above_a_backed_child": Bug(
        RESIDENCY,
        [
            Edit(
                RESIDENCY,
                '[[forbid]]\nevent = "evict_host"\nwhen = "any child host in [writing, backed, pinned]"\n'
                'error = "NotAHostLeaf"\nreason = "a child still holds a host copy"\n',
                "",
            )
        ],
        2,
        "invariant 2: node 0 holds its data nowhere but cannot be deleted (it has children)",
        [
            "start: chain",
            "node 0: write",
            "node 0: write_done",
            "node 1: write",
            "node 1: write_done",
            "node 1: evict_device",
            "node 0: evict_device",
            "node 0: evict_host",
        ],
    ),
    # Give-backs of nothing: a second release or unlock passes unnoticed.
    "release_accepted_at_zero": Bug(
        RESIDENCY,
        [
            Edit(
                HOST,
                'source = ["unbacked", "backed", "evicted"]\nerror = "ReleaseAtZero"',
                'source = ["unbacked", "evicted"]\nerror = "ReleaseAtZero"',
            ),
            Edit(HOST, "", _transition("release", "backed", "backed")),
        ],
        2,
        "invariant 6: node 0: release is accepted though nothing holds pins there (pins=0, no pin to give back)",
        ["start: chain", "node 0: write", "node 0: write_done"],
    ),
    # Copies that can never be acknowledged.
    "load_acks_refused_under_a_resident_parent": Bug(
        RESIDENCY,
        [Edit(RESIDENCY, "", _forbid("load_done", "parent device in [resident]", "ParentBusy"))],
        2,
        "invariant 6: node 1: load_done is refused (ParentBusy) though load holds pins there (pins=1)",
        LOAD_BACK,
    ),
    "write_acks_wait_for_each_other": Bug(
        RESIDENCY,
        [
            Edit(RESIDENCY, "", _forbid(event, when, error))
            for event in ("write_done", "write_failed")
            for when, error in (
                ("parent host in [writing]", "ParentWriting"),
                ("any child host in [writing]", "ChildWriting"),
            )
        ],
        2,
        "liveness: node 0: its device-to-host copy can never finish "
        "(write_done: ChildWriting; write_failed: ChildWriting)",
        ["start: chain", "node 0: write", "node 1: write"],
    ),
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_a_planted_bug_is_found_with_a_shortest_trace(tmp_path: Path, name: str) -> None:
    bug = BUGS[name]
    result = check.check_spec(_spec(tmp_path, bug.top, bug.edits), bug.nodes, Bounds({}))
    assert (result.violation, result.trace) == (bug.violation, bug.trace)


def test_a_failed_load_that_keeps_its_pages_is_found_before_exploring(tmp_path: Path) -> None:
    edit = Edit(
        DEVICE,
        'event = "load_failed"\nsource = "loading"\ndest = "absent"\nguard = "locks == 0"\neffect = "free_device"',
        'event = "load_failed"\nsource = "loading"\ndest = "resident"\nguard = "locks == 0"',
    )
    result = check.check_spec(_spec(tmp_path, RESIDENCY, [edit]), 2, Bounds({}))
    assert result.violation == (
        "copy load: no acknowledgement reports a failure (load_done, load_failed both leave"
        " the device pages valid): a failed copy would be taken as KV"
    )
    assert result.trace == []


def _self_loops(event: str, states: list[str]) -> str:
    """Return transitions of ``event`` from each of ``states`` back to it: an event that only reads."""
    return "".join(_transition(event, state, state) for state in states)


HOST_STATES = ["unbacked", "writing", "backed", "pinned", "evicted"]
STORAGE_STATES = ["unstored", "storing", "stored", "reading"]


def _event(file: str, name: str) -> Edit:
    """Declare event ``name`` in ``file``."""
    return Edit(
        file, "[events]\n", f'[events]\n{name} = {{ doc = "Reads only.", past = "read" }}\n'
    )


# Each correct variant: the spec it edits, how, and whether it explores the
# shipped spec's states (a rename, an event that only reads) or more (a counter).
CORRECT: dict[str, tuple[str, list[Edit], bool]] = {
    "free_states_renamed": (
        RESIDENCY,
        [
            Edit(file, old, new)
            for file in (HOST, RESIDENCY)
            for old, new in (("unbacked", "empty"), ("evicted", "freed"))
        ]
        + [Edit(DEVICE, "absent", "offloaded"), Edit(RESIDENCY, "absent", "offloaded")],
        True,
    ),
    "counters_renamed": (
        RESIDENCY,
        [Edit(file, "pins", "refs") for file in (HOST, RESIDENCY)]
        + [Edit(DEVICE, "locks", "lock_ref")],
        True,
    ),
    "storage_state_renamed": (
        RESIDENCY_STORAGE,
        [Edit(STORAGE, "unstored", "nowhere")],
        True,
    ),
    "host_event_that_only_reads": (
        RESIDENCY,
        [_event(HOST, "peek"), Edit(HOST, "", _self_loops("peek", HOST_STATES))],
        True,
    ),
    "device_event_that_only_reads": (
        RESIDENCY,
        [
            _event(DEVICE, "touch"),
            Edit(
                DEVICE,
                "",
                _transition("touch", "resident", "resident")
                + '\n[[forbid]]\nevent = "touch"\nsource = ["loading", "absent"]\n'
                'error = "NotResident"\nreason = "not on the device"\n',
            ),
        ],
        True,
    ),
    "storage_key_query_that_only_reads": (
        RESIDENCY_STORAGE,
        [_event(STORAGE, "exists"), Edit(STORAGE, "", _self_loops("exists", STORAGE_STATES))],
        True,
    ),
    # More states: each extra counter is part of the state.
    "counter_raised_by_load": (
        RESIDENCY,
        [
            Edit(HOST, "pins = 0   #", "loads = 0\npins = 0   #"),
            Edit(
                HOST,
                'dest = "pinned"\nupdate = "pins += 1"\n\n[[forbid]]\nevent = "load"',
                'dest = "pinned"\nupdate = "pins += 1, loads += 1"\n\n[[forbid]]\nevent = "load"',
            ),
        ],
        False,
    ),
    "counter_raised_by_a_give_back": (
        RESIDENCY,
        [
            Edit(HOST, "pins = 0   #", "served = 0\npins = 0   #"),
            Edit(
                HOST,
                'event = "load_done"\nsource = "pinned"\ndest = "backed"\nguard = "pins == 1"\n'
                'update = "pins -= 1"',
                'event = "load_done"\nsource = "pinned"\ndest = "backed"\nguard = "pins == 1"\n'
                'update = "pins -= 1, served += 1"',
            ),
        ],
        False,
    ),
    "counter_raised_by_a_propagating_lock": (
        RESIDENCY,
        [
            Edit(DEVICE, "locks = 0   #", "hits = 0\nlocks = 0   #"),
            Edit(
                DEVICE,
                'dest = "resident"\nupdate = "locks += 1"\npropagate',
                'dest = "resident"\nupdate = "locks += 1, hits += 1"\npropagate',
            ),
        ],
        False,
    ),
    "extra_region": (
        RESIDENCY,
        [
            Edit(
                RESIDENCY,
                'device = "device_residency.toml"',
                'device = "device_residency.toml"\nstats = "stats.toml"',
            ),
            Edit(
                "stats.toml",
                "",
                '[machine]\nname = "stats"\ninitial = "on"\n\n[counters]\nhits = 0\n\n'
                '[states]\non = { doc = "Counting.", final = true }\n\n'
                '[events]\nhit = { doc = "A lookup hit.", past = "hit" }\n'
                + _transition("hit", "on", "on", update="hits += 1"),
            ),
        ],
        False,
    ),
}


@functools.cache
def _shipped_states(top: str) -> int:
    """How many states the shipped spec ``top`` has on 2 nodes (searched once per module)."""
    return check.check_spec(spec_dir() / top, 2, Bounds({})).states


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_variant_passes(tmp_path: Path, name: str) -> None:
    top, edits, same = CORRECT[name]
    result = check.check_spec(_spec(tmp_path, top, edits), 2, Bounds({}))
    assert result.violation is None
    assert (result.states == _shipped_states(top)) is same


RENAMED = CORRECT["free_states_renamed"][1]
"""The edits that rename the free states (``unbacked``, ``evicted``, ``absent``): names the checks do not read."""


def test_the_write_policy_backs_up_nodes_whose_free_states_are_renamed(tmp_path: Path) -> None:
    # wants_backup read the host's free states by their shipped names, so it
    # started no backup on a spec that renames them: 6 states instead of 1 063.
    renamed = _spec(tmp_path, RESIDENCY, RENAMED)
    result = check.check_spec(renamed, 2, Bounds({}), policy=WritePolicy.WRITE_THROUGH)
    shipped = check.check_spec(
        spec_dir() / RESIDENCY, 2, Bounds({}), policy=WritePolicy.WRITE_THROUGH
    )
    assert (result.violation, result.states) == (None, shipped.states)


def test_a_bug_in_a_backup_is_found_under_the_write_policy_with_free_states_renamed(
    tmp_path: Path,
) -> None:
    # write_done drops the pins taken while the copy was in flight.
    drops = Edit(
        HOST,
        'event = "write_done"\nsource = "writing"\ndest = "pinned"\nguard = "pins >= 1"',
        'event = "write_done"\nsource = "writing"\ndest = "backed"\nguard = "pins >= 1"\nupdate = "pins = 0"',
    )
    spec = _spec(tmp_path, RESIDENCY, [*RENAMED, drops])
    result = check.check_spec(spec, 2, Bounds({}), policy=WritePolicy.WRITE_THROUGH)
    assert (result.violation, result.trace) == (
        "invariant 6: node 0: pins is 0 but its holders account for 1 (write_done moves pins "
        "by other steps than one up or one down, so the check counts it as neither a hold nor "
        "a give-back)",
        ["start: chain", "node 0: write", "node 0: pin", "node 0: write_done"],
    )
