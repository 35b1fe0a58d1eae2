"""The path analysis, construct by construct: each test is one code shape and its findings."""

from __future__ import annotations

import textwrap

import pytest

from fsm_cache.audit import AuditConfig, Pair, check_source, flow


def audit(source: str, config: AuditConfig | None = None) -> list[str]:
    """Return ``line:col: CODE message [function]`` for each finding in ``source``."""
    text = textwrap.dedent(source)
    found = check_source(text, "m.py", config or AuditConfig())
    return [f"{f.line}:{f.col}: {f.code} {f.message} [{f.function}]" for f in found]


LEAK_HINT = "release it in try/finally or hold it with a lease"


def test_try_finally_pair_is_clean() -> None:
    assert not audit("""
        def f(node):
            node.protect_host()
            try:
                work(node)
            finally:
                node.release_host()
    """)


def test_return_inside_try_runs_the_finally() -> None:
    assert not audit("""
        def f(node):
            node.protect_host()
            try:
                if node.ready:
                    return 1
                return work(node)
            finally:
                node.release_host()
    """)


def test_early_return_leaks() -> None:
    assert audit("""
        def f(node):
            node.protect_host()
            if node.evicted:
                return None
            node.release_host()
            return node.value
    """) == [
        "3:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_falling_off_the_end_leaks() -> None:
    assert audit("""
        def f(node):
            node.protect_host()
            if node.ready:
                node.release_host()
    """) == [
        "3:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 5 [f]"
    ]


def test_a_call_between_acquire_and_release_leaks_when_it_raises() -> None:
    assert audit("""
        def f(self, node):
            self.inc_lock_ref(node)
            self.copy(node)
            self.dec_lock_ref(node)
    """) == [f"3:5: FSM104 inc_lock_ref() on 'node' leaks if line 4 raises; {LEAK_HINT} [f]"]


def test_raise_and_assert_are_exception_exits() -> None:
    assert audit("""
        def f(node, strict):
            node.protect_host()
            assert node.host_value is not None
            node.release_host()

        def g(node, strict):
            node.protect_host()
            if strict:
                raise ValueError("no host copy")
            node.release_host()
    """) == [
        f"3:5: FSM104 protect_host() on 'node' leaks if line 4 raises; {LEAK_HINT} [f]",
        f"8:5: FSM104 protect_host() on 'node' leaks if line 10 raises; {LEAK_HINT} [g]",
    ]


def test_non_raising_builtins_and_logging_do_not_count() -> None:
    assert not audit("""
        def f(node, logger):
            node.protect_host()
            n = len(node.key)
            logger.debug("pinned %d", n)
            node.release_host()
    """)


def test_release_in_except_and_finally_is_a_double_release() -> None:
    assert audit("""
        def f(node):
            node.protect_host()
            try:
                work()
            except Exception:
                node.release_host()
                raise
            finally:
                node.release_host()
    """) == ["10:9: FSM102 release_host() on 'node' can run twice: already released at line 7 [f]"]


def test_sibling_handlers_run_at_most_one() -> None:
    assert not audit("""
        def f(node):
            node.protect_host()
            try:
                work()
            except TimeoutError:
                node.release_host()
                raise
            except Exception:
                node.release_host()
                raise
            node.release_host()
    """)


def test_a_typed_handler_lets_other_exceptions_escape() -> None:
    assert audit("""
        def f(node):
            node.protect_host()
            try:
                work()
            except KeyError:
                node.release_host()
                raise
            node.release_host()
    """) == [f"3:5: FSM104 protect_host() on 'node' leaks if line 5 raises; {LEAK_HINT} [f]"]


def test_nested_cleanup_handlers_release_twice() -> None:
    assert audit("""
        def f(self, node):
            self.inc_lock_ref(node)
            try:
                try:
                    self.load(node)
                except RuntimeError:
                    self.dec_lock_ref(node)
                    raise
            except Exception:
                self.dec_lock_ref(node)
                return False
            self.dec_lock_ref(node)
            return True
    """) == ["11:9: FSM102 dec_lock_ref() on 'node' can run twice: already released at line 8 [f]"]


def test_a_release_inside_a_loop_repeats() -> None:
    assert audit("""
        def f(node, ops):
            node.protect_host()
            for op in ops:
                node.release_host()
    """) == [
        "5:9: FSM102 release_host() on 'node' can run twice: it runs again on a later loop"
        " iteration [f]"
    ]


def test_release_in_loop_then_unconditional_release() -> None:
    assert audit("""
        def f(node, reqs):
            node.protect_host()
            for req in reqs:
                if req.aborted:
                    node.release_host()
                    break
            node.release_host()
    """) == ["8:5: FSM102 release_host() on 'node' can run twice: already released at line 6 [f]"]


def test_while_true_leaves_only_by_break_or_return() -> None:
    assert not audit("""
        def f(node, queue):
            node.protect_host()
            while True:
                if not queue:
                    node.release_host()
                    return None
                if queue[0] is None:
                    break
                del queue[0]
            node.release_host()
    """)


def test_loops_over_the_same_collection_pair_up_per_element() -> None:
    assert not audit("""
        def f(nodes, controller):
            for node in nodes:
                node.protect_host()
            try:
                controller.load([n.host_value for n in nodes])
            finally:
                for node in reversed(nodes):
                    node.release_host()
    """)


def test_loop_else_runs_when_the_loop_does_not_break() -> None:
    assert (
        audit("""
        def f(node, attempts):
            node.protect_host()
            for attempt in attempts:
                if attempt.ok:
                    break
            else:
                node.release_host()
                return False
            node.release_host()
            return True
    """)
        == []
    )


def test_a_local_list_stands_for_what_was_put_in_it() -> None:
    assert not audit("""
        def f(leaves, flush):
            staged = []
            try:
                for x in leaves:
                    x.protect_host()
                    staged.append(x)
                flush()
            finally:
                for x in staged:
                    x.release_host()
    """)


def test_a_local_list_is_not_a_hand_off() -> None:
    assert audit("""
        def f(node):
            batch = []
            node.protect_host()
            batch.append(node)
    """) == [
        "4:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 5 [f]"
    ]


def test_hand_offs_by_return_attribute_container_and_yield() -> None:
    assert not audit("""
        def returned(node):
            node.protect_host()
            return node

        def attribute(req, node):
            node.protect_host()
            req.anchor = node

        def table(self, rid, node, op):
            node.protect_host()
            self.ongoing[rid] = (node, op)

        def queue(self, node):
            node.protect_host()
            self.staged.append(node)

        def generator(nodes):
            for node in nodes:
                node.protect_host()
                yield node
    """)


def test_store_then_pin_is_a_hand_off() -> None:
    assert not audit("""
        def f(self, node, op_id):
            self.ongoing_backup[op_id] = node
            node.protect_host()
    """)


def test_a_value_read_from_a_resource_does_not_hand_it_on() -> None:
    # Only whole values hand on: a length or an id put into a local list
    # that is then returned holds no node.
    assert audit("""
        def counted(node):
            sizes = []
            node.protect_host()
            sizes.append(len(node.key))
            return sizes

        def kept(node):
            staged = []
            node.protect_host()
            staged.append(node)
            return staged
    """) == [
        "4:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function returns at line 6 [counted]"
    ]


def test_release_without_acquire() -> None:
    assert audit("""
        def f(self, req):
            self.dec_lock_ref(req.last_node)
    """) == [
        "3:5: FSM103 dec_lock_ref() on 'req.last_node' has no inc_lock_ref() in reach"
        " and no documented hand-off [f]"
    ]


def test_release_on_a_path_that_skipped_the_acquire() -> None:
    assert audit("""
        def f(node, pin):
            if pin:
                node.protect_host()
            work()
            node.release_host()
    """) == [
        f"4:9: FSM104 protect_host() on 'node' leaks if line 5 raises; {LEAK_HINT} [f]",
        "6:5: FSM105 release_host() on 'node' also runs on a path that skipped"
        " protect_host() at line 4 [f]",
    ]


def test_a_repeated_branch_test_takes_the_same_branch() -> None:
    assert not audit("""
        def f(self, node):
            if self.enable_storage:
                node.protect_host()
            try:
                self.flush()
            finally:
                if self.enable_storage:
                    node.release_host()
    """)


def test_reassigning_a_tested_name_forgets_the_branch() -> None:
    assert audit("""
        def f(node, pin):
            if pin:
                node.protect_host()
            pin = node.ready
            if pin:
                node.release_host()
    """) == [
        "4:9: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 7 [f]",
        "7:9: FSM105 release_host() on 'node' also runs on a path that skipped"
        " protect_host() at line 4 [f]",
    ]


def test_a_flag_set_after_the_pin_tells_the_paths_that_pinned() -> None:
    # `pinned = True` before the pin, a flag bound again to a test's result,
    # or changed by `|=`, no longer tells which paths pinned.
    assert audit("""
        def set_late(node):
            pinned = False
            try:
                node.protect_host()
                work()
                pinned = True
            finally:
                if pinned:
                    node.release_host()

        def bound_again(node, c):
            pinned = False
            node.protect_host()
            pinned = True
            pinned = c
            if pinned:
                node.release_host()

        def augmented(node, c):
            pinned = False
            node.protect_host()
            pinned |= c
            if pinned:
                node.release_host()
    """) == [
        f"5:9: FSM104 protect_host() on 'node' leaks if line 6 raises; {LEAK_HINT} [set_late]",
        "14:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 18 [bound_again]",
        "22:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 25 [augmented]",
    ]


def test_with_body_exceptions_pass_through() -> None:
    assert audit("""
        def f(node, lock):
            node.protect_host()
            with lock:
                work(node)
            node.release_host()

        def g(node, lock):
            with lock.held():
                node.protect_host()
                try:
                    work(node)
                finally:
                    node.release_host()
    """) == [f"3:5: FSM104 protect_host() on 'node' leaks if line 5 raises; {LEAK_HINT} [f]"]


def test_async_code_is_followed_like_sync_code() -> None:
    assert audit("""
        async def f(node, storage):
            node.protect_host()
            async with storage.session() as session:
                await session.fetch(node)
            node.release_host()
    """) == [f"3:5: FSM104 protect_host() on 'node' leaks if line 4 raises; {LEAK_HINT} [f]"]


def test_match_cases_are_branches() -> None:
    assert audit("""
        def f(node, policy):
            node.protect_host()
            match policy:
                case "write_back":
                    node.release_host()
                case "write_through":
                    node.release_host()
    """) == [
        "3:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 8 [f]"
    ]


def test_a_closure_that_releases_takes_the_resource() -> None:
    assert not audit("""
        def f(node, controller):
            node.protect_host()

            def done(_):
                node.release_host()

            controller.submit(node.host_value, callback=done)

        def g(self, node):
            self.inc_lock_ref(node)
            self.controller.submit(node.value, callback=lambda _: self.dec_lock_ref(node))
    """)


def test_a_release_passed_uncalled_is_a_callback_that_takes_the_resource() -> None:
    """``stack.callback(node.release_host)`` is ``lambda: node.release_host()``: it was FSM101."""
    assert not audit("""
        import contextlib
        import functools

        def exit_stack(node):
            with contextlib.ExitStack() as stack:
                node.protect_host()
                stack.callback(node.release_host)
                work(node)

        def with_arguments(self, loop, node):
            self.inc_lock_ref(node)
            loop.call_soon(self.dec_lock_ref, node)

        def partial(self, node):
            self.inc_lock_ref(node)
            self.on_done = functools.partial(self.dec_lock_ref, node)

        def keyword(controller, node):
            node.protect_host()
            controller.submit(node.host_value, callback=node.release_host)
    """)


def test_a_release_passed_for_another_resource_takes_nothing() -> None:
    assert audit("""
        def f(self, loop, node, other):
            self.inc_lock_ref(node)
            loop.call_soon(self.dec_lock_ref, other)
    """) == [
        "3:5: FSM101 inc_lock_ref() on 'node' is not released or handed on"
        " when the function ends at line 4 [f]"
    ]


def test_a_contextmanager_with_try_finally_is_clean() -> None:
    assert not audit("""
        import contextlib

        class Cache:
            @contextlib.contextmanager
            def locked(self, node):
                self.inc_lock_ref(node)
                try:
                    yield node
                finally:
                    self.dec_lock_ref(node)
    """)


def test_methods_and_nested_functions_are_named_by_qualified_name() -> None:
    assert [
        line.rsplit(" ", 1)[1]
        for line in audit("""
        class Cache:
            def outer(self, req):
                def inner(other):
                    other.release_host()
                self.dec_lock_ref(req.node)
    """)
    ] == ["[Cache.outer.inner]", "[Cache.outer]"]


def test_config_takes_ownership_hands_on_and_permits_releases() -> None:
    config = AuditConfig(takes_ownership=frozenset({"Cache.track", "finish"}))
    assert not audit(
        """
        class Cache:
            def start(self, node):
                self.inc_lock_ref(node)
                self.track(node)

            def track(self, node):
                self.dec_lock_ref(node)

            def finish(self, node):
                self.dec_lock_ref(node)
    """,
        config,
    )


def test_config_hands_off_silences_leaks_only() -> None:
    config = AuditConfig(hands_off=frozenset({"start"}))
    assert audit(
        """
        def start(node):
            node.protect_host()
            node.release_host()
            node.release_host()
    """,
        config,
    ) == ["5:5: FSM102 release_host() on 'node' can run twice: already released at line 4 [start]"]


def test_config_ignore_drops_codes() -> None:
    config = AuditConfig(ignore=frozenset({"FSM104"}))
    assert not audit(
        """
        def f(node):
            node.protect_host()
            work()
            node.release_host()
    """,
        config,
    )


def test_module_level_code_is_not_audited() -> None:
    assert not audit("""
        node.protect_host()
    """)


# Bounds of the analysis: deep nesting, many paths, long loops (D1-D3).


def test_a_long_elif_chain_is_followed_without_recursion() -> None:
    branches = "".join(f"    elif c{i}:\n        pass\n" for i in range(1, 400))
    source = (
        "def f(node):\n    node.protect_host()\n    if c0:\n        pass\n"
        f"{branches}    else:\n        return None\n    node.release_host()\n"
    )
    assert audit(source) == [
        "2:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function returns at line 804 [f]"
    ]


@pytest.mark.usefixtures("default_recursion_limit")  # an earlier test may raise it
def test_a_function_that_makes_no_pair_call_is_not_analyzed() -> None:
    # Most functions of a cache acquire and release nothing: following their
    # paths was nearly all of the audit's time on SGLang's trees. One past
    # the bounds has nothing unchecked to report either; one that fires an
    # event or takes a verb may pair, so it is analyzed.
    deep = "    x = " + " + ".join(["a"] * 1500) + "\n"
    source = (
        f"def f(node):\n    node.refresh()\n{deep}\n"
        f"def g(engine, rec):\n    engine.fire(rec, 'ping')\n{deep}\n"
        f"def h(engine, rec):\n    take = engine.verb('ping')\n{deep}"
    )
    assert audit(source) == [
        "5:1: FSM106 g is too deeply nested to analyze; nothing in it is checked [g]",
        "9:1: FSM106 h is too deeply nested to analyze; nothing in it is checked [h]",
    ]


@pytest.mark.usefixtures("default_recursion_limit")  # an earlier test may raise it
def test_a_function_too_deeply_nested_to_analyze_is_reported_not_checked() -> None:
    source = "def f(node):\n    node.protect_host()\n    x = " + " + ".join(["a"] * 1500) + "\n"
    assert audit(source) == [
        "1:1: FSM106 f is too deeply nested to analyze; nothing in it is checked [f]"
    ]


def test_calls_before_an_acquire_do_not_fill_the_states() -> None:
    steps = "".join(f"    self.step{i}()\n" for i in range(300))
    source = f"def f(self, node):\n{steps}    node.protect_host()\n    self.risky()\n"
    source += "    node.release_host()\n"
    assert audit(source) == [
        f"302:5: FSM104 protect_host() on 'node' leaks if line 303 raises; {LEAK_HINT} [f]"
    ]


def test_a_full_set_of_states_is_loosened_not_cut() -> None:
    tests = "".join(f"    if c{i}:\n        a{i}()\n" for i in range(9)) * 2
    source = (
        f"def f(node):\n{tests}    node.protect_host()\n    if x:\n        node.release_host()\n"
    )
    assert audit(source) == [
        "38:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 40 [f]"
    ]


def test_too_many_distinct_states_is_reported_not_checked() -> None:
    pins = "".join(f"        if c{i}:\n            n{i}.protect_host()\n" for i in range(10))
    assert audit(f"class C:\n    def f(self):\n{pins}") == [
        "2:5: FSM106 C.f is too complex to analyze (more than 512 distinct path states);"
        " nothing in it is checked [C.f]"
    ]


def test_a_function_not_analyzed_is_silenced_on_its_def_line() -> None:
    pins = "".join(f"    if c{i}:\n        n{i}.protect_host()\n" for i in range(10))
    assert audit(f"def f():  # fsm-cache: ignore[FSM106]\n{pins}") == []


def nested(depth: int, block: list[str]) -> str:
    """Return ``f`` pinning a node around ``depth`` blocks, each nested in the last line of the one before."""
    lines = ["def f(node):", "    node.protect_host()"]
    for level in range(depth):
        indent = "    " * (level + 1)
        lines.extend(indent + line.format(level=level) for line in block)
    lines.append("    " * (depth + 1) + "work()")
    lines.append("    node.release_host()")
    return "\n".join(lines) + "\n"


def test_nested_loops_that_only_call_run_once_per_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "MAX_STEPS", 2_000)
    assert audit(nested(24, ["for x{level} in xs{level}:"])) == [
        f"2:5: FSM104 protect_host() on 'node' leaks if line 27 raises; {LEAK_HINT} [f]"
    ]


