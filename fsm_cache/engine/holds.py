"""Holds: the live records whose pins or locks are still up at the end of a run.

A lease names where a pin was taken, but a pin fired without one
(``engine.fire(node, "pin")``, SGLang's ``protect_host()``) leaves nothing
behind but the counter. :func:`held_records` finds such records without any
registry of records (which would cost memory in production): it walks the
objects the garbage collector tracks and picks out those shaped like a record
of a live engine. That walk is for the end of a test run (the pytest plugin
does it), never for a hot path.
"""

from __future__ import annotations

import gc
import types
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsm_cache.engine import trail
from fsm_cache.engine.core import Engine


@dataclass(frozen=True)
class Held:
    """A live record whose hold counter (pins, locks) is off its initial value.

    Attributes:
        label: How the record is called in messages (``node``).
        ident: The record's id.
        state: The record's states and counters (``pinned (pins=1)``).
        history: Its trail (``pinned at a.py:3 in f``), empty outside trail mode.
    """

    label: str
    ident: object
    state: str
    history: str = ""

    def __str__(self) -> str:
        where = f"; {self.history}" if self.history else ""
        return f"{self.label} {self.ident}: {self.state}{where}"


def held_records(engines: Iterable[Engine] | None = None) -> list[Held]:
    """Return the live records of ``engines`` (default: every live engine) that still hold.

    A record holds while a counter that a state of its machine carries
    (``pinned(N)`` carries ``pins``; ``resident`` carries ``locks``) is off its
    initial value, whether a lease or a bare event raised it. A record is any
    object whose ``id``, region states and counters are plain fields (slots
    or instance attributes, which a plain class attribute may default; no
    properties) with states its machine declares:
    ``engine.new()`` records, :class:`~fsm_cache.residency.ResidencyRecord`
    subclasses and SGLang-compat nodes alike. A record with ``children`` and
    no ``parent`` (a tree's root, or a standalone node) holds only by counters
    no event propagates to ancestors (pins): its locks are its children's, or
    SGLang's own lock on its root. Runs a full collection first, so records
    only garbage keeps alive are not reported.
    """
    gc.collect()
    objects = gc.get_objects()
    if engines is None:
        engines = [o for o in objects if issubclass(type(o), Engine)]
    shapes = list({id(e.system): _Shape(e) for e in engines}.values())
    plans: dict[type, list[tuple[_Shape, list[_Field]]]] = {}
    found: dict[int, Held] = {}
    for obj in objects:
        kind = type(obj)
        plan = plans.get(kind)
        if plan is None:
            plan = plans[kind] = [(s, f) for s in shapes if (f := _fields(kind, s.names))]
        for shape, fields in plan:
            held = shape.held(obj, fields)
            if held is not None:
                found.setdefault(id(obj), held)
                break
    return sorted(found.values(), key=lambda h: (h.label, len(str(h.ident)), str(h.ident)))


_Field = tuple[str, "types.MemberDescriptorType | None"]
"""A record field: its name and its slot, or None for an instance attribute."""


class _Shape:
    """What a record of one engine looks like, and how to tell whether it holds."""

    def __init__(self, engine: Engine) -> None:
        system = engine.system
        self.engine = engine
        self.regions = {r: frozenset(m.state_names) for r, m in system.regions}
        carried = {s.counter for _, m in system.regions for s in m.states if s.counter}
        self.carried = [(c, v) for c, v in system.counters if c in carried]
        spread = {
            c
            for _, m in system.regions
            for t in m.transitions
            if t.propagate
            for c in t.update.counters()
        }
        self.own = [(c, v) for c, v in self.carried if c not in spread]
        """The carried counters no event propagates to ancestors: a root's are its own."""
        self.names = ("id", *self.regions, *(c for c, _ in system.counters))
        self.past = system.past_tenses

    def held(self, obj: object, fields: list[_Field]) -> Held | None:
        """Return ``obj`` as a :class:`Held` if it is a record of this shape that holds."""
        values = _read(obj, fields)
        if values is None or not self.carried:
            return None
        if any(values[region] not in states for region, states in self.regions.items()):
            return None
        if all(values[counter] == initial for counter, initial in self.carried):
            return None
        if _tree_root(obj) and all(values[counter] == initial for counter, initial in self.own):
            return None
        log = values.get("trail")
        history = trail.account(trail.sites(log), self.past) if isinstance(log, deque) else ""
        return Held(self.engine.system.label, values["id"], self.engine.describe(obj), history)


def _tree_root(obj: object) -> bool:
    """Whether ``obj`` may be the root of a tree: it has ``children`` and its ``parent`` is None.

    A root's propagated counts hold nothing of their own: its locks are its
    children's, plus, in SGLang, the one lock the cache keeps on it for ever
    (``reset`` sets ``lock_ref = 1``, children or none); a leaked lock shows on
    the nodes below. Its other counts (pins) are its own. A standalone node (a
    :class:`~fsm_cache.residency.Node` in no tree) looks the same: its pins are
    reported, its locks no more than an empty SGLang tree's root's.
    """
    return hasattr(obj, "children") and getattr(obj, "parent", False) is None


def _fields(kind: type, names: tuple[str, ...]) -> list[_Field]:
    """Return how to read ``names`` (and ``trail``) off a ``kind``; [] if it has no such fields."""
    if kind.__module__ == "builtins" or issubclass(kind, type):
        return []
    fields: list[_Field] = []
    for name in (*names, "trail"):
        owner = next((k.__dict__ for k in kind.__mro__ if name in k.__dict__), None)
        if kind.__dictoffset__ != 0 and (owner is None or not _descriptor(owner[name])):
            fields.append((name, None))  # an instance attribute, perhaps defaulted by the class
        elif owner is not None and isinstance(owner[name], types.MemberDescriptorType):
            fields.append((name, owner[name]))
        elif name != "trail":
            return []  # a property, or no place for it: not a record field
    return fields


def _descriptor(value: object) -> bool:
    """Whether a class attribute computes what it reads (a property, a slot, a method)."""
    return hasattr(type(value), "__get__")


def _default(kind: type, name: str) -> Any:
    """The plain class attribute ``name`` of ``kind`` stands for an unset instance attribute."""
    owner = next((k.__dict__ for k in kind.__mro__ if name in k.__dict__), None)
    if owner is None or _descriptor(owner[name]):
        raise KeyError(name)
    return owner[name]


def _read(obj: object, fields: list[_Field]) -> dict[str, Any] | None:
    """Read the fields without running the object's own code; None if a required one is unset."""
    values: dict[str, Any] = {}
    attrs: object = {}
    if any(slot is None for _, slot in fields):
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except Exception:  # an exotic __dict__ (a property, a proxy) is no record's
            return None
    if type(attrs) is not dict:
        return None
    for name, slot in fields:
        try:
            if slot is not None:
                values[name] = slot.__get__(obj, type(obj))
            else:
                values[name] = attrs[name] if name in attrs else _default(type(obj), name)
        except (AttributeError, KeyError):
            if name != "trail":
                return None
    return values
