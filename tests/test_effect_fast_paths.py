"""Events with effects run through generated fast paths that answer as the plan path did (issue 15).

The plan path (``step(rec)`` returns ``(assignments, effect names, propagates)``,
then every effect runs through ``run_effect`` and the assignments are set one by
one) is kept below, as the engine ran it before the fast paths, compiled under a
file name marked as dispatch code so that its trail notes walk to the same call
site as the engine's. Both are driven from one call instruction (:func:`call`),
so trail entries compare exactly: event, code object and instruction offset.

For every shipped spec, on random trees of three records, every event is fired
through the engine and through the plan path on two copies of one tree, with
effects that log the record they see and, in turn, each effect failing: the
outcome (refusal or EffectFailed, type and message, and the cause), the effects
called, what each record looked like when they were called, and every record
afterwards, trails included, must be the same.
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fsm_cache.engine import runtime, trail
from fsm_cache.engine.codegen import propagates
from fsm_cache.engine.core import Engine
from fsm_cache.errors import EffectFailed, FsmCacheError
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import Spec, System, as_system
from fsm_cache.spec.shipped import load_shipped, residency_system, shipped_spec_paths


PLAN_PATH = """
def general(engine, effects, rec, event):
    on, history, label = engine.trail, engine.history, engine.system.label
    step = engine.planner(event)
    plan = step(rec)
    plans = [(rec, plan)]
    if plan[2]:
        node = getattr(rec, "parent", None)
        while node is not None:
            plans.append((node, step(node)))
            node = getattr(node, "parent", None)
    for target, (_, names, _) in plans:
        for name in names:
            run_effect(effects[name], name, event, target, label)
    for target, (assigns, _, _) in plans:
        for attr, value in assigns:
            setattr(target, attr, value)
        if on:
            target.trail = note(target.trail, event, history)
"""
PLAN_FILE = "<tests: the plan path before issue 15>"
_namespace: dict[str, Any] = {"run_effect": runtime.run_effect, "note": trail.note}
exec(compile(PLAN_PATH, PLAN_FILE, "exec"), _namespace)
trail.internal(PLAN_FILE)
general: Callable[[Engine, dict[str, Any], Any, str], None] = _namespace["general"]

SPECS = [path.stem for path in shipped_spec_paths()]
ROLES = ("root", "node", "child")


class Rec:
    """A tree record with every attribute the engine reads: parent and children too."""

    trail: Any

    def __init__(self, engine: Engine, ident: int, parent: Rec | None) -> None:
        engine.init(self, ident)
        self.parent = parent
        self.children: dict[int, Rec] = {}
        if parent is not None:
            parent.children[ident] = self


def call(fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn``: one call instruction, so both paths' trail entries name the same offset."""
    fn(*args)


def effectful(system: System, event: str) -> list[str]:
    """The effects ``event``'s transitions name, in region order."""
    found = [
        t.effect
        for region in system.regions_of(event)
        for t in system.machines[region].transitions
        if t.event == event and t.effect is not None
    ]
    return list(dict.fromkeys(found))


def owned(system: System) -> tuple[str, ...]:
    """The attributes the engine owns on a record but the id and the trail: regions, counters."""
    return (*(r for r, _ in system.regions), *(c for c, _ in system.counters))


def values(fields: tuple[str, ...], rec: Any) -> tuple[Any, ...]:
    """Everything the engine owns on a record but the trail (``fields``: :func:`owned`)."""
    return (rec.id, *(getattr(rec, f) for f in fields))


class Harness:
    """One engine of ``spec`` whose effects log into the world being driven.

    Each effect logs its name, which record it was called with and what that
    record held then; the one the world names as ``fail`` raises OSError.
    ``pure`` engines are built without effects (``no_effect`` stand-ins,
    which the plan path calls and the fast paths skip).
    """

    def __init__(self, spec: Spec, *, on: bool, pure: bool = False) -> None:
        self.spec, self.system = spec, as_system(spec)
        self.fields = owned(self.system)
        self.world: World | None = None
        names = sorted(self.system.effect_names)
        hooks = {name: self._hook(name) for name in names}
        self.effects = dict.fromkeys(names, runtime.no_effect) if pure else hooks
        self.engine = Engine(spec, effects=None if pure else hooks, trail=on)

    def _hook(self, name: str) -> Callable[[Any], None]:
        def hook(rec: Any) -> None:
            world = self.world
            assert world is not None
            role = ROLES[[r is rec for r in world.records].index(True)]
            world.log.append((name, role, values(self.fields, rec)))
            if name == world.fail:
                raise OSError(f"{name} broke")

        return hook