def test_a_function_over_its_step_budget_is_reported_not_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flow, "MAX_STEPS", 10_000)
    pins = "".join(f"    if c{i}:\n        n{i}.protect_host()\n" for i in range(8))
    assert audit(f"def f():\n{pins}" + "    work()\n" * 60) == [
        "1:1: FSM106 f is too complex to analyze (more than 10000 statement steps);"
        " nothing in it is checked [f]"
    ]


def test_nested_try_finally_cost_one_pass_per_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "MAX_STEPS", 2_000)  # one pass per exit per level: 2**18 passes
    assert audit(nested(18, ["try:", "    work()", "finally:"])) == [
        f"2:5: FSM104 protect_host() on 'node' leaks if line 4 raises; {LEAK_HINT} [f]"
    ]


def test_a_finally_that_acquires_as_the_function_returns_leaks_at_its_end() -> None:
    """The return held nothing, so it kept no line; the leak is named at the finally's end."""
    assert audit("""
        def f(node):
            try:
                return 1
            finally:
                node.protect_host()
                log()
    """) == [
        "6:9: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function returns at line 7 [f]"
    ]


def test_an_element_picked_per_loop_pass_is_not_released_twice() -> None:
    assert audit("""
        class C:
            def writing_check(self):  # fsm-cache: takes-ownership
                for ack_id in self.cache_controller.ack_write_queue:
                    self.dec_lock_ref(self.ongoing_write_through.pop(ack_id))

            def drain(self):  # fsm-cache: takes-ownership
                for i in range(self.n):
                    self.dec_lock_ref(self.nodes[i])

            def drain_queue(self):  # fsm-cache: takes-ownership
                while self.q:
                    self.q.popleft().release_host()

            def pin_each(self, ids):
                for k in ids:
                    self.inc_lock_ref(self.table[k])
                for k in ids:
                    self.dec_lock_ref(self.table[k].node)
                    self.dec_lock_ref(self.table[k])
    """) == [
        "19:13: FSM103 dec_lock_ref() on 'self.table[k].node' has no inc_lock_ref() in reach"
        " and no documented hand-off [C.pin_each]"
    ]


