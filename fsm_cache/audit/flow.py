"""Path analysis of one function: every path, with what it holds at each point.

The walker interprets the statements of a function over sets of abstract
states (:mod:`fsm_cache.audit.state`). A call that may raise forks a state
into the ``raise`` flow, so ``try``/``except``/``finally`` see exactly the
acquisitions outstanding at each possible raise. Loops run their body once and
twice, which exposes a release that repeats. Compound statements live in
:mod:`fsm_cache.audit.compound`.

The work is bounded: a function whose analysis would run more than
:data:`MAX_STEPS` statement steps (one statement from one path state) raises
:class:`~fsm_cache.audit.state.TooComplex` instead of running for minutes.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fsm_cache.audit import compound
from fsm_cache.audit.calls import (
    Classifier,
    Comprehension,
    Op,
    OpKind,
    call_arguments,
    effects,
)
from fsm_cache.audit.events import Sink
from fsm_cache.audit.scope import (
    ELEMENT,
    Scope,
    build_scope,
    element_bindings,
    is_none,
    none_test,
    test_fact,
    walk_same_scope,
)
from fsm_cache.audit.state import (
    Flow,
    FlowOutcome,
    ResourceKey,
    State,
    States,
    TooComplex,
    add,
    merge,
    states_of,
)


# Statement steps (one statement run from one path state) allowed per function.
MAX_STEPS = 250_000


@dataclass
class Walker:
    """Interprets one function's statements over sets of path states.

    Attributes:
        scope: The function's names; its ``env`` changes as loops are entered.
        classifier: Says what each call does.
        sink: Receives the events seen along the way.
        frozen: Resource texts whose operations repeat harmlessly in a later loop
            iteration (the loop variable of that loop stands for every element).
        repeating: Whether a later pass of some loop is being run.
        steps: Statement steps run so far, against :data:`MAX_STEPS`.
        pair_ops: Acquires and releases run so far (a loop pass without any
            cannot depend on ``frozen``).
    """

    scope: Scope
    classifier: Classifier
    sink: Sink = field(default_factory=Sink)
    frozen: frozenset[str] = frozenset()
    repeating: bool = False
    steps: int = 0
    pair_ops: int = 0

    def block(self, body: list[ast.stmt], states: States) -> FlowOutcome:
        """Run ``body`` from ``states``; return the states per way of leaving it."""
        outcome: FlowOutcome = {}
        current = states
        for stmt in body:
            if not current:
                break
            result = self.stmt(stmt, current)
            current = result.pop(Flow.NORMAL, {})
            merge(outcome, result)
        add(outcome, Flow.NORMAL, current)
        return outcome

    def stmt(self, stmt: ast.stmt, states: States) -> FlowOutcome:
        """Run one statement.

        Raises:
            TooComplex: The function has used up its :data:`MAX_STEPS`.
        """
        self.count(states)
        handler = _HANDLERS.get(type(stmt), _simple)
        return handler(self, stmt, states)

    def count(self, states: States) -> None:
        """Charge one statement step per state against :data:`MAX_STEPS`.

        Raises:
            TooComplex: The function has used up its steps.
        """
        self.steps += len(states)
        if self.steps > MAX_STEPS:
            raise TooComplex(f"more than {MAX_STEPS} statement steps")

    def evaluate(self, node: ast.AST, states: States, outcome: FlowOutcome) -> States:
        """Apply the calls inside ``node`` in order; raising paths go to ``outcome``."""
        for effect in effects(node):
            states = self._effect(effect, states, outcome)
        return states

    def split(self, test: ast.expr, states: States) -> tuple[States, States]:
        """Return the states that pass ``test`` and those that fail it, as an ``if`` does."""
        return _split(self, test, states)

    def hand_on(self, value: ast.AST | None, states: States) -> States:
        """Mark the resources that ``value`` holds whole, or reachable from it, as handed on.

        Only whole values count (:meth:`Scope.wholes`): returning or storing
        ``node`` or ``(node, op)`` hands ``node`` on, ``len(node.key)`` or
        ``node.id`` does not. What is read from a receipt is a receipt
        (``return handle.params``, ``self.held =
        cache.inc_lock_ref(node).to_dec_params()``), so it hands on what the
        receipt stands for.
        """
        if value is None:
            return states
        owners, reads = self.held_by(value)
        if not owners and not reads:
            return states
        return states_of(*(state.hand_on(owners, owners, reads) for state in states))

    def held_by(self, value: ast.AST) -> tuple[frozenset[str], frozenset[str]]:
        """Return the resources ``value`` holds whole, and the names it reads a receipt from.

        The first are the texts of its whole values (:meth:`Scope.wholes`)
        and of what an acquire in them acquired (``cache.lock(node)`` holds
        ``node``); the second the names that a whole value reads an
        attribute of or calls a method on (``handle`` of ``handle.params``).
        """
        owners: set[str] = set()
        reads: set[str] = set()
        for whole in self.scope.wholes(value):
            if isinstance(whole, ast.Name | ast.Attribute | ast.Subscript):
                owners.add(self.scope.canon(whole))
            op = self.classifier.receipt_of(whole, self.scope)
            if op is not None and op.resource is not None:
                owners.add(self.scope.canon(op.resource))
            root = _read_from(whole)
            if root is not None:
                reads.add(self.scope.canon(root))
        return frozenset(owners), frozenset(reads)

    def forget(self, targets: list[ast.expr], states: States) -> States:
        """Drop the branch facts that read any of the assigned ``targets``."""
        names = frozenset(ast.unparse(sub) for target in targets for sub in _stored(target))
        return states_of(*(state.forget(names, self.scope.mentions) for state in states))

    def bind(
        self,
        targets: list[ast.expr],
        value: ast.expr | None,
        states: States,
        *,
        augmented: bool = False,
    ) -> States:
        """Store ``value`` into ``targets``, by ``=``, ``:=`` or (``augmented``) ``+=``.

        After ``value``'s calls have run. A receipt bound to one name stands
        for what it acquired, a store that escapes hands the value on, one
        into a local container aliases it, and the branch facts that read a
        target are forgotten; a guard or flag bound by ``=`` to a value known
        to pass or fail its test records that on the path.
        """
        plain = value if not augmented else None
        if len(targets) == 1 and plain is not None:
            states = self.receipt(targets[0], plain, states)
        if any(_escapes(self.scope, target) for target in targets):
            states = self.hand_on(value, states)
        elif value is not None:
            for target in targets:
                if isinstance(target, ast.Subscript):
                    states = self.collect(target.value, [value], states)
                elif isinstance(target, ast.Name) and isinstance(value, Comprehension):
                    states = self.collect_built(target, value, states)
        states = self.forget(targets, states)
        if len(targets) == 1 and plain is not None:
            states = self.known_none(targets[0], plain, states)
            states = self.known_flag(targets[0], plain, states)
        return states

    def _effect(self, effect: ast.AST, states: States, outcome: FlowOutcome) -> States:
        if isinstance(effect, ast.Lambda):
            return self.closure(effect, states)
        if isinstance(effect, ast.IfExp | ast.BoolOp):
            return self._conditional(effect, states, outcome)
        if isinstance(effect, Comprehension):
            return self._comprehension(effect, states, outcome)
        if isinstance(effect, ast.NamedExpr):
            return self.bind([effect.target], effect.value, states)
        if isinstance(effect, ast.Yield | ast.YieldFrom | ast.Await):
            if not isinstance(effect, ast.Await):  # an await raises the future's exception
                states = self.hand_on(effect.value, states)
            add(outcome, Flow.RAISE, _at(states, effect.lineno))
            return states
        assert isinstance(effect, ast.Call)
        states = self.deferred(effect, states)
        op = self.classifier.classify(effect, self.scope)
        if op.kind is OpKind.CALL and self.classifier.reads_receipt(effect, self.scope):
            op = Op(OpKind.SAFE, effect)
        return self._call(op, states, outcome)

    def _conditional(
        self, expr: ast.IfExp | ast.BoolOp, states: States, outcome: FlowOutcome
    ) -> States:
        """Run ``a if c else b`` or ``a and b``: each part only on the paths that reach it."""
        if isinstance(expr, ast.BoolOp):
            return self._bool_op(expr, states, outcome)
        states = self.evaluate(expr.test, states, outcome)
        taken, skipped = _split(self, expr.test, states)
        taken = self.evaluate(expr.body, taken, outcome)
        return {**taken, **self.evaluate(expr.orelse, skipped, outcome)}

    def _bool_op(self, op: ast.BoolOp, states: States, outcome: FlowOutcome) -> States:
        """Run ``a and b and c``: each operand runs only when the ones before did not decide."""
        done: States = {}
        for value in op.values[:-1]:
            states = self.evaluate(value, states, outcome)
            taken, skipped = _split(self, value, states)
            decided, states = (skipped, taken) if isinstance(op.op, ast.And) else (taken, skipped)
            done.update(decided)
        return {**done, **self.evaluate(op.values[-1], states, outcome)}

    def _comprehension(self, comp: Comprehension, states: States, outcome: FlowOutcome) -> States:
        """Run a comprehension once and again, its loop variables bound as a ``for`` loop's.

        Like a ``for`` loop, it is assumed to run at least once; a resource
        that is a loop variable's element is not acted on twice by the second pass.
        """
        first = comp.generators[0]
        states = self.evaluate(first.iter, states, outcome)
        exits: States = {}
        varying: set[str] = set()
        for iteration in range(2):
            entry, pair_ops = states, self.pair_ops
            with self.loop_pass({}, frozenset(varying) if iteration else None):
                states = self._generate(comp, states, outcome, varying, exits)
            exits.update(states)
            if self.pair_ops == pair_ops and states.keys() <= entry.keys():
                break
        return exits

    @contextmanager
    def loop_pass(self, bindings: dict[str, str], varying: frozenset[str] | None) -> Iterator[None]:
        """Bind a loop pass's variables; a later pass (``varying`` given) freezes them.

        Each pass starts from the names, frozen texts and repeating flag the
        loop was entered with, and they are put back however the pass leaves.
        """
        saved_env, saved_frozen, saved_repeating = self.scope.env, self.frozen, self.repeating
        self.scope.env = {**saved_env, **bindings}
        if varying is not None:
            self.frozen, self.repeating = saved_frozen | varying, True
        try:
            yield
        finally:
            self.scope.env, self.frozen = saved_env, saved_frozen
            self.repeating = saved_repeating

    def _generate(
        self,
        comp: Comprehension,
        states: States,
        outcome: FlowOutcome,
        varying: set[str],
        exits: States,
    ) -> States:
        """Run one element of ``comp``; states its ``if`` clauses filter out go to ``exits``."""
        for index, generator in enumerate(comp.generators):
            if index:
                states = self.evaluate(generator.iter, states, outcome)
            bindings = element_bindings(generator.target, generator.iter, self.scope)
            varying.update(bindings.values())
            self.scope.env.update(bindings)
            for test in generator.ifs:
                states = self.evaluate(test, states, outcome)
                states, skipped = _split(self, test, states)
                exits.update(skipped)
        parts = [comp.key, comp.value] if isinstance(comp, ast.DictComp) else [comp.elt]
        for part in parts:
            states = self.evaluate(part, states, outcome)
        return states

    def _call(self, op: Op, states: States, outcome: FlowOutcome) -> States:
        if op.kind is OpKind.CALL:
            add(outcome, Flow.RAISE, _at(states, op.call.lineno))
        elif op.kind in (OpKind.TAKE, OpKind.STORE):
            for argument in call_arguments(op.call):
                states = self.hand_on(argument, states)
            if op.kind is OpKind.TAKE:
                add(outcome, Flow.RAISE, _at(states, op.call.lineno))
        elif op.kind is OpKind.COLLECT and op.resource is not None:
            states = self.collect(op.resource, call_arguments(op.call), states)
        elif op.resource is not None and op.kind is not OpKind.SAFE:
            self.pair_ops += 1
            key = (op.pair, self.scope.canon(op.resource))
            if not (self._repeats(key[1]) or self._varies(op.resource) or self._switches(op)):
                states = self._pair(op, key, states)
        return states

    def collect(self, container: ast.expr, values: list[ast.expr], states: States) -> States:
        """Record that the elements of a local ``container`` stand for ``values``.

        And for what those stand for: after ``lock = cache.lock(node)``,
        ``locks.append(lock)`` puts in ``locks`` the receipt of ``node``.
        """
        texts = frozenset(text for value in values for text in self.held_by(value)[0])
        texts |= self.sink.stood_for(texts)
        alias = f"{self.scope.canon(container)}{ELEMENT}"
        if texts:
            self.sink.aliased(alias, texts)
        return states_of(*(state.alias(alias, texts) for state in states)) if texts else states

    def collect_built(self, target: ast.Name, comp: Comprehension, states: States) -> States:
        """Record that the elements of a local list built by ``comp`` stand for its elements.

        ``locks = [cache.lock(n) for n in nodes]`` puts into ``locks`` what
        ``for n in nodes: locks.append(cache.lock(n))`` does.
        """
        saved = self.scope.env
        try:
            for generator in comp.generators:
                bindings = element_bindings(generator.target, generator.iter, self.scope)
                self.scope.env = {**self.scope.env, **bindings}
            element = comp.value if isinstance(comp, ast.DictComp) else comp.elt
            return self.collect(target, [element], states)
        finally:
            self.scope.env = saved

    def receipt(self, target: ast.expr, value: ast.expr, states: States) -> States:
        """Make ``target`` of ``target = <acquire call>`` stand for the resource acquired.

        The value an acquire returns is its receipt (``lock = cache.lock(node)``):
        releasing it (``cache.unlock(lock)``) releases the resource, and storing
        or returning it hands the resource on. So is what is read from the
        receipt in the same expression (``cache.inc_lock_ref(node).to_dec_params()``).
        """
        if not isinstance(target, ast.Name):
            return states
        op = self.classifier.receipt_of(value, self.scope)
        if op is None or op.resource is None:
            return states
        alias, text = self.scope.canon(target), self.scope.canon(op.resource)
        if alias == text:
            return states
        self.sink.receipt(alias, text)
        return states_of(*(state.alias(alias, frozenset({text})) for state in states))

    def known_none(self, target: ast.expr, value: ast.expr, states: States) -> States:
        """Record on each path whether a guard name was just bound to None or to a receipt.

        ``lock = None`` makes ``lock is None`` true on the path and ``lock =
        cache.lock(node)`` makes it false, so a later ``if lock is not None:``
        releases on the paths that acquired and only on those. A receipt is
        taken to be not None: an acquire that returns None took nothing.
        """
        if not isinstance(target, ast.Name) or target.id not in self.scope.guards:
            return states
        if is_none(value):
            none = True
        elif self.classifier.receipt_of(value, self.scope) is not None:
            none = False
        else:
            return states
        test = none_test(target.id)
        return states_of(*(state.assume(test, none) for state in states))

    def known_flag(self, target: ast.expr, value: ast.expr, states: States) -> States:
        """Record on each path that a flag name was just bound to True or to False.

        ``pinned = False``, then ``node.protect_host(); pinned = True``, makes
        a later ``if pinned: node.release_host()`` release on the paths that
        pinned and only on those (:attr:`Scope.flags`).
        """
        if not isinstance(target, ast.Name) or target.id not in self.scope.flags:
            return states
        if not (isinstance(value, ast.Constant) and isinstance(value.value, bool)):
            return states
        return states_of(*(state.assume(target.id, value.value) for state in states))

    def entered(self, expr: ast.expr) -> ResourceKey | None:
        """Return what a ``with`` item holds: an acquire's (``with cache.lock(node):``) or a receipt's.

        A receipt (``with lock:`` after ``lock = cache.lock(node)``) is keyed by
        its name, which stands for what it acquired.
        """
        if isinstance(expr, ast.Name) and self.scope.receipts.get(expr.id, -1) >= 0:
            return self.scope.receipts[expr.id], self.scope.canon(expr)
        if not isinstance(expr, ast.Call):
            return None
        op = self.classifier.classify(expr, self.scope)
        if op.kind is not OpKind.ACQUIRE or op.resource is None:
            return None
        return op.pair, self.scope.canon(op.resource)

    def exit_with(self, keys: list[ResourceKey], outcome: FlowOutcome, line: int) -> FlowOutcome:
        """Release ``keys``, last entered first, on every way out of the ``with`` at ``line``.

        The lease an acquire returns releases on ``__exit__`` unless it was
        released already, so a key no longer held is left alone, not doubled.
        """
        if not keys:
            return outcome
        return {
            flow: states_of(*(_give_back(state, keys, line) for state in states))
            for flow, states in outcome.items()
        }

    def _varies(self, resource: ast.expr) -> bool:
        """Return whether ``resource`` names another resource in each later loop pass.

        In a later pass, an expression that reads a name rebound per iteration
        (``self.nodes[i]``, ``self.table[k].node``) or calls something
        (``self.q.popleft()``, ``self.ongoing.pop(ack_id)``) stands for a
        different element than in the first pass, so it neither pairs nor doubles.
        """
        if not self.repeating:
            return False
        rebound = {name for name, text in self.scope.env.items() if text in self.frozen}
        return any(
            isinstance(sub, ast.Call) or (isinstance(sub, ast.Name) and sub.id in rebound)
            for sub in walk_same_scope(resource)
        )

    def _switches(self, op: Op) -> bool:
        """Return whether a later loop pass makes ``op`` through another receiver.

        ``for comp in comps: comp.release_component_lock(node, params)`` releases
        ``node`` in a different component each pass, not twice in one, as
        ``self.caches[i].dec_lock_ref(node)`` does with ``i`` rebound per pass.
        """
        func = op.call.func
        if not self.repeating or not isinstance(func, ast.Attribute) or func.value is op.resource:
            return False
        return self._repeats(self.scope.canon(func.value)) or self._varies(func.value)

    def _repeats(self, text: str) -> bool:
        """Return whether ``text`` is a per-iteration resource seen again in a later pass."""
        return any(text == f or text.startswith((f + ".", f + "[")) for f in self.frozen)

    def _pair(self, op: Op, key: ResourceKey, states: States) -> States:
        line, col = op.call.lineno, op.call.col_offset + 1
        if op.kind is OpKind.ACQUIRE:
            self.sink.acquired(key, line, col)
            return states_of(*(state.acquire(key, line, col) for state in states))
        after: list[State] = []
        for state in states:
            released, earlier, matched = state.release(key, line)
            if earlier is None and not matched:
                earlier = state.last_release(_last_element(key))
            if earlier is not None:
                self.sink.double((line, col, key), earlier)
            elif matched:
                self.sink.match((line, col, key))
            else:
                self.sink.unmatch((line, col, key))
            after.append(released)
        return states_of(*after)

    def deferred(self, call: ast.Call, states: States) -> States:
        """A release passed uncalled to ``call`` is a callback that takes its resource.

        ``stack.callback(node.release_host)``, ``submit(x, callback=lock.release)``,
        ``loop.call_soon(self.dec_lock_ref, node)`` and ``partial(self.dec_lock_ref,
        node)`` call the release later, with the positional arguments that follow
        it, as ``lambda: self.dec_lock_ref(node)`` would.
        """
        later = [(argument, call.args[index + 1 :]) for index, argument in enumerate(call.args)]
        later += [(keyword.value, []) for keyword in call.keywords]
        texts: set[str] = set()
        for function, arguments in later:
            if not isinstance(function, ast.Attribute | ast.Name):
                continue
            release = ast.copy_location(ast.Call(func=function, args=arguments, keywords=[]), call)
            op = self.classifier.classify(release, self.scope)
            if op.kind is OpKind.RELEASE and op.resource is not None:
                texts.add(self.scope.canon(op.resource))
        if not texts:
            return states
        return states_of(*(state.hand_on(frozenset(texts)) for state in states))

    def attempted(
        self, test: ast.expr, through: States, around: States | None = None
    ) -> tuple[States, States]:
        """Return ``through`` as it passes ``test``, and ``around`` (default ``through``) as it fails it.

        They change only where ``test`` is an acquire (:meth:`tried`, asked
        once for both sides): where it returned false, it took nothing.
        """
        around = through if around is None else around
        tried = self.tried(test)
        if tried is None:
            return through, around
        key, negated = tried
        if negated:
            return states_of(*(state.retract(key) for state in through)), around
        return through, states_of(*(state.retract(key) for state in around))

    def tried(self, test: ast.expr) -> tuple[ResourceKey, bool] | None:
        """Return what ``test`` tried to acquire, and whether it is negated, if it is an acquire.

        ``if lock.acquire(False):`` and ``if not lock.acquire(blocking=False):``
        test whether the acquire took the resource: where it returned false, it
        did not. So does ``if not ok:`` after ``ok = lock.acquire(False)``, a
        name bound only to that pair's acquires (a receipt).
        """
        negated = False
        while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, not negated
        if isinstance(test, ast.Name) and self.scope.receipts.get(test.id, -1) >= 0:
            return (self.scope.receipts[test.id], self.scope.canon(test)), negated
        if isinstance(test, ast.Await):
            test = test.value
        if not isinstance(test, ast.Call):
            return None
        op = self.classifier.classify(test, self.scope)
        if op.kind is not OpKind.ACQUIRE or op.resource is None:
            return None
        return (op.pair, self.scope.canon(op.resource)), negated

    def closure(
        self, func: ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef, states: States
    ) -> States:
        """A nested function that releases a captured resource takes its ownership."""
        inner = build_scope(func)
        own = inner.params | inner.locals
        texts = frozenset(
            text
            for root, text in self.classifier.release_texts(func, self.scope)
            if root not in own
        )
        return states_of(*(state.hand_on(texts) for state in states)) if texts else states


Handler = Callable[[Walker, ast.stmt, States], FlowOutcome]


def _give_back(state: State, keys: list[ResourceKey], line: int) -> State:
    """Return ``state`` after a ``with`` released those of ``keys`` it still holds."""
    for key in reversed(keys):
        released, _, matched = state.release(key, line)
        state = released if matched else state
    return state


def _read_from(expr: ast.expr) -> ast.Name | None:
    """Return the name that ``expr`` reads an attribute of or calls a method on, if any.

    ``handle`` of ``handle.params``, ``handle.to_dec_params()`` or ``(await
    handle).params``: where ``handle`` is a receipt, so is what is read from it.
    """
    read = False
    while isinstance(expr, ast.Attribute | ast.Call | ast.Await):
        read = read or not isinstance(expr, ast.Await)
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr if read and isinstance(expr, ast.Name) else None


def _last_element(key: ResourceKey) -> ResourceKey:
    """Return the key a loop gave ``key`` while its variable was rebound each pass.

    After ``for op in ops: node = pop(op); node.release_host()``, ``node`` is the
    last element, which the loop already released.
    """
    root = re.match(r"[A-Za-z_]\w*", key[1])
    if root is None:
        return key
    return key[0], f"{root.group(0)}[*]{key[1][root.end() :]}"


def _at(states: States, line: int) -> States:
    """Mark ``states`` as leaving at ``line``; the line matters only to what is still held.

    States that hold nothing all leave at line 0, so a long run of calls that
    may raise does not multiply them.
    """
    return states_of(*(state.at(line if state.held else 0) for state in states))


def _stored(target: ast.expr) -> list[ast.expr]:
    """Return the names and attributes an assignment to ``target`` changes."""
    if isinstance(target, ast.Tuple | ast.List | ast.Starred):
        elements = target.elts if not isinstance(target, ast.Starred) else [target.value]
        return [sub for element in elements for sub in _stored(element)]
    if isinstance(target, ast.Subscript):
        return [target.value]
    return [target]


def _simple(walker: Walker, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run a statement without control flow: its calls, then its stores."""
    outcome: FlowOutcome = {}
    guarded = _guarded_choice(walker.scope, stmt)
    if guarded is not None:
        return walker.stmt(guarded, states)
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        states = walker.closure(stmt, states)
    elif not isinstance(stmt, ast.ClassDef):
        states = walker.evaluate(stmt, states, outcome)
    value = getattr(stmt, "value", None)
    value = value if isinstance(value, ast.expr) else None
    augmented = isinstance(stmt, ast.AugAssign)
    states = walker.bind(_targets(stmt), value, states, augmented=augmented)
    add(outcome, Flow.NORMAL, states)
    return outcome