Layout = tuple[tuple[tuple[str, Any], ...], ...]
"""What each of root, node and child holds at the start: its regions' states and counters."""


def layout(system: System, seed: int) -> Layout:
    """Draw each record's states from ``seed``, with counters their invariants allow."""
    rng = random.Random(seed)
    drawn_records = []
    for _ in ROLES:
        held: list[tuple[str, Any]] = []
        for region, machine in system.regions:
            state = machine.state(rng.choice(machine.state_names))
            while True:  # counters its invariant allows: the engine keeps them so
                drawn = {c: rng.choice((0, 0, 1, 2)) for c in machine.counter_names}
                if state.invariant.holds(drawn):
                    break
            held += [(region, state.name), *drawn.items()]
        drawn_records.append(tuple(held))
    return tuple(drawn_records)


class World:
    """Three records, root > node > child, holding ``start``, driven by ``harness``."""

    def __init__(self, harness: Harness, start: Layout, fail: str | None = None) -> None:
        self.harness, self.system = harness, harness.system
        self.fail = fail
        self.log: list[tuple[str, str, tuple[Any, ...]]] = []
        engine = harness.engine
        root = Rec(engine, 1, None)
        node = Rec(engine, 2, root)
        child = Rec(engine, 3, node)
        self.records = (root, node, child)
        for rec, held in zip(self.records, start, strict=True):
            for attr, value in held:
                setattr(rec, attr, value)
        harness.world = self

    def snapshot(self) -> list[tuple[Any, ...]]:
        """Every record's values and trail entries (event, code object, instruction offset)."""
        return [
            (*values(self.harness.fields, rec), list(rec.trail) if rec.trail is not None else None)
            for rec in self.records
        ]

    def fire(self, event: str, path: str) -> tuple[Any, ...] | None:
        """Fire ``event`` at the middle record by ``path``; return what it raised."""
        node, engine = self.records[1], self.harness.engine
        if path == "plan":
            return outcome(general, engine, self.harness.effects, node, event)
        if path == "fire":
            return outcome(engine.fire, node, event)
        return outcome(engine.verb(event), node)


def outcome(fn: Callable[..., None], *args: Any) -> tuple[Any, ...] | None:
    """Call ``fn`` through :func:`call`; return what it raised: type, message, cause."""
    try:
        call(fn, *args)
    except FsmCacheError as exc:
        cause = exc.__cause__
        return type(exc), str(exc), type(cause), str(cause), exc.__suppress_context__
    return None


def run(
    harness: Harness, start: Layout, event: str, path: str, fail: str | None = None
) -> tuple[Any, ...]:
    """Fire ``event`` twice at a fresh world; return the outcomes, the logs and the snapshots."""
    w = World(harness, start, fail)
    first = w.fire(event, path)
    after = w.snapshot()
    second = w.fire(event, path)
    return (first, after, second, w.snapshot(), w.log)


def starts(system: System, seeds: int) -> list[Layout]:
    """The trees the first ``seeds`` seeds draw, each once: one drawn again answers the same."""
    return list(dict.fromkeys(layout(system, seed) for seed in range(seeds)))


def cases(spec: Spec) -> list[tuple[str, str | None]]:
    """Every event, with no effect failing and with each of its effects failing in turn."""
    system = as_system(spec)
    return [
        (event, fail) for event in system.event_names for fail in (None, *effectful(system, event))
    ]


@pytest.mark.parametrize("name", SPECS)
def test_events_without_propagation_or_effects_have_generated_fast_paths(name: str) -> None:
    spec = load_shipped(name)
    system = as_system(spec)
    for effects in (None, Harness(spec, on=False).effects):
        for on in (False, True):
            engine = Engine(spec, effects=effects, trail=on)
            for event in system.event_names:
                verb = engine.verb(event)
                generated = verb.__code__.co_filename == engine.filename
                # propagating events without effects: a generated loop over the chain
                chain = propagates(system, event) and not effectful(system, event) and not on
                assert generated == (not propagates(system, event) or chain), event
                if (effectful(system, event) or chain) and generated:
                    assert verb.__name__ == f"_fire_{event}"