def test_the_same_resource_released_in_each_loop_pass_still_doubles() -> None:
    assert audit("""
        def f(self, node, ids):
            for k in ids:
                self.dec_lock_ref(self.table[0])
    """) == [
        "4:9: FSM102 dec_lock_ref() on 'self.table[0]' can run twice:"
        " it runs again on a later loop iteration [f]",
    ]


def test_a_guarded_wildcard_case_can_fall_through() -> None:
    assert audit("""
        def f(node, cmd):
            node.protect_host()
            match cmd:
                case 1:
                    node.release_host()
                case _ if cmd > 5:
                    node.release_host()
    """) == [
        "3:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 8 [f]"
    ]


def test_a_failed_case_guard_still_ran_for_the_later_cases() -> None:
    # The guard pinned where it returned true, only: the later case that
    # releases runs where it returned false, so it releases nothing.
    assert audit("""
        def f(node, cmd):
            match cmd:
                case "load" if node.protect_host():
                    node.release_host()
                case _:
                    node.release_host()
    """) == [
        "7:13: FSM103 release_host() on 'node' has no protect_host() in reach"
        " and no documented hand-off [f]"
    ]


def test_an_await_in_one_branch_raises_where_it_runs() -> None:
    assert audit("""
        async def leaks(node, fut, c):
            node.protect_host()
            value = await fut if c else None
            node.release_host()

        async def pinned_elsewhere(node, fut, c):
            if not c:
                node.protect_host()
            value = await fut if c else None
            if not c:
                node.release_host()
    """) == [f"3:5: FSM104 protect_host() on 'node' leaks if line 4 raises; {LEAK_HINT} [leaks]"]


