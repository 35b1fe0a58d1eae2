"""Check a generated contracts module on every representative input, without CrossHair.

A composition of three regions or more (``residency_storage``: host, device and
storage, with rules that read the parent and the children) has more paths than
CrossHair explores within its pinned budget: it leaves those contracts at "no
counterexample within budget". Their inputs, though, are finite: every
parameter of a generated function is a state (an enum, or ``None`` for an
absent parent or child) or a counter, and each counter's exact representatives
(:func:`fsm_cache.spec.validate.representatives`: the critical values of every
guard, invariant and forbid that reads it, which say why they stand for every
value) cover every class of values a check tells apart. Calling each function
on the product of those domains (a neighbour's states taken together, all
``None`` or none, as a precondition has it), with its preconditions as filters, and
evaluating each postcondition on the result is therefore a complete check of
the same contracts CrossHair would prove. One row per postcondition: confirmed
on every representative input, or the first counterexample found.

The representatives are the spec's; the code under test is what is in
doubt. So every integer the module's code compares a counter with joins that
counter's values too (:func:`code_constants`): code that tests a counter
against a constant the spec never names (``pins == 9``) is still called on
both sides of its test, where the spec's values alone would never reach 9.
An input on which the code raises is a counterexample to each contract, as
CrossHair reports it, not a traceback.
"""

from __future__ import annotations

import ast
import enum
import importlib.util
import inspect
import itertools
import math
import operator
import sys
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsm_cache.contracts.generate import NEIGHBOURS, parameter
from fsm_cache.contracts.runner import COUNTEREXAMPLE, NOT_ANALYSED, Row, contracts, parse_module
from fsm_cache.errors import FsmCacheError
from fsm_cache.spec.machine import System
from fsm_cache.spec.validate import representatives


CONFIRMED_EVERY_INPUT = "confirmed on every representative input"

MAX_INPUTS = 1_000_000
"""The most inputs one function is called with; a larger domain is not analysed."""


def counter_domains(system: System) -> dict[str, tuple[int, ...]]:
    """Return each counter's representative values, composition forbids' guards included."""
    extra = [f.guard for f in system.forbids]
    domains: dict[str, tuple[int, ...]] = {}
    for _, machine in system.regions:
        domains.update(representatives(machine, *extra))
    return domains


def check_module(
    target: str,
    path: Path,
    counters: Mapping[str, Sequence[int]],
    functions: Collection[str] | None = None,
) -> list[Row]:
    """Call every contracted function of the module at ``path`` on every representative input.

    Args:
        target: The name rows are reported under (the spec's).
        path: A module written by :mod:`fsm_cache.contracts.generate`.
        counters: Per counter parameter, the values standing for all of them;
            the constants the module's code compares each with are added
            (:func:`widened`).
        functions: The functions to check, of those the module contracts; all when None.

    Raises:
        FsmCacheError: The module cannot be imported.
    """
    counters = widened(counters, path)
    module = _load(path)
    together = getattr(module, NEIGHBOURS, {})
    rows: list[Row] = []
    for name in dict.fromkeys(c.function for c in contracts(path)):
        if functions is None or name in functions:
            rows += _check_function(target, getattr(module, name), counters, together.get(name, ()))
    return rows


def input_counts(
    path: Path, counters: Mapping[str, Sequence[int]], functions: Collection[str]
) -> dict[str, int]:
    """Return how many inputs :func:`check_module` calls each of ``functions`` with.

    The count is the one a row of it reports, and the one compared with
    :data:`MAX_INPUTS`; nothing is called.

    Raises:
        FsmCacheError: The module cannot be imported.
    """
    counters = widened(counters, path)
    module = _load(path)
    together = getattr(module, NEIGHBOURS, {})
    return {
        name: _size(_axes(getattr(module, name), counters, together.get(name, ()))[1])
        for name in functions
    }


