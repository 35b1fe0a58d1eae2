"""A lease taken as a receipt gives its acquire back by its own ``release()``.

``HiCache.lock``/``HiCache.pin`` return a :class:`~fsm_cache.engine.lease.Lease`;
``engine.lease(rec)`` does too. The audit's FSM104 advice is to hold an
acquire with one, so holding it so must not be a finding itself.
"""

from __future__ import annotations

import textwrap

from fsm_cache.audit import AuditConfig, Pair, check_source


LOCK = AuditConfig(pairs=(Pair("lock", "unlock"),))
PIN = AuditConfig(pairs=(Pair("pin", "release"),))
BOTH = AuditConfig(pairs=(Pair("lock", "unlock"), Pair("pin", "release")))


def audit(source: str, config: AuditConfig) -> list[str]:
    """Return ``line:col: CODE message [function]`` for each finding in ``source``."""
    found = check_source(textwrap.dedent(source), "m.py", config)
    return [f"{f.line}:{f.col}: {f.code} {f.message} [{f.function}]" for f in found]


def test_a_receipts_own_release_gives_back_its_acquire() -> None:
    assert not audit(
        """
        def locked(cache, node):
            lock = cache.lock(node)
            try:
                work(node)
            finally:
                lock.release()

        def pinned(cache, node):
            lease = cache.pin(node)
            try:
                work(node)
            finally:
                lease.release()
        """,
        BOTH,
    )


def test_a_receipts_own_release_can_run_twice_and_is_named_as_the_pairs() -> None:
    assert audit(
        """
        def f(cache, node):
            lock = cache.lock(node)
            lock.release()
            lock.release()
        """,
        LOCK,
    ) == ["5:5: FSM102 unlock() on 'lock' can run twice: already released at line 4 [f]"]


def test_a_receipt_released_on_one_path_only_leaks_on_the_other() -> None:
    assert audit(
        """
        def f(cache, node):
            lock = cache.lock(node)
            if node.evicted:
                return None
            lock.release()
        """,
        LOCK,
    ) == [
        "3:12: FSM101 lock() on 'node' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_an_engine_leases_release_is_its_own_not_a_pairs() -> None:
    assert not audit(
        """
        def f(engine, rec):
            lease = engine.lease(rec)
            try:
                work(rec)
            finally:
                lease.release()

        def g(engine, rec):
            with engine.lease(rec) as lease:
                work(rec)
                lease.release()
        """,
        PIN,
    )


def test_a_release_on_a_name_bound_to_anything_else_is_still_unmatched() -> None:
    assert audit(
        """
        def f(cache, node, other):
            lease = cache.pin(node) if node.cold else other
            lease.release()
        """,
        PIN,
    ) == [
        "3:13: FSM101 pin() on 'node' is not released or handed on"
        " when the function ends at line 4 [f]",
        "4:5: FSM103 release() on 'lease' has no pin() in reach and no documented hand-off [f]",
    ]


def test_a_receipt_released_in_a_callback_is_handed_on() -> None:
    assert not audit(
        """
        def f(cache, node):
            lock = cache.lock(node)
            register(lambda: lock.release())
        """,
        LOCK,
    )


def test_receipts_taken_per_loop_pass_are_released_per_pass() -> None:
    assert not audit(
        """
        def f(cache, nodes):
            for node in nodes:
                lease = cache.lock(node)
                try:
                    work(node)
                finally:
                    lease.release()
        """,
        LOCK,
    )