def test_a_release_before_the_only_acquire_has_none_in_reach() -> None:
    assert audit("""
        def f(self, node):
            self.dec_lock_ref(node)
            self.locks[node.id] = self.inc_lock_ref(node)
    """) == [
        "3:5: FSM103 dec_lock_ref() on 'node' has no inc_lock_ref() in reach"
        " and no documented hand-off [f]"
    ]


def test_columns_count_characters_not_bytes() -> None:
    assert audit("""
        def f(node):
            s = "ééé"; node.protect_host()
    """) == [
        "3:16: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 3 [f]"
    ]


def test_pinning_an_attribute_of_a_stored_owner_is_a_hand_off() -> None:
    assert not audit("""
        def store_owner_first(self, req):
            self.running.append(req)
            self.inc_lock_ref(req.last_node)

        def store_owner_after(self, req):
            self.inc_lock_ref(req.last_node)
            self.new_chunked_req = req

        def each_owner(self, reqs):
            for req in reqs:
                self.can_run_list.append(req)
                self.inc_lock_ref(req.nodes[0])
    """)


def test_a_stored_attribute_of_an_object_does_not_hand_the_object_on() -> None:
    assert audit("""
        def f(self, req, request):
            req.prefix = req.prefix_indices
            self.running.append(request)
            self.inc_lock_ref(req.last_node)
            self.inc_lock_ref(requests.node)
    """) == [
        "5:5: FSM101 inc_lock_ref() on 'req.last_node' is not released or handed on"
        " when the function ends at line 6 [f]",
        "6:5: FSM101 inc_lock_ref() on 'requests.node' is not released or handed on"
        " when the function ends at line 6 [f]",
    ]


