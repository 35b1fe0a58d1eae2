"""Compound statements for the path analysis: ``try``, loops, ``with`` and ``match``.

Each handler takes the walker, the statement and the incoming states, and
returns the states per way of leaving the statement, as
:meth:`fsm_cache.audit.flow.Walker.stmt` does. Handlers read the walker
through :class:`Walking` and change nothing of it but through its methods:
the walker owns its loop state.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from fsm_cache.audit.scope import Scope, loop_bindings
from fsm_cache.audit.state import (
    Flow,
    FlowOutcome,
    ResourceKey,
    State,
    States,
    add,
    merge,
    states_of,
)


_CATCH_ALL = frozenset({"Exception", "BaseException"})
if sys.version_info >= (3, 11):
    _TRY = (ast.Try, ast.TryStar)
else:
    _TRY = (ast.Try,)


class Walking(Protocol):
    """What a compound statement's handler asks of the walker running it."""

    @property
    def scope(self) -> Scope:
        """The function's names."""

    @property
    def pair_ops(self) -> int:
        """Acquires and releases run so far."""

    def block(self, body: list[ast.stmt], states: States) -> FlowOutcome:
        """Run ``body`` from ``states``; return the states per way of leaving it."""

    def evaluate(self, node: ast.AST, states: States, outcome: FlowOutcome) -> States:
        """Apply the calls inside ``node`` in order; raising paths go to ``outcome``."""

    def forget(self, targets: list[ast.expr], states: States) -> States:
        """Drop the branch facts that read any of the assigned ``targets``."""

    def split(self, test: ast.expr, states: States) -> tuple[States, States]:
        """Return the states that pass ``test`` and those that fail it."""

    def attempted(
        self, test: ast.expr, through: States, around: States | None = None
    ) -> tuple[States, States]:
        """Return ``through`` as it passes ``test``, ``around`` as it fails it (an acquire's result)."""

    def receipt(self, target: ast.expr, value: ast.expr, states: States) -> States:
        """Make ``target`` of ``target = <acquire call>`` stand for the resource acquired."""

    def entered(self, expr: ast.expr) -> ResourceKey | None:
        """Return what a ``with`` item holds: an acquire's or a receipt's."""

    def exit_with(self, keys: list[ResourceKey], outcome: FlowOutcome, line: int) -> FlowOutcome:
        """Release ``keys``, last entered first, on every way out of the ``with`` at ``line``."""

    def loop_pass(
        self, bindings: dict[str, str], varying: frozenset[str] | None
    ) -> AbstractContextManager[None]:
        """Bind a loop pass's variables; a later pass (``varying`` given) freezes them."""


