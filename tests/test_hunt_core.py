"""Defects found by an adversarial hunt through the cache core, one test each."""

from __future__ import annotations

import pytest
import torch

from fsm_cache.cache.arguments import TokenKey
from fsm_cache.cache.hicache import HiCache
from fsm_cache.errors import BadArgument
from fsm_cache.memory.tiers import CacheConfig


BASE = CacheConfig(
    device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
)


def states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


# -- token ids that are bools -------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, 3, True], "tokens[3] is True, not an int"),
        ([False, 1, 2, 3], "tokens[0] is False, not an int"),
        ([0, 1, 256, 512, 7, 1, 0, False], "tokens[7] is False, not an int"),
        (torch.tensor([True, False, True, True]), "tokens[0] is True, not an int"),
    ],
)
def test_bool_token_ids_are_refused_and_change_nothing(tokens: object, message: str) -> None:
    """Bools were taken as the ids 0 and 1: ``[True, False, ...]`` matched ``[1, 0, ...]``'s KV."""
    cache = HiCache(BASE)
    cache.insert([1, 0, 1, 1, 5, 6, 7, 8])
    before, logged = states(cache), list(cache.log.entries)
    for op, call in (
        ("insert", lambda: cache.insert(tokens)),  # type: ignore[arg-type]
        ("match_prefix", lambda: cache.match_prefix(tokens)),  # type: ignore[arg-type]
        ("TokenKey", lambda: TokenKey(tokens)),  # type: ignore[arg-type]
    ):
        with pytest.raises(BadArgument) as caught:
            call()
        assert str(caught.value) == f"{op}: {message}"
    assert (states(cache), list(cache.log.entries)) == (before, logged)


def test_ids_0_and_1_as_ints_still_match() -> None:
    cache = HiCache(BASE)
    cache.insert([1, 0, 1, 1, 0, 0, 0, 1])
    assert cache.match_prefix(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1])).device_len == 8
    assert cache.match_prefix(TokenKey([1, 0, 1, 1])).device_len == 4
