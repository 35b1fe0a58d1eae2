"""Trail mode: refusals name the call sites of the record's last few events and their own."""

from __future__ import annotations

import copy
import inspect
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from fsm_cache.engine import trail
from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition
from fsm_cache.spec.loader import spec_from_dict
from fsm_cache.spec.shipped import host_machine, residency_system


HERE = os.path.basename(__file__)


def here() -> int:
    """Return the line number of the caller's current line."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def firing_line(function: Any) -> int:
    """Return the line of ``function`` that fires the engine (for calls that raise)."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, text in enumerate(lines) if "engine." in text)


def backup_to_storage(engine: Engine, node: Any) -> int:
    line = here() + 1
    engine.fire(node, "pin")
    return line


def prefetch(engine: Engine, node: Any) -> int:
    line = here() + 1
    engine.verb("pin")(node)
    return line


def drain_backup(engine: Engine, node: Any) -> int:
    line = here() + 1
    engine.fire(node, "release")
    return line


def release_aborted_request(engine: Engine, node: Any) -> int:
    line = here() + 1
    engine.verb("release")(node)
    return line


def backed(engine: Engine, ident: int = 17) -> Any:
    node = engine.new(ident)
    setattr(node, engine.system.regions[0][0], "backed")
    return node


def refusal(engine: Engine, node: Any, event: str) -> IllegalTransition:
    with pytest.raises(IllegalTransition) as info:
        engine.fire(node, event)
    return info.value


REFUSED = f"refused at {HERE}:{firing_line(refusal)} in refusal"


def test_a_refusal_names_the_earlier_call_sites_and_its_own() -> None:
    engine = Engine(residency_system(), trail=True)
    node = backed(engine)
    a = backup_to_storage(engine, node)
    b = prefetch(engine, node)
    c = drain_backup(engine, node)
    d = release_aborted_request(engine, node)
    with pytest.raises(IllegalTransition) as info:
        release_aborted_request(engine, node)
    history = (
        f"pinned at {HERE}:{a} in backup_to_storage and at {HERE}:{b} in prefetch; "
        f"released at {HERE}:{c} in drain_backup and at {HERE}:{d} in release_aborted_request; "
        f"refused at {HERE}:{d} in release_aborted_request"
    )
    exc = info.value
    assert exc.history == history
    assert str(exc) == (
        f"node 17: release refused in backed (pins=0): release without a matching pin; {history}"
    )


def test_a_refusal_names_the_events_in_the_order_they_fired() -> None:
    """Across repeated cycles the order shows which release was the extra one.

    The events used to be grouped by name (``pinned at A and at B; released
    at C and at D``), which hid that the second pin came between the releases.
    """
    engine = Engine(host_machine(), trail=True)
    node = backed(engine)
    a = backup_to_storage(engine, node)
    c = drain_backup(engine, node)
    b = prefetch(engine, node)
    d = release_aborted_request(engine, node)
    exc = refusal(engine, node, "release")
    assert exc.history == (
        f"pinned at {HERE}:{a} in backup_to_storage; released at {HERE}:{c} in drain_backup; "
        f"pinned at {HERE}:{b} in prefetch; "
        f"released at {HERE}:{d} in release_aborted_request; {REFUSED}"
    )
    assert [event for event, _ in exc.sites] == ["pin", "release", "pin", "release"]


def test_only_a_run_of_one_event_shares_its_name() -> None:
    a, b, c, d = (trail.Site(f"{name}.py", 1, "f") for name in "abcd")
    recent = (("pin", a), ("pin", b), ("release", c), ("pin", d))
    assert trail.account(recent, {}, d) == (
        "pinned at a.py:1 in f and at b.py:1 in f; released at c.py:1 in f; "
        "pinned at d.py:1 in f; refused at d.py:1 in f"
    )


def test_the_sites_are_on_the_refusal() -> None:
    engine = Engine(host_machine(), trail=True)
    node = backed(engine)
    a = backup_to_storage(engine, node)
    c = drain_backup(engine, node)
    with pytest.raises(IllegalTransition) as info:
        release_aborted_request(engine, node)
    exc = info.value
    assert exc.site == trail.Site(
        __file__, firing_line(release_aborted_request), "release_aborted_request"
    )
    assert exc.sites == (
        ("pin", trail.Site(__file__, a, "backup_to_storage")),
        ("release", trail.Site(__file__, c, "drain_backup")),
    )


