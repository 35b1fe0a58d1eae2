"""The checked engine: a spec compiled into fast per-event functions over slotted records.

Per instance the engine keeps only a slotted record: an ``id``, one state per
region, the counters and a ``trail`` slot (None unless trail mode is on).
Events are plain functions of the record; :meth:`Engine.verb` returns one for
a hot loop, :meth:`Engine.fire` looks it up by name.

Check, then act: every event is checked completely (every region, every
cross-region and tree condition, every ancestor it propagates to) before
effects run, and effects run before anything is written. A refusal raises the
spec's error class and leaves every record exactly as it was; an effect that
raises leaves them unchanged too and is chained as the cause of
:class:`~fsm_cache.errors.EffectFailed`. The writes are computed before the
effects run, so an effect that changes a record the event writes (fires an
event at it) fails the event too, and the record keeps what the effect left.
An effect that fires its own event at its record again, directly or through
other events, is refused there, before it runs a second time
(:class:`~fsm_cache.errors.EffectReentered`).

A record's ``parent`` is the caller's own attribute, set where the engine does
not see it, so a chain that loops is found by the walk itself: every
:data:`~fsm_cache.engine.runtime.WALK` records an event walking the ancestors
looks for a repeated one and raises :class:`~fsm_cache.errors.ParentLoop`
before anything is written. A walk pays only for counting its records (a
``for`` over a range where it had a ``while True``).

An engine takes no lock: an event reads, checks, then writes, so events fired
at one record from two threads at once may interleave. Callers serialise them
(the cache is single-threaded and refuses a second thread).

The generated source is in :mod:`linecache` under :attr:`Engine.filename`, so a
refusal's traceback shows the generated line that refused.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, NoReturn, SupportsIndex

from fsm_cache.engine import trail as trails
from fsm_cache.engine.codegen import Compiled, Plan, Refusal, Refuser, Step, Verb, compile_system
from fsm_cache.engine.lease import Lease, LeaseBook
from fsm_cache.engine.legal import Legal, unknown_state
from fsm_cache.engine.runtime import (
    WALK,
    Effect,
    caller_frame,
    effect_failed,
    guarded,
    looped,
    meddled,
    no_effect,
    run_effect,
)
from fsm_cache.errors import (
    BadArgument,
    FsmCacheError,
    IllegalTransition,
    ReadOnlyAttribute,
    SpecError,
    error_class,
)
from fsm_cache.numeric import whole
from fsm_cache.spec.holders import Hold, Holders
from fsm_cache.spec.machine import MachineSpec, Spec, System, as_system
from fsm_cache.spec.validate import layout_problems


__all__ = ["Effect", "Engine", "Plan", "Verb"]

trails.internal(__file__)
_DISPATCH = trails.internal_files()
"""The live set of dispatch files (read directly: :meth:`Engine.verb` tests it per lookup)."""


class Engine:
    """A spec compiled for execution.

    Args:
        spec: The machine or composition to run.
        effects: Hooks by effect name, called with the record after all checks
            pass and before the commit. Without a mapping, effects are no-ops
            (a pure engine); with one, every effect the spec names must be
            bound, and nothing else: a misspelt name would bind nothing.
        trail: Trail mode: keep the call sites of each record's recent events,
            so refusals name them; defaults to ``FSM_CACHE_TRAIL``.
        history: How many events each record's trail keeps in trail mode.
        audit: Deprecated spelling of ``trail`` (warns); to be removed.

    Attributes:
        system: The compiled system (read-only: see below).
        trail: Whether the engine runs in trail mode (read-only).
        history: How many events each record's trail keeps (read-only).
        leases: The leases :meth:`lease` handed out and not yet released (read-only).
        Record: The slotted record class; :meth:`new` builds one (read-only).

    Raises:
        BadArgument: ``spec`` is no machine or composition, ``effects`` no
            mapping (or it binds a name no transition of the spec gives as
            its effect, or a hook it binds is not callable), ``trail`` or
            ``audit`` neither a bool nor None, or ``history`` not an int >= 0.
        SpecError: An effect the spec names is not bound, or a name of the
            spec cannot be a record's slot or a name in generated code (a spec
            built in code, never validated, with a counter called ``id`` or
            ``trail``, a name that is no identifier, a counter declared twice:
            :func:`~fsm_cache.spec.validate.layout_problems`).
        ConfigError: ``trail`` and ``audit`` both given and different, or
            ``FSM_CACHE_TRAIL`` and ``FSM_CACHE_AUDIT`` disagree.

    What the engine is built with is fixed: ``system``, ``trail`` and
    ``history`` are compiled into its functions, ``Record`` is the class of
    their records, and ``leases`` is the book its leases are opened in (and
    :meth:`init` voids them in). Assigning any of them later raises
    :class:`~fsm_cache.errors.ReadOnlyAttribute` rather than changing nothing
    or something else: a replaced book would keep :meth:`init` from voiding
    the leases it forgot.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        effects: Mapping[str, Effect] | None = None,
        trail: bool | None = None,
        history: int = 8,
        audit: bool | None = None,
    ) -> None:
        _check_arguments(spec, effects, trail, audit, history)
        # A spec built in code was never validated; its names become slots and generated code.
        unusable = layout_problems(spec)
        if unusable:
            raise SpecError(unusable)
        self.system: Final[System] = as_system(spec)
        chosen = trails.choose(trail, audit, "Engine", stacklevel=2)
        self._trail = trails.from_environment(stacklevel=2) if chosen is None else chosen
        self._history = min(history, sys.maxsize)  # a deque's longest; more would overflow it
        self.leases: Final[LeaseBook] = LeaseBook()
        self._pairs: dict[tuple[str, str], str | tuple[str, ...]] = {}
        """Each (acquire, release) pair :meth:`lease` was given, judged (:meth:`_pair`): why
        it does not pair, or the give-backs its lease may be released by, its own first."""
        self._effects = self._bind(effects)
        self._past = self.system.past_tenses
        self._compiled: Compiled = compile_system(
            self.system,
            self._refuser,
            trail=self.trail,
            history=self.history,
            effects=self._effects,
        )
        self._verbs = {
            event: self._compiled.verbs.get(event) or self._general(event)
            for event in self.system.event_names
        }
        self._direct = {**self._verbs, **self._compiled.direct} if self.trail else self._verbs
        self.Record: Final[type] = _record_class(self.system)

    if not TYPE_CHECKING:  # mypy would take any attribute for settable, a typo included

        def __setattr__(self, name: str, value: object) -> None:
            """Set ``name`` while the engine is built, and none of :data:`_BUILT` after.

            Plain attributes rather than properties: reading ``engine.leases`` (the
            cache does per lock) stays an attribute read; only an assignment pays.
            A built engine takes no attribute it was not built with: a typo
            (``engine.trails = True``) set a new one and changed nothing.

            Raises:
                ReadOnlyAttribute: ``name`` is fixed when the engine is built, or
                    no attribute an engine has; nothing changed.
            """
            why = _BUILT.get(name)
            if why is not None and name in self.__dict__:
                raise _fixed(name, value, why)
            known = name in self.__dict__ or hasattr(type(self), name)  # a property refuses
            if not known and "Record" in self.__dict__:  # built: Record is set last
                raise _fixed(name, value, _UNKNOWN)
            object.__setattr__(self, name, value)

        def __delattr__(self, name: str) -> None:
            """Delete ``name``, unless it is one of :data:`_BUILT` (set again, it would pass).

            Raises:
                ReadOnlyAttribute: ``name`` is fixed when the engine is built; nothing changed.
            """
            why = _BUILT.get(name)
            if why is not None:
                raise ReadOnlyAttribute.deleted(f"Engine.{name}", why)
            object.__delattr__(self, name)

    @property
    def trail(self) -> bool:
        """Whether the engine runs in trail mode; fixed when it is built.

        The engine's functions are compiled with it, so it cannot change
        afterwards: build another engine with ``Engine(spec, trail=True)``.
        """
        return self._trail

    @trail.setter
    def trail(self, value: NoReturn) -> None:  # NoReturn: mypy refuses the assignment too
        raise _fixed("trail", value, _COMPILED_WITH.format(name="trail"))

    @property
    def history(self) -> int:
        """How many events each record's trail keeps in trail mode; fixed when it is built.

        The engine's functions are compiled with it, so it cannot change
        afterwards: build another engine with ``Engine(spec, history=16)``.
        """
        return self._history

    @history.setter
    def history(self, value: NoReturn) -> None:  # NoReturn: mypy refuses the assignment too
        raise _fixed("history", value, _COMPILED_WITH.format(name="history"))

    @property
    def audit(self) -> bool:
        """Deprecated name of :attr:`trail` (warns); to be removed."""
        warnings.warn(
            "Engine.audit is deprecated; read Engine.trail instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.trail

    @property
    def source(self) -> str:
        """The generated Python source of the engine's functions."""
        return self._compiled.source

    @property
    def filename(self) -> str:
        """The unique name the source is compiled and registered in linecache under.

        ``<fsm_cache residency engine 3>``: the system's name and a number no
        other engine in the process has. Tracebacks name it, with the line.
        """
        return self._compiled.filename

    @property
    def slots(self) -> tuple[str, ...]:
        """The attributes a record needs: ``id``, one per region, counters and ``trail``."""
        return _slots(self.system)

    @property
    def events(self) -> tuple[str, ...]:
        """Every event name the engine accepts."""
        return tuple(self._verbs)

    def new(self, ident: object = 0, birth: str | None = None) -> Any:
        """Return a fresh record with initial counters, in the initial states or those of ``birth``.

        Raises:
            SpecError: The spec declares no birth of that name.
            BadArgument: ``birth`` is neither a str nor None.
        """
        states = self._born(birth, "new")
        rec = self.Record(ident)
        if states is not None:
            _initialise(self.system, rec, ident, states)
        return rec

    def init(self, rec: Any, ident: object, birth: str | None = None) -> None:
        """Put any object with the record's attributes into the initial states (or ``birth``'s).

        The record starts afresh, so a lease still held on it would release
        a pin or lock of the record's new life: each is void, as a cache's
        reset voids its leases, and its ``release()`` raises LeaseError
        naming the caller of ``init`` as where it was released.

        Raises:
            SpecError: The spec declares no birth of that name; ``rec`` is unchanged.
            BadArgument: ``birth`` is neither a str nor None, or ``rec`` cannot
                hold one of the record's attributes (:attr:`slots`): it has no
                room for it, or its setter raised (chained as the cause);
                ``rec`` is unchanged.
        """
        states = self._born(birth, "init")
        pairs = _initial(self.system, ident, states)
        was = [getattr(rec, name, _UNSET) for name, _ in pairs]
        done = 0
        try:
            for name, value in pairs:
                setattr(rec, name, value)
                done += 1
        except Exception as exc:  # a setter of the caller's class may raise anything
            for (name, _), old in zip(pairs[:done], was, strict=False):
                if old is _UNSET:
                    delattr(rec, name)
                else:
                    setattr(rec, name, old)
            error = BadArgument(
                f"Engine.init: rec {rec!r} is not a record of {self.system.name}:"
                f" it cannot hold {pairs[done][0]}"
            )
            if isinstance(exc, AttributeError | TypeError):  # no such slot: nothing to add
                raise error from None
            raise error from exc
        if self.leases.holding(rec):
            self.leases.void(trails.caller_site(), rec)

    def _born(self, birth: object, where: str) -> dict[str, str] | None:
        """Return every region's state at ``birth``, or None for no birth (the initial states).

        Raises:
            BadArgument: ``birth`` is neither a str nor None.
            SpecError: The spec declares no birth of that name.
        """
        if birth is None:
            return None
        if not isinstance(birth, str):
            raise BadArgument(f"Engine.{where}: birth must be a str or None, got {birth!r}")
        try:
            return self.system.born(birth)
        except KeyError:
            known = ", ".join(b.name for b in self.system.births) or "none"
            raise SpecError(
                [f"{self.system.source}: unknown birth {birth!r} (declared: {known})"]
            ) from None

    def bad_record(
        self, states: Mapping[str, object], counters: Mapping[str, object]
    ) -> str | None:
        """Return why no record could be in ``states`` with ``counters``, or None if one can.

        A record is legal when each region is in one of its machine's states,
        each counter is an int >= 0 its state's invariant allows (``pinned``
        needs ``pins >= 1``), and some run of the spec reaches the whole: the
        composition's refusals keep a host ``writing`` from a device
        ``absent``. All of it comes from the spec (:mod:`fsm_cache.engine.legal`);
        the runs are the search validation made (:func:`fsm_cache.spec.reach.runs`
        searches each spec once), read on first use. The engine itself
        trusts its records (its fast paths rely on the invariants), so code
        that builds a record from a caller's states asks this first.

        Args:
            states: State by region; a region left out is in its initial state.
            counters: Value by counter; a counter left out has its initial value.

        Raises:
            BadArgument: ``states`` or ``counters`` is no mapping.
        """
        for name, given in (("states", states), ("counters", counters)):
            if not isinstance(given, Mapping):
                raise BadArgument(f"Engine.bad_record: {name} must be a mapping, got {given!r}")
        return self._legal.problem(states, counters)

    @cached_property
    def _legal(self) -> Legal:
        return Legal.of(self.system)

    def verb(self, event: str) -> Verb:
        """Return the checked function for ``event``, to call as ``verb(record)``.

        In trail mode the function notes where it is called from. Asked for by
        code outside fsm_cache, it notes its immediate caller; asked for by
        fsm_cache's own dispatch code (:meth:`fire`, leases, the cache), it
        walks past their frames to the first caller outside them, which costs
        a file test per event (about 20 ns). So a verb asked for
        outside fsm_cache and handed to fsm_cache code to call names that
        code's line: pass such code the engine, or call :meth:`fire`. Telling
        the two apart looks at the caller's frame (about 80 ns a lookup in
        trail mode): code that fires often looks its verbs up once, or calls
        :meth:`fire`, which does not look.

        The function checks the record against the spec and nothing else: it
        reads the record's attributes unchecked, since a check would cost every
        event, so an object that is no record raises AttributeError there.
        :meth:`fire` names it instead, on the path that already failed.

        Raises:
            SpecError: No region declares ``event``.
            BadArgument: ``event`` is not a str.
        """
        try:
            if self.trail and caller_frame(1).f_code.co_filename not in _DISPATCH:
                return self._direct[event]
            return self._verbs[event]
        except (KeyError, TypeError):
            raise self._unknown_event(event, "verb") from None

    def fire(self, rec: Any, event: str) -> None:
        """Fire ``event`` at ``rec``: check everything, run effects, then commit.

        Raises:
            IllegalTransition: The spec refuses the event; ``rec`` is unchanged.
            EffectFailed: A bound effect raised, and ``rec`` is unchanged; or
                it changed the states or counters of a record the event
                writes, which keeps what the effect left.
            EffectReentered: A bound effect fired this event at ``rec`` again
                (directly or through another event); that firing was refused
                before the effect ran again, and nothing was written.
            SpecError: Unknown event name.
            BadArgument: ``event`` is not a str, or ``rec`` (or an ancestor
                the event reads) is no record: it lacks an attribute the
                engine reads (in trail mode, ``trail`` too); nothing changed.
            ParentLoop: The event propagates and ``rec``'s parent chain loops
                (a BadArgument); nothing changed.
        """
        try:
            verb = self._verbs[event]
        except (KeyError, TypeError):
            raise self._unknown_event(event, "fire") from None
        try:
            verb(rec)
        except AttributeError:
            self._name_non_record(rec, "fire")
            raise

    def allowed(self, rec: Any, event: str) -> bool:
        """Return whether ``event`` would be accepted now, without changing anything.

        In trail mode a record that :meth:`fire` would not take for lack of a
        ``trail`` is named here too, rather than said to accept the event.

        Raises:
            SpecError: Unknown event name.
            BadArgument: As for :meth:`fire`.
        """
        step = self._step(event, "allowed")
        try:
            plans = self._plans(rec, step, event)
            if self.trail:  # fire notes the event on each record it writes
                for target, _ in plans:
                    target.trail  # noqa: B018 -- read for the AttributeError alone
        except IllegalTransition:
            return False
        except AttributeError:
            self._name_non_record(rec, "allowed")
            raise
        return True

    def plan(self, rec: Any, event: str) -> Plan:
        """Check ``event`` on ``rec`` alone and return what it would write, changing nothing.

        The plan is ``(assignments, effect names, propagates)``; when
        ``propagates`` is true, :meth:`fire` checks and applies the same event on
        every ancestor too. Model checkers use this to combine per-node answers.

        Raises:
            IllegalTransition: ``rec`` refuses ``event`` (nothing changed).
            SpecError: Unknown event name.
            BadArgument: ``event`` is not a str, or ``rec`` is no record.
        """
        step = self._step(event, "plan")
        try:
            return step(rec)
        except AttributeError:
            self._name_non_record(rec, "plan")
            raise

    def planner(self, event: str) -> Step:
        """Return :meth:`plan` for one event as a plain function of the record (for hot loops).

        The function reads its record unchecked, as :meth:`verb`'s do.

        Raises:
            SpecError: Unknown event name.
            BadArgument: ``event`` is not a str.
        """
        return self._step(event, "planner")

    def lease(self, rec: Any, acquire: str = "pin", release: str = "release") -> Lease:
        """Fire ``acquire`` and return a lease whose ``release()`` fires ``release`` once.

        A lease is the receipt of a hold, so its release must give back
        exactly the holds its acquire takes, as the spec's own meaning says
        (:class:`~fsm_cache.spec.holders.Holders`, the classification the model
        checker reads): ``pin`` and ``release``, ``lock`` and ``unlock``, in
        the composed residency ``load`` and ``load_done`` (never ``release``,
        which gives back a pin of the host alone). An acquire that adds one to
        no count an event gives back takes no hold, and is refused whatever
        the release: a door's ``open`` from ``shut`` to ``open`` changes a
        state, and nothing in the spec says which event undoes it, so a lease
        could not check its release. Fire such events with :meth:`fire`, or
        spell the flag as a count (``open = 1`` from a state whose invariant
        is ``open == 0``, given back by ``open = 0``), which is a hold.

        An acquire the spec lets end more than one way is released by the
        other give-back when it is named: a lease of ``load`` taken with
        ``load_done`` is closed by ``lease.release("load_failed")`` when the
        copy failed (:attr:`Lease.gives <fsm_cache.engine.lease.Lease.gives>`
        lists them, by the same rule as the pair here).

        Raises:
            SpecError: Unknown ``acquire`` or ``release`` event; nothing was fired.
            BadArgument: ``release`` does not give back exactly what
                ``acquire`` takes, or ``acquire`` takes no hold; an event is
                not a str, or ``rec`` is no record; nothing was fired.
            IllegalTransition: The spec refuses ``acquire``; ``rec`` is unchanged.
            EffectFailed: A bound effect of ``acquire`` failed (as for :meth:`fire`).
        """
        undo, take = self._verb(release, "lease"), self._verb(acquire, "lease")
        gives = self._pairs.get((acquire, release)) or self._pair(acquire, release)
        if isinstance(gives, str):
            raise BadArgument(gives)
        try:
            take(rec)
        except AttributeError:
            self._name_non_record(rec, "lease")
            raise
        return self.leases.open(
            rec, undo, acquire, self.system.label, gives=gives, choose=self._give_back
        )

    def _pair(self, acquire: str, release: str) -> str | tuple[str, ...]:
        """Judge the pair, and keep the verdict for the next lease of it.

        The verdict is why ``release`` does not give back what ``acquire``
        takes, or the give-backs a lease of the pair may be released by:
        ``release`` first, then the others :meth:`Holders.givers` names, the
        rule the pair is judged by.
        """
        judged: str | tuple[str, ...] | None = _unreturned(
            self.system, self._holders, acquire, release
        )
        if judged is None:
            judged = (release, *(x for x in self._holders.givers(acquire) if x != release))
        self._pairs[acquire, release] = judged
        return judged

    def _give_back(self, event: str) -> Verb:
        """Return the function a lease fires for its named give-back ``event`` (one of its gives)."""
        return self._verb(event, "lease")

    @cached_property
    def _holders(self) -> Holders:
        """The spec's holder kinds, read once, on the first lease (a few ms a spec)."""
        return Holders.of(self.system)

    def counters(self, rec: Any, region: str | None = None) -> dict[str, int]:
        """Return the record's counters, of one region or of all of them.

        Raises:
            SpecError: No region is called ``region``.
            BadArgument: ``region`` is neither a str nor None, or ``rec`` is no record.
        """
        machines = self.machines() if region is None else [self._machine(region)]
        try:
            return {c: getattr(rec, c) for m in machines for c in m.counter_names}
        except AttributeError:
            self._name_non_record(rec, "counters")
            raise

    def machines(self) -> list[Any]:
        """Return the region machines in order."""
        return [m for _, m in self.system.regions]

    def describe(self, rec: Any) -> str:
        """Return ``backed/resident (pins=0, locks=0)`` for ``rec``.

        Raises:
            BadArgument: ``rec`` is no record.
        """
        try:
            states = "/".join(str(getattr(rec, r)) for r, _ in self.system.regions)
        except AttributeError:
            self._name_non_record(rec, "describe")
            raise
        shown = ", ".join(f"{k}={v}" for k, v in self.counters(rec).items())
        return f"{states} ({shown})" if shown else states

    # -- arguments -----------------------------------------------------------

    def _verb(self, event: str, where: str) -> Verb:
        """Return ``event``'s function as :meth:`fire` runs it; ``where`` names the caller."""
        try:
            return self._verbs[event]
        except (KeyError, TypeError):
            raise self._unknown_event(event, where) from None

    def _step(self, event: str, where: str) -> Step:
        """Return ``event``'s checking function; ``where`` names the caller in errors."""
        try:
            return self._compiled.steps[event]
        except (KeyError, TypeError):
            raise self._unknown_event(event, where) from None

    def _unknown_event(self, event: object, where: str) -> FsmCacheError:
        """Return the error for an event name the spec does not declare, or no name at all."""
        if not isinstance(event, str):
            return BadArgument(f"Engine.{where}: event must be a str, got {event!r}")
        line = self.system.unknown_event(event)
        if where == "lease":  # the events may be the defaults, which the caller never wrote
            line += "; Engine.lease fires 'pin' and 'release' unless given others"
        return SpecError([line])

    def _machine(self, region: str) -> Any:
        """Return ``region``'s machine, or raise SpecError naming the regions there are."""
        if not isinstance(region, str):
            raise BadArgument(f"Engine.counters: region must be a str or None, got {region!r}")
        machine = self.system.machines.get(region)
        if machine is None:
            known = ", ".join(r for r, _ in self.system.regions)
            raise SpecError([f"{self.system.source}: unknown region {region!r} (regions: {known})"])
        return machine

    def _name_non_record(self, rec: Any, where: str) -> None:
        """Raise BadArgument if ``rec``, or an ancestor, lacks an attribute the engine reads.

        Called once something already raised AttributeError, so the per-event
        functions check nothing; if every record has them, the caller re-raises.
        """
        needed = _slots(self.system)
        if not self.trail:  # a trail is read only in trail mode, and may be absent otherwise
            needed = needed[:-1]
        node, seen, who = rec, set(), "rec"
        while id(node) not in seen:
            missing = [name for name in needed if not hasattr(node, name)]
            if missing:
                raise BadArgument(
                    f"Engine.{where}: {who} {node!r} is not a record of {self.system.name}:"
                    f" it has no {', '.join(missing)}"
                )
            seen.add(id(node))
            node, who = getattr(node, "parent", None), "rec's ancestor"
            if node is None:
                return

    # -- compilation ---------------------------------------------------------

    def _bind(self, effects: Mapping[str, Effect] | None) -> dict[str, Effect]:
        named = self.system.effect_names
        if effects is None:
            return dict.fromkeys(named, no_effect)
        # A key no transition names (a typo, a hook for another spec) would bind nothing.
        unknown = [name for name in effects if name not in named]
        if unknown:
            raise BadArgument(_unknown_effects(self.system, unknown))
        missing = sorted(named - set(effects))
        if missing:
            raise SpecError(
                [f"{self.system.source}: effect {name!r} is not bound" for name in missing]
            )
        for name in sorted(named):
            if not callable(effects[name]):
                raise BadArgument(
                    f"Engine: effect {name!r} must be callable, got {effects[name]!r}"
                )
        # Each hook refuses to run again on a record it is running on: an effect that fired
        # its own event there would recurse to the recursion limit (runtime.guarded).
        return {
            name: hook if hook is no_effect else guarded(hook, name)
            for name, hook in effects.items()
        }

    def _plans(self, rec: Any, step: Step, event: str) -> list[tuple[Any, Plan]]:
        """Check ``event`` on ``rec`` (and its ancestors if it propagates); change nothing.

        Raises:
            ParentLoop: The ancestors loop (checked every :data:`~fsm_cache.engine.runtime.WALK`
                records, as the generated walks do).
        """
        plans = [(rec, step(rec))]
        if plans[0][1][2]:
            node = getattr(rec, "parent", None)
            while node is not None:
                plans.append((node, step(node)))
                if not len(plans) % WALK:
                    looped(plans, self.system.label, event)
                node = getattr(node, "parent", None)
        return plans

    def _general(self, event: str) -> Verb:
        effects, on, history, label = self._effects, self.trail, self.history, self.system.label
        step = self._compiled.steps[event]
        names = [*(r for r, _ in self.system.regions), *(c for c, _ in self.system.counters)]

        def fields(targets: list[tuple[Any, Plan]]) -> list[tuple[object, ...]]:
            return [tuple(getattr(target, name) for name in names) for target, _ in targets]

        def fire(rec: Any) -> None:
            plans = self._plans(rec, step, event)
            if on:  # a record with no trail raises here, before any effect or write
                for target, _ in plans:
                    target.trail  # noqa: B018 -- read for the AttributeError alone
            if any(plan[1] for _, plan in plans):
                was = fields(plans)
                for target, (_, run, _) in plans:
                    for name in run:
                        run_effect(effects[name], name, event, target, label)
                        if fields(plans) != was:  # the writes below would undo what it did
                            cause = RuntimeError(meddled(event))
                            raise effect_failed(cause, name, event, target, label)
            for target, (assigns, _, _) in plans:
                for attr, value in assigns:
                    setattr(target, attr, value)
                if on:
                    target.trail = trails.note(target.trail, event, history)

        return fire

    def _refuser(self, refusals: Sequence[Refusal]) -> Refuser:
        """Return the ``_refuse(rec, index)`` generated code calls to raise ``refusals[index]``."""
        system = self.system

        def refuse(rec: Any, index: int) -> None:
            refusal = refusals[index]
            machine = system.machines[refusal.region]
            unknown = unknown_state(refusal.region, machine, getattr(rec, refusal.region))
            if unknown is not None:  # not a refusal of the spec's: a record no run makes
                raise BadArgument(f"{system.label} {rec.id}: {unknown}")
            raise self.refusal(rec, refusal)

        return refuse

    def refusal(self, rec: Any, refusal: Refusal) -> IllegalTransition:
        """Return the error refusing ``refusal.event`` on ``rec``, shaped as the spec's own.

        The generated code raises it for the spec's refusals; a collaborator that
        refuses by a rule of its own (vLLM's manager: a request claiming another
        request's copy) raises it too, so that its message, its trail and its
        class read as the engine's. In trail mode it names the record's recent
        call sites and the refused call's.
        """
        # Only trail mode pays for the frame walk to the refused call's own site; outside
        # it a trail left from an earlier trail-mode engine is stale, and is not reported.
        on = self.trail
        recent = trails.sites(getattr(rec, "trail", None)) if on else ()
        site = trails.caller_site() if on else None
        return error_class(refusal.error)(
            label=self.system.label,
            instance=rec.id,
            state=getattr(rec, refusal.region),
            counters={
                c: getattr(rec, c) for c in self.system.machines[refusal.region].counter_names
            },
            event=refusal.event,
            reason=refusal.reason,
            history=trails.account(recent, self._past, site),
            site=site,
            sites=recent,
            others={other: getattr(rec, other) for other in refusal.others},
        )


def _check_arguments(
    spec: object, effects: object, trail: object, audit: object, history: object
) -> None:
    """Raise BadArgument naming the first of :class:`Engine`'s arguments that is no such thing."""
    if not isinstance(spec, MachineSpec | System):
        raise BadArgument(f"Engine: spec must be a MachineSpec or System, got {spec!r}")
    if effects is not None and not isinstance(effects, Mapping):
        raise BadArgument(
            f"Engine: effects must be a mapping of effect names to callables, or None; got {effects!r}"
        )
    trails.check_flags("Engine", trail, audit)
    if not whole(history):
        raise BadArgument(f"Engine: history must be an int >= 0, got {history!r}")


_COMPILED_WITH = (
    "the engine's functions were compiled with {name}; build another Engine(spec, {name}=...)"
)
"""Why a setting compiled into the engine's functions (``trail``, ``history``) cannot be set."""

_BUILT: Final = {
    "system": "the engine's functions were compiled from it; build another Engine(spec)",
    "Record": "the engine's functions were compiled for its records;"
    " build another Engine(spec) for another record class",
    "leases": "the engine opens its leases in it and init voids them there;"
    " release them, or void them with Engine.leases.void(site)",
}
"""Why each plain attribute the engine is built with cannot be set (:meth:`Engine.__setattr__`)."""


_UNKNOWN = "an engine has no such attribute (its settings are Engine(spec, ...)'s arguments)"
"""Why a built engine refuses an attribute it was not built with (:meth:`Engine.__setattr__`)."""


def _fixed(name: str, value: object, why: str) -> ReadOnlyAttribute:
    """Return the error for assigning ``value`` to the engine's ``name``, fixed when it was built."""
    return ReadOnlyAttribute.assigned(f"Engine.{name}", value, why)


def _unknown_effects(system: System, unknown: Sequence[object]) -> str:
    """Return why ``effects`` binding ``unknown`` is refused, naming the effects the spec has."""
    names = ", ".join(repr(name) for name in unknown)
    which = "not an effect" if len(unknown) == 1 else "not effects"
    has = ", ".join(sorted(system.effect_names))
    its = f"its effects: {has}" if has else "it names no effect"
    return f"Engine: effects binds {names}, {which} of {system.name} ({its})"


def _unreturned(system: System, holders: Holders, acquire: str, release: str) -> str | None:
    """Return why ``release`` does not give back exactly what ``acquire`` takes, or None."""
    if not holders.acquires[acquire]:
        return (
            f"Engine.lease: {acquire} takes no hold of {system.name}: it adds one to no count"
            " that an event gives back, so no release would give back what it took"
        )
    takers = holders.givers(acquire)
    if release in takers:
        return None
    gives = holders.releases[release]
    if not takers:
        back = "no event gives it back"
    else:
        back = f"{' and '.join(takers)} give{'s' if len(takers) == 1 else ''} it back"
    return (
        f"Engine.lease: {release} gives back {_holds(system, gives) or 'nothing'},"
        f" not what {acquire} takes ({_holds(system, holders.acquires[acquire])}); {back}"
    )


def _holds(system: System, holds: Sequence[Hold]) -> str:
    """Name holds as messages do: ``pins``, or ``pins of host, device`` in a composition."""
    composed = len(system.regions) > 1
    return " and ".join(
        f"{counter} of {', '.join(regions)}" if composed else counter for counter, regions in holds
    )


def _initial(
    system: System, ident: object, states: dict[str, str] | None = None
) -> list[tuple[str, object]]:
    """Return a fresh record's attributes and values: its id, every region's state, counters, no trail.

    Each region is in its initial state unless ``states`` says otherwise.
    """
    regions = [(r, states[r] if states else m.initial) for r, m in system.regions]
    return [("id", ident), *regions, *system.counters, ("trail", None)]


def _initialise(
    system: System, rec: Any, ident: object, states: dict[str, str] | None = None
) -> None:
    """Set ``rec``'s attributes to a fresh record's (:func:`_initial`)."""
    for name, value in _initial(system, ident, states):
        setattr(rec, name, value)


_UNSET = object()
"""Stands for an attribute an object did not have (``init`` removes it again on a failure)."""


def _slots(system: System) -> tuple[str, ...]:
    return ("id", *(r for r, _ in system.regions), *(c for c, _ in system.counters), "trail")


def _record_class(system: System) -> type:
    """Build the slotted record class of ``system`` (under 100 bytes an instance).

    A copy (``copy.copy``) has the record's id, states and counters and a
    trail of its own: the trail is a deque, and a copy that shared it wrote
    the events fired at it into the original's, whose next refusal then named
    them. ``copy.deepcopy`` copies every field deeply, the trail included.
    A record does not pickle: its class is built here, at run time, where
    unpickling cannot find it, and its trail keeps code objects
    (:data:`~fsm_cache.engine.trail.Entry`), which do not pickle either.
    """
    slots = _slots(system)

    def init(self: Any, ident: object = 0) -> None:
        _initialise(system, self, ident)

    def show(self: Any) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in slots[:-1])
        return f"{system.name}.Record({fields})"

    def copied(self: Any) -> Any:
        """Return a record of the same fields with a trail of its own (None where it has none)."""
        twin = object.__new__(self.__class__)
        for name in slots:
            value = getattr(self, name, _UNSET)
            if value is not _UNSET:
                setattr(twin, name, value)
        kept: trails.Trail | None = getattr(self, "trail", None)
        if kept is not None:
            twin.trail = deque(kept, maxlen=kept.maxlen)
        return twin

    def deep(self: Any, memo: dict[int, object]) -> Any:
        """Return a record of deep copies of the fields (``copy.deepcopy``)."""
        twin = object.__new__(self.__class__)
        memo[id(self)] = twin
        for name in slots:
            value = getattr(self, name, _UNSET)
            if value is not _UNSET:
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    def unpicklable(self: Any, protocol: SupportsIndex) -> NoReturn:  # noqa: ARG001 (pickle's)
        """Refuse to be pickled (see :func:`_record_class`), with pickle's own error class."""
        raise TypeError(
            f"cannot pickle {show(self)}: a record's class is built by its Engine at run time; "
            "pickle its id, states and counters and set them on engine.new(id) instead"
        )

    return type(
        "Record",
        (),
        {
            "__slots__": slots,
            "__init__": init,
            "__repr__": show,
            "__copy__": copied,
            "__deepcopy__": deep,
            "__reduce_ex__": unpicklable,
        },
    )
