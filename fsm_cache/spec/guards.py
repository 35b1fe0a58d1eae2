"""Guards, updates and conditions: the small expression language of specs.

Guards and updates are data, parsed by a tiny grammar and never ``eval``-ed, so
the validator, the engine's code generator, the contracts and the model
checker can all reason about them::

    guard      := comparison ("and" comparison)*      e.g.  pins >= 1 and locks == 0
    comparison := COUNTER OP INT                        OP in == != < <= > >=
    update     := assign ("," assign)*                  e.g.  pins -= 1
    assign     := COUNTER ("+=" | "-=" | "=") INT
    condition  := [SCOPE] REGION "in" "[" STATE ("," STATE)* "]"
    SCOPE      := "parent" | "any child"

A condition looks at a machine region's state on the same record, on its
parent, or on any of its children (for tree-shaped systems).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


OPS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# re.ASCII: Python's \d takes any script's digits (a fullwidth 4 would read as 4) and its \s
# Unicode spaces; the spec language is ASCII, as its names are.
_COMPARISON = re.compile(rf"^\s*({_NAME})\s*(==|!=|<=|>=|<|>)\s*(-?\d+)\s*$", re.ASCII)
_ASSIGN = re.compile(rf"^\s*({_NAME})\s*(\+=|-=|=)\s*(\d+)\s*$", re.ASCII)
# Python converts at most 4300 digits between int and str; a constant stays well below
# that, so every value the tools derive from one (c + 1, c + step) still prints.
MAX_DIGITS = 1000
_CONDITION = re.compile(
    rf"^\s*(parent\s+|any\s+child\s+)?({_NAME})\s+in\s+\[([^\]]*)\]\s*$", re.ASCII
)


class GrammarError(ValueError):
    """A guard, update or condition does not parse; the message says why."""


@dataclass(frozen=True)
class Comparison:
    """``counter op value``, one conjunct of a guard."""

    counter: str
    op: str
    value: int

    def holds(self, counters: Mapping[str, int]) -> bool:
        """Return whether the comparison holds for these counter values."""
        return OPS[self.op](counters[self.counter], self.value)

    def turns_at(self) -> int:
        """Return the last count at which the comparison's answer turns: it answers alike from there up.

        0 when it answers alike for every count (``pins >= 0``). An equality
        turns twice (``pins == 2`` at 2 and again at 3), and its last turn is
        the one that counts: read where the counter cannot be below 2 (a node
        that two copies in flight pin), it answers otherwise only at 3. A
        search that bounds the counter below this may never see one of its
        answers where it is read.
        """
        # the answer of x OP c can change only at c or at c + 1
        turns = (v for v in (self.value + 1, self.value) if v > 0)
        counter = self.counter
        return next(
            (v for v in turns if self.holds({counter: v}) != self.holds({counter: v - 1})), 0
        )

    def __str__(self) -> str:
        return f"{self.counter} {self.op} {self.value}"


@dataclass(frozen=True)
class Guard:
    """A conjunction of comparisons; the empty guard is always true."""

    terms: tuple[Comparison, ...] = ()

    def holds(self, counters: Mapping[str, int]) -> bool:
        """Return whether every term holds for these counter values."""
        return all(term.holds(counters) for term in self.terms)

    def counters(self) -> set[str]:
        """Return the counters the guard reads."""
        return {term.counter for term in self.terms}

    def constants(self) -> list[int]:
        """Return the constants the guard compares against."""
        return [term.value for term in self.terms]

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __str__(self) -> str:
        return " and ".join(str(term) for term in self.terms)


TRUE = Guard()


@dataclass(frozen=True)
class Assign:
    """``counter op amount`` with op one of ``+=``, ``-=``, ``=``."""

    counter: str
    op: str
    amount: int

    def apply(self, value: int) -> int:
        """Return the counter's value after the assignment."""
        if self.op == "+=":
            return value + self.amount
        if self.op == "-=":
            return value - self.amount
        return self.amount

    def delta(self) -> int:
        """Return the signed change for ``+=``/``-=`` (0 for ``=``)."""
        return {"+=": self.amount, "-=": -self.amount}.get(self.op, 0)

    def __str__(self) -> str:
        return f"{self.counter} {self.op} {self.amount}"