def test_a_first_event_refused_names_only_its_own_site() -> None:
    engine = Engine(host_machine(), trail=True)
    exc = refusal(engine, engine.new(5), "release")
    assert exc.sites == ()
    assert str(exc) == (
        f"node 5: release refused in unbacked (pins=0): release without a matching pin; {REFUSED}"
    )


def test_propagating_events_are_noted_on_every_record() -> None:
    engine = Engine(residency_system(), trail=True)
    root, leaf = engine.new(1), engine.new(2)
    leaf_tree = _Tree(leaf, root)
    line = here() + 1
    engine.fire(leaf_tree, "lock")
    engine.fire(leaf_tree, "unlock")
    exc = refusal(engine, root, "unlock")
    site = f"{HERE}:{line} in test_propagating_events_are_noted_on_every_record"
    assert str(exc) == (
        "node 1: unlock refused in resident (locks=0): unlock without a matching lock; "
        f"locked at {site}; unlocked at {HERE}:{line + 1} in "
        f"test_propagating_events_are_noted_on_every_record; {REFUSED}"
    )


def test_a_refusal_at_an_ancestor_names_the_call_on_the_descendant() -> None:
    engine = Engine(residency_system(), trail=True)
    root = engine.new(1)
    leaf = _Tree(engine.new(2), root)
    leaf.locks = 1
    line = here() + 2
    with pytest.raises(IllegalTransition) as info:
        engine.fire(leaf, "unlock")
    assert str(info.value) == (
        "node 1: unlock refused in resident (locks=0): unlock without a matching lock; "
        f"refused at {HERE}:{line} in test_a_refusal_at_an_ancestor_names_the_call_on_the_descendant"
    )
    assert (leaf.locks, root.locks) == (1, 0)


class _Tree:
    """A record wrapper with a parent, for engines whose records have no parent slot."""

    __slots__ = ("device", "host", "id", "locks", "parent", "pins", "rec", "trail")
    locks: int

    def __init__(self, rec: Any, parent: Any) -> None:
        for slot in ("id", "host", "device", "pins", "locks", "trail"):
            setattr(self, slot, getattr(rec, slot))
        self.parent = parent


def test_a_transition_that_writes_nothing_is_noted() -> None:
    spec = spec_from_dict(
        {
            "machine": {"name": "m", "initial": "a"},
            "states": {"a": {}, "b": {}},
            "transition": [
                {"event": "poke", "source": "a", "dest": "a"},
                {"event": "stop", "source": "a", "dest": "b"},
                {"event": "go_on", "source": "b", "dest": "a"},
            ],
            "forbid": [
                {"event": "stop", "source": "b", "error": "E", "reason": "stopped"},
                {"event": "poke", "source": "b", "error": "E", "reason": "stopped"},
                {"event": "go_on", "source": "a", "error": "E", "reason": "going"},
            ],
        }
    )
    engine = Engine(spec, trail=True)
    rec = engine.new(1)
    line = here() + 1
    engine.verb("poke")(rec)
    engine.verb("stop")(rec)
    exc = refusal(engine, rec, "stop")
    where = "test_a_transition_that_writes_nothing_is_noted"
    assert exc.history == (
        f"poked at {HERE}:{line} in {where}; stopped at {HERE}:{line + 1} in {where}; {REFUSED}"
    )


def test_a_refused_event_leaves_the_record_and_its_trail_as_they_were() -> None:
    engine = Engine(host_machine(), trail=True)
    node = backed(engine)
    a = backup_to_storage(engine, node)
    before = (node.state, node.pins, list(node.trail))
    with pytest.raises(IllegalTransition):
        engine.verb("evict_host")(node)
    assert (node.state, node.pins, list(node.trail)) == before
    assert [(event, site.line) for event, site in trail.sites(node.trail)] == [("pin", a)]


