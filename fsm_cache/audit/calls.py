"""What a call does to ownership: acquire, release, hand on, or maybe raise.

Resources are named by text. ``node.protect_host()`` acts on ``node`` (the
receiver); ``self.inc_lock_ref(node)`` and ``self.inc_lock_ref(node=node)`` act
on ``node`` (the first argument, positional or keyword), unless the pair
declares its resource's argument (:func:`declared`).
"""

from __future__ import annotations

import ast
import enum
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from fsm_cache.audit.model import Argument, AuditConfig
from fsm_cache.audit.scope import (
    Scope,
    bound_names,
    calls_anything,
    conditional_effects,
    container_puts,
    empty_container,
    is_none,
    name_bindings,
    none_test,
    root_name,
    sole_kinds,
    string_constant,
    target_names,
    verb_event,
    walk_same_scope,
)


# Methods that put their arguments into the receiver: a store into a
# container that outlives the function hands ownership on.
STORE_METHODS = frozenset(
    {"append", "appendleft", "add", "extend", "insert", "put", "put_nowait", "push", "update"}
)


class OpKind(enum.Enum):
    """What a call does to the resources of the analysis."""

    ACQUIRE = "acquire"
    RELEASE = "release"
    TAKE = "take"
    STORE = "store"
    COLLECT = "collect"
    SAFE = "safe"
    CALL = "call"


@dataclass(frozen=True)
class Op:
    """A classified call.

    Attributes:
        kind: What the call does.
        call: The call node.
        pair: Index of the pair for ACQUIRE and RELEASE, else -1.
        resource: The expression acquired or released, if any.
    """

    kind: OpKind
    call: ast.Call
    pair: int = -1
    resource: ast.expr | None = None


