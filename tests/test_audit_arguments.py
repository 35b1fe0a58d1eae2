"""A pair may declare which argument of its calls is the resource.

By default a pair call acts on its first argument, else its receiver. A
release that takes leading arguments (``release_layout(event, key)`` after
``acquire_layout(key)``), or an acquire on its receiver passed an option first
(``lock.acquire(timeout=t)``), then pairs the wrong expressions; the pair says
where its resource is instead: ``acquire_layout(key):release_layout(event, key)``,
``acquire(self):release``.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from fsm_cache.audit import (
    Argument,
    AuditConfig,
    AuditError,
    Pair,
    check_source,
    parse_pair,
    register,
)
from fsm_cache.audit.config import ConfigFinder


LAYOUT = "acquire_layout(key):release_layout(event, key)"
LOCK = "acquire(self):release"
LEAK = "is not released or handed on when the function"


def audit(source: str, *pairs: str) -> list[str]:
    """Return ``line:col: CODE message`` for each finding in ``source`` under ``pairs``."""
    config = AuditConfig(pairs=tuple(parse_pair(pair) for pair in pairs))
    found = check_source(textwrap.dedent(source), "m.py", config)
    return [f"{f.line}:{f.col}: {f.code} {f.message}" for f in found]


def test_a_declared_argument_is_parsed_and_written_back() -> None:
    pair = parse_pair(LAYOUT)
    assert pair == Pair(
        "acquire_layout", "release_layout", Argument(("key",)), Argument(("event", "key"))
    )
    assert pair.release_at is not None
    assert (pair.release_at.position, pair.release_at.keyword) == (1, "key")
    assert str(pair) == LAYOUT
    assert parse_pair(LOCK) == Pair("acquire", "release", Argument(("self",)), None)
    assert str(parse_pair("pin( _ , node ):unpin")) == "pin(_, node):unpin"


@pytest.mark.parametrize(
    ("release", "by_default"),
    [
        ("domain.release_layout(event, key)", "event"),
        ("domain.release_layout(event, key=key)", "event"),
        ("domain.release_layout(event=event, key=key)", "event"),
        ("domain.release_layout(key=key, event=event)", None),
        ("release_layout(event, key)", "event"),
    ],
)
def test_a_release_with_a_leading_argument_pairs_its_declared_one(
    release: str, by_default: str | None
) -> None:
    """Declared, the resource is found by position or keyword, in any order; by default
    the first argument was taken, so the lock leaked and an unknown event was released."""
    source = f"""
        def f(domain, key, event):
            domain.acquire_layout(key)
            try:
                domain.fill(key)
            finally:
                {release}
    """
    assert audit(source, LAYOUT) == []
    unpaired = audit(source, "acquire_layout:release_layout")
    assert [line.split(" on ")[1].split("'")[1] for line in unpaired] == (
        ["key", by_default] if by_default else []
    )


def test_a_declared_argument_still_finds_the_wrong_one_released() -> None:
    assert audit(
        """
        def f(domain, key, other, event):
            domain.acquire_layout(key=key)
            domain.release_layout(event, other)
        """,
        LAYOUT,
    ) == [
        f"3:5: FSM101 acquire_layout() on 'key' {LEAK} ends at line 4",
        "4:5: FSM103 release_layout() on 'other' has no acquire_layout() in reach"
        " and no documented hand-off",
    ]


def test_an_option_passed_first_to_a_receiver_acquire_is_not_the_resource() -> None:
    source = """
        def f(lock, t, items):
            lock.acquire(timeout=t)
            try:
                return items.pop()
            finally:
                lock.release()
    """
    assert audit(source, LOCK) == []
    assert audit(source, "acquire:release") == [
        f"3:5: FSM101 acquire() on 't' {LEAK} returns at line 5",
        "7:9: FSM103 release() on 'lock' has no acquire() in reach and no documented hand-off",
    ]
    assert audit(
        """
        def f(lock, t, items):
            lock.acquire(blocking=True, timeout=t)
            if not items:
                return None
            lock.release()
        """,
        LOCK,
    ) == [f"3:5: FSM101 acquire() on 'lock' {LEAK} returns at line 5"]


def test_a_call_that_may_not_pass_the_declared_argument_is_not_counted() -> None:
    """Unpacked arguments may or may not hold it, and a call without it names no resource."""
    assert audit(
        """
        def f(domain, args, options, event):
            domain.release_layout(*args)
            domain.release_layout(event, **options)
            domain.release_layout(event)
            release_layout(key=None)
        """,
        "acquire_layout(key):release_layout(event, key)",
        "pin(self):unpin",
    ) == [
        "6:5: FSM103 release_layout() on 'None' has no acquire_layout() in reach"
        " and no documented hand-off"
    ]
    assert audit("def f(node):\n    pin()\n", "pin(self):unpin") == []


def test_an_event_fired_at_a_record_acts_on_the_record_whatever_the_pair_declares() -> None:
    assert audit(
        """
        def f(engine, rec, t):
            engine.fire(rec, "acquire")
            rec.lock.release()
        """,
        "acquire(self):release(self)",
    ) == [
        f"3:5: FSM101 acquire() on 'rec' {LEAK} ends at line 4",
        "4:5: FSM103 release() on 'rec.lock' has no acquire() in reach and no documented hand-off",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "pin():unpin",
            "bad pair 'pin():unpin': pin(...) must list the argument names up to the resource,"
            " the resource last (pin(event, key)), or be pin(self) for the receiver",
        ),
        (
            "pin:unpin(a, 1)",
            "bad pair 'pin:unpin(a, 1)': unpin(...) must list the argument names up to the"
            " resource, the resource last (unpin(event, key)), or be unpin(self) for the receiver",
        ),
        (
            "pin(node:unpin",
            "bad pair 'pin(node:unpin': pin(...) must list the argument names up to the"
            " resource, the resource last (pin(event, key)), or be pin(self) for the receiver",
        ),
        (
            "pin(self, node):unpin",
            "bad pair 'pin(self, node):unpin': self names pin()'s receiver and stands alone;"
            " list only the arguments a call passes",
        ),
        ("pin(a, a):unpin", "bad pair 'pin(a, a):unpin': pin() names argument 'a' twice"),
        (
            "pin(x).y:unpin",
            "bad pair 'pin(x).y:unpin': pin(...) must list the argument names"
            " up to the resource, the resource last (pin(event, key)), or be pin(self) for the receiver",
        ),
        ("a.b(x):c", "bad pair 'a.b(x):c': expected ACQUIRE:RELEASE, two call names"),
        ("pin(x):pin(y)", "bad pair 'pin(x):pin(y)': the acquire and release names must differ"),
    ],
)
def test_a_bad_argument_list_is_refused(text: str, message: str) -> None:
    with pytest.raises(AuditError) as caught:
        parse_pair(text)
    assert str(caught.value) == message


def test_a_declared_argument_is_read_from_the_pyproject_and_the_pair_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text(f"[tool.fsm_cache.audit]\npairs = [{LAYOUT!r}]\n")
    source = tmp_path / "layouts.py"
    source.write_text(
        "def f(domain, key, event):\n"
        "    domain.acquire_layout(key)\n"
        "    domain.release_layout(event, key)\n"
    )
    assert ConfigFinder().for_file(source).pairs == (parse_pair(LAYOUT),)
    parser = argparse.ArgumentParser(prog="fsm-cache")
    register(parser.add_subparsers(dest="command", required=True))
    runs = []
    for extra in ([], ["--pair", LAYOUT], ["--pair", "acquire_layout:release_layout"]):
        args = parser.parse_args(["audit", str(source), *extra])
        status = args.handler(args)
        runs.append((status, capsys.readouterr().out.count(": FSM10")))
    assert runs == [(0, 0), (0, 0), (1, 2)]