def test_a_lease_notes_the_callers_of_lease_and_release() -> None:
    engine = Engine(host_machine(), trail=True)
    node = backed(engine)
    line = here() + 1
    lease = engine.lease(node)
    lease.release()
    exc = refusal(engine, node, "release")
    where = "test_a_lease_notes_the_callers_of_lease_and_release"
    assert exc.history == (
        f"pinned at {HERE}:{line} in {where}; released at {HERE}:{line + 1} in {where}; {REFUSED}"
    )


def test_a_verb_asked_for_here_notes_its_immediate_caller() -> None:
    engine = Engine(host_machine(), trail=True)
    node = backed(engine)
    pin, release = engine.verb("pin"), engine.verb("release")  # asked for outside fsm_cache
    helper: dict[str, Any] = {}
    exec(compile("def dispatch(verb, rec):\n    verb(rec)\n", "<dispatch>", "exec"), helper)
    trail.internal("<dispatch>")
    try:
        helper["dispatch"](pin, node)  # handed to dispatch code: names its line
        line = here() + 1
        release(node)
    finally:
        trail.forget("<dispatch>")
    assert trail.sites(node.trail) == (
        ("pin", trail.Site("<dispatch>", 2, "dispatch")),
        (
            "release",
            trail.Site(__file__, line, "test_a_verb_asked_for_here_notes_its_immediate_caller"),
        ),
    )


def test_the_trail_keeps_only_the_last_events() -> None:
    engine = Engine(host_machine(), trail=True, history=2)
    node = backed(engine)
    backup_to_storage(engine, node)
    b = prefetch(engine, node)
    c = drain_backup(engine, node)
    engine.fire(node, "release")
    last = here() - 1
    exc = refusal(engine, node, "release")
    assert exc.history == (
        f"released at {HERE}:{c} in drain_backup and at {HERE}:{last} in "
        f"test_the_trail_keeps_only_the_last_events; {REFUSED}"
    )
    assert b not in (c, last)


def test_a_copy_of_a_record_keeps_a_trail_of_its_own() -> None:
    """Events fired at a copy are not the original's: its refusal names only its own.

    ``copy.copy`` once shared the trail's deque, so a refusal of the
    original named a pin and a release that only the copy had.
    """
    engine = Engine(host_machine(), trail=True, history=3)
    node = backed(engine)
    a = backup_to_storage(engine, node)
    trial = copy.copy(node)
    drain_backup(engine, trial)
    backup_to_storage(engine, trial)
    assert (node.state, node.pins, trial.state, trial.pins) == ("pinned", 1, "pinned", 1)
    assert trial.trail.maxlen == 3
    assert [event for event, *_ in trial.trail] == ["pin", "release", "pin"]
    c = drain_backup(engine, node)
    exc = refusal(engine, node, "release")
    assert exc.history == (
        f"pinned at {HERE}:{a} in backup_to_storage; released at {HERE}:{c} in drain_backup; "
        f"{REFUSED}"
    )


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
@pytest.mark.parametrize("traced", [True, False], ids=["trail", "no-trail"])
def test_a_copy_of_a_record_has_its_fields_and_changes_apart(
    copier: Callable[[Any], Any], traced: bool
) -> None:
    engine = Engine(residency_system(), trail=traced)
    node = engine.new(("node", 7))
    engine.fire(node, "write")
    twin = copier(node)
    assert repr(twin) == repr(node)
    assert (twin.trail is None) == (not traced)
    assert twin.trail is None or twin.trail is not node.trail
    assert twin.trail is None or list(twin.trail) == list(node.trail)
    engine.fire(twin, "write_done")
    assert (node.host, twin.host) == ("writing", "backed")
    assert node.trail is None or [event for event, *_ in node.trail] == ["write"]
    assert type(twin) is engine.Record


def test_a_record_does_not_pickle_and_says_why() -> None:
    engine = Engine(host_machine(), trail=True)
    node = engine.new(3)
    with pytest.raises(TypeError) as info:
        pickle.dumps(node)
    assert str(info.value) == (
        "cannot pickle host_residency.Record(id=3, state='unbacked', pins=0): a record's class is "
        "built by its Engine at run time; pickle its id, states and counters and set them "
        "on engine.new(id) instead"
    )


