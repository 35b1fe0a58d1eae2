"""Properties of the path analysis over generated function bodies.

Bodies mix calls that may raise, returns, raises, branches, loops with
``break``/``continue``, ``try``/``except``/``finally`` and ``with``; none of
them touches the pinned node, so whatever they do:

- a pin released in a ``finally`` around the body is never reported;
- a pin never released is reported exactly once, at the pin, as a leak.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_cache.audit import AuditConfig, check_source


Block = list[str]

SIMPLE = st.sampled_from(["work()", "x = 1", "return", "raise RuntimeError()", "log.debug('x')"])


def indent(block: Block) -> Block:
    return [f"    {line}" for line in block]


def blocks(depth: int, in_loop: bool) -> st.SearchStrategy[Block]:
    """Return a strategy for a non-empty block of statements."""
    simple = (SIMPLE | st.sampled_from(["break", "continue"])) if in_loop else SIMPLE
    statement = simple.map(lambda line: [line])
    if depth > 0:
        inner = blocks(depth - 1, in_loop)
        looped = blocks(depth - 1, True)
        statement = st.one_of(
            statement,
            st.tuples(inner, inner).map(lambda b: ["if c:", *indent(b[0]), "else:", *indent(b[1])]),
            looped.map(lambda b: ["for item in items:", *indent(b)]),
            looped.map(lambda b: ["while c:", *indent(b)]),
            st.tuples(inner, inner).map(
                lambda b: ["try:", *indent(b[0]), "except ValueError:", *indent(b[1])]
            ),
            st.tuples(inner, inner).map(
                lambda b: ["try:", *indent(b[0]), "finally:", *indent(b[1])]
            ),
            inner.map(lambda b: ["with ctx():", *indent(b)]),
        )
    return st.lists(statement, min_size=1, max_size=3).map(
        lambda parts: [line for part in parts for line in part]
    )


def function(lines: Block) -> str:
    return "\n".join(["def f(node, items, c, ctx, log):", *indent(lines)]) + "\n"


@settings(max_examples=150, deadline=None)
@given(blocks(3, in_loop=False))
def test_a_pin_released_in_finally_is_never_reported(body: Block) -> None:
    lines = ["node.protect_host()", "try:", *indent(body), "finally:", "    node.release_host()"]
    assert check_source(function(lines), "m.py", AuditConfig()) == []


@settings(max_examples=150, deadline=None)
@given(blocks(3, in_loop=False))
def test_a_pin_never_released_is_reported_once_at_the_pin(body: Block) -> None:
    findings = check_source(function(["node.protect_host()", *body]), "m.py", AuditConfig())
    assert [(f.line, f.col) for f in findings] == [(2, 5)]
    assert findings[0].code in {"FSM101", "FSM104"}
