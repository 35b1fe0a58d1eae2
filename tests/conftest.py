"""Shared test configuration: the ``gpu`` marker skips without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest


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
