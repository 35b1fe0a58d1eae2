"""What the argument checks take as a number: an int, a real, an index; never a bool.

``bool`` is a subclass of ``int``, so ``isinstance(True, int)`` holds and
``True`` would pass as a count of one page, a timeout of one second or a
history of one entry. Every layer that checks a number it is given asks
these predicates, so the rule is written once. Each only answers; the
caller raises its own typed error with its own message.

Three forms, for what a site takes:

* :func:`whole`: a Python int (a subclass such as an ``IntEnum`` too), of at
  least a bound. A numpy integer is not one: configuration, specs and
  constructor arguments are plain Python values.
* :func:`as_index`: anything that stands for an int (``operator.index``: a
  numpy integer, a one-element integer tensor), for the values a serving
  engine passes per request, which may come from an array.
* :func:`real`: an int or a float (a numpy float is a float subclass).

:func:`boolean` says whether a value is a bool of any kind, for the checks
that take values by comparison (a page list compared with a run of pages).

A leaf: it imports nothing of ours, nor torch or numpy, so the checked core
may use it and mypyc-compiled modules may call it.
"""

from __future__ import annotations

import math
import operator
from typing import TypeGuard


def whole(value: object, least: int | None = 0) -> TypeGuard[int]:
    """Whether ``value`` is an int of at least ``least`` (any int if ``least`` is None).

    Args:
        value: What the caller was given.
        least: The smallest value taken; None takes negative ints too.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return least is None or value >= least


def real(value: object) -> TypeGuard[float]:
    """Whether ``value`` is an int or a float (NaN and the infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: object) -> TypeGuard[float]:
    """Whether ``value`` is an int or a float that a float can hold, neither NaN nor infinite.

    An int too large for a float passes a comparison with infinity, then
    makes the first float arithmetic with it (``clock() + timeout``, ``pages
    * ratio``) raise ``OverflowError``, as ``math.isfinite`` itself does.
    """
    try:
        return real(value) and math.isfinite(value)
    except OverflowError:
        return False


def shown(value: object) -> str:
    """``repr(value)`` for a message; an int too large for a float by its size.

    Past 4,300 digits an int's ``repr`` raises ``ValueError``, so the
    message refusing it would fail in its place.
    """
    if type(value) is int and not finite(value):
        return f"an int of {value.bit_length()} bits"
    return repr(value)


_BOOL_DTYPES = frozenset({"torch.bool", "bool"})
"""The names of torch's and numpy's bool dtypes."""


def boolean(value: object) -> bool:
    """Whether ``value`` is a bool: Python's, numpy's, or a bool tensor.

    Each equals 0 or 1, so a check by value (``==``, a list index, a
    ``range``) takes it for that number; a check that refuses bools asks this.
    """
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in _BOOL_DTYPES


def as_index(value: object) -> int | None:
    """Return the int ``value`` stands for, or None if it is not an integer (or is a bool).

    Numpy integers and one-element integer tensors stand for their int;
    floats, bools, bool tensors and numpy bools (whose ``__index__`` gives 0
    or 1: numpy 2.2, the newest on Python 3.10, only warns) and the rest do
    not. Read by the dtype's name, so neither torch nor numpy is imported.
    """
    if boolean(value):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return None