def widened(counters: Mapping[str, Sequence[int]], path: Path) -> dict[str, tuple[int, ...]]:
    """Return ``counters`` with each constant ``k`` the module compares a counter with, and ``k + 1``.

    A test ``x OP k`` splits the values of ``x`` at ``k``: ``k`` and ``k + 1``
    (with the values below, which start at 0) meet each side of it.
    """
    found = code_constants(path, counters)
    return {
        name: tuple(sorted({*values, *(v for k in found[name] for v in (k, k + 1) if v >= 0)}))
        for name, values in counters.items()
    }


def code_constants(path: Path, counters: Iterable[str]) -> dict[str, set[int]]:
    """Return, per counter, the integers the module at ``path`` compares it with.

    A counter is read as ``c_<name>`` (the engine's locals), ``<name>`` (a
    contract's parameter) or ``<anything>.<name>`` (a record's field); the
    integer is a literal on the other side of the comparison, or in a literal
    tuple, list or set an ``in`` test reads.
    """
    found: dict[str, set[int]] = {name: set() for name in counters}
    for node in ast.walk(parse_module(path)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, b in itertools.pairwise(operands):
            for side, other in ((a, b), (b, a)):
                for name in _counters(side, found):
                    found[name] |= _integers(other)
    return found


def _counters(node: ast.expr, counters: Mapping[str, object]) -> set[str]:
    """Return the counters ``node`` may read (a counter ``c_x`` beside ``x``: both, harmlessly)."""
    if isinstance(node, ast.Attribute):
        names = {node.attr}
    elif isinstance(node, ast.Name):
        names = {node.id, node.id.removeprefix("c_")}
    else:
        return set()
    return {name for name in names if name in counters}


def _integers(node: ast.expr) -> set[int]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError):  # not a literal: a name, a call
        return set()
    values = value if isinstance(value, tuple | list | set | frozenset) else (value,)
    return {v for v in values if type(v) is int}


_LOADS = itertools.count()
"""Numbers each module :func:`_load` imports, so that no two share a name in ``sys.modules``."""


def _load(path: Path) -> Any:
    """Import the module at ``path`` under a name of its own, registered while it runs.

    Two loads may overlap (two threads verifying specs, a run's targets
    being verified side by side), and the file stem is the spec's name
    (``contracts_<spec>``), which two specs may share (a negative control's
    is ``host_residency``): under the stem alone, one load's entry was
    replaced by the other's, then removed with it, and the first's ``del``
    raised ``KeyError``.
    """
    name = f"_fsm_cache_exhaustive_{path.stem}_{next(_LOADS)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FsmCacheError(f"verify: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in the module look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _check_function(
    target: str,
    func: Callable[..., Any],
    counters: Mapping[str, Sequence[int]],
    together: Sequence[Sequence[str]],
) -> list[Row]:
    from icontract._checkers import find_checker

    checker = find_checker(func)
    pre = [c for group in getattr(checker, "__preconditions__", []) for c in group]
    post = list(getattr(checker, "__postconditions__", []))
    params, axes = _axes(func, counters, together)
    size = _size(axes)
    if size > MAX_INPUTS:
        why = f"{size} inputs, more than {MAX_INPUTS}"
        return [Row(target, func.__name__, _text(c), NOT_ANALYSED, why) for c in post]
    found = _Walk(func, params, axes, pre, post).found()
    return [
        Row(target, func.__name__, _text(c), COUNTEREXAMPLE, found[i])
        if i in found
        else Row(target, func.__name__, _text(c), CONFIRMED_EVERY_INPUT, f"{size} inputs")
        for i, c in enumerate(post)
    ]


