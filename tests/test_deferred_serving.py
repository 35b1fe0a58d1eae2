"""The serving loop on fake CUDA streams: copies land late, and no lookup is ever wrong.

On a GPU a load spans several polls, and the serving loop inserts leaves under
a chain still loading. :func:`~fsm_cache.testing.fakecuda.deferred_copier`
runs the copy engine's CUDA path on CPU tensors with each copy's effect held
back until its event completes (a seeded 0..N polls), so the cache meets the
orders a GPU produces. Before issue 13's fix this handed out 8, 1 and 22 wrong
prefixes under write-through, selective write-through and write-back.
"""

from __future__ import annotations

import pytest
import torch

from fsm_cache.bench.serving import serve
from fsm_cache.bench.workload import ChatWorkload, requests
from fsm_cache.cache.hicache import HiCache
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.testing.fakecuda import deferred_copier


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_prefix_served_holds_its_tokens_kv(policy: str, seed: int) -> None:
    cache = HiCache(
        CacheConfig(
            device_pages=48,
            host_pages=160,
            page_size=4,
            layers=1,
            heads=1,
            head_dim=4,
            device="cpu",
            write_policy=policy,
            load_back_threshold=4,
            selective_threshold=1,
            copier=deferred_copier(seed=seed, max_polls=4),
            debug=True,
        )
    )
    trace = ChatWorkload(
        requests=120, system_prompts=2, system_tokens=16, turn_tokens=8, live=6, seed=seed
    )
    layout = cache.tiers.device.layout
    checked = 0
    for request in requests(trace):
        key = request.tokens[: len(request.tokens) - len(request.tokens) % 4]
        match = cache.match_prefix(key)
        got = cache.tiers.read_device(match.device_pages).contiguous().view(torch.uint8)
        want = synthetic_kv(layout, key[: match.device_len]).contiguous().view(torch.uint8)
        assert torch.equal(got, want), f"request {request}: wrong KV for {match.device_len} tokens"
        checked += match.device_len > 0
        serve(cache, [request])
    assert checked > 20
    assert cache.stats().transitions["load_done"] > 0  # load-backs really crossed polls
    cache.close()
    cache_nodes = list(cache.tree)
    assert all(n.host != "writing" and n.device != "loading" for n in cache_nodes)
