"""A reference executor of specs built on ``transitions``: the oracle the engine is tested against.

It reads the same spec objects as :mod:`fsm_cache.engine.codegen` but shares no code
with it: each region is a ``transitions.Machine`` (shared, ``model=None``,
``auto_transitions=False``, string states; guards are ``conditions``, counter
updates and effects are callbacks), and the composition rules are interpreted
directly from the :class:`~fsm_cache.spec.machine.System`:

* refusals are found in this order: each region in region order (its first
  declared forbid whose guard holds, then its transitions), then the system's
  forbids in declaration order; the first one found is raised;
* an event fires in every region that declares it and is legal only if all of
  them allow it (a synchronous product);
* a transition with ``propagate = "ancestors"`` makes the same step on every
  ancestor, all checked before any record changes; a parent chain that loops
  is refused with :class:`~fsm_cache.errors.ParentLoop` where the walk first
  comes back to a record, once every record before it passed (the engine
  looks for the repeat only every :data:`~fsm_cache.engine.runtime.WALK`
  records, but an ancestor answers the same each time it is walked, so the
  outcome is the same: the nearest refusal, else the loop);
* effects run after every check passed and before the commit; one raising
  leaves every record unchanged and raises :class:`EffectFailed`.

Every step runs on scratch copies of the records and is copied back only when
everything passed. It is slow (about 10 µs per trigger) and meant to be
obviously right, not fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


try:
    from transitions import Machine, MachineError
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    if exc.name != "transitions":
        raise
    raise ModuleNotFoundError(
        "the reference executor is built on transitions, which comes with the reference "
        "extra: pip install 'fsm-cache[reference]'",
        name=exc.name,
    ) from exc

from fsm_cache.engine.core import Effect
from fsm_cache.engine.runtime import parent_loop
from fsm_cache.errors import EffectFailed, IllegalTransition, SpecError, error_class
from fsm_cache.spec.guards import Condition
from fsm_cache.spec.machine import (
    GUARDS_FAIL,
    Forbid,
    MachineSpec,
    Spec,
    System,
    Transition,
    as_system,
)


class Record:
    """A record with every attribute the engine and the reference read.

    ``id``, one attribute per region, one per counter, ``trail`` (for the
    engine's trail mode), ``parent`` (a record or None) and ``children``
    (a list of records). Attributes are set by :meth:`Reference.new` or
    :meth:`fsm_cache.engine.core.Engine.init`.
    """

    def __init__(self, ident: object = 0) -> None:
        self.id = ident
        self.trail: Any = None
        self.parent: Record | None = None
        self.children: list[Record] = []


class _Scratch:
    """A scratch copy of one record's regions and counters that the machines act on."""

    def __init__(self, system: System, rec: Any) -> None:
        for region, machine in system.regions:
            setattr(self, region, getattr(rec, region))
            for counter in machine.counter_names:
                setattr(self, counter, getattr(rec, counter))
        self.effects: list[str] = []
        self.chosen: list[Transition] = []


class Reference:
    """Executes a spec with ``transitions`` machines, for comparison with the engine.

    Args:
        spec: The machine or composition to run.
        effects: Hooks by effect name, as for the engine; None runs none.
    """

    def __init__(self, spec: Spec, *, effects: Mapping[str, Effect] | None = None) -> None:
        self.system = as_system(spec)
        self.effects = dict(effects or {})
        self.machines = {region: _build(region, m) for region, m in self.system.regions}

    def new(self, ident: object = 0) -> Record:
        """Return a fresh :class:`Record` in the initial state with initial counters."""
        rec = Record(ident)
        for region, machine in self.system.regions:
            setattr(rec, region, machine.initial)
            for counter, value in machine.counters:
                setattr(rec, counter, value)
        return rec

    def fire(self, rec: Any, event: str) -> None:
        """Fire ``event`` at ``rec`` (and its ancestors if it propagates), or refuse it.

        Raises:
            IllegalTransition: The spec refuses it; no record changed.
            EffectFailed: An effect raised; no record changed.
            SpecError: No region declares ``event``.
            ParentLoop: The event propagates and ``rec``'s parent chain loops,
                and no record before the repeat refused it; no record changed.
        """
        plans = self._plans(rec, event)
        for target, scratch in plans:
            for name in scratch.effects:
                self._run_effect(name, event, target)
        for target, scratch in plans:
            for region, machine in self.system.regions:
                setattr(target, region, getattr(scratch, region))
                for counter in machine.counter_names:
                    setattr(target, counter, getattr(scratch, counter))

    def allowed(self, rec: Any, event: str) -> bool:
        """Return whether ``event`` would be accepted now, changing nothing.

        Raises:
            ParentLoop: As for :meth:`fire` (a looping chain is no answer).
        """
        try:
            self._plans(rec, event)
        except IllegalTransition:
            return False
        return True

    def _plans(self, rec: Any, event: str) -> list[tuple[Any, _Scratch]]:
        if event not in self.system.event_names:
            raise SpecError([self.system.unknown_event(event)])
        first = self._step(rec, event)
        plans = [(rec, first)]
        if any(t.propagate == "ancestors" for t in first.chosen):
            taken = {id(rec)}  # the records are alive, so their ids are their own
            node = getattr(rec, "parent", None)
            while node is not None:
                if id(node) in taken:
                    walked = [target for target, _ in plans]
                    raise parent_loop([*walked, node], self.system.label, event)
                taken.add(id(node))
                plans.append((node, self._step(node, event)))
                node = getattr(node, "parent", None)
        return plans

    def _step(self, rec: Any, event: str) -> _Scratch:
        """Check ``event`` on one record and return the scratch copy it would leave."""
        scratch = _Scratch(self.system, rec)
        for region in self.system.regions_of(event):
            self._region_step(rec, scratch, region, event)
        owner = self.system.regions_of(event)[0]
        for forbid in self.system.forbids_for(event):
            if _system_forbid_holds(forbid, rec, owner):
                read = [c.region for c in forbid.when if c.scope == "self"]
                others = {r: getattr(rec, r) for r in read if r != owner}
                raise self._refusal(rec, owner, event, forbid.error, forbid.reason, others=others)
        return scratch

    def _region_step(self, rec: Any, scratch: _Scratch, region: str, event: str) -> None:
        spec = self.system.machines[region]
        state = getattr(rec, region)
        counters = {c: getattr(rec, c) for c in spec.counter_names}
        forbids = list(spec.forbids_for(state, event))
        for forbid in forbids:
            if forbid.guard.holds(counters):
                raise self._refusal(rec, region, event, forbid.error, forbid.reason)
        try:
            fired = self.machines[region].events[event].trigger(scratch)
        except (MachineError, KeyError):
            fired = False
            if not forbids:
                error, reason = spec.unanswered(state, event)
                raise self._refusal(rec, region, event, error, reason) from None
        if not fired:
            raise self._refusal(rec, region, event, *GUARDS_FAIL)

    def _refusal(
        self,
        rec: Any,
        region: str,
        event: str,
        error: str,
        reason: str,
        *,
        others: Mapping[str, str] | None = None,
    ) -> IllegalTransition:
        """Return the refusal the engine raises: ``others`` are the other regions a rule read."""
        machine = self.system.machines[region]
        return error_class(error)(
            label=self.system.label,
            instance=rec.id,
            state=getattr(rec, region),
            counters={c: getattr(rec, c) for c in machine.counter_names},
            event=event,
            reason=reason,
            others=others,
        )

    def _run_effect(self, name: str, event: str, rec: Any) -> None:
        effect = self.effects.get(name)
        if effect is None:
            return
        try:
            effect(rec)
        except Exception as exc:
            msg = f"{self.system.label} {rec.id}: effect {name} of {event} failed: {exc}"
            raise EffectFailed(msg) from exc


def _build(region: str, spec: MachineSpec) -> Machine:
    """Build the shared ``transitions.Machine`` of one region, state kept in ``region``."""
    machine = Machine(
        model=None,
        states=list(spec.state_names),
        initial=spec.initial,
        auto_transitions=False,
        send_event=True,
        model_attribute=region,
    )
    for tr in spec.transitions:
        machine.add_transition(
            tr.event,
            list(tr.sources),
            tr.dest,
            conditions=[_guard(spec, tr)],
            after=[_update(spec, tr)],
        )
    return machine


def _guard(spec: MachineSpec, tr: Transition) -> Callable[[Any], bool]:
    def condition(event_data: Any) -> bool:
        model = event_data.model
        return tr.guard.holds({c: getattr(model, c) for c in spec.counter_names})

    return condition


def _update(spec: MachineSpec, tr: Transition) -> Callable[[Any], None]:
    def callback(event_data: Any) -> None:
        model = event_data.model
        after = tr.update.apply({c: getattr(model, c) for c in spec.counter_names})
        for counter, value in after.items():
            setattr(model, counter, value)
        if tr.effect is not None:
            model.effects.append(tr.effect)
        model.chosen.append(tr)

    return callback


def _system_forbid_holds(forbid: Forbid, rec: Any, owner: str) -> bool:
    if forbid.sources and getattr(rec, owner) not in forbid.sources:
        return False
    counters = {name: getattr(rec, name) for name in forbid.guard.counters()}
    return forbid.guard.holds(counters) and all(_condition_holds(c, rec) for c in forbid.when)


def _condition_holds(cond: Condition, rec: Any) -> bool:
    if cond.scope == "self":
        return bool(getattr(rec, cond.region) in cond.states)
    if cond.scope == "parent":
        parent = getattr(rec, "parent", None)
        return parent is not None and getattr(parent, cond.region) in cond.states
    return any(getattr(child, cond.region) in cond.states for child in _children(rec))


def _children(rec: Any) -> Iterable[Any]:
    children = getattr(rec, "children", None)
    if not children:
        return ()
    return children.values() if isinstance(children, Mapping) else children