class _Walk:
    """Call a function on the axes' product, its preconditions as filters; note what breaks.

    An input is a list of the parameters' values, in the signature's order
    (each axis binds a run of them), and the result is appended to it while
    the postconditions are evaluated; each condition reads its arguments out
    of it by position (:func:`_reader`), so no mapping is built per input and
    per condition. The inputs are walked, and each contract's first
    counterexample found, in the order of the axes' product.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        params: Sequence[tuple[str, ...]],
        axes: Sequence[Sequence[tuple[Any, ...]]],
        pre: Sequence[Any],
        post: Sequence[Any],
    ) -> None:
        self.func = func
        self.raw = inspect.unwrap(func)
        self.names = [name for names in params for name in names]
        self.axes = axes
        self.spans: list[tuple[int, int]] = []
        for names in params:
            start = self.names.index(names[0])
            self.spans.append((start, start + len(names)))
        position = {name: i for i, name in enumerate(self.names)}
        self.by_name = not _positional(self.raw, self.names)
        self.checked = [
            [_reader(c, position, None) for c in group] for group in _checked_by_axis(params, pre)
        ]
        self.post = [_reader(c, position, len(self.names)) for c in post]
        self.values: list[Any] = [None] * len(self.names)
        self.broken: dict[int, str] = {}
        self.pending = [(i, *reader) for i, reader in enumerate(self.post)]
        """The postconditions no input has broken yet, by index."""

    def found(self) -> dict[int, str]:
        """Return, per postcondition broken, its first counterexample's text."""
        self._walk(0)
        return self.broken

    def _args(self) -> dict[str, Any]:
        """Return the input ``values`` holds, by parameter (the result appended to it left out)."""
        return dict(zip(self.names, self.values, strict=False))

    def _break(self, i: int, why: str) -> None:
        self.broken[i] = why
        self.pending = [entry for entry in self.pending if entry[0] != i]

    def _call(self) -> None:
        """Call the function on the input ``values`` holds, and note the contracts it breaks."""
        values = self.values
        try:
            result = self.raw(**self._args()) if self.by_name else self.raw(*values)
        except Exception as exc:  # the code under test raised: no contract holds on this input
            why = f"{_call(self.func.__name__, self._args())} raises {_raised(exc)}"
            for i, *_ in list(self.pending):
                self._break(i, why)
            return
        values.append(result)
        try:
            for i, condition, at, get in self.pending:
                try:  # _reader's three ways, inline: a call less per condition and input
                    if at is not None:
                        held = bool(condition(values[at]))
                    elif get is not None:
                        held = bool(condition(*get(values)))
                    else:
                        held = bool(condition(values))
                except Exception as exc:  # the contract itself raised (its meaning, say)
                    why = f"{_call(self.func.__name__, self._args())}: the contract raises"
                    self._break(i, f"{why} {_raised(exc)}")
                    continue
                if not held:
                    self._break(i, _call(self.func.__name__, self._args()))
        finally:
            values.pop()

    def _walk(self, axis: int) -> bool:
        """Call on every input past the axes bound so far; False once every contract has failed."""
        if axis == len(self.axes):
            self._call()
            return bool(self.pending)
        start, stop = self.spans[axis]
        values = self.values
        checked = self.checked[axis]
        last = axis + 1 == len(self.axes)
        for bound in self.axes[axis]:
            values[start:stop] = bound
            for condition, at, get in checked:
                if at is not None:
                    held = condition(values[at])
                elif get is not None:
                    held = condition(*get(values))
                else:
                    held = condition(values)
                if not held:
                    break
            else:
                if last:
                    self._call()
                    if not self.pending:
                        return False
                elif not self._walk(axis + 1):
                    return False
        return True


def _positional(func: Callable[..., Any], names: Sequence[str]) -> bool:
    """Return whether calling ``func`` with ``names``' values by position is calling it by name."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no signature to read: call it by name
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters[: len(names)]] == list(names) and all(
        p.kind in kinds for p in parameters[: len(names)]
    )


_Reader = tuple[Callable[..., Any], int | None, Callable[[list[Any]], Any] | None]
"""A condition and where its arguments are in an input's values (:func:`_reader`)."""