def test_a_conditional_expression_acquires_under_its_test() -> None:
    assert not audit("""
        def ternary(node, c):
            node.protect_host() if c else None
            if c:
                node.release_host()

        def conjunction(node, c):
            c and node.protect_host()
            if c:
                node.release_host()

        def disjunction(node, c):
            c or node.protect_host()
            if not c:
                node.release_host()
    """)


def test_a_conditional_expression_releases_only_under_its_test() -> None:
    assert audit("""
        def ternary(node, c):
            node.protect_host()
            node.release_host() if c else None

        def conjunction(node, c):
            node.protect_host()
            c and node.release_host()

        def disjunction(node, c):
            node.protect_host()
            c or node.release_host()
    """) == [
        "3:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 4 [ternary]",
        "7:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 8 [conjunction]",
        "11:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 12 [disjunction]",
    ]


def test_enumerate_and_zip_targets_stand_for_the_elements() -> None:
    assert not audit("""
        def enumerated(self, nodes):
            for node in nodes:
                self.inc_lock_ref(node)
            try:
                work()
            finally:
                for i, node in enumerate(reversed(nodes)):
                    self.dec_lock_ref(node)

        def zipped(self, nodes, ops):
            for node, op in zip(nodes, ops):
                node.protect_host()
            try:
                work()
            finally:
                for op, node in zip(ops, nodes):
                    node.release_host()
    """)