def _guarded_choice(scope: Scope, stmt: ast.stmt) -> ast.If | None:
    """Return ``guard = a if c else b`` as ``if c: guard = a`` / ``else: guard = b``.

    Each branch then records whether the guard holds a receipt or None on its
    paths (:meth:`Walker.known_none`). Any other statement gives None.
    """
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target, value = stmt.targets[0], stmt.value
    if not (isinstance(target, ast.Name) and target.id in scope.guards):
        return None
    if not isinstance(value, ast.IfExp):
        return None
    branches: list[ast.stmt] = [
        ast.copy_location(ast.Assign(targets=[target], value=part), stmt)
        for part in (value.body, value.orelse)
    ]
    return ast.copy_location(ast.If(test=value.test, body=branches[:1], orelse=branches[1:]), stmt)


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return list(stmt.targets)
    if isinstance(stmt, ast.AugAssign | ast.AnnAssign):
        return [stmt.target]
    return []


def _escapes(scope: Scope, target: ast.expr) -> bool:
    """Return whether storing into ``target`` hands the value on.

    It does for an attribute, a container that outlives the function, and a
    name declared ``global`` or ``nonlocal``.
    """
    if isinstance(target, ast.Tuple | ast.List):
        return any(_escapes(scope, element) for element in target.elts)
    if isinstance(target, ast.Attribute):
        return True
    if isinstance(target, ast.Name):
        return target.id in scope.shared
    return isinstance(target, ast.Subscript) and not scope.is_local(target.value)


