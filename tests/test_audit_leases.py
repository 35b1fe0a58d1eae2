"""A lease taken as a receipt gives its acquire back: by ``with``, or by its own ``release()``.

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


WITH_LOCK = """
    def plain(cache, node):
        with cache.lock(node):
            work(node)

    def named(cache, node):
        with cache.lock(node) as lease:
            if node.evicted:
                return None
            work(lease)

    def in_a_loop(cache, nodes):
        for node in nodes:
            with cache.lock(node):
                if node.evicted:
                    continue
                work(node)

    async def awaited(cache, node):
        async with cache.lock(node):
            await work(node)
"""


def test_an_acquire_used_as_a_with_item_is_released_on_every_way_out() -> None:
    assert not audit(WITH_LOCK, LOCK)
    assert not audit(WITH_LOCK.replace("lock(", "pin("), PIN)


def test_a_with_item_entered_after_an_acquired_one_may_raise_without_a_leak() -> None:
    assert not audit(
        """
        def f(cache, a, b, path):
            with cache.lock(a), open(path) as log, cache.lock(b):
                work(a, b, log)
        """,
        LOCK,
    )


def test_a_release_inside_the_with_body_is_not_doubled_by_its_end() -> None:
    assert not audit(
        """
        def f(cache, node):
            with cache.lock(node) as lease:
                cache.unlock(lease)
                work(node)
        """,
        LOCK,
    )


def test_a_release_after_the_with_is_a_double_release() -> None:
    assert audit(
        """
        def f(cache, node):
            with cache.lock(node):
                work(node)
            cache.unlock(node)
        """,
        LOCK,
    ) == ["5:5: FSM102 unlock() on 'node' can run twice: already released at line 3 [f]"]


def test_a_receipt_released_after_the_with_is_a_double_release() -> None:
    # The `as` name and the receipt entered by name are what they acquired:
    # releasing either after the `with` released it again.
    assert audit(
        """
        def unlocked(cache, node):
            with cache.lock(node) as lease:
                work()
            cache.unlock(lease)

        def released(cache, node):
            with cache.lock(node) as lease:
                work()
            lease.release()

        def entered_by_name(cache, node):
            lease = cache.lock(node)
            with lease:
                work()
            cache.unlock(node)
        """,
        LOCK,
    ) == [
        "5:5: FSM102 unlock() on 'lease' can run twice: already released at line 3 [unlocked]",
        "10:5: FSM102 unlock() on 'lease' can run twice: already released at line 8 [released]",
        "16:5: FSM102 unlock() on 'node' can run twice: already released at line 14"
        " [entered_by_name]",
    ]


def test_an_acquire_inside_the_with_body_still_leaks() -> None:
    assert audit(
        """
        def f(cache, node, other):
            with cache.lock(node):
                cache.lock(other)
        """,
        LOCK,
    ) == [
        "4:9: FSM101 lock() on 'other' is not released or handed on"
        " when the function ends at line 4 [f]"
    ]


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

        def h(engine, rec):  # a lease's release naming its other give-back
            lease = engine.lease(rec, "load", "load_done")
            try:
                work(rec)
            except OSError:
                lease.release("load_failed")
                raise
            lease.release()
        """,
        PIN,
    )


