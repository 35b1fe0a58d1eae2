"""Fast paths, plain and in trail mode, do what the spec means on every state and valuation.

The one-region fast paths commit inside their branches, read a counter only
where a guard tests it or an update writes it, and write a constant where a guard
or the source state's invariant pins the counter (``release`` with ``pins == 1``
writes 0, ``pin`` from ``backed`` writes 1), and in trail mode look the caller's
frame up before the checks. Each shipped machine and composition is run here on
every state and representative valuation its invariants allow (the engine keeps
them) against :func:`fsm_cache.spec.meaning.step`, through the verb a caller
asks for and through :meth:`Engine.fire`: an accepted event notes exactly one
entry naming this file's calling line, a refused one changes nothing, trail
included.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_cache.engine import trail
from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition
from fsm_cache.spec.machine import MachineSpec, System, as_system
from fsm_cache.spec.meaning import step
from fsm_cache.spec.shipped import load_shipped, shipped_spec_paths
from fsm_cache.spec.validate import valuations


HERE = os.path.basename(__file__)


def specs() -> Iterator[tuple[str, MachineSpec | System]]:
    """Yield every shipped spec and, for compositions, each of their machines alone."""
    for path in shipped_spec_paths():
        spec = load_shipped(path.stem)
        yield path.stem, spec
        if isinstance(spec, System):
            for region, machine in spec.regions:
                yield f"{path.stem}.{region}", machine


def records(system: System) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """Yield every combination of region states and representative counter valuations.

    Each region's valuations satisfy its state's invariant: the engine keeps
    every invariant (validation proves each step does), and a fast path may
    rely on it (``pin`` from ``backed``, where ``pins == 0``, writes 1).
    """
    machines = [m for _, m in system.regions]
    for states in itertools.product(*(m.states for m in machines)):
        per_machine = [valuations(m, s.invariant) for m, s in zip(machines, states, strict=True)]
        for values in itertools.product(*per_machine):
            counters: dict[str, int] = {}
            for found in values:
                counters.update(found)
            yield {r: s.name for (r, _), s in zip(system.regions, states, strict=True)}, counters


def here() -> int:
    """Return the line number of the caller's current line."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def fire_verb(engine: Engine, rec: Any, event: str) -> int:
    line = here() + 1
    engine.verb(event)(rec)
    return line


def fire_dispatched(engine: Engine, rec: Any, event: str) -> int:
    line = here() + 1
    engine.fire(rec, event)
    return line


def snapshot(system: System, rec: Any) -> tuple[object, ...]:
    return (
        *(getattr(rec, r) for r, _ in system.regions),
        *(getattr(rec, c) for c, _ in system.counters),
    )


def earlier(engine: Engine) -> trail.Trail:
    """Return a full trail of ``engine``'s length: ``earlier`` events, noted here.

    Each record starts with a copy. Noted from this small function, not the
    test's long one: a refusal in trail mode names the site of every entry,
    and finding an entry's line walks its function's line table.
    """
    full = None
    for _ in range(engine.history):
        full = trail.note(full, "earlier", engine.history)
    assert full is not None
    return full


@pytest.mark.parametrize("name", [name for name, _ in specs()])
@pytest.mark.parametrize("on", [False, True], ids=["plain", "trail"])
def test_fast_paths_agree_with_the_spec_and_note_only_what_they_did(name: str, on: bool) -> None:
    spec = dict(specs())[name]
    system = as_system(spec)
    engine = Engine(spec, trail=on)
    full = earlier(engine)
    checked = 0
    for states, counters in records(system):
        for event, fire in itertools.product(system.event_names, (fire_verb, fire_dispatched)):
            rec = engine.new(1)
            for attr, value in {**states, **counters}.items():
                setattr(rec, attr, value)
            if on:  # a full trail: a note evicts its oldest entry
                rec.trail = deque(full, full.maxlen)
            before = list(rec.trail) if on else None
            want = step(system, event, states, counters)
            try:
                line, error = fire(engine, rec, event), ""
            except IllegalTransition as exc:
                line, error = 0, type(exc).__name__
            assert (error, *snapshot(system, rec)) == want, (name, states, counters, event)
            if not on:
                assert rec.trail is None
            elif error:  # a refusal notes nothing
                assert list(rec.trail) == before
            else:
                noted = trail.sites(rec.trail)
                assert [e for e, _ in noted] == ["earlier"] * (engine.history - 1) + [event]
                assert (noted[-1][1].filename, noted[-1][1].line) == (__file__, line)
                assert str(noted[-1][1]) == f"{HERE}:{line} in {fire.__name__}"
            checked += 1
    assert checked >= 2 * len(system.event_names)