@dataclass(frozen=True)
class Update:
    """A list of assignments applied together; the empty update changes nothing."""

    assigns: tuple[Assign, ...] = ()

    def apply(self, counters: Mapping[str, int]) -> dict[str, int]:
        """Return a new counter mapping with every assignment applied."""
        result = dict(counters)
        for assign in self.assigns:
            result[assign.counter] = assign.apply(counters[assign.counter])
        return result

    def counters(self) -> set[str]:
        """Return the counters the update writes."""
        return {assign.counter for assign in self.assigns}

    def __bool__(self) -> bool:
        return bool(self.assigns)

    def __str__(self) -> str:
        return ", ".join(str(assign) for assign in self.assigns)


NO_UPDATE = Update()


@dataclass(frozen=True)
class Condition:
    """A region's state, looked up on this record, its parent, or any child.

    Attributes:
        scope: ``self``, ``parent`` or ``child`` (meaning: any child).
        region: The machine region whose state is read.
        states: The condition holds when that state is one of these.
    """

    scope: str
    region: str
    states: tuple[str, ...]

    def __str__(self) -> str:
        prefix = {"self": "", "parent": "parent ", "child": "any child "}[self.scope]
        return f"{prefix}{self.region} in [{', '.join(self.states)}]"


def critical_values(constants: Iterable[int], steps: Iterable[int]) -> tuple[int, ...]:
    """Return ascending counter values that meet every class no comparison tells apart.

    ``constants`` are what the counter is compared with (``x OP c``), ``steps``
    the signed amounts updates move it by (``x += k``: ``k``; ``x -= k``: ``-k``).
    A check of one step asks about ``x`` before it (``x OP c``), after it
    (``x + d OP c``, with ``d`` a step or 0 for an untouched counter; ``x = k``
    makes the image a constant) and whether it went negative (``x + d < 0``, so
    0 counts as a constant). Each such atom is ``x OP p`` for a *critical point*
    ``p = c - d``; so between two consecutive critical points, and past the last,
    every value of ``x`` answers every atom alike. The critical points >= 0
    (0 is always one) and each point plus one thus meet every class. Each value
    returned is the smallest of its class, so the first counterexample found in
    ascending order is the smallest there is.
    """
    shifts = {0, *steps}
    points = {c - d for c in {0, *constants} for d in shifts if c >= d}
    return tuple(sorted(points | {p + 1 for p in points}))


def parse_guard(text: str) -> Guard:
    """Parse ``pins >= 1 and locks == 0`` into a :class:`Guard`.

    Raises:
        GrammarError: A conjunct is not ``COUNTER OP INT``.
    """
    if not text.strip():
        return TRUE
    terms = []
    for part in re.split(r"\band\b", text):
        match = _COMPARISON.match(part)
        if match is None:
            msg = f"expected COUNTER OP INT (OP one of == != < <= > >=), got {part.strip()!r}"
            raise GrammarError(msg)
        terms.append(Comparison(match[1], match[2], _integer(match[3])))
    return Guard(tuple(terms))


def parse_update(text: str) -> Update:
    """Parse ``pins += 1, locks = 0`` into an :class:`Update`.

    Raises:
        GrammarError: An assignment is not ``COUNTER (+=|-=|=) INT`` or a counter repeats.
    """
    if not text.strip():
        return NO_UPDATE
    assigns = []
    for part in text.split(","):
        match = _ASSIGN.match(part)
        if match is None:
            msg = f"expected COUNTER += INT, COUNTER -= INT or COUNTER = INT, got {part.strip()!r}"
            raise GrammarError(msg)
        assigns.append(Assign(match[1], match[2], _integer(match[3])))
    names = [assign.counter for assign in assigns]
    if len(set(names)) != len(names):
        msg = f"a counter is assigned twice in {text.strip()!r}"
        raise GrammarError(msg)
    return Update(tuple(assigns))


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_DIGITS:
        msg = f"an integer has {digits} digits, more than {MAX_DIGITS}"
        raise GrammarError(msg)
    return int(text)


def parse_condition(text: str) -> Condition:
    """Parse ``parent device in [absent]`` into a :class:`Condition`.

    Raises:
        GrammarError: The text is not ``[parent|any child] REGION in [STATE, ...]``.
    """
    match = _CONDITION.match(text)
    names = [name.strip() for name in match[3].split(",")] if match else []
    if match is None or not all(re.fullmatch(_NAME, name) for name in names):
        msg = f"expected [parent|any child] REGION in [STATE, ...], got {text.strip()!r}"
        raise GrammarError(msg)
    scope = (match[1] or "").split()
    return Condition(scope[-1] if scope else "self", match[2], tuple(names))
