"""What the names of one function mean: parameters, locals, loop variables, tests.

The path analysis asks three questions of a function's names: is a container
local (storing into it is not a hand-off), which text stands for a loop
variable (so ``for node in nodes`` pins and releases pair up as ``nodes[*]``),
and which branch tests repeat (only those are worth correlating).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_WRAPPERS = frozenset({"reversed", "list", "sorted", "tuple"})
_BOUNDARIES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass
class Scope:
    """Names of one function, plus the loop variables bound at the current point.

    Attributes:
        params: Parameter names.
        locals: Names bound in the body (not parameters).
        correlated: Normalized branch tests that occur more than once.
        mentions: Test -> the texts of the names and attributes it reads.
        env: Loop variable -> the text it stands for (``nodes[*]``).
    """

    params: frozenset[str]
    locals: frozenset[str]
    correlated: frozenset[str]
    mentions: dict[str, frozenset[str]]
    env: dict[str, str] = field(default_factory=dict)

    def canon(self, expr: ast.expr) -> str:
        """Return the text of ``expr`` with a loop variable replaced by what it stands for."""
        text = ast.unparse(expr)
        root = root_name(expr)
        if root is not None and root in self.env:
            return self.env[root] + text[len(root) :]
        return text

    def texts(self, node: ast.AST) -> frozenset[str]:
        """Return the canonical texts of every name, attribute and subscript in ``node``."""
        return frozenset(
            self.canon(sub)
            for sub in walk_same_scope(node)
            if isinstance(sub, ast.Name | ast.Attribute | ast.Subscript)
        )

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
    tests = [sub.test for node in body for sub in walk_same_scope(node) if isinstance(sub, ast.If)]
    counts = Counter(test_fact(test)[0] for test in tests)
    mentions = {test_fact(test)[0]: texts_of(test) for test in tests}
    correlated = frozenset(test for test, count in counts.items() if count > 1)
    return Scope(params, frozenset(bound - params), correlated, mentions)


def test_fact(test: ast.expr) -> tuple[str, bool]:
    """Return a branch test as (normalized text, outcome): ``not x`` is (``x``, False)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        text, outcome = test_fact(test.operand)
        return text, not outcome
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        flipped = {ast.IsNot: ast.Is(), ast.NotEq: ast.Eq(), ast.NotIn: ast.In()}
        op = flipped.get(type(test.ops[0]))
        if op is not None:
            positive = ast.Compare(test.left, [op], test.comparators)
            return ast.unparse(positive), False
    return ast.unparse(test), True


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
    bindings = {name: f"{name}[*]" for name in varying}
    if isinstance(loop, ast.While):
        return bindings
    if isinstance(loop.target, ast.Name):
        bindings[loop.target.id] = f"{scope.canon(unwrap(loop.iter))}[*]"
    else:
        bindings.update({name: f"{name}[*]" for name in target_names(loop.target)})
    return bindings


def unwrap(expr: ast.expr) -> ast.expr:
    """Strip order-only wrappers: ``reversed(nodes)`` iterates the same nodes."""
    while (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id in _WRAPPERS
        and len(expr.args) == 1
    ):
        expr = expr.args[0]
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