def _return(walker: Walker, stmt: ast.stmt, states: States) -> FlowOutcome:
    assert isinstance(stmt, ast.Return)
    outcome: FlowOutcome = {}
    states = walker.hand_on(stmt.value, walker.evaluate(stmt, states, outcome))
    add(outcome, Flow.RETURN, _at(states, stmt.lineno))
    return outcome


def _raise(walker: Walker, stmt: ast.stmt, states: States) -> FlowOutcome:
    outcome: FlowOutcome = {}
    states = walker.evaluate(stmt, states, outcome)
    add(outcome, Flow.RAISE, _at(states, stmt.lineno))
    return outcome


def _assert(walker: Walker, stmt: ast.stmt, states: States) -> FlowOutcome:
    outcome: FlowOutcome = {}
    states = walker.evaluate(stmt, states, outcome)
    add(outcome, Flow.RAISE, _at(states, stmt.lineno))
    add(outcome, Flow.NORMAL, states)
    return outcome


def _jump(flow: Flow) -> Handler:
    def run(_walker: Walker, _stmt: ast.stmt, states: States) -> FlowOutcome:
        return {flow: states}

    return run


def _if(walker: Walker, stmt: ast.stmt, states: States) -> FlowOutcome:
    """Run both branches; a repeated test takes the branch it took before on that path.

    An ``elif`` chain is walked in a loop, not by recursion, so a long chain
    does not exhaust the stack.
    """
    assert isinstance(stmt, ast.If)
    outcome: FlowOutcome = {}
    branch: ast.If | None = stmt
    while branch is not None and states:
        states = walker.evaluate(branch.test, states, outcome)
        taken, skipped = _split(walker, branch.test, states)
        merge(outcome, walker.block(branch.body, taken))
        orelse = branch.orelse
        if len(orelse) == 1 and isinstance(orelse[0], ast.If):
            branch, states = orelse[0], skipped
            walker.count(states)
        else:
            merge(outcome, walker.block(orelse, skipped))
            branch = None
    return outcome


