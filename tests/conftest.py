"""Shared test configuration: the ``gpu`` marker skips without CUDA.

On a machine meant to have a GPU (``scripts/gpu_check.sh``), set
``FSM_CACHE_REQUIRE_GPU=1``: a ``gpu`` test that skips, for want of CUDA or
for any other reason, then fails, so a run that checked nothing cannot pass.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from collections.abc import Generator, Iterator

import pytest


REQUIRE_GPU = "FSM_CACHE_REQUIRE_GPU"


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run on a compiled module older than its source: Python would import it instead."""
    del config
    from fsm_cache import native

    if not native.wanted_pure() and (stale := native.stale()):
        names = ", ".join(str(path.name) for path in stale)
        raise pytest.UsageError(
            f"compiled modules older than their sources: {names}; run `make compile`, "
            f"or `python scripts/compile.py --clean`, or set {native.ENVIRONMENT}=1"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    del config
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Turn a skipped ``gpu`` test into a failure where ``FSM_CACHE_REQUIRE_GPU=1``."""
    del call
    report = yield
    if report.skipped and os.environ.get(REQUIRE_GPU) == "1" and item.get_closest_marker("gpu"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"gpu test skipped where {REQUIRE_GPU}=1 requires it to run: {why}"
    return report


@pytest.fixture(autouse=True)
def _recursion_limit_kept() -> Iterator[None]:
    """Put back after every test the recursion limit it found.

    mypy's API raises the limit for its own run and leaves it raised, and a
    test that depends on the default (a source too deep to analyze) then
    passed or failed by which test its xdist process ran before.
    """
    limit = sys.getrecursionlimit()
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector off for the test: memory must go back by reference counts alone.

    A cache's parts refer to each other; a test that it frees its pools when
    dropped or closed must not pass because a collection happened to run.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.fixture
def default_recursion_limit() -> Iterator[None]:
    """Hold Python's default recursion limit (1000) for the test, then restore the one before.

    tomllib parses nested arrays recursively: under the default limit arrays
    5000 deep overflow it, but an earlier test or a tool (CrossHair, Hypothesis)
    may have raised the limit, and then they parse. A test of the overflow holds
    the default, so it checks what a user's run meets.
    """
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)
