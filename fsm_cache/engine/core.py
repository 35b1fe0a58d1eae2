"""The checked engine: a spec compiled into fast per-event functions over slotted records.

Per instance the engine keeps only a slotted record: an ``id``, one state per
region, the counters and an audit ``trail`` slot (None unless audit mode is
on). Events are plain functions of the record; :meth:`Engine.verb` returns one
for a hot loop, :meth:`Engine.fire` looks it up by name.

Check, then act: every event is checked completely (every region, every
cross-region and tree condition, every ancestor it propagates to) before
effects run, and effects run before anything is written. A refusal raises the
spec's error class and leaves every record exactly as it was; an effect that
raises leaves them unchanged too and is chained as the cause of
:class:`~fsm_cache.errors.EffectFailed`.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fsm_cache.engine import trail
from fsm_cache.engine.codegen import Emitter, compile_event, compile_fast, needs_general
from fsm_cache.engine.lease import Lease, LeaseBook
from fsm_cache.errors import EffectFailed, IllegalTransition, SpecError, error_class
from fsm_cache.spec.machine import Spec, System, as_system


trail.internal(__file__)

Effect = Callable[[Any], None]
Verb = Callable[[Any], None]
Plan = tuple[tuple[tuple[str, object], ...], list[str], bool]


class Engine:
    """A spec compiled for execution.

    Args:
        spec: The machine or composition to run.
        effects: Hooks by effect name, called with the record after all checks
            pass and before the commit. Without a mapping, effects are no-ops
            (a pure engine); with one, every effect the spec names must be bound.
        audit: Keep call sites of each record's recent events; defaults to
            ``FSM_CACHE_AUDIT``.
        history: How many events each record's trail keeps in audit mode.

    Raises:
        SpecError: An effect the spec names is not bound.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        effects: Mapping[str, Effect] | None = None,
        audit: bool | None = None,
        history: int = 8,
    ) -> None:
        self.system: System = as_system(spec)
        self.audit = trail.audit_default() if audit is None else audit
        self.history = history
        self.leases = LeaseBook()
        self._effects = self._bind(effects)
        self._past = {e.name: e.past for _, m in self.system.regions for e in m.events if e.past}
        self._verbs = self._compile()
        self.Record = _record_class(self.system)

    @property
    def slots(self) -> tuple[str, ...]:
        """The attributes a record needs: ``id``, one per region, counters and ``trail``."""
        return _slots(self.system)

    @property
    def events(self) -> tuple[str, ...]:
        """Every event name the engine accepts."""
        return tuple(self._verbs)

    def new(self, ident: object = 0) -> Any:
        """Return a fresh record in the initial state with initial counters."""
        return self.Record(ident)

    def init(self, rec: Any, ident: object) -> None:
        """Put any object with the record's attributes into the initial state."""
        _initialise(self.system, rec, ident)

    def verb(self, event: str) -> Verb:
        """Return the checked function for ``event``, to call as ``verb(record)``.

        Raises:
            SpecError: No region declares ``event``.
        """
        try:
            return self._verbs[event]
        except KeyError:
            raise SpecError([f"{self.system.source}: unknown event {event!r}"]) from None

    def fire(self, rec: Any, event: str) -> None:
        """Fire ``event`` at ``rec``: check everything, run effects, then commit.

        Raises:
            IllegalTransition: The spec refuses the event; ``rec`` is unchanged.
            EffectFailed: A bound effect raised; ``rec`` is unchanged.
            SpecError: Unknown event name.
        """
        self.verb(event)(rec)

    def allowed(self, rec: Any, event: str) -> bool:
        """Return whether ``event`` would be accepted now, without changing anything."""
        try:
            self._plans(rec, self._steps[event])
        except IllegalTransition:
            return False
        except KeyError:
            raise SpecError([f"{self.system.source}: unknown event {event!r}"]) from None
        return True

    def plan(self, rec: Any, event: str) -> Plan:
        """Check ``event`` on ``rec`` alone and return what it would write, changing nothing.

        The plan is ``(assignments, effect names, propagates)``; when
        ``propagates`` is true, :meth:`fire` checks and applies the same event on
        every ancestor too. Model checkers use this to combine per-node answers.

        Raises:
            IllegalTransition: ``rec`` refuses ``event`` (nothing changed).
            SpecError: Unknown event name.
        """
        step = self._steps.get(event)
        if step is None:
            raise SpecError([f"{self.system.source}: unknown event {event!r}"])
        return step(rec)

    def lease(self, rec: Any, acquire: str = "pin", release: str = "release") -> Lease:
        """Fire ``acquire`` and return a lease whose ``release()`` fires ``release`` once."""
        self.fire(rec, acquire)
        return self.leases.open(rec, self.verb(release), acquire, self.system.label)

    def counters(self, rec: Any, region: str | None = None) -> dict[str, int]:
        """Return the record's counters, of one region or of all of them."""
        machines = [self.system.machines[region]] if region else self.machines()
        return {c: getattr(rec, c) for m in machines for c in m.counter_names}

    def machines(self) -> list[Any]:
        """Return the region machines in order."""
        return [m for _, m in self.system.regions]

    def describe(self, rec: Any) -> str:
        """Return ``backed/resident (pins=0, locks=0)`` for ``rec``."""
        states = "/".join(getattr(rec, r) for r, _ in self.system.regions)
        shown = ", ".join(f"{k}={v}" for k, v in self.counters(rec).items())
        return f"{states} ({shown})" if shown else states

    # -- compilation ---------------------------------------------------------

    def _bind(self, effects: Mapping[str, Effect] | None) -> dict[str, Effect]:
        named = {
            t.effect for _, m in self.system.regions for t in m.transitions if t.effect is not None
        }
        if effects is None:
            return dict.fromkeys(named, _no_effect)
        missing = sorted(named - set(effects))
        if missing:
            raise SpecError(
                [f"{self.system.source}: effect {name!r} is not bound" for name in missing]
            )
        return dict(effects)

    def _compile(self) -> dict[str, Verb]:
        em = Emitter(self.system, audit=self.audit)
        steps = {event: compile_event(em, event) for event in self.system.event_names}
        fast = {
            event: compile_fast(em, event)
            for event in self.system.event_names
            if not needs_general(self.system, event)
        }
        namespace: dict[str, Any] = {
            "_refuse": self._refuser(em),
            "_parent_in": _parent_in,
            "_child_in": _child_in,
            "_getframe": sys._getframe,
            "_INTERNAL": trail.internal_files(),
            "_deque": deque,
            "_history": self.history,
        }
        self.source = "\n".join(em.lines)
        filename = f"<fsm_cache:{self.system.name}>"
        trail.internal(filename)
        code = compile(self.source, filename, "exec")
        exec(code, namespace)
        self._steps: dict[str, Callable[[Any], Plan]] = {e: namespace[n] for e, n in steps.items()}
        verbs: dict[str, Verb] = {}
        for event in self.system.event_names:
            verbs[event] = namespace[fast[event]] if event in fast else self._general(event)
        return verbs

    def _plans(self, rec: Any, step: Callable[[Any], Plan]) -> list[tuple[Any, Plan]]:
        """Check ``event`` on ``rec`` (and its ancestors if it propagates); change nothing."""
        plans = [(rec, step(rec))]
        if plans[0][1][2]:
            node = getattr(rec, "parent", None)
            while node is not None:
                plans.append((node, step(node)))
                node = getattr(node, "parent", None)
        return plans

    def _general(self, event: str) -> Verb:
        effects, audit, history, label = self._effects, self.audit, self.history, self.system.label
        step = self._steps[event]

        def fire(rec: Any) -> None:
            plans = self._plans(rec, step)
            for target, (_, names, _) in plans:
                for name in names:
                    _run_effect(effects[name], name, event, target, label)
            for target, (assigns, _, _) in plans:
                for attr, value in assigns:
                    setattr(target, attr, value)
                if audit:
                    target.trail = trail.note(target.trail, event, history)

        return fire

    def _refuser(self, em: Emitter) -> Callable[[Any, int], None]:
        refusals, system, past, audit = em.refusals, self.system, self._past, self.audit

        def refuse(rec: Any, index: int) -> None:
            refusal = refusals[index]
            machine = system.machines[refusal.region]
            recent = trail.sites(getattr(rec, "trail", None))
            # Only audit mode pays for the frame walk to the refused call's own site.
            site = trail.caller_site() if audit else None
            raise error_class(refusal.error)(
                label=system.label,
                instance=rec.id,
                state=getattr(rec, refusal.region),
                counters={c: getattr(rec, c) for c in machine.counter_names},
                event=refusal.event,
                reason=refusal.reason,
                history=trail.render(recent, past, site),
                site=site,
                sites=recent,
            )

        return refuse


