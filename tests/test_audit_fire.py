"""The audit pairs events fired through the engine's generic entry points.

``engine.fire(rec, "pin")``, HiCache's ``cache.fire("pin", node)`` and
``engine.verb("pin")(rec)`` are calls of ``pin`` as much as ``pool.pin(rec)``.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from fsm_cache.audit import AuditConfig, Pair, check_source, register


CONN = AuditConfig(pairs=(Pair("acquire", "release"),))
PIN = AuditConfig(pairs=(Pair("pin", "release"),))
LEAK = "is not released or handed on when the function returns at line"


def audit(source: str, config: AuditConfig = CONN) -> list[str]:
    """Return ``line:col: CODE message [function]`` for each finding in ``source``."""
    found = check_source(textwrap.dedent(source), "m.py", config)
    return [f"{f.line}:{f.col}: {f.code} {f.message} [{f.function}]" for f in found]


def test_engine_fire_with_a_literal_event_is_that_events_call() -> None:
    assert audit("""
        def f(engine, conn, q):
            engine.fire(conn, "acquire")
            if q is None:
                return None
            engine.fire(conn, "release")
    """) == [f"3:5: FSM101 acquire() on 'conn' {LEAK} 5 [f]"]


def test_hicache_fire_names_the_event_first() -> None:
    assert audit(
        """
        def f(cache, node):
            cache.fire("pin", node)
            if node.evicted:
                return None
            cache.fire("release", node)
        """,
        PIN,
    ) == [f"3:5: FSM101 pin() on 'node' {LEAK} 5 [f]"]


def test_fire_pairs_with_the_named_call_and_the_event_keyword() -> None:
    assert not audit("""
        def f(self, engine, pool, conn):
            engine.fire(conn, event="acquire")
            try:
                conn.ping()
            finally:
                pool.release(conn)
    """)


def test_a_release_fired_twice_is_a_double_release() -> None:
    assert audit(
        """
        def f(cache, node):
            cache.pin(node)
            cache.fire("release", node)
            cache.fire(event="release", node=node)
        """,
        PIN,
    ) == ["5:5: FSM102 release() on 'node' can run twice: already released at line 4 [f]"]


def test_a_verb_called_at_once_is_its_events_call() -> None:
    assert audit("""
        def f(engine, conn, q):
            engine.verb("acquire")(conn)
            if q is None:
                return None
            engine.verb("release")(conn)
    """) == [f"3:5: FSM101 acquire() on 'conn' {LEAK} 5 [f]"]


def test_a_name_bound_to_a_verb_calls_its_event() -> None:
    assert audit("""
        def f(engine, conn, q):
            take = engine.verb("acquire")
            give = engine.verb("release")
            take(conn)
            if q is None:
                return None
            give(conn)
    """) == [f"5:5: FSM101 acquire() on 'conn' {LEAK} 7 [f]"]


def test_a_name_also_bound_to_something_else_is_no_verb() -> None:
    assert not audit("""
        def f(engine, conn, other):
            take = engine.verb("acquire")
            if other:
                take = other
            take(conn)
    """)


def test_an_event_that_is_no_literal_or_no_pair_is_a_call_that_may_raise() -> None:
    hint = "release it in try/finally or hold it with a lease"
    assert audit("""
        def f(engine, conn, event):
            engine.fire(conn, "acquire")
            engine.fire(conn, event)
            engine.fire(conn, "ping")
            engine.fire(conn, "release")
    """) == [f"3:5: FSM104 acquire() on 'conn' leaks if line 4 raises; {hint} [f]"]


def test_a_callback_that_fires_the_release_takes_the_resource() -> None:
    assert not audit("""
        def f(engine, conn, loop):
            engine.fire(conn, "acquire")
            loop.call_soon(lambda: engine.fire(conn, "release"))
    """)


def test_a_pair_implementation_that_fires_its_event_is_not_audited_for_it() -> None:
    assert not audit("""
        class Pool:
            def acquire(self, conn):
                self.engine.fire(conn, "acquire")

            def release(self, conn):
                self.engine.fire(conn, "release")
    """)


def test_the_cli_reports_a_pin_leaked_through_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "user.py"
    source.write_text(
        textwrap.dedent("""
            def via_engine(engine, conn, q):
                engine.fire(conn, "acquire")
                if q is None:
                    return None
                engine.fire(conn, "release")
        """),
        encoding="utf-8",
    )
    parser = argparse.ArgumentParser(prog="fsm-cache")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", str(source), "--pair", "acquire:release"])
    status = args.handler(args)
    out, err = capsys.readouterr()
    assert (status, err) == (1, "")
    assert out == f"{source}:3:5: FSM101 acquire() on 'conn' {LEAK} 5 [via_engine]\n"