def test_a_receipt_or_none_is_released_by_its_own_release_under_its_none_test() -> None:
    # A name bound to a receipt on some paths and to None on the others is
    # still a receipt: its own release, where it is not None, releases.
    assert not audit(
        """
        def conditional(cache, node, c):
            lock = cache.lock(node) if c else None
            try:
                yield
            finally:
                if lock is not None:
                    lock.release()

        def in_a_branch(cache, node, c):
            lock = None
            if c:
                lock = cache.lock(node)
            if lock is not None:
                lock.release()
        """,
        LOCK,
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


def test_a_receipt_used_as_a_with_item_is_released_by_it() -> None:
    assert not audit(
        """
        def f(cache, node):
            lock = cache.lock(node)
            with lock:
                work(node)
        """,
        LOCK,
    )


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


def test_a_receipt_bound_by_walrus_is_a_receipt() -> None:
    """``(lock := cache.lock(node))`` was no receipt: its unlock was FSM103 and its lock FSM101."""
    assert not audit(
        """
        def tested(cache, node):
            if (lock := cache.lock(node)) is not None:
                try:
                    work(node)
                finally:
                    cache.unlock(lock)

        def refused(cache, node):
            if (lock := cache.lock(node)) is None:
                return None
            try:
                return work(node)
            finally:
                lock.release()

        def plain(cache, node):
            print(lock := cache.lock(node))
            cache.unlock(lock)
        """,
        LOCK,
    )


def test_a_receipt_bound_by_walrus_still_leaks() -> None:
    assert audit(
        """
        def f(cache, node):
            if (lock := cache.lock(node)) is not None:
                if node.evicted:
                    return None
                cache.unlock(lock)
        """,
        LOCK,
    ) == [
        "3:17: FSM101 lock() on 'node' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_receipts_built_into_a_local_list_or_dict_are_its_elements() -> None:
    """``locks = [cache.lock(n) for n in nodes]`` stood for nothing: FSM101, and FSM103 on each unlock."""
    assert not audit(
        """
        def listed(cache, nodes):
            locks = [cache.lock(n) for n in nodes]
            try:
                work(nodes)
            finally:
                for lock in locks:
                    cache.unlock(lock)

        def keyed(cache, nodes):
            locks = {n.id: cache.lock(n) for n in nodes}
            try:
                work(nodes)
            finally:
                for lock in locks.values():
                    cache.unlock(lock)

        def stored(cache, nodes):
            locks = {}
            for n in nodes:
                locks[n.id] = cache.lock(n)
            try:
                work(nodes)
            finally:
                for lock in locks.values():
                    cache.unlock(lock)
        """,
        LOCK,
    )


def test_receipts_built_into_a_local_list_still_leak_unreleased() -> None:
    assert audit(
        """
        def f(cache, nodes):
            locks = [cache.lock(n) for n in nodes]
            if not locks:
                return None
            for lock in locks:
                cache.unlock(lock)
        """,
        LOCK,
    ) == [
        "3:14: FSM101 lock() on 'nodes[*]' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_receipts_put_in_a_local_container_are_released_by_their_own_release() -> None:
    """``for lock in locks: lock.release()`` left every receipt in ``locks`` reported as FSM101."""
    assert not audit(
        """
        def appended(cache, nodes):
            locks = []
            try:
                for n in nodes:
                    locks.append(cache.lock(n))
                work(nodes)
            finally:
                for lock in locks:
                    lock.release()

        def built(cache, nodes):
            locks = [cache.lock(n) for n in nodes]
            try:
                work(nodes)
            finally:
                for lock in reversed(locks):
                    lock.release()

        def named_first(cache, nodes):
            locks = []
            try:
                for n in nodes:
                    lock = cache.lock(n)
                    locks.append(lock)
                work(nodes)
            finally:
                for lock in locks:
                    lock.release()

        def keyed(cache, nodes):
            locks = {}
            try:
                for n in nodes:
                    locks[n.id] = cache.lock(n)
                work(nodes)
            finally:
                for lock in locks.values():
                    lock.release()
        """,
        LOCK,
    )


def test_receipts_in_a_local_container_not_drained_still_leak() -> None:
    assert audit(
        """
        def never(cache, nodes):
            locks = []
            for n in nodes:
                locks.append(cache.lock(n))
            work(nodes)

        def early(cache, nodes, x):
            locks = [cache.lock(n) for n in nodes]
            if x:
                return None
            for lock in locks:
                lock.release()

        def mixed(cache, nodes, other):
            locks = [cache.lock(n) for n in nodes]
            locks.append(other)
            for lock in locks:
                lock.release()

        def twice(cache, nodes):
            locks = [cache.lock(n) for n in nodes]
            for lock in locks:
                lock.release()
            for lock in locks:
                lock.release()
        """,
        LOCK,
    ) == [
        "5:22: FSM101 lock() on 'nodes[*]' is not released or handed on"
        " when the function ends at line 6 [never]",
        "9:14: FSM101 lock() on 'nodes[*]' is not released or handed on"
        " when the function returns at line 11 [early]",
        "16:14: FSM101 lock() on 'nodes[*]' is not released or handed on"
        " when the function ends at line 19 [mixed]",
        "26:9: FSM102 unlock() on 'locks[*]' can run twice: already released at line 24 [twice]",
    ]