def test_a_sorted_copy_with_a_key_iterates_the_same_elements() -> None:
    assert not audit("""
        def f(nodes):
            for node in sorted(nodes, key=len):
                node.protect_host()
            try:
                work()
            finally:
                for node in reversed(nodes):
                    node.release_host()
    """)


def test_a_strict_zip_pairs_the_same_elements() -> None:
    """``zip(nodes, ops, strict=True)`` gave FSM101 on ``node[*]`` and FSM103 on ``nodes[*]``."""
    assert not audit("""
        def f(nodes, ops):
            for node, op in zip(nodes, ops, strict=True):
                node.protect_host()
            try:
                work()
            finally:
                for node in nodes:
                    node.release_host()
    """)


def test_comprehension_variables_stand_for_the_elements() -> None:
    assert not audit("""
        def f(nodes):
            for n in nodes:
                n.protect_host()
            try:
                work()
            finally:
                [n.release_host() for n in nodes]
    """)


def test_a_comprehension_releases_twice_like_a_loop() -> None:
    assert audit("""
        def after_a_loop(nodes):
            for n in nodes:
                n.protect_host()
            for n in nodes:
                n.release_host()
            [n.release_host() for n in nodes]

        def per_element(node, xs):
            node.protect_host()
            [node.release_host() for _ in xs]

        def filtered(nodes):
            for n in nodes:
                n.protect_host()
            [n.release_host() for n in nodes if n.ready]
    """) == [
        "7:6: FSM102 release_host() on 'nodes[*]' can run twice: already released at line 6"
        " [after_a_loop]",
        "11:6: FSM102 release_host() on 'node' can run twice:"
        " it runs again on a later loop iteration [per_element]",
        "15:9: FSM101 protect_host() on 'nodes[*]' is not released or handed on"
        " when the function ends at line 16 [filtered]",
    ]