def _split(walker: Walker, test: ast.expr, states: States) -> tuple[States, States]:
    """Return the states that take a branch on ``test`` and those that skip it.

    Where ``test`` is an acquire, the side on which it returned false holds
    nothing from it (:meth:`Walker.attempted`).
    """
    fact, polarity = test_fact(test)
    tracked = fact in walker.scope.correlated
    branches: dict[bool, list[State]] = {True: [], False: []}
    for state in states:
        known = state.fact(fact) if tracked else None
        for taken in (True, False):
            value = polarity == taken
            if known is None or known == value:
                branches[taken].append(state.assume(fact, value) if tracked else state)
    return walker.attempted(test, states_of(*branches[True]), states_of(*branches[False]))


_HANDLERS: dict[type[ast.stmt], Handler] = {
    ast.Return: _return,
    ast.Raise: _raise,
    ast.Assert: _assert,
    ast.Break: _jump(Flow.BREAK),
    ast.Continue: _jump(Flow.CONTINUE),
    ast.If: _if,
    **compound.HANDLERS,
}


def analyze(
    func: ast.FunctionDef | ast.AsyncFunctionDef, classifier: Classifier
) -> tuple[FlowOutcome, Sink]:
    """Run every path of ``func``; return how they leave it and the events seen."""
    scope = build_scope(func)
    scope.receipts = classifier.receipt_names(func.body, scope)
    scope.guards = classifier.none_guards(func.body, scope)
    scope.receipt_containers = classifier.receipt_containers(func.body, scope)
    scope.correlated |= {none_test(name) for name in scope.guards}
    walker = Walker(scope, classifier)
    outcome = walker.block(func.body, states_of(State()))
    return outcome, walker.sink
