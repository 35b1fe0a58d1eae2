"""The cache asks the spec before it fires what it chose: a stricter rule skips, never raises.

Eviction and the write policy pick their nodes by tests that mirror the shipped
rules (a device leaf, a host-only leaf, a node with no host copy). Each then
asks the machine whether the event is allowed before firing it, so that a rule
added to ``residency.toml`` (ours, later) makes the cache pass the node by,
as the model checker's search does, instead of raising half-way through an
insert, an eviction or a poll.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.spec import shipped


PAGE = 4
MARK = "# -- rules along the tree"


@pytest.fixture
def add_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Add a ``[[forbid]]`` rule to a copy of the shipped specs, which caches built after read."""

    def add(rule: str) -> None:
        for spec in shipped.spec_dir().glob("*.toml"):
            shutil.copy(spec, tmp_path)
        composed = tmp_path / "residency.toml"
        text = composed.read_text()
        assert text.count(MARK) == 1
        composed.write_text(text.replace(MARK, f"{rule}\n{MARK}"))
        monkeypatch.setattr(shipped, "spec_dir", lambda: tmp_path)
        shipped.load_shipped.cache_clear()

    yield add
    monkeypatch.undo()
    shipped.load_shipped.cache_clear()


def make(policy: str = "write_through", device_pages: int = 8, host_pages: int = 16) -> HiCache:
    return HiCache(
        CacheConfig(
            device_pages=device_pages,
            host_pages=host_pages,
            page_size=PAGE,
            layers=1,
            heads=1,
            head_dim=4,
            dtype="float32",
            device="cpu",
            write_policy=policy,
            load_back_threshold=1,
        )
    )


def tokens(pages: int, start: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def test_device_eviction_passes_by_a_leaf_the_spec_keeps(
    add_rule: Callable[[str], None],
) -> None:
    add_rule(
        '[[forbid]]\nevent = "evict_device"\nwhen = "host in [pinned]"\n'
        'error = "HostCopyPinned"\nreason = "a holder reads the host copy"\n'
    )
    cache = make()
    older, newer = tokens(4, 100), tokens(4, 200)
    cache.insert(older)
    cache.insert(newer)
    cache.poll()
    kept = cache.match_prefix(older).last_device_node
    other = cache.match_prefix(newer).last_device_node
    lease = cache.pin(kept)  # the least recently used leaf, which the new rule keeps
    assert cache.evict(4 * PAGE) == 4 * PAGE
    assert cache.stats().refused == {"evict_device": 1}  # seen, as any refusal is
    assert (kept.residency(), other.residency()) == (
        "pinned/resident (pins=1, locks=0)",
        "backed/absent (pins=0, locks=0)",
    )
    lease.release()
    assert cache.evict(4 * PAGE) == 4 * PAGE  # released: the rule lets it go


def test_host_eviction_passes_by_a_leaf_the_spec_keeps(
    add_rule: Callable[[str], None],
) -> None:
    add_rule(
        '[[forbid]]\nevent = "evict_host"\nwhen = "parent host in [pinned]"\n'
        'error = "HostCopyPinned"\nreason = "the holder of the parent reads below it"\n'
    )
    cache = make(device_pages=16, host_pages=8)
    parent, child = tokens(4, 100), tokens(4, 200)
    cache.insert(parent)
    cache.poll()
    cache.insert(parent + child)
    cache.poll()
    assert cache.evict(8 * PAGE) == 8 * PAGE
    top = cache.match_prefix(parent).last_host_node
    below = cache.match_prefix(parent + child).last_host_node
    lease = cache.pin(top)
    assert cache.evict_host(4 * PAGE) == 0  # the only host leaf is kept by the new rule
    assert below.residency() == "backed/absent (pins=0, locks=0)"
    assert cache.tree.nodes.get(below.id) is below
    lease.release()
    assert cache.evict_host(4 * PAGE) == 4 * PAGE


def test_a_backup_the_spec_refuses_is_skipped_not_raised(
    add_rule: Callable[[str], None],
) -> None:
    add_rule(
        '[[forbid]]\nevent = "write"\nguard = "locks >= 1"\n'
        'error = "DeviceLocked"\nreason = "a running request still writes its KV"\n'
    )
    cache = make(policy="write_through_selective", device_pages=16, host_pages=32)
    key = tokens(4, 100)
    cache.insert(key)
    node = cache.match_prefix(key).last_device_node
    lock = cache.lock(node)
    cache.insert(key)  # a second hit: the selective policy wants a backup, the rule refuses it
    assert node.residency() == "unbacked/resident (pins=0, locks=1)"
    lock.release()
    cache.insert(key)
    assert node.residency() == "writing/resident (pins=0, locks=0)"