def test_a_pair_called_through_each_element_acts_once_per_element() -> None:
    # SGLang 0.5.23's UnifiedTreeCore locks a node in every component:
    # `for comp in self.components: comp.release_component_lock(node, params)`.
    # Each pass goes through another receiver, so it is no double release;
    # the same receiver in every pass still is.
    components = AuditConfig(pairs=(Pair("acquire_component_lock", "release_component_lock"),))
    assert audit(
        """
        def each_component(self, node):
            for comp in self.components:
                comp.acquire_component_lock(node)
            try:
                self.work(node)
            finally:
                for comp in reversed(self.components):
                    comp.release_component_lock(node)

        def each_index(self, node):
            for i in range(len(self.parts)):
                self.parts[i].acquire_component_lock(node)
            for i in range(len(self.parts)):
                self.parts[i].release_component_lock(node)

        def same_receiver(self, node):
            self.part.acquire_component_lock(node)
            for _ in range(2):
                self.part.release_component_lock(node)
        """,
        components,
    ) == [
        "20:9: FSM102 release_component_lock() on 'node' can run twice:"
        " it runs again on a later loop iteration [same_receiver]"
    ]


LOCK_PAIR = AuditConfig(pairs=(Pair("lock", "unlock"),))


def test_an_acquire_receipt_releases_and_hands_on_the_resource() -> None:
    assert not audit(
        """
        def released(self, last_node):
            lock = self.tree_cache.lock(last_node)
            try:
                yield None
            finally:
                self.tree_cache.unlock(lock)

        def returned(self, node_id):
            receipt = self.tree.lock(node_id)
            return receipt

        def stored(self, node_id):
            receipt = self.tree.lock(node_id)
            self.locks[node_id] = receipt
        """,
        LOCK_PAIR,
    )


def test_what_is_read_from_a_receipt_is_a_receipt() -> None:
    assert not audit("""
        def f(self, node_id, ack_id):
            lock_params = self.inc_lock_ref(node_id).to_dec_params()
            self.ongoing_write_through[ack_id] = lock_params

        async def g(self, node_id):
            handle = await self.tree.inc_lock_ref(node_id)
            return handle.params
    """)


def test_reading_a_receipt_as_it_is_taken_is_part_of_the_acquire() -> None:
    # SGLang 0.5.23 writes `self.ongoing_backup[op] = (node_id,
    # self.inc_host_lock_ref(node_id).to_dec_params())`: no try can sit
    # between the acquire and the read of its result. A later statement, or
    # a call the receipt is passed to, still may raise.
    assert audit("""
        def same_expression(self, node_id, op):
            self.ongoing[op] = (node_id, self.inc_lock_ref(node_id).to_dec_params().copy())

        async def awaited(self, node_id):
            self.held = (await self.tree.inc_lock_ref(node_id)).params.freeze()

        def later_statement(self, node_id):
            result = self.inc_lock_ref(node_id)
            self.held = result.to_dec_params()

        def wrapped(self, node):
            return TreeLock(node, self.inc_lock_ref(node).to_dec_params())
    """) == [
        f"9:14: FSM104 inc_lock_ref() on 'node_id' leaks if line 10 raises; {LEAK_HINT}"
        " [later_statement]",
        f"13:27: FSM104 inc_lock_ref() on 'node' leaks if line 13 raises; {LEAK_HINT} [wrapped]",
    ]


def test_a_receipt_or_none_is_released_under_its_none_test() -> None:
    # A name bound to a receipt on some paths and to None on others, then
    # tested against None: the test tells the paths that acquired. Testing
    # the wrong way round, or binding the name again, loses that.
    assert audit(
        """
        def wrong_way_round(self, node, c):
            lock = None
            if c:
                lock = self.cache.lock(node)
            if lock is None:
                self.cache.unlock(lock)

        def bound_again(self, node, c):
            lock = self.cache.lock(node) if c else None
            lock = self.other()
            if lock is not None:
                self.cache.unlock(lock)

        def early_return(self, node, c, d):
            lock = self.cache.lock(node) if c else (None if d else self.cache.lock(node))
            if lock is None:
                return
            self.cache.unlock(lock)
        """,
        LOCK_PAIR,
    ) == [
        "5:16: FSM101 lock() on 'node' is not released or handed on"
        " when the function ends at line 7 [wrong_way_round]",
        "7:9: FSM103 unlock() on 'lock' has no lock() in reach and no documented hand-off"
        " [wrong_way_round]",
        "10:12: FSM101 lock() on 'node' is not released or handed on"
        " when the function ends at line 13 [bound_again]",
        "13:9: FSM105 unlock() on 'lock' also runs on a path that skipped lock()"
        " at line 10 [bound_again]",
    ]


