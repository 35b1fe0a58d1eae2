"""Fixtures that build SGLang's real radix caches on the CPU (``make test-sglang``).

These tests run only in a side environment that has an SGLang wheel installed
(``.cache/sglang/venv-<version>``, built by ``make test-sglang``). Anywhere else,
the normal ``pytest`` run included, nothing here is collected.

``mode`` is how the caches run:

* ``stock``: SGLang's own code, as installed;
* ``patched``: the same after ``fsm_cache.compat.sglang.patch()`` (trail mode on),
  undone after the test. Both modes must give SGLang's results; only the
  patched one refuses the planted misuses.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from fsm_cache.testing import sglang as standins

from .fakes import CpuController, FakeAllocator, FakeHostPool, StorageController, server_args


if standins.sglang_present():
    standins.install()
else:
    collect_ignore_glob = ["test_*.py"]

MODES = ("stock", "patched")

UNCHECKED_WARNING = r"UnifiedRadixCache \(.*\) is (not )?checked"
"""patch()'s warning on 0.5.23 (its default cache is checked in part); the tests of it catch it."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Let every test patch 0.5.23 without its warning failing the run."""
    for item in items:
        item.add_marker(pytest.mark.filterwarnings(f"ignore:{UNCHECKED_WARNING}:UserWarning"))


def sglang_version() -> str:
    """The installed SGLang wheel's version."""
    return importlib.metadata.version("sglang")


class Api:
    """SGLang's radix-cache calls, spelled for the installed version.

    0.5.6 takes a ``RadixKey`` over a list and plain arguments; 0.5.23 takes
    ``*Params`` dataclasses, a ``RadixKey`` over ``array('q')`` and returns
    ``*Result`` objects.
    """

    def __init__(self) -> None:
        self.version = sglang_version()
        self.rc: Any = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        self.base: Any = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        self.params: Any = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        self.new = hasattr(self.base, "InsertParams")

    def key(self, ids: Sequence[int]) -> Any:
        """A ``RadixKey`` over ``ids``."""
        return self.rc.RadixKey(array("q", ids) if self.new else list(ids))

    def insert(self, cache: Any, ids: Sequence[int], value: Any) -> int:
        """Insert ``ids`` with device slots ``value``; the prefix already cached."""
        if self.new:
            return int(
                cache.insert(self.base.InsertParams(key=self.key(ids), value=value)).prefix_len
            )
        return int(cache.insert(self.key(ids), value))

    def match(self, cache: Any, ids: Sequence[int]) -> tuple[int, Any]:
        """Match ``ids``: the device-resident prefix length and the last device node."""
        if self.new:
            found = cache.match_prefix(self.base.MatchPrefixParams(key=self.key(ids)))
            return int(found.device_prefix_len), found.last_device_node
        found = cache.match_prefix(self.key(ids))
        return len(found.device_indices), found.last_device_node

    def evict(self, cache: Any, tokens: int) -> None:
        """Ask the cache to free ``tokens`` device slots."""
        if self.new:
            cache.evict(self.base.EvictParams(num_tokens=tokens))
        else:
            cache.evict(tokens)

    def cache_params(self, allocator: FakeAllocator, page_size: int = 1, **options: Any) -> Any:
        """``CacheInitParams`` with the fake allocator and no request pool, plus ``options``."""
        return self.params.CacheInitParams(
            disable=options.pop("disable", False),
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            **options,
        )


@pytest.fixture(scope="session")
def sg() -> Api:
    """The installed SGLang's radix-cache API."""
    return Api()


@pytest.fixture
def allocator() -> FakeAllocator:
    """64 device slots on the CPU."""
    return FakeAllocator(64)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, sg: Api) -> Iterator[str]:
    """Run SGLang's caches as installed (``stock``) or checked (``patched``)."""
    chosen = str(request.param)
    if chosen == "stock":
        yield chosen
        return
    from fsm_cache.compat.sglang import patch

    with patch(trail=True):
        yield chosen