Planned = dict[tuple[str, bool, Layout, str, str | None], tuple[Any, ...]]


@pytest.fixture(scope="module")
def planned() -> Planned:
    """The plan path's answers, by spec, trail mode, tree, event and failing effect.

    The ``fire`` and ``verb`` cases of one spec and mode hold their answers to
    the same plan-path runs: each is made once, by whichever case comes first.
    """
    return {}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("on", [False, True], ids=["plain", "trail"])
@pytest.mark.parametrize("path", ["fire", "verb"])
def test_every_event_answers_as_the_plan_path(
    name: str, on: bool, path: str, planned: Planned
) -> None:
    spec = load_shipped(name)
    harness = Harness(spec, on=on)
    seen = {"accepted": 0, "refused": 0, "failed": 0}
    for start in starts(harness.system, 200):
        for event, fail in cases(spec):
            ours = run(harness, start, event, path, fail)
            key = (name, on, start, event, fail)
            if key not in planned:
                planned[key] = run(harness, start, event, "plan", fail)
            assert ours == planned[key], (name, start, event, fail)
            first = ours[0]
            kind = (
                "accepted" if first is None else "failed" if first[0] is EffectFailed else "refused"
            )
            seen[kind] += 1
    assert all(seen.values()), seen  # each kind of answer was compared


@pytest.mark.parametrize("name", SPECS)
def test_a_pure_engine_answers_as_the_plan_path(name: str) -> None:
    spec = load_shipped(name)
    for on in (False, True):
        harness = Harness(spec, on=on, pure=True)
        for start in starts(harness.system, 30):
            for event in as_system(spec).event_names:
                ours = run(harness, start, event, "fire")
                assert ours == run(harness, start, event, "plan"), (start, event)


VALVE = """
[machine]
name = "valve"
initial = "shut"
label = "valve"

[counters]
turns = 0

[states]
shut = {}
open = {}

[[transition]]
event = "turn"
source = "shut"
dest = "open"
update = "turns += 1"
effect = "open_valve"

[[transition]]
event = "turn"
source = "open"
dest = "shut"
guard = "turns >= 1"
update = "turns += 1"
effect = "close_valve"

[[forbid]]
event = "turn"
source = "open"
guard = "turns == 0"
error = "IllegalTransition"
reason = "an open valve that was never turned"

[[transition]]
event = "slam"
source = ["shut", "open"]
dest = "shut"
update = "turns = 0"
effect = "close_valve"
"""
GATE = """
[machine]
name = "gate"
initial = "up"
label = "valve"

[states]
up = {}
down = {}

[[transition]]
event = "slam"
source = "up"
dest = "down"
effect = "drop_gate"

[[transition]]
event = "slam"
source = "down"
dest = "down"

[[transition]]
event = "lift"
source = "down"
dest = "up"

[[forbid]]
event = "lift"
source = "up"
error = "IllegalTransition"
reason = "the gate is up"
"""
PLANT = """
[composition]
name = "plant"
label = "valve"

[composition.regions]
valve = "valve.toml"
gate = "gate.toml"

[[forbid]]
event = "turn"
when = "gate in [down]"
error = "IllegalTransition"
reason = "the gate is down"
"""


def plant(folder: Path) -> tuple[Spec, Spec]:
    """A valve alone (branches commit inline) and composed with a gate (they do not).

    ``turn`` runs one of two effects by branch; ``slam`` runs an effect in each
    region of the composition, and a constant update.
    """
    for name, text in (("valve", VALVE), ("gate", GATE), ("plant", PLANT)):
        (folder / f"{name}.toml").write_text(textwrap.dedent(text), encoding="utf-8")
    return load_spec(folder / "valve.toml"), load_spec(folder / "plant.toml")