def test_an_acquire_receipt_that_is_dropped_leaks() -> None:
    assert audit(
        """
        def f(self, node):
            lock = self.tree_cache.lock(node)
            if node.evicted:
                return None
            self.tree_cache.unlock(lock)
        """,
        LOCK_PAIR,
    ) == [
        "3:12: FSM101 lock() on 'node' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_a_store_into_a_global_or_nonlocal_name_is_a_hand_off() -> None:
    assert not audit("""
        def global_name(node):
            global HELD
            node.protect_host()
            HELD = node

        def global_list(node):
            global HELD
            HELD = []
            node.protect_host()
            HELD.append(node)

        def outer():
            held = None

            def inner(node):
                nonlocal held
                node.protect_host()
                held = node

            return inner
    """)


def test_a_function_named_after_its_pair_is_its_implementation() -> None:
    assert audit("""
        class Cache:
            def inc_lock_ref(self, node_id):
                result = self._binding.inc_lock_ref(node_id)
                return _result_from_binding(result)

            def dec_lock_ref(self, node_id):
                self._binding.dec_lock_ref(node_id)

            def release_host(self, node):
                node.protect_host()
                self.inc_lock_ref(node)
    """) == [
        "12:9: FSM101 inc_lock_ref() on 'node' is not released or handed on"
        " when the function ends at line 12 [Cache.release_host]",
    ]


LOCKS = AuditConfig(pairs=(Pair("acquire", "release"),))


def test_an_acquire_tested_for_its_result_took_nothing_where_it_returned_false() -> None:
    """``if not lock.acquire(False): return`` was FSM101 on the return, where nothing was taken."""
    assert not audit(
        """
        def refused(lock):
            if not lock.acquire(False):
                return None
            try:
                return work()
            finally:
                lock.release()

        def taken(lock):
            if lock.acquire(blocking=False):
                lock.release()
                return False
            return True

        def conditional(lock):
            return lock.release() if lock.acquire(False) else None

        def spin(lock):
            while not lock.acquire(False):
                wait()
            try:
                work()
            finally:
                lock.release()

        def drain(lock):
            while lock.acquire(False):
                lock.release()

        def kept(lock):
            ok = lock.acquire(False)
            if not ok:
                return None
            try:
                return work()
            finally:
                lock.release()
        """,
        LOCKS,
    )


def test_an_acquire_tested_for_its_result_still_leaks_where_it_returned_true() -> None:
    assert audit(
        """
        def f(lock):
            if not lock.acquire(False):
                return None
            return work()
        """,
        LOCKS,
    ) == [
        "3:12: FSM101 acquire() on 'lock' is not released or handed on"
        " when the function returns at line 5 [f]"
    ]


def test_a_context_manager_class_keeps_what_enter_takes_for_exit_to_give_back() -> None:
    """``__enter__`` pinning ``self.node`` was FSM101, and ``__exit__`` releasing it FSM103."""
    assert not audit("""
        class Pinned:
            def __enter__(self):
                self.node.protect_host()

            def __exit__(self, *exc):
                self.node.release_host()

        class Locked:
            def __init__(self, cache, node):
                self.cache, self.node = cache, node
                self.cache.inc_lock_ref(self.node)

            async def __aenter__(self):
                self.cache.inc_lock_ref(self.node)

            async def __aexit__(self, *exc):
                self.cache.dec_lock_ref(self.node)

            def __del__(self):
                self.cache.dec_lock_ref(self.node)
    """)


def test_enter_still_leaks_what_it_takes_when_it_raises_or_is_not_its_objects() -> None:
    assert audit("""
        class Pinned:
            def __enter__(self):
                self.node.protect_host()
                self.check(self.node)
                return self

            def __exit__(self, node, *exc):
                node.release_host()

        def __enter__(node):
            node.protect_host()
    """) == [
        f"4:9: FSM104 protect_host() on 'self.node' leaks if line 5 raises; {LEAK_HINT}"
        " [Pinned.__enter__]",
        "9:9: FSM103 release_host() on 'node' has no protect_host() in reach"
        " and no documented hand-off [Pinned.__exit__]",
        "12:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 12 [__enter__]",
    ]
