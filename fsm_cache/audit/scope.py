"""What the names of one function mean: parameters, locals, loop variables, tests.

The path analysis asks three questions of a function's names: is a container
local (storing into it is not a hand-off), which text stands for a loop
variable (so ``for node in nodes`` pins and releases pair up as ``nodes[*]``),
and which branch tests repeat (only those are worth correlating).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar


K = TypeVar("K")
"""The kind :func:`sole_kinds` reads off a bound value (an event, a pair's index)."""


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
ELEMENT = "[*]"
"""What a container's text ends with to stand for each of its elements (``nodes[*]``)."""
_PUT_METHODS = frozenset({"append", "appendleft", "add", "push", "put", "put_nowait"})
_EMPTY_BUILDERS = frozenset({"list", "dict", "set", "deque"})
_WRAPPERS = frozenset({"reversed", "list", "sorted", "tuple"})
_BOUNDARIES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass
class Scope:
    """Names of one function, plus the loop variables bound at the current point.

    Attributes:
        params: Parameter names.
        locals: Names bound in the body (not parameters).
        correlated: Normalized branch tests that occur more than once, and the
            None tests of the guards (set by the analysis).
        mentions: Test -> the texts of the names and attributes it reads.
        env: Loop variable -> the text it stands for (``nodes[*]``).
        shared: Names declared ``global`` or ``nonlocal``: storing into them
            hands the value on.
        verbs: Name bound only to ``engine.verb("pin")`` -> the event it fires.
        receipts: Name bound only to receipts of one pair (``lock =
            cache.lock(node)``) -> that pair's index; -1 for ``engine.lease(...)``.
            Set by the analysis, which knows the pairs.
        guards: Names that hold an acquire's receipt on some paths and that
            a branch tests against None (:func:`none_test`); their tests are
            correlated with their assignments. Set by the analysis.
        flags: Names bound to ``True`` or ``False`` somewhere and tested by
            themselves (``if pinned:``, ``if not ok:``); their tests are
            correlated with those assignments.
        receipt_containers: Local container bound and filled only with
            receipts of one pair (``locks.append(cache.lock(node))``,
            ``locks = [cache.lock(n) for n in nodes]``) -> that pair's index;
            -1 for leases. Set by the analysis.
    """

    params: frozenset[str]
    locals: frozenset[str]
    correlated: frozenset[str]
    mentions: dict[str, frozenset[str]]
    env: dict[str, str] = field(default_factory=dict)
    shared: frozenset[str] = frozenset()
    verbs: dict[str, str] = field(default_factory=dict)
    receipts: dict[str, int] = field(default_factory=dict)
    guards: frozenset[str] = frozenset()
    flags: frozenset[str] = frozenset()
    receipt_containers: dict[str, int] = field(default_factory=dict)

    def receipt_pair(self, name: str) -> int | None:
        """Return the pair whose receipt ``name`` holds here, -1 for a lease, else None.

        A name bound only to receipts of one pair holds one (:attr:`receipts`);
        so does the loop variable of ``for lock in locks`` while it stands for
        an element of a container of receipts (:attr:`receipt_containers`).
        """
        pair = self.receipts.get(name)
        if pair is not None:
            return pair
        element = self.env.get(name, "")
        if not element.endswith(ELEMENT):
            return None
        return self.receipt_containers.get(element[: -len(ELEMENT)])

    def canon(self, expr: ast.expr) -> str:
        """Return the text of ``expr`` with a loop variable replaced by what it stands for."""
        text = ast.unparse(expr)
        root = root_name(expr)
        if root is not None and root in self.env:
            return self.env[root] + text[len(root) :]
        return text

    def wholes(self, node: ast.AST) -> Iterator[ast.expr]:
        """Yield the expressions whose values ``node`` evaluates to, or holds whole.

        What is reachable from them goes with them when ``node`` is handed
        on: ``req`` in ``req``, ``(req, 1)``, ``Entry(req)`` or ``req if c else
        None``; but a value read from one (``req.prefix_indices``,
        ``len(req.key)``) does not hand on ``req``. A name, attribute or
        subscript is itself; a container display holds
        its elements (and a dict its keys); a call's result may hold its
        arguments (``Entry(req)``), and is yielded too, for what reads a
        receipt (``cache.lock(node).params``); ``a if c else b``, ``a and
        b`` and ``(x := a)`` are one of their operands; ``await f(x)`` is
        what ``f(x)`` gives, while ``await fut`` is not ``fut``; a
        comprehension holds its elements. Anything else (``len(req.key)``,
        ``a + b``, ``f"{req}"``) is a new value.

        While a comprehension's elements are yielded, its loop variables are
        bound in :attr:`env`, so :meth:`canon` of what is yielded reads them.
        """
        if isinstance(node, ast.Name | ast.Attribute | ast.Subscript):
            yield node
            return
        parts: list[ast.expr | None] = []
        if isinstance(node, ast.Starred):
            parts = [node.value]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            parts = list(node.elts)
        elif isinstance(node, ast.Dict):
            parts = [*node.keys, *node.values]
        elif isinstance(node, ast.Call):
            yield node
            parts = [*node.args, *(keyword.value for keyword in node.keywords)]
        elif isinstance(node, ast.IfExp):
            parts = [node.body, node.orelse]
        elif isinstance(node, ast.BoolOp):
            parts = list(node.values)
        elif isinstance(node, ast.NamedExpr):
            parts = [node.value]
        elif isinstance(node, ast.Await):
            yield node
            parts = [node.value] if isinstance(node.value, ast.Call) else []
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            yield from self._elements(node)
        for part in parts:
            if part is not None:
                yield from self.wholes(part)

    def _elements(
        self, comp: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp
    ) -> Iterator[ast.expr]:
        """Yield the whole values of a comprehension's elements, its loop variables bound."""
        saved = self.env
        try:
            for generator in comp.generators:
                bindings = element_bindings(generator.target, generator.iter, self)
                self.env = {**self.env, **bindings}
            parts = [comp.key, comp.value] if isinstance(comp, ast.DictComp) else [comp.elt]
            for part in parts:
                yield from self.wholes(part)
        finally:
            self.env = saved

    def is_local(self, expr: ast.expr) -> bool:
        """Return whether ``expr`` is rooted in a local variable of this function."""
        root = root_name(expr)
        return root is not None and root in self.locals


def build_scope(func: FunctionNode | ast.Lambda) -> Scope:
    """Collect the names and branch tests of ``func``."""
    args = func.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    params = frozenset(arg.arg for arg in every if arg is not None)
    body: list[ast.AST] = [func.body] if isinstance(func.body, ast.expr) else list(func.body)
    bound = {name for node in body for name in bound_names(node)}
    shared = {
        name
        for node in body
        for sub in walk_same_scope(node)
        if isinstance(sub, ast.Global | ast.Nonlocal)
        for name in sub.names
    }
    tests = [test for node in body for sub in walk_same_scope(node) for test in branch_tests(sub)]
    counts = Counter(test_fact(test)[0] for test in tests)
    mentions = {test_fact(test)[0]: texts_of(test) for test in tests}
    flags = frozenset(
        name
        for name, value in name_bindings(body, with_items=False)
        if isinstance(value, ast.Constant) and isinstance(value.value, bool) and name in mentions
    )
    correlated = frozenset(test for test, count in counts.items() if count > 1) | flags
    locals_ = frozenset(bound - params - shared)
    verbs = {name: event for name, event in verb_names(body).items() if name in locals_}
    return Scope(
        params,
        locals_,
        correlated,
        mentions,
        shared=frozenset(shared),
        verbs=verbs,
        flags=flags,
    )


def verb_names(body: list[ast.AST]) -> dict[str, str]:
    """Return the names bound to ``X.verb("event")`` and to nothing else, with their event.

    ``take = engine.verb("pin")`` makes ``take(rec)`` a call of ``pin``. A name
    also bound to anything else, or to two events, could be either, so it is none.
    """
    return sole_kinds(body, name_bindings(body, with_items=False), verb_event)


def name_bindings(body: list[ast.AST], *, with_items: bool) -> Iterator[tuple[str, ast.expr]]:
    """Yield (name, value) of each ``name = value`` and ``(name := value)`` in ``body``.

    With ``with_items``, also of each ``with value as name``.
    """
    for node in body:
        for sub in walk_same_scope(node):
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                if isinstance(sub.targets[0], ast.Name):
                    yield sub.targets[0].id, sub.value
            elif isinstance(sub, ast.NamedExpr):
                yield sub.target.id, sub.value
            elif (
                with_items
                and isinstance(sub, ast.withitem)
                and isinstance(sub.optional_vars, ast.Name)
            ):
                yield sub.optional_vars.id, sub.context_expr


def container_puts(body: list[ast.AST]) -> Iterator[tuple[str, ast.expr]]:
    """Yield (name, value) of each value put into the container a name holds, in ``body``.

    ``name.append(value)`` (and ``appendleft``, ``add``, ``push``, ``put``),
    ``name.insert(i, value)`` and ``name[key] = value``.
    """
    for node in body:
        for sub in walk_same_scope(node):
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        yield target.value.id, sub.value
            elif isinstance(sub, ast.Call):
                container = _put_into(sub)
                if container is not None:
                    yield container, sub.args[-1]


def _put_into(call: ast.Call) -> str | None:
    """Return the name whose container ``call`` puts one value into, if it does."""
    func = call.func
    if not isinstance(func, ast.Attribute) or not isinstance(func.value, ast.Name):
        return None
    if call.keywords or any(isinstance(argument, ast.Starred) for argument in call.args):
        return None
    arity = 2 if func.attr == "insert" else 1 if func.attr in _PUT_METHODS else 0
    return func.value.id if arity and len(call.args) == arity else None


def empty_container(value: ast.expr) -> bool:
    """Return whether ``value`` is an empty list, dict or set (``[]``, ``{}``, ``set()``, ``deque()``)."""
    if isinstance(value, ast.List | ast.Set | ast.Tuple):
        return not value.elts
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _EMPTY_BUILDERS
    return False


def sole_kinds(
    body: list[ast.AST],
    bindings: Iterable[tuple[str, ast.expr]],
    kind_of: Callable[[ast.expr], K | None],
    neutral: Callable[[ast.expr], bool] = lambda _value: False,
) -> dict[str, K]:
    """Return the names that ``bindings`` bind only to values of one kind, with that kind.

    A name also bound in ``body`` any other way (a loop target, a parameter of
    a nested ``def``, a value ``kind_of`` gives no kind and that is not
    ``neutral``), or bound to two kinds, could be anything, so it is none. A
    ``neutral`` value (None, for a receipt) is no kind, and allowed.
    """
    kinds: dict[str, set[K]] = {}
    counted: Counter[str] = Counter()
    for name, value in bindings:
        kind = kind_of(value)
        if kind is not None:
            kinds.setdefault(name, set()).add(kind)
        if kind is not None or neutral(value):
            counted[name] += 1
    binds = Counter(name for node in body for name in bound_names(node))
    return {
        name: next(iter(found))
        for name, found in kinds.items()
        if len(found) == 1 and binds[name] == counted[name]
    }


def verb_event(expr: ast.expr) -> str | None:
    """Return the event of ``engine.verb("pin")`` (any receiver), or None for anything else."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)):
        return None
    if expr.func.attr != "verb" or len(expr.args) + len(expr.keywords) != 1:
        return None
    if expr.args:
        return string_constant(expr.args[0])
    keyword = expr.keywords[0]
    return string_constant(keyword.value) if keyword.arg == "event" else None


def is_none(expr: ast.expr) -> bool:
    """Return whether ``expr`` is the literal ``None``."""
    return isinstance(expr, ast.Constant) and expr.value is None


def string_constant(expr: ast.expr | None) -> str | None:
    """Return the value of a string literal, or None for any other expression."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    return None


def branch_tests(node: ast.AST) -> list[ast.expr]:
    """Return the tests that decide which code of ``node`` runs, if it is a branch.

    The test of an ``if`` and the guard of a ``case``; the test of a
    conditional expression, and the leading operands of a boolean operation,
    when the code they guard calls something (``x.protect_host() if c else
    None``, ``c and x.protect_host()``).
    """
    if isinstance(node, ast.If):
        return [node.test]
    if isinstance(node, ast.match_case):
        return [] if node.guard is None else [node.guard]
    if isinstance(node, ast.IfExp) and conditional_effects(node):
        return [node.test]
    if isinstance(node, ast.BoolOp) and conditional_effects(node):
        return list(node.values[:-1])
    return []


def conditional_effects(node: ast.IfExp | ast.BoolOp) -> bool:
    """Return whether the code that ``node`` runs only on some outcomes calls, awaits or yields."""
    guarded = [node.body, node.orelse] if isinstance(node, ast.IfExp) else node.values[1:]
    return any(calls_anything(part) for part in guarded)


def calls_anything(node: ast.AST) -> bool:
    """Return whether ``node`` calls, awaits or yields anything outside nested functions."""
    return any(
        isinstance(sub, ast.Call | ast.Await | ast.Yield | ast.YieldFrom)
        for sub in walk_same_scope(node)
    )


def test_fact(test: ast.expr) -> tuple[str, bool]:
    """Return a branch test as (normalized text, outcome): ``not x`` is (``x``, False)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        text, outcome = test_fact(test.operand)
        return text, not outcome
    if isinstance(test, ast.NamedExpr):  # (lock := cache.lock(node)) tests lock, once bound
        return test_fact(test.target)
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.NamedExpr):
        test = ast.Compare(test.left.target, test.ops, test.comparators)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        flipped = {ast.IsNot: ast.Is(), ast.NotEq: ast.Eq(), ast.NotIn: ast.In()}
        op = flipped.get(type(test.ops[0]))
        if op is not None:
            positive = ast.Compare(test.left, [op], test.comparators)
            return ast.unparse(positive), False
    return ast.unparse(test), True


def none_test(name: str) -> str:
    """Return the normalized test of ``name is None`` (and of ``name is not None``)."""
    return f"{name} is None"


def texts_of(node: ast.AST) -> frozenset[str]:
    """Return the plain texts of the names and attributes read in ``node``."""
    return frozenset(
        ast.unparse(sub) for sub in ast.walk(node) if isinstance(sub, ast.Name | ast.Attribute)
    )


def root_name(expr: ast.expr) -> str | None:
    """Return the variable an attribute/subscript/call chain starts from, if any."""
    while isinstance(expr, ast.Attribute | ast.Subscript | ast.Call | ast.Starred):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def loop_bindings(loop: ast.For | ast.AsyncFor | ast.While, scope: Scope) -> dict[str, str]:
    """Return what each name that varies per iteration stands for inside ``loop``.

    The target of ``for node in nodes`` stands for ``nodes[*]``, so a loop that
    pins each node pairs with a later loop that releases each node. Other names
    rebound in the body (and tuple targets) stand for ``name[*]``.
    """
    varying = {name for stmt in loop.body for name in bound_names(stmt)}
    bindings = {name: f"{name}{ELEMENT}" for name in varying}
    if isinstance(loop, ast.While):
        return bindings
    bindings.update(element_bindings(loop.target, loop.iter, scope))
    return bindings


def element_bindings(target: ast.expr, iterable: ast.expr, scope: Scope) -> dict[str, str]:
    """Return what the names of a ``for`` target stand for, one element of ``iterable`` each.

    ``node`` of ``for node in nodes`` stands for ``nodes[*]``; so does ``node``
    of ``for i, node in enumerate(nodes)`` and of ``for node, op in zip(nodes,
    ops)`` (where ``op`` stands for ``ops[*]``). Other names stand for ``name[*]``.
    """
    iterable = unwrap(iterable)
    if isinstance(target, ast.Name):
        return {target.id: f"{scope.canon(iterable)}{ELEMENT}"}
    sources = _zipped(target, iterable)
    if not isinstance(target, ast.Tuple | ast.List) or sources is None:
        return {name: f"{name}{ELEMENT}" for name in target_names(target)}
    bindings: dict[str, str] = {}
    for element, source in zip(target.elts, sources, strict=True):
        if source is None:
            bindings.update({name: f"{name}{ELEMENT}" for name in target_names(element)})
        else:
            bindings.update(element_bindings(element, source, scope))
    return bindings


def _zipped(target: ast.expr, iterable: ast.expr) -> list[ast.expr | None] | None:
    """Return the iterable each element of a tuple target comes from, if known.

    ``i, node`` over ``enumerate(nodes)`` is ``[None, nodes]`` (the index comes
    from no collection); ``a, b`` over ``zip(xs, ys)`` is ``[xs, ys]``.
    """
    if not isinstance(target, ast.Tuple | ast.List) or not isinstance(iterable, ast.Call):
        return None
    func, args = iterable.func, iterable.args
    if not isinstance(func, ast.Name) or any(isinstance(a, ast.Starred) for a in args):
        return None
    if func.id == "enumerate" and len(target.elts) == 2 and len(args) >= 1:
        return [None, args[0]]
    if func.id == "zip" and len(target.elts) == len(args) and _only_strict(iterable.keywords):
        return list(args)
    return None


def _only_strict(keywords: list[ast.keyword]) -> bool:
    """Return whether ``zip``'s keywords are at most ``strict=``, which pairs the same elements."""
    return all(keyword.arg == "strict" for keyword in keywords)


def unwrap(expr: ast.expr) -> ast.expr:
    """Strip order-only wrappers: ``reversed(nodes)`` iterates the same nodes.

    ``table.values()`` iterates the elements of ``table`` too: those that
    ``table[k] = x`` puts there.
    """
    while isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Name) and func.id in _WRAPPERS and len(expr.args) == 1:
            expr = expr.args[0]  # sorted(nodes, key=...) too
        elif isinstance(func, ast.Attribute) and func.attr == "values" and not expr.args:
            expr = func.value
        else:
            break
    return expr


def bound_names(node: ast.AST) -> Iterator[str]:
    """Yield the names bound in ``node`` outside nested functions and classes."""
    for sub in walk_same_scope(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            yield sub.id
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield sub.name


def target_names(target: ast.expr) -> Iterator[str]:
    """Yield the names an assignment target binds."""
    for sub in ast.walk(target):
        if isinstance(sub, ast.Name):
            yield sub.id


def walk_same_scope(node: ast.AST) -> Iterator[ast.AST]:
    """Walk ``node`` without entering nested functions, lambdas or classes."""
    yield node
    if isinstance(node, _BOUNDARIES):
        return
    for child in ast.iter_child_nodes(node):
        yield from walk_same_scope(child)
