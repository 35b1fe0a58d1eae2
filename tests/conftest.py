"""Shared test configuration: the ``gpu`` marker skips without CUDA."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    del config
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