@pytest.mark.parametrize("on", [False, True], ids=["plain", "trail"])
def test_branch_effects_region_order_and_updates_answer_as_the_plan_path(
    tmp_path: Path, on: bool
) -> None:
    for spec in plant(tmp_path):
        harness = Harness(spec, on=on)
        assert harness.engine.verb("turn").__code__.co_filename == harness.engine.filename
        logs = set()
        for start in starts(harness.system, 40):
            for event, fail in cases(spec):
                ours = run(harness, start, event, "fire", fail)
                assert ours == run(harness, start, event, "plan", fail), (start, event, fail)
                logs.add(tuple(name for name, _, _ in ours[-1]))
        called = {name for log in logs for name in log}
        assert {"open_valve", "close_valve"} <= called
        if len(as_system(spec).regions) == 2:  # slam: the valve's region first, as declared
            assert any(
                log[i : i + 2] == ("close_valve", "drop_gate")
                for log in logs
                for i in range(len(log))
            )


def test_an_effect_sees_the_record_before_the_commit_and_a_failure_leaves_it(
    tmp_path: Path,
) -> None:
    spec, _ = plant(tmp_path)
    seen: list[tuple[str, int]] = []

    def open_valve(rec: Any) -> None:
        seen.append((rec.state, rec.turns))

    def close_valve(rec: Any) -> None:
        raise ValueError("stuck")

    engine = Engine(spec, effects={"open_valve": open_valve, "close_valve": close_valve})
    rec = engine.new(4)
    engine.fire(rec, "turn")
    assert seen == [("shut", 0)]
    assert (rec.state, rec.turns) == ("open", 1)
    with pytest.raises(EffectFailed) as info:
        engine.fire(rec, "turn")
    assert str(info.value) == "valve 4: effect close_valve of turn failed: stuck"
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.__suppress_context__
    assert (rec.state, rec.turns, rec.trail) == ("open", 1, None)


@pytest.mark.parametrize("on", [False, True], ids=["plain", "trail"])
@pytest.mark.parametrize("composed", [False, True], ids=["inline", "composed"])
def test_an_effect_that_changes_its_record_fails_and_its_event_is_not_applied(
    tmp_path: Path, on: bool, composed: bool
) -> None:
    """The writes were computed before the effect ran: committing them would undo what it did.

    An effect that fires an event at its own record (a copy that completes at
    once and acknowledges itself) used to be overwritten by the commit that
    followed, leaving a record no run of the spec makes. The event fails
    instead, and the record keeps what the effect left.
    """
    spec = plant(tmp_path)[composed]

    def open_valve(rec: Any) -> None:
        rec.turns += 10

    names = as_system(spec).effect_names
    effects = {**dict.fromkeys(names, runtime.no_effect), "open_valve": open_valve}
    engine = Engine(spec, effects=effects, trail=on)
    rec = engine.new(4)
    with pytest.raises(EffectFailed) as info:
        engine.fire(rec, "turn")
    assert str(info.value) == (
        "valve 4: effect open_valve of turn failed: it changed the record's states or counters"
        " (did it fire an event at the record?); turn was not applied"
    )
    region = "valve" if composed else "state"
    assert (getattr(rec, region), rec.turns, rec.trail) == ("shut", 10, None)


def test_an_effect_of_a_propagating_event_that_changes_a_record_fails() -> None:
    """The plan path (an event that propagates, with effects) checks every record it will write."""
    system = residency_system()
    lock = next(t for t in system.machines["device"].transitions if t.event == "lock")
    device = replace(
        system.machines["device"],
        transitions=tuple(
            replace(t, effect="note_lock") if t is lock else t
            for t in system.machines["device"].transitions
        ),
    )
    spec = replace(system, regions=(system.regions[0], ("device", device)))
    names = as_system(spec).effect_names
    engine: Engine

    def note_lock(rec: Any) -> None:
        if rec.parent is not None:
            engine.fire(rec.parent, "lock")  # an event at another record the lock will write

    effects = {name: (note_lock if name == "note_lock" else runtime.no_effect) for name in names}
    engine = Engine(spec, effects=effects, trail=False)
    root: Any = Rec(engine, 1, None)
    child: Any = Rec(engine, 2, root)
    with pytest.raises(EffectFailed) as info:
        engine.fire(child, "lock")
    assert str(info.value).startswith("node 2: effect note_lock of lock failed: it changed")
    assert (root.locks, child.locks) == (1, 0)