class Classifier:
    """Classifies calls against the configured pairs and ownership-taking functions."""

    def __init__(self, config: AuditConfig, takers: frozenset[str]) -> None:
        self.acquires = {pair.acquire: index for index, pair in enumerate(config.pairs)}
        self.releases = {pair.release: index for index, pair in enumerate(config.pairs)}
        self.arguments = {
            name: pair.argument(name)
            for pair in config.pairs
            for name in (pair.acquire, pair.release)
        }
        self.takers = frozenset(name.rsplit(".", 1)[-1] for name in takers)
        self.non_raising = config.non_raising
        self._may_pair = frozenset(self.arguments) | {"fire", "verb"}  # see may_pair

    def may_pair(self, node: ast.AST) -> bool:
        """Return whether any call inside ``node`` could be a pair call.

        A cheap test by name: a call named like an acquire or a release, a
        ``fire`` or a ``verb``, or a call of what a call returned
        (``engine.verb("pin")(rec)``). Code without one acquires and releases
        nothing, so it has nothing to analyze.
        """
        names = self._may_pair
        return any(
            isinstance(sub, ast.Call)
            and (isinstance(sub.func, ast.Call) or callee_name(sub) in names)
            for sub in ast.walk(node)
        )

    def classify(self, call: ast.Call, scope: Scope) -> Op:
        """Return what ``call`` does, judged by the name it calls or the event it fires.

        ``lease.release()`` on a name bound only to receipts of one pair
        (:meth:`receipt_names`) releases that pair, whatever its release is
        named; on a name bound only to ``engine.lease(...)`` it is an ordinary
        call (the lease releases itself, which the audit does not pair).
        """
        released = _receipt_release(call, scope)
        if released is not None:
            return released
        paired = self._pair_call(call, scope)
        if paired is not None:
            return self._pair_op(call, *paired)
        name = callee_name(call)
        if name in self.takers:
            return Op(OpKind.TAKE, call)
        if name in STORE_METHODS and isinstance(call.func, ast.Attribute):
            stays_local = scope.is_local(call.func.value)
            return Op(
                OpKind.COLLECT if stays_local else OpKind.STORE, call, resource=call.func.value
            )
        return Op(OpKind.SAFE if name in self.non_raising else OpKind.CALL, call)

    def _pair_call(self, call: ast.Call, scope: Scope) -> tuple[str, ast.expr | None] | None:
        """Return the pair name ``call`` invokes and its resource, if it is a pair call.

        An event fired through a generic entry point (:func:`fired`) counts as
        a call of the event's name, before the name the call is made through;
        it acts on the record it fires at, whatever argument the pair declares
        for a direct call.
        """
        event, resource = fired(call, scope.verbs)
        if event is not None and (event in self.acquires or event in self.releases):
            return event, resource
        name = callee_name(call)
        if name in self.acquires or name in self.releases:
            argument = self.arguments[name]
            return name, subject(call) if argument is None else declared(call, argument)
        return None

    def _pair_op(self, call: ast.Call, name: str, resource: ast.expr | None) -> Op:
        if resource is None:
            return Op(OpKind.SAFE, call)
        if name in self.acquires:
            return Op(OpKind.ACQUIRE, call, self.acquires[name], resource)
        return Op(OpKind.RELEASE, call, self.releases[name], resource)

    def release_texts(self, node: ast.AST, scope: Scope) -> Iterator[tuple[str, str]]:
        """Yield (root name, canonical text) of every release anywhere inside ``node``."""
        for sub in ast.walk(node):
            op = self.classify(sub, scope) if isinstance(sub, ast.Call) else None
            if op is not None and op.kind is OpKind.RELEASE and op.resource is not None:
                root = root_name(op.resource)
                if root is not None:
                    yield root, scope.canon(op.resource)

    def receipt_of(self, value: ast.expr, scope: Scope) -> Op | None:
        """Return the acquire whose receipt ``value`` is, if any.

        ``value`` is the acquire call itself, or reads an attribute or calls a
        method of its result (``cache.inc_lock_ref(node).to_dec_params()``),
        awaited or not.
        """
        expr: ast.expr = value
        while isinstance(expr, ast.Await | ast.Attribute | ast.Call):
            if isinstance(expr, ast.Call):
                op = self.classify(expr, scope)
                if op.kind is OpKind.ACQUIRE:
                    return op
                expr = expr.func
            else:
                expr = expr.value
        return None

    def reads_receipt(self, call: ast.Call, scope: Scope) -> bool:
        """Return whether ``call`` is a method of an acquire's result, in the acquire's expression.

        ``cache.inc_lock_ref(node).to_dec_params()`` reads the receipt as it is
        taken: it is part of the acquire, not a call after it that may raise
        and leak it (no ``try`` could sit between the two).
        """
        func = call.func
        return isinstance(func, ast.Attribute) and self.receipt_of(func.value, scope) is not None

    def none_guards(self, body: list[ast.stmt], scope: Scope) -> frozenset[str]:
        """Return the names bound to an acquire's receipt on some paths and tested against None.

        ``params = cache.inc_lock_ref(node).to_dec_params() if c else None``, or
        ``lock = None`` and then ``lock = cache.lock(node)`` in a branch: a
        later ``if lock is not None:`` runs on the paths that acquired, not on
        the others.
        """
        names: set[str] = set()
        for name, value in name_bindings(list(body), with_items=False):
            options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            if any(self.receipt_of(option, scope) is not None for option in options):
                names.add(name)
        return frozenset(name for name in names if none_test(name) in scope.mentions)

    def receipt_names(self, body: list[ast.stmt], scope: Scope) -> dict[str, int]:
        """Return the names bound only to receipts of one pair, with that pair's index.

        A receipt is bound by ``lock = cache.lock(node)`` or ``with
        cache.lock(node) as lock``. A name bound only to ``X.lease(...)`` (the
        engine's lease, which is no acquire to the audit) maps to -1. A name
        may also be bound to None, where it acquired nothing (``lock = None``,
        ``lock = cache.lock(node) if c else None``). A name also bound to
        anything else, or to two pairs' receipts, is none.
        """
        nodes: list[ast.AST] = list(body)
        bindings = name_bindings(nodes, with_items=True)
        return sole_kinds(nodes, bindings, lambda value: self._option_pair(value, scope), is_none)

    def _option_pair(self, value: ast.expr, scope: Scope) -> int | None:
        """Return the pair whose receipt ``value`` is, or each of its options not None is."""
        if not isinstance(value, ast.IfExp):
            return self._lease_pair(value, scope)
        options = [option for option in (value.body, value.orelse) if not is_none(option)]
        return _sole({self._lease_pair(option, scope) for option in options})

    def receipt_containers(self, body: list[ast.stmt], scope: Scope) -> dict[str, int]:
        """Return the local containers that hold only receipts of one pair, with that pair's index.

        ``locks = []`` filled by ``locks.append(cache.lock(node))`` (or
        ``locks[k] = ...``, or with ``lock`` after ``lock = cache.lock(node)``),
        or built as ``locks = [cache.lock(n) for n in nodes]``: each element
        is a receipt, so ``for lock in locks: lock.release()`` releases them
        (:meth:`Scope.receipt_pair`). A container bound or filled with
        anything else, or with two pairs' receipts, holds none; -1 for leases.
        """
        nodes: list[ast.AST] = list(body)
        valued = self._receipt_valued(nodes, scope)

        def kind(value: ast.expr) -> int | None:
            if isinstance(value, ast.Name):
                return valued.get(value.id)
            return self._lease_pair(value, scope)

        kinds: dict[str, set[int | None]] = {}
        assigned: Counter[str] = Counter()
        for name, value in name_bindings(nodes, with_items=False):
            assigned[name] += 1
            found = kinds.setdefault(name, set())
            if not empty_container(value):
                built = _built_element(value)
                found.add(None if built is None else kind(built))
        for name, value in container_puts(nodes):
            kinds.setdefault(name, set()).add(kind(value))
        binds = Counter(name for node in nodes for name in bound_names(node))
        return {
            name: pair
            for name, found in kinds.items()
            if (pair := _sole(found)) is not None
            and name in scope.locals
            and binds[name] == assigned[name]
        }

    def _receipt_valued(self, nodes: list[ast.AST], scope: Scope) -> dict[str, int]:
        """Return the names every ``=`` binds to a receipt of one pair, with its index.

        As :meth:`receipt_names`, but a name may also be a ``for`` target
        (``for lock in locks``, the container it was put into).
        """
        kinds: dict[str, set[int | None]] = {}
        for name, value in name_bindings(nodes, with_items=True):
            kinds.setdefault(name, set()).add(self._lease_pair(value, scope))
        counted = Counter(name for name, _ in name_bindings(nodes, with_items=True))
        counted.update(
            name
            for node in nodes
            for sub in walk_same_scope(node)
            if isinstance(sub, ast.For | ast.AsyncFor | ast.comprehension)
            for name in target_names(sub.target)
        )
        binds = Counter(name for node in nodes for name in bound_names(node))
        return {
            name: pair
            for name, found in kinds.items()
            if (pair := _sole(found)) is not None and binds[name] == counted[name]
        }

    def _lease_pair(self, value: ast.expr, scope: Scope) -> int | None:
        """Return the pair whose receipt ``value`` is, -1 for ``X.lease(...)``, else None."""
        op = self.receipt_of(value, scope)
        if op is not None:
            return op.pair
        unwrapped = value.value if isinstance(value, ast.Await) else value
        if isinstance(unwrapped, ast.Call) and isinstance(unwrapped.func, ast.Attribute):
            return -1 if unwrapped.func.attr == "lease" else None
        return None


