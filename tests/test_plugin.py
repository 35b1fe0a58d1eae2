"""The pytest plugin: audit mode, spec items, the fsm_spec marker and leaked leases."""

from __future__ import annotations

import pytest

from fsm_cache.shipped import spec_dir


pytest_plugins = ["pytester"]

BUGS = spec_dir() / "bugs_detected"


def test_fsm_audit_turns_on_audit_mode(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        from fsm_cache.engine import Engine
        from fsm_cache.shipped import host_machine

        def test_audit():
            assert os.environ["FSM_CACHE_AUDIT"] == "1"
            assert Engine(host_machine()).audit
        """
    )
    pytester.runpytest_subprocess("--fsm-audit").assert_outcomes(passed=1)


def test_leaked_lease_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from fsm_cache.engine import Engine
        from fsm_cache.shipped import host_machine

        HELD = []

        def test_leaks():
            engine = Engine(host_machine())
            rec = engine.new(7)
            engine.fire(rec, "write")
            engine.fire(rec, "write_done")
            HELD.append(engine.lease(rec))
        """
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["fsm_cache: 1 lease(s) never released:", "  <Lease pin on node 7, taken at *"]
    )


def test_released_leases_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from fsm_cache.engine import Engine
        from fsm_cache.shipped import host_machine

        def test_releases():
            engine = Engine(host_machine())
            rec = engine.new(7)
            engine.fire(rec, "write")
            engine.fire(rec, "write_done")
            with engine.lease(rec):
                assert rec.pins == 1
        """
    )
    assert pytester.runpytest_subprocess().ret == pytest.ExitCode.OK


def test_ini_specs_become_check_and_verify_items(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        f"""
        [pytest]
        fsm_specs =
            {spec_dir() / "device_residency.toml"}
            {BUGS / "unlock_skips_ancestor.toml"}
        fsm_check_nodes = 2
        """
    )
    # Item names hold the spec's absolute path, so select by the name's
    # prefix rather than by a bare word the checkout's path may contain.
    chosen = "fsm-check or (fsm-verify and device_residency.toml)"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", chosen)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*unlock_skips_ancestor.toml: violation: invariant 6: node 0: locks is 1 but its holders account for 0"
        ]
    )


def test_marker_model_checks_before_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.fsm_spec({str(spec_dir() / "residency.toml")!r})
        def test_good():
            pass

        @pytest.mark.fsm_spec({str(BUGS / "evict_device_while_writing.toml")!r})
        def test_bad():
            pass
        """
    )
    pytester.makeini("[pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*violation: invariant 5: node 1: a device-to-host copy reads a device copy that is absent"
        ]
    )
