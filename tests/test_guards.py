"""The guard, update and condition grammar: parsing, evaluation, rendering, every error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm_cache.spec.guards import (
    NO_UPDATE,
    TRUE,
    Assign,
    Comparison,
    Condition,
    GrammarError,
    Guard,
    Update,
    parse_condition,
    parse_guard,
    parse_update,
)


NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda n: n != "and")
COMPARISONS = st.builds(
    Comparison, NAMES, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), st.integers(-50, 50)
)
ASSIGNS = st.builds(Assign, NAMES, st.sampled_from(["+=", "-=", "="]), st.integers(0, 50))


def test_guard_parses_conjunctions_and_renders_canonically() -> None:
    guard = parse_guard("pins>=1   and locks == 0")
    assert guard == Guard((Comparison("pins", ">=", 1), Comparison("locks", "==", 0)))
    assert str(guard) == "pins >= 1 and locks == 0"
    assert guard.counters() == {"pins", "locks"}
    assert guard.constants() == [1, 0]


def test_empty_guard_is_true_and_falsy() -> None:
    assert parse_guard("  ") is TRUE
    assert TRUE.holds({})
    assert not TRUE
    assert str(TRUE) == ""


@pytest.mark.parametrize(
    ("text", "counters", "expected"),
    [
        ("n == 1", {"n": 1}, True),
        ("n != 1", {"n": 1}, False),
        ("n < 0", {"n": -1}, True),
        ("n <= -2", {"n": -1}, False),
        ("n > 2 and m >= 3", {"n": 3, "m": 3}, True),
        ("n > 2 and m >= 3", {"n": 3, "m": 2}, False),
    ],
)
def test_guard_holds(text: str, counters: dict[str, int], expected: bool) -> None:
    assert parse_guard(text).holds(counters) is expected


@given(st.lists(COMPARISONS, min_size=1, max_size=4))
def test_guard_round_trips_through_its_text(terms: list[Comparison]) -> None:
    guard = Guard(tuple(terms))
    assert parse_guard(str(guard)) == guard


@given(st.lists(ASSIGNS, min_size=1, max_size=4, unique_by=lambda a: a.counter))
def test_update_round_trips_through_its_text(assigns: list[Assign]) -> None:
    update = Update(tuple(assigns))
    assert parse_update(str(update)) == update


def test_update_applies_all_assignments_to_a_copy() -> None:
    update = parse_update("pins += 2, locks -= 1, n = 7")
    before = {"pins": 1, "locks": 1, "n": 0, "other": 5}
    assert update.apply(before) == {"pins": 3, "locks": 0, "n": 7, "other": 5}
    assert before == {"pins": 1, "locks": 1, "n": 0, "other": 5}
    assert update.counters() == {"pins", "locks", "n"}
    assert [a.delta() for a in update.assigns] == [2, -1, 0]
    assert str(update) == "pins += 2, locks -= 1, n = 7"


def test_empty_update_changes_nothing() -> None:
    assert parse_update("") is NO_UPDATE
    assert not NO_UPDATE
    assert NO_UPDATE.apply({"n": 3}) == {"n": 3}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("device in [absent]", Condition("self", "device", ("absent",))),
        (
            "parent device in [absent, loading]",
            Condition("parent", "device", ("absent", "loading")),
        ),
        (
            "any  child host in [ writing ,backed ]",
            Condition("child", "host", ("writing", "backed")),
        ),
    ],
)
def test_condition_scopes(text: str, expected: Condition) -> None:
    assert parse_condition(text) == expected
    assert parse_condition(str(expected)) == expected


def test_condition_renders_its_scope() -> None:
    assert str(Condition("child", "host", ("a", "b"))) == "any child host in [a, b]"
    assert str(Condition("parent", "device", ("absent",))) == "parent device in [absent]"
    assert str(Condition("self", "device", ("absent",))) == "device in [absent]"


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("pins >= one", "pins >= one"),
        ("pins => 1", "pins => 1"),
        ("pins >= 1 and", ""),
        ("pins >= 1 or locks == 0", "pins >= 1 or locks == 0"),
        ("1 <= pins", "1 <= pins"),
        ("pins >= 1.5", "pins >= 1.5"),
    ],
)
def test_guard_grammar_errors(text: str, bad: str) -> None:
    with pytest.raises(GrammarError) as info:
        parse_guard(text)
    assert str(info.value) == (f"expected COUNTER OP INT (OP one of == != < <= > >=), got {bad!r}")


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("pins ++", "pins ++"),
        ("pins += -1", "pins += -1"),
        ("pins *= 2", "pins *= 2"),
        ("pins += 1,", ""),
        ("pins += 1; locks -= 1", "pins += 1; locks -= 1"),
    ],
)
def test_update_grammar_errors(text: str, bad: str) -> None:
    with pytest.raises(GrammarError) as info:
        parse_update(text)
    assert str(info.value) == (
        f"expected COUNTER += INT, COUNTER -= INT or COUNTER = INT, got {bad!r}"
    )


def test_update_assigning_a_counter_twice_is_an_error() -> None:
    with pytest.raises(GrammarError) as info:
        parse_update(" pins += 1, pins -= 1 ")
    assert str(info.value) == "a counter is assigned twice in 'pins += 1, pins -= 1'"


@pytest.mark.parametrize(
    "text",
    [
        "device absent",
        "device in absent",
        "device in []",
        "device in [absent,]",
        "device in [1abc]",
        "grandparent device in [absent]",
        "every child host in [backed]",
    ],
)
def test_condition_grammar_errors(text: str) -> None:
    with pytest.raises(GrammarError) as info:
        parse_condition(text)
    assert str(info.value) == f"expected [parent|any child] REGION in [STATE, ...], got {text!r}"


def test_grammar_error_is_a_value_error() -> None:
    assert issubclass(GrammarError, ValueError)


@given(
    op=st.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
    value=st.integers(-3, 40),
)
def test_a_comparison_turns_last_at_the_count_from_which_it_answers_alike(
    op: str, value: int
) -> None:
    """Every count from the last turn up answers alike; the turn (if any) otherwise than the one below."""
    term = Comparison("x", op, value)
    turn = term.turns_at()
    steady = term.holds({"x": turn})
    assert all(term.holds({"x": v}) == steady for v in range(turn, max(turn, value) + 3))
    if turn:
        assert term.holds({"x": turn - 1}) != steady


@pytest.mark.parametrize(
    ("text", "turn"),
    [
        ("x >= 8", 8),
        ("x > 8", 9),
        ("x <= 1", 2),
        ("x < 1", 1),
        ("x == 0", 1),
        ("x >= 0", 0),
        ("x == 2", 3),  # turns at 2 and again at 3: read where x >= 2, only 3 answers otherwise
        ("x != 1", 2),
        ("x == -1", 0),
    ],
)
def test_where_a_comparison_turns(text: str, turn: int) -> None:
    (term,) = parse_guard(text).terms
    assert term.turns_at() == turn