class Clock:
    """``time`` for SGLang's cache modules: a monotonic clock that ticks per call.

    LRU order then follows the order of the calls, not the timer's resolution.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        """One tick later than the last call."""
        self.now += 1.0
        return self.now

    def perf_counter(self) -> float:
        """Same clock (eviction metrics read it)."""
        return self.monotonic()


@pytest.fixture(autouse=True)
def clock(sg: Api, monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Replace ``time`` in SGLang's cache modules with a deterministic :class:`Clock`."""
    ticking = Clock()
    monkeypatch.setattr(sg.rc, "time", ticking)
    if importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is not None:
        monkeypatch.setattr(hiradix_module(), "time", ticking)
    return ticking


def hiradix_module() -> Any:
    """0.5.6's ``hiradix_cache`` module; skip on versions that have none."""
    try:
        return importlib.import_module("sglang.srt.mem_cache.hiradix_cache")
    except ModuleNotFoundError:
        pytest.skip(f"sglang {sglang_version()} has no hiradix_cache.py")


def build_hiradix(
    sg: Api,
    allocator: FakeAllocator,
    monkeypatch: pytest.MonkeyPatch,
    write_policy: str,
    page_size: int = 1,
    *,
    storage: bool = False,
) -> Any:
    """SGLang's real ``HiRadixCache`` over the CPU fakes (host pool, controller, one rank).

    With ``storage``, a storage tier too (:class:`~.fakes.StorageController`).
    """
    import torch

    hi = hiradix_module()
    allocator.kvcache = hi.MHATokenToKVPool.__new__(hi.MHATokenToKVPool)
    controller = StorageController if storage else CpuController
    monkeypatch.setattr(hi, "MHATokenToKVPoolHost", FakeHostPool)
    monkeypatch.setattr(hi, "HiCacheController", controller.build)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    args = server_args(write_policy, storage=storage)
    return hi.HiRadixCache(sg.cache_params(allocator, page_size), args)


def whole_state(cache: Any, allocator: Any) -> dict[str, Any]:
    """Everything a refusal must leave as it was: every node, SGLang's counts, both tiers' memory.

    Each node (by token path) with its slots, SGLang's counters and, when
    checked, its residency; the cache's sizes; the free lists and logs of the
    device allocator and (``HiRadixCache``) the host pool; the copies in
    flight and queued.
    """
    nodes = {}
    stack: list[tuple[Any, tuple[int, ...]]] = [(cache.root_node, ())]
    while stack:
        node, above = stack.pop()
        path = above + tuple(node.key) if node.key is not None else above
        fields = [
            None if node.value is None else [int(x) for x in node.value],
            None
            if getattr(node, "host_value", None) is None
            else [int(x) for x in node.host_value],
            node.lock_ref,
            getattr(node, "host_ref_counter", None),
        ]
        for name in ("host", "device", "pins", "locks", "pending", "deleted", "evicting"):
            fields.append(getattr(node, name, None))
        ack_with = getattr(node, "ack_with", None)
        fields.append(None if ack_with is None else ack_with.id)
        nodes[path] = fields
        stack.extend((child, path) for child in node.children.values())
    state: dict[str, Any] = {
        "nodes": nodes,
        "sizes": (cache.evictable_size(), cache.protected_size()),
        "device": (list(allocator.free_slots), [list(f) for f in allocator.freed]),
    }
    ctl = getattr(cache, "cache_controller", None)
    if ctl is not None:
        host = ctl.mem_pool_host
        state["host"] = (list(host.free_slots), [list(f) for f in host.freed])
        state["copies"] = (
            sorted(cache.ongoing_write_through),
            sorted(cache.ongoing_load_back),
            [ack.node_ids for ack in ctl.ack_write_queue],
            [ack.node_ids for ack in ctl.ack_load_queue],
            list(ctl.load_queue),
            list(ctl.writes),
            list(ctl.loads),
        )
    return state