def _receipt_release(call: ast.Call, scope: Scope) -> Op | None:
    """Return what ``NAME.release()`` does when NAME holds a receipt or a lease, else None.

    A lease's release is an ordinary call, its give-back named or not
    (``lease.release("load_failed")``); a receipt's is a release of its pair
    only without arguments.
    """
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr != "release" or not isinstance(func.value, ast.Name):
        return None
    pair = scope.receipt_pair(func.value.id)
    if pair is None:
        return None
    if pair < 0:
        return Op(OpKind.CALL, call)
    return None if call.args or call.keywords else Op(OpKind.RELEASE, call, pair, func.value)


def _sole(kinds: set[int | None]) -> int | None:
    """Return the one pair of ``kinds``; None where there are several, none, or an unknown one."""
    return next(iter(kinds)) if len(kinds) == 1 else None


def _built_element(value: ast.expr) -> ast.expr | None:
    """Return the element a comprehension builds (a dict's value), or None for any other value."""
    if isinstance(value, ast.DictComp):
        return value.value
    if isinstance(value, ast.ListComp | ast.SetComp):
        return value.elt
    return None


def callee_name(call: ast.Call) -> str:
    """Return the bare name a call invokes (``release_host`` for ``node.release_host()``)."""
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return ""


def fired(call: ast.Call, verbs: Mapping[str, str]) -> tuple[str | None, ast.expr | None]:
    """Return the literal event ``call`` fires through a generic entry point, and at what.

    ``engine.fire(rec, "pin")`` and HiCache's ``cache.fire("pin", node)`` fire
    ``pin`` at ``rec`` or ``node``; so do ``engine.verb("pin")(rec)`` and
    ``take(rec)`` after ``take = engine.verb("pin")`` (``verbs``). Anything
    else, an event held in a variable included, is ``(None, None)``.
    """
    func = call.func
    verb = verb_event(func) if isinstance(func, ast.Call) else None
    if verb is not None:
        return verb, subject(call)
    if isinstance(func, ast.Name) and func.id in verbs:
        return verbs[func.id], subject(call)
    if callee_name(call) == "fire":
        return _fire_arguments(call)
    return None, None


