"""``fsm-cache verify`` on a contracts module whose contracts its parser does not recognise.

Rows were the postconditions found by their decorator's name (``ensure``), and
CrossHair was given those functions alone: a postcondition declared through an
alias, or a class invariant, beside a recognised one, was never checked, and a
broken one passed the run (exit 0).
"""

from __future__ import annotations

from pathlib import Path

from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.contracts.runner import Options


_OPTIONS = Options(per_condition_timeout=4.0, per_path_timeout=2.0, jobs=1)

_ALIAS = """import icontract
from icontract import ensure as post


@icontract.require(lambda x: 0 <= x <= 10)
@icontract.ensure(lambda result: result >= 0, "f never negative")
def f(x: int) -> int:
    return x


@icontract.require(lambda x: 0 <= x <= 10)
@post(lambda result: result >= 0, "g never negative")
def g(x: int) -> int:
    return -1 if x == 7 else x
"""

_INVARIANT = """import icontract


@icontract.require(lambda x: 0 <= x <= 10)
@icontract.ensure(lambda result: result >= 0, "f never negative")
def f(x: int) -> int:
    return x


@icontract.invariant(lambda self: self.n >= 0, "n never negative")
class Counter:
    def __init__(self) -> None:
        self.n = 0

    def down(self) -> None:
        self.n -= 1
"""

_NAMED_CONDITION = """import icontract


def _never_negative(result: int) -> bool:
    return result >= 0


@icontract.require(lambda x: 0 <= x <= 10)
@icontract.ensure(_never_negative, "never negative")
def h(x: int) -> int:
    return -1 if x == 5 else x
"""


def _verdicts(tmp_path: Path, source: str) -> list[tuple[str, str, str]]:
    path = tmp_path / "mine.py"
    path.write_text(source)
    return [
        (r.function, r.contract, r.verdict()) for r in crosshair_run.prove("mine", path, _OPTIONS)
    ]


def test_an_aliased_postcondition_is_checked_and_its_counterexample_reported(
    tmp_path: Path,
) -> None:
    assert _verdicts(tmp_path, _ALIAS) == [
        ("f", "f never negative", crosshair_run.CONFIRMED),
        ("g", "g never negative", "counterexample: g(7)"),
    ]


def test_a_class_invariant_a_method_breaks_is_a_counterexample(tmp_path: Path) -> None:
    rows = _verdicts(tmp_path, _INVARIANT)
    assert rows[0] == ("f", "f never negative", crosshair_run.CONFIRMED)
    assert ("Counter.down", "n never negative", "counterexample: down(Counter())") in rows


def test_a_named_condition_that_is_false_is_no_raise(tmp_path: Path) -> None:
    """CrossHair reports it on the condition's own line: it was ``h(5) raises "def ..." yields false``."""
    assert _verdicts(tmp_path, _NAMED_CONDITION) == [
        ("h", "never negative", "counterexample: h(5)")
    ]