def run_try(walker: Walking, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run ``try``: handlers see the body's raising paths; ``finally`` sees every exit."""
    assert isinstance(stmt, _TRY)
    body = walker.block(stmt.body, states)
    pending: FlowOutcome = {}
    merge(pending, walker.block(stmt.orelse, body.pop(Flow.NORMAL, {})))
    raised = body.pop(Flow.RAISE, {})
    merge(pending, body)
    caught = states_of(*(state.at(0) for state in raised))
    for handler in stmt.handlers:
        merge(pending, walker.block(handler.body, caught))
    if not any(_catches_all(handler) for handler in stmt.handlers):
        add(pending, Flow.RAISE, raised)
    if not stmt.finalbody:
        return pending
    return _run_finally(walker, stmt.finalbody, pending)


def _run_finally(walker: Walking, body: list[ast.stmt], pending: FlowOutcome) -> FlowOutcome:
    """Run a ``finally`` body over every way of leaving its ``try``.

    A state that ends the body normally goes on as it left the ``try``
    (returning, raising, ...), at the line it left from; the body's own
    exits replace that. No step reads the line a state left from, so the
    body runs once per state with the line cleared, for every exit that
    state left by: a path's normal end and its raise from the same state
    share one pass. Nested ``try``/``finally`` statements thus cost one pass
    per level, not one per exit per level (exponential in their depth). A
    path that left holding nothing kept no line; if the body acquires on it,
    it leaves at the body's last line.
    """
    exits: dict[State, list[tuple[Flow, int]]] = {}
    for flow, leaving in pending.items():
        for state in leaving:
            exits.setdefault(state.at(0), []).append((flow, state.site))
    groups: dict[tuple[tuple[Flow, int], ...], States] = {}
    for state, left in exits.items():
        groups.setdefault(tuple(left), {})[state] = None
    end = body[-1].end_lineno or body[-1].lineno
    outcome: FlowOutcome = {}
    for ways, starts in groups.items():
        final = walker.block(body, starts)
        ended = final.pop(Flow.NORMAL, {})
        for flow, site in ways:
            # a path that left holding nothing kept no line: what the body took leaks at its end
            line = site or (0 if flow is Flow.NORMAL else end)
            add(outcome, flow, states_of(*(s.at(line if s.held else 0) for s in ended)))
        merge(outcome, final)
    return outcome


def _catches_all(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(kind is None or ast.unparse(kind) in _CATCH_ALL for kind in kinds)


def run_loop(walker: Walking, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run a loop body once and twice; ``for`` loops are assumed to run at least once.

    A ``for`` loop's variable stands for every element, so pinning and releasing
    it pair up across loops over the same collection, and its operations are
    not repeated in the second pass. Anything else repeats and can double.

    The second pass is skipped when it cannot differ from the first: the first
    acquired and released nothing and left no state it did not start from.
    Nested loops that only call other code thus cost one pass per level, not
    two to the power of the depth.
    """
    assert isinstance(stmt, ast.For | ast.AsyncFor | ast.While)
    outcome: FlowOutcome = {}
    header = stmt.test if isinstance(stmt, ast.While) else stmt.iter
    current = walker.evaluate(header, states, outcome)
    endless = isinstance(stmt, ast.While) and _always_true(stmt.test)
    exits: States = {}
    if isinstance(stmt, ast.While) and not endless:
        current, leaving = walker.attempted(stmt.test, current)
        exits.update(leaving)
    bindings = loop_bindings(stmt, walker.scope)
    for iteration in range(2):
        entry, pair_ops = current, walker.pair_ops
        body = _iterate(walker, stmt, current, bindings, iteration)
        add(outcome, Flow.NORMAL, body.pop(Flow.BREAK, {}))
        current = {**body.pop(Flow.NORMAL, {}), **body.pop(Flow.CONTINUE, {})}
        leaving = current
        if isinstance(stmt, ast.While):
            current = walker.evaluate(stmt.test, current, outcome)
            current, leaving = walker.attempted(stmt.test, current)
        merge(outcome, body)
        if not endless:
            exits.update(leaving)
        if walker.pair_ops == pair_ops and current.keys() <= entry.keys():
            break
    merge(outcome, walker.block(stmt.orelse, exits))
    return outcome


def _iterate(
    walker: Walking,
    stmt: ast.For | ast.AsyncFor | ast.While,
    states: States,
    bindings: dict[str, str],
    iteration: int,
) -> FlowOutcome:
    """Run one pass of a loop body with its loop variables bound."""
    with walker.loop_pass(bindings, frozenset(bindings.values()) if iteration else None):
        targets = [] if isinstance(stmt, ast.While) else [stmt.target]
        entry = walker.forget(targets, states)
        return walker.block(stmt.body, entry)


def _always_true(test: ast.expr) -> bool:
    return isinstance(test, ast.Constant) and bool(test.value)


def run_with(walker: Walking, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run ``with``: entering may raise; an acquire entered as an item is released on the way out.

    ``with cache.lock(node):`` holds the lock as a lease, whose end releases
    it however the body leaves (and an item entered after it that raises
    releases it too); ``as lease`` binds its receipt. The body's other
    acquisitions pass through unchanged.
    """
    assert isinstance(stmt, ast.With | ast.AsyncWith)
    outcome: FlowOutcome = {}
    entered: list[ResourceKey] = []
    for item in stmt.items:
        entering: FlowOutcome = {}
        states = walker.evaluate(item.context_expr, states, entering)
        merge(outcome, walker.exit_with(entered, entering, stmt.lineno))
        key = walker.entered(item.context_expr)
        entered += [key] if key is not None else []
        if item.optional_vars is not None:
            states = walker.receipt(item.optional_vars, item.context_expr, states)
    targets = [item.optional_vars for item in stmt.items if item.optional_vars is not None]
    body = walker.block(stmt.body, walker.forget(targets, states))
    merge(outcome, walker.exit_with(entered, body, stmt.lineno))
    return outcome


def run_match(walker: Walking, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run ``match``: every case is a branch; no case matching falls through.

    A case's guard (``case "load" if node.protect_host():``) runs where its
    pattern matched, as an ``if`` test: its raises leave the ``match``, the
    paths that pass it run the body, and those that fail it (the guard
    still ran) go on to the later cases, as do the paths whose pattern did
    not match.
    """
    assert isinstance(stmt, ast.Match)
    outcome: FlowOutcome = {}
    states = walker.evaluate(stmt.subject, states, outcome)
    for case in stmt.cases:
        taken = states
        if case.guard is not None:
            guarded = walker.evaluate(case.guard, states, outcome)
            taken, failed = walker.split(case.guard, guarded)
            states = {**states, **failed}
        merge(outcome, walker.block(case.body, taken))
    last = stmt.cases[-1] if stmt.cases else None
    catch_all = (
        last is not None
        and last.guard is None
        and isinstance(last.pattern, ast.MatchAs)
        and last.pattern.pattern is None
    )
    if not catch_all:
        add(outcome, Flow.NORMAL, states)
    return outcome


Handler = Callable[[Walking, ast.stmt, States], FlowOutcome]

HANDLERS: dict[type[ast.stmt], Handler] = {
    **dict.fromkeys(_TRY, run_try),
    ast.For: run_loop,
    ast.AsyncFor: run_loop,
    ast.While: run_loop,
    ast.With: run_with,
    ast.AsyncWith: run_with,
    ast.Match: run_match,
}