def _fire_arguments(call: ast.Call) -> tuple[str | None, ast.expr | None]:
    """Return the literal event and the record of a ``fire`` call, either argument order."""
    if any(isinstance(argument, ast.Starred) for argument in call.args):
        return None, None
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    first, second = (*call.args, None, None)[:2]
    if string_constant(first) is not None:  # HiCache: fire(event, node)
        return string_constant(first), second or keywords.get("node")
    if string_constant(second) is not None:  # Engine: fire(rec, event)
        return string_constant(second), first
    target = first or keywords.get("rec") or keywords.get("node")
    return string_constant(keywords.get("event")), target


def subject(call: ast.Call) -> ast.expr | None:
    """Return the resource of a pair call: its first argument, else its receiver.

    The first argument is the first positional one, else the first keyword
    one, so ``inc_lock_ref(node=node)`` acts on ``node`` as
    ``inc_lock_ref(node)`` does. A literal first argument is a flag
    (``lock.acquire(False)``, ``node.protect_host(force=True)``), not a
    resource; nor is an unpacking (``*nodes``, ``**options``), whose
    arguments are unknown.
    """
    if call.args:
        first: ast.expr | None = call.args[0]
    elif call.keywords and call.keywords[0].arg is not None:
        first = call.keywords[0].value
    else:
        first = None
    if first is not None and not isinstance(first, ast.Starred | ast.Constant):
        return first
    if isinstance(call.func, ast.Attribute):
        return call.func.value
    return None


def declared(call: ast.Call, argument: Argument) -> ast.expr | None:
    """Return the resource of a pair call whose pair declares its ``argument``; None if not passed.

    ``release_layout(event, key)`` finds the resource passed as ``key=`` or as
    the second positional argument, and ``acquire(self)`` the receiver, so
    neither a leading argument nor an option passed first is taken for it.
    None (the call is not counted) when the call does not pass it, or when an
    unpacking (``*args``, ``**options``) may: what that holds is unknown.
    """
    if argument.receiver:
        return call.func.value if isinstance(call.func, ast.Attribute) else None
    for keyword in call.keywords:
        if keyword.arg == argument.keyword:
            return keyword.value
    leading = call.args[: argument.position + 1]
    if any(isinstance(arg, ast.Starred) for arg in leading):
        return None
    if len(leading) > argument.position:
        return leading[argument.position]
    return None


def call_arguments(call: ast.Call) -> list[ast.expr]:
    """Return the positional and keyword argument expressions of ``call``."""
    return [*call.args, *(keyword.value for keyword in call.keywords)]


Comprehension = ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp
Effect = (
    ast.Call
    | ast.Await
    | ast.Yield
    | ast.YieldFrom
    | ast.Lambda
    | ast.IfExp
    | ast.BoolOp
    | ast.NamedExpr
    | Comprehension
)


def effects(node: ast.AST) -> Iterator[Effect]:
    """Yield the calls, awaits, yields, lambdas and ``:=`` bindings of ``node`` in evaluation order.

    In post-order: ``(lock := cache.lock(node))`` yields the call, then the binding.
    An ``await`` is yielded only when it awaits something other than a call
    (``await fut``, ``await self.pending[k]``): awaiting a call is that call,
    which raises or not as the call does.

    A conditional expression or boolean operation whose guarded operands call
    something, and a comprehension that calls something, are yielded whole
    instead of their parts: the walker runs their parts under their tests
    and with their loop variables bound.
    """
    if _whole(node):
        yield node
        return
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Lambda):
            yield child
        elif not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from effects(child)
    awaits_call = isinstance(node, ast.Await) and isinstance(node.value, ast.Call)
    effect = ast.Call | ast.Await | ast.Yield | ast.YieldFrom | ast.NamedExpr
    if isinstance(node, effect) and not awaits_call:
        yield node


def _whole(node: ast.AST) -> TypeGuard[ast.IfExp | ast.BoolOp | Comprehension]:
    """Return whether the walker runs ``node`` as one effect, its parts in their own order."""
    if isinstance(node, ast.IfExp | ast.BoolOp):
        return conditional_effects(node)
    return isinstance(node, Comprehension) and calls_anything(node)