def _reader(contract: Any, position: Mapping[str, int], result: int | None) -> _Reader:
    """Return how ``contract`` is evaluated on an input's values (and the result).

    Each argument is read at its parameter's position, the result at
    ``result`` (postconditions only). ``(condition, i, None)``: the
    condition of one argument, ``values[i]``; ``(condition, None, get)``:
    of several, ``*get(values)``; ``(check, None, None)``: ``check(values)``,
    for a condition of none, or one that cannot be called by position or
    reads a name no parameter has (called by name, as :func:`_holds` calls it).
    """
    condition = contract.condition
    names = list(contract.condition_args)
    where = {**position, "result": result} if result is not None else dict(position)
    if not _positional(condition, names) or not all(n in where for n in names):

        def by_name(values: list[Any]) -> bool:
            return _holds(contract, {name: values[i] for name, i in where.items()})

        return by_name, None, None
    at = [where[name] for name in names]
    if not at:
        return lambda _values: condition(), None, None
    if len(at) == 1:
        return condition, at[0], None
    return condition, None, operator.itemgetter(*at)


def _axes(
    func: Callable[..., Any],
    counters: Mapping[str, Sequence[int]],
    together: Sequence[Sequence[str]],
) -> tuple[list[tuple[str, ...]], list[list[tuple[Any, ...]]]]:
    """Return the parameters each axis gives values to, and each axis's values.

    An axis is one parameter, or the states of one neighbour (``together``,
    a run of consecutive parameters, :data:`~fsm_cache.contracts.generate.NEIGHBOURS`):
    all ``None`` or none, as a precondition has it, so the inputs it rules
    out are neither called nor counted. The axes' product walks the inputs
    that remain in the order the parameters' product does, so the first
    counterexample found is the same.
    """
    names, domains = _domains(func, counters)
    domain = dict(zip(names, domains, strict=True))
    first = {group[0]: tuple(group) for group in together}
    grouped = {name for group in together for name in group}
    order: list[tuple[str, ...]] = []
    axes: list[list[tuple[Any, ...]]] = []
    for name in names:
        if name in first:
            group = first[name]
            present = itertools.product(*([v for v in domain[n] if v is not None] for n in group))
            order.append(group)
            axes.append([(None,) * len(group), *present])
        elif name not in grouped:
            order.append((name,))
            axes.append([(value,) for value in domain[name]])
    return order, axes


def _checked_by_axis(params: Sequence[tuple[str, ...]], pre: Sequence[Any]) -> list[list[Any]]:
    """Return, per axis, the preconditions whose last parameter it binds.

    Each is checked once that axis is bound, for every input below it: it
    rules all of them out or none. The inputs every precondition holds on
    are called in the order the axes' product gives them, as when each
    precondition was checked on each input.
    """
    axis_of = {name: axis for axis, names in enumerate(params) for name in names}
    checked: list[list[Any]] = [[] for _ in params]
    for c in pre:
        checked[max((axis_of[a] for a in c.condition_args), default=0)].append(c)
    return checked


def _size(axes: Sequence[Sequence[object]]) -> int:
    return math.prod(len(axis) for axis in axes)


def _domains(
    func: Callable[..., Any], counters: Mapping[str, Sequence[int]]
) -> tuple[list[str], list[Sequence[Any]]]:
    """Return the parameter names and the values each one ranges over.

    A counter's parameter is spelled as :func:`~fsm_cache.contracts.generate.parameter`
    spells it (``_OLD`` for the counter ``OLD``).
    """
    hints = typing.get_type_hints(inspect.unwrap(func))
    names = list(inspect.signature(func).parameters)
    by_param = {parameter(name): values for name, values in counters.items()}
    return names, [_domain(name, hints[name], by_param) for name in names]


def _domain(name: str, hint: Any, counters: Mapping[str, Sequence[int]]) -> Sequence[Any]:
    if hint is int:
        return tuple(counters[name])
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    if members and _is_enum(members[0]):
        return (None, *members[0])
    if _is_enum(hint):
        return tuple(hint)
    raise FsmCacheError(f"verify: parameter {name!r} of type {hint!r} has no finite domain")


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _holds(contract: Any, values: Mapping[str, Any]) -> bool:
    return bool(contract.condition(**{a: values[a] for a in contract.condition_args}))


def _raised(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _text(contract: Any) -> str:
    return str(contract.description or "")


def _call(name: str, args: Mapping[str, Any]) -> str:
    shown = ", ".join(f"{k}={_shown(v)}" for k, v in args.items())
    return f"{name}({shown})"


def _shown(value: Any) -> str:
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)