def test_without_trail_mode_there_is_no_history() -> None:
    engine = Engine(host_machine(), trail=False)
    node = backed(engine)
    backup_to_storage(engine, node)
    drain_backup(engine, node)
    assert node.trail is None
    exc = refusal(engine, node, "release")
    assert str(exc) == "node 17: release refused in backed (pins=0): release without a matching pin"
    assert (exc.history, exc.site, exc.sites) == ("", None, ())


def test_a_refusal_outside_trail_mode_names_no_trail_left_from_trail_mode() -> None:
    traced, plain = Engine(host_machine(), trail=True), Engine(host_machine(), trail=False)
    node = backed(traced)
    backup_to_storage(traced, node)
    drain_backup(traced, node)
    assert node.trail is not None  # left by the trail-mode engine, stale for the other
    exc = refusal(plain, node, "release")
    assert str(exc) == "node 17: release refused in backed (pins=0): release without a matching pin"
    assert (exc.history, exc.site, exc.sites) == ("", None, ())


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither trail variable set, whatever the shell running the tests exports."""
    monkeypatch.delenv("FSM_CACHE_TRAIL", raising=False)
    monkeypatch.delenv("FSM_CACHE_AUDIT", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("yes", True), ("0", False), ("", False), ("no", False), ("FALSE", False)],
)
def test_the_environment_turns_trail_mode_on(
    environ: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    environ.setenv("FSM_CACHE_TRAIL", value)
    engine = Engine(host_machine())
    assert engine.trail is on
    node = backed(engine)
    line = backup_to_storage(engine, node)
    drain_backup(engine, node)
    message = str(refusal(engine, node, "release"))
    assert (f"pinned at {HERE}:{line} in backup_to_storage" in message) is on
    assert message.endswith(REFUSED) is on


def test_the_argument_overrides_the_environment(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("FSM_CACHE_TRAIL", "1")
    assert Engine(host_machine(), trail=False).trail is False
    environ.delenv("FSM_CACHE_TRAIL")
    assert Engine(host_machine(), trail=True).trail is True
    assert Engine(host_machine()).trail is False


def test_undeclared_past_tenses_are_derived() -> None:
    spec = spec_from_dict(
        {
            "machine": {"name": "m", "initial": "a"},
            "states": {"a": {}, "b": {}},
            "transition": [
                {"event": "stop", "source": "a", "dest": "b"},
                {"event": "go_on", "source": "b", "dest": "a"},
            ],
            "forbid": [
                {"event": "stop", "source": "b", "error": "E", "reason": "stopped"},
                {"event": "go_on", "source": "a", "error": "E", "reason": "going"},
            ],
        }
    )
    engine = Engine(spec, trail=True)
    rec = engine.new(1)
    line = here() + 1
    engine.fire(rec, "stop")
    engine.fire(rec, "go_on")
    exc = refusal(engine, rec, "go_on")
    where = "test_undeclared_past_tenses_are_derived"
    assert exc.history == (
        f"stopped at {HERE}:{line} in {where}; go_on at {HERE}:{line + 1} in {where}; {REFUSED}"
    )


@pytest.mark.parametrize(
    ("event", "past"),
    [
        ("pin", "pinned"),
        ("release", "released"),
        ("lock", "locked"),
        ("stop", "stopped"),
        ("load", "loaded"),
        ("fix", "fixed"),
        ("evict_host", "evict_host"),
        ("open", "opened"),
        ("flip", "flipped"),
        ("free", "freed"),
        ("clip", "clipped"),
        ("drop", "dropped"),
        ("tap", "tapped"),
    ],
)
def test_past_tense(event: str, past: str) -> None:
    assert trail.past_tense(event) == past


def test_internal_files_are_skipped() -> None:
    assert trail.is_internal(trail.__file__) is False
    import fsm_cache.engine.core

    assert trail.is_internal(fsm_cache.engine.core.__file__)
    assert trail.sites(None) == ()
    assert trail.account((), {}) == ""