def _run_effect(effect: Effect, name: str, event: str, rec: Any, label: str) -> None:
    try:
        effect(rec)
    except Exception as exc:
        msg = f"{label} {rec.id}: effect {name} of {event} failed: {exc}"
        raise EffectFailed(msg) from exc


def _no_effect(rec: Any) -> None:
    """Stand-in for an effect when the engine runs without bound effects."""


def _parent_in(rec: Any, region: str, states: tuple[str, ...]) -> bool:
    parent = getattr(rec, "parent", None)
    return parent is not None and getattr(parent, region) in states


def _child_in(rec: Any, region: str, states: tuple[str, ...]) -> bool:
    children = getattr(rec, "children", None)
    if not children:
        return False
    values: Iterable[Any] = children.values() if isinstance(children, Mapping) else children
    return any(getattr(child, region) in states for child in values)


def _initialise(system: System, rec: Any, ident: object) -> None:
    """Set ``rec``'s id, every region's initial state, initial counters and no trail."""
    rec.id = ident
    for region, machine in system.regions:
        setattr(rec, region, machine.initial)
    for name, value in system.counters:
        setattr(rec, name, value)
    rec.trail = None


def _slots(system: System) -> tuple[str, ...]:
    return ("id", *(r for r, _ in system.regions), *(c for c, _ in system.counters), "trail")


def _record_class(system: System) -> type:
    """Build the slotted record class of ``system`` (under 100 bytes an instance)."""

    def init(self: Any, ident: object = 0) -> None:
        _initialise(system, self, ident)

    def show(self: Any) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in _slots(system)[:-1])
        return f"{system.name}.Record({fields})"

    return type(
        "Record",
        (),
        {"__slots__": _slots(system), "__init__": init, "__repr__": show},
    )
