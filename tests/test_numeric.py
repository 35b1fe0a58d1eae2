"""The package's one rule for numbers it is given: ints, reals and indices, never a bool."""

from __future__ import annotations

import ast
import enum
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import fsm_cache
from fsm_cache.numeric import as_index, finite, real, shown, whole


class Level(enum.IntEnum):
    """An int subclass, as a caller's configuration may hold."""

    LOW = 1
    HIGH = 7


@pytest.mark.parametrize(
    ("value", "least", "taken"),
    [
        (0, 0, True),
        (5, 5, True),
        (4, 5, False),
        (-1, 0, False),
        (-3, None, True),
        (10**30, 1, True),
        (Level.HIGH, 1, True),  # an int subclass is an int
        (Level.LOW, 2, False),
        (True, 0, False),  # a bool is not, whatever the bound
        (False, 0, False),
        (True, None, False),
        (np.int64(3), 0, False),  # a numpy integer is no Python int: as every site took it
        (2.0, 0, False),  # a whole float is not an int either
        (math.nan, 0, False),
        ("3", 0, False),
        (None, None, False),
        (Fraction(4, 1), 0, False),
    ],
)
def test_whole_takes_ints_of_at_least_least_and_no_bool(
    value: object, least: int | None, taken: bool
) -> None:
    assert whole(value, least) is taken


def test_whole_defaults_to_counts() -> None:
    assert (whole(0), whole(-1), whole(False)) == (True, False, False)


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        (0, True),
        (-2, True),
        (2.5, True),
        (math.inf, True),  # the callers bound it themselves
        (math.nan, True),
        (np.float64(1.5), True),  # a float subclass
        (Level.HIGH, True),
        (True, False),
        (False, False),
        (np.int64(3), False),  # neither int nor float: as the sites took it
        ("1.0", False),
        (None, False),
        (1j, False),
    ],
)
def test_real_takes_ints_and_floats_and_no_bool(value: object, taken: bool) -> None:
    assert real(value) is taken


@pytest.mark.parametrize(
    ("value", "index"),
    [
        (3, 3),
        (-4, -4),
        (Level.HIGH, 7),
        (np.int64(5), 5),
        (np.uint8(255), 255),
        (torch.tensor(6), 6),
        (torch.tensor([2]), 2),
        (True, None),
        (np.True_, None),
        (torch.tensor(True), None),  # its __index__ gives 1
        (torch.tensor([False]), None),
        (2.0, None),
        (np.float64(2.0), None),
        (torch.tensor(2.0), None),
        (torch.tensor([1, 2]), None),
        ("3", None),
        (None, None),
    ],
)
def test_as_index_is_the_int_a_value_stands_for_and_no_bool(
    value: object, index: int | None
) -> None:
    found = as_index(value)
    assert found == index
    assert found is None or type(found) is int


def _checks_bool(node: ast.AST) -> bool:
    """Whether ``node`` (or the operand of a ``not``) is ``isinstance(x, bool)``."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node = node.operand
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Name)
        and node.args[1].id == "bool"
    )


def _checks_int(node: ast.AST) -> bool:
    """Whether ``node`` (or the operand of a ``not``) is ``isinstance(x, int)`` or of a tuple with int."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node = node.operand
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if node.func.id != "isinstance" or len(node.args) != 2:
        return False
    kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
    return any(isinstance(k, ast.Name) and k.id == "int" for k in kinds)


def test_no_module_spells_the_rule_by_hand() -> None:
    # "an int, and not a bool" written out again is a second copy of the rule
    package = Path(fsm_cache.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "numeric.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.BoolOp)
                and any(map(_checks_bool, node.values))
                and any(map(_checks_int, node.values))
            ):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert found == []


def test_finite_is_a_real_a_float_holds_and_shown_names_one_it_cannot_by_size() -> None:
    """``math.isfinite(10**400)`` raises OverflowError, and ``repr(10**5000)`` ValueError."""
    assert [finite(v) for v in (0, -3, 2.5, np.float64(1.0), 10**300)] == [True] * 5
    assert [finite(v) for v in (math.nan, math.inf, 10**400, -(10**400), True, "1")] == [False] * 6
    assert [shown(v) for v in (2.5, "x", None)] == ["2.5", "'x'", "None"]
    assert shown(10**400) == "an int of 1329 bits"
    assert shown(10**5000) == "an int of 16610 bits"
