"""SGLang 0.5.23's ``UnifiedRadixCache`` driven as its scheduler drives it, stock and patched.

What ``test_scheduler`` does for ``RadixCache``, for the cache 0.5.23's
scheduler builds by default for a plain full-attention model
(``registry.create_unified_radix_cache``: the unified tree with the one
``FULL`` component, no host tier; with ``--disable-radix-cache`` too), on both
tree cores. Each seed's requests make the scheduler's calls in its order:
``match_prefix`` with the request (``match_kv_cache``), ``lock`` at admission
(``_commit_prefill_admission``), a row and KV slots allocated after
``evict_for_alloc`` of the shortfall (``evict_to_free_tokens``), chunked
prefill's ``checkpoint`` (``checkpoint_kv_cache``), decode, the release
(``release_kv_cache``: ``checkpoint`` when finished, ``free_kv_row``,
``unlock``, ``on_release``), ``touch_prefix`` for a waiting request, a second
holder's ``lock`` with or without a host receipt (``_lock_node``), released at
once or held across steps, ``evict``, and ``reset`` when nothing is running,
on a pool small enough that admissions evict and some find no room.

With ``--enable-hierarchical-cache`` the cache also gets its host tier
(``init_hicache``, over CPU fakes of the controller and host pool) under each
write policy, and its own code crosses the lock boundary: a backup locks its
node until acknowledged, a load back pins its host copy and locks its path.
The scheduler then loads host hits back under a lock of the match and its
host copy (``_lock_node(lock_host=True)``, ``init_load_back``), starts the
loads, polls the copies (``check_hicache_events``) as they land late or in
bulk, and evicts host copies; the host pool is small enough that backups fail.

Each seed runs once stock and once under :func:`fsm_cache.compat.sglang.patch`;
after every step both runs must agree on the step's answer, every node (id,
parent, span, device slots, ``FULL`` lock count, host copy), the sizes,
``total_size``, ``all_values_flatten``, the free lists, the copies in flight
and the running requests' rows and receipts. The allocator keeps a ledger of what each slot holds (the KV of one
token after its prefix, in its ``extra_key`` namespace): every matched prefix,
every running request's row and every node's path must hold exactly their
tokens' KV, in both runs; copies carry it between the tiers.

Faults: a lock-boundary call that fails inside the tree core (both runs
raise; the caller keeps its receipt and gives it again, so a patch that had
counted the failed call refuses the retry), and, in the patched run only,
the misuses the patch refuses (a lock released twice, a receipt given to
another node, an acquire on a node the tree no longer has, a host receipt
released twice), each with the error its receipts out call for, and leaving
the cache as the stock run, which skips them, has it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import random
import re
import types
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from fsm_cache.compat.sglang import patch
from fsm_cache.errors import BadArgument, LeaseError, ReleaseAtZero, StaleNode, UnlockAtZero

from .conftest import Api
from .fakes import (
    FakeAllocator,
    FakeReq,
    FakeReqToTokenPool,
    HostPoolGroup,
    HybridController,
    HybridHostPool,
)
from .test_differential import Trace, attempt, first_parting, ints


UNIFIED = "sglang.srt.mem_cache.unified_radix_cache"

Printed = Callable[[], str]
"""What the cache printed since the last call (the Rust core prints from Rust: read at the descriptor)."""

Kv = tuple[str | None, tuple[int, ...]]
"""What one slot holds: the KV of a token after its prefix, in an ``extra_key`` namespace."""

Planted = tuple[Callable[[], Any], type[Exception]]
"""A misuse: the call, and the error the patch must refuse it with."""

MISUSES = ("unlock twice", "another node", "stale acquire", "host twice")
"""The misuses the patched run plants (the stock run skips them)."""

FAULTS = ("inc_lock_ref", "dec_lock_ref", "dec_host_lock_ref")
"""The tree core methods a faulty step makes fail once."""


@pytest.fixture(scope="module")
def unified() -> Any:
    """0.5.23's ``unified_radix_cache`` module; skip where SGLang has none or msgspec is missing."""
    if importlib.util.find_spec(UNIFIED) is None:
        pytest.skip("this SGLang has no UnifiedRadixCache")
    pytest.importorskip("msgspec", reason="make test-sglang installs msgspec in the side venv")
    return importlib.import_module(UNIFIED)


@pytest.fixture
def printed(capfd: pytest.CaptureFixture[str]) -> Printed:
    """What the test printed since the last call, read through the file descriptor."""
    return lambda: capfd.readouterr().out


class Ledger:
    """What each slot of a pool holds; a freed slot holds nothing."""

    def __init__(self) -> None:
        self.kv: dict[int, Kv] = {}

    def write(self, slots: Any, extra: str | None, tokens: list[int], start: int) -> None:
        """The forward pass writes the KV of ``tokens[start:]`` into ``slots``."""
        for offset, slot in enumerate(ints(slots) or []):
            self.kv[slot] = (extra, tuple(tokens[: start + offset + 1]))

    def drop(self, slots: list[int]) -> None:
        """``slots`` were freed: they hold nothing."""
        for slot in slots:
            self.kv.pop(slot, None)

    def holds(self, slots: list[int], extra: str | None, tokens: list[int]) -> bool:
        """Whether ``slots`` hold exactly the KV of ``tokens``' first ``len(slots)``, one each."""
        return len(slots) <= len(tokens) and all(
            self.kv.get(slot) == (extra, tuple(tokens[: i + 1])) for i, slot in enumerate(slots)
        )


class KvAllocator(FakeAllocator):
    """:class:`FakeAllocator` with a :class:`Ledger` of what each device slot holds."""

    def __init__(self, size: int, page_size: int) -> None:
        super().__init__(size, page_size=page_size)
        self.ledger = Ledger()

    def free(self, indices: Any) -> None:
        """Give slots back; what they held is gone."""
        slots = [int(i) for i in indices]
        super().free(slots)
        self.ledger.drop(slots)

    def clear(self) -> None:
        """Free everything (``flush_cache``)."""
        super().clear()
        self.ledger.kv.clear()


class KvHostPool(HybridHostPool):
    """:class:`HybridHostPool` with a :class:`Ledger` of what each host slot holds."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.ledger = Ledger()

    def free(self, indices: Any) -> None:
        """Give host slots back; what they held is gone."""
        slots = [int(i) for i in indices]
        super().free(slots)
        self.ledger.drop(slots)

    def clear(self) -> None:
        """Free everything (``UnifiedRadixCache.reset``)."""
        super().clear()
        self.ledger.kv.clear()


class KvController(HybridController):
    """:class:`HybridController` whose copies carry what the slots hold, device to host and back."""

    mem_pool_device_allocator: KvAllocator
    mem_pool_host: KvHostPool

    def write(
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        *,
        node_id: int = -1,
        extra_pools: object = None,
        flush: bool = True,
        start_owner: int | None = None,
    ) -> torch.Tensor | None:
        """Back up ``device_indices``: the host slots hold what they hold."""
        host = super().write(
            device_indices,
            priority,
            node_id=node_id,
            extra_pools=extra_pools,
            flush=flush,
            start_owner=start_owner,
        )
        if host is not None:
            device = self.mem_pool_device_allocator.ledger.kv
            for src, dst in zip(ints(device_indices) or [], ints(host) or [], strict=True):
                if src in device:
                    self.mem_pool_host.ledger.kv[dst] = device[src]
        return host

    def load(
        self,
        host_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        extra_pools: object = None,
        *,
        device_indices: torch.Tensor | None = None,
        anchor_indices: object = None,
    ) -> torch.Tensor | None:
        """Load ``host_indices`` back: the device slots hold what they hold."""
        device = super().load(
            host_indices,
            priority,
            node_id,
            extra_pools,
            device_indices=device_indices,
            anchor_indices=anchor_indices,
        )
        if device is not None:
            host = self.mem_pool_host.ledger.kv
            for src, dst in zip(ints(host_indices) or [], ints(device) or [], strict=True):
                if src in host:
                    self.mem_pool_device_allocator.ledger.kv[dst] = host[src]
        return device


def attach_host_tier(
    unified: Any, cache: Any, params: Any, monkeypatch: pytest.MonkeyPatch, policy: str
) -> KvController:
    """``init_hicache`` of ``cache`` with a 24-slot host pool, as ``create_unified_radix_cache`` calls it.

    SGLang's ``attach_hybrid_pool_to_unified_cache`` builds the host pools and
    the controller from the model's KV pool on CUDA streams; this one gives
    the cache the CPU fakes, set where SGLang's ``_apply_stack_result`` sets
    them. The server's memory options are read from the runtime context,
    published by the server: here, the write policy and no storage tier.
    """
    assembler = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    host = KvHostPool(24)
    full = importlib.import_module(
        "sglang.srt.mem_cache.unified_cache.component_type"
    ).ComponentType.FULL

    def attach(cache: Any, params: Any, server_args: Any, **options: Any) -> None:
        cache.host_pool_group = HostPoolGroup(host)
        cache.cache_controller = KvController(params.token_to_kv_pool_allocator, host, policy)
        cache.full_kv_pool_host = host
        cache.components[full]._full_kv_pool_host = host  # noqa: SLF001 (SGLang's own attribute)

    memory = types.SimpleNamespace(
        hicache_host_memory_mode="cache",
        hicache_storage_backend=None,
        hicache_write_policy=policy,
        hicache_storage_prefetch_policy="best_effort",
    )
    monkeypatch.setattr(assembler, "attach_hybrid_pool_to_unified_cache", attach)
    monkeypatch.setattr(unified, "get_memory", lambda: memory)
    monkeypatch.setattr(
        unified, "get_observability", lambda: types.SimpleNamespace(extra_metric_labels=None)
    )
    monkeypatch.setattr(unified, "atexit", types.SimpleNamespace(register=lambda f: f))
    cache.init_hicache(types.SimpleNamespace(), params)
    controller: KvController = cache.cache_controller
    return controller


class Driver:
    """One seed's requests through a ``UnifiedRadixCache`` as 0.5.23's scheduler makes its calls.

    Args:
        sg: SGLang's API.
        cache: The cache, stock or patched.
        allocator: Its device allocator.
        seed: The seed of the requests and of every choice.
        patched: Whether the cache is patched (only then are misuses planted).
        printed: What the test printed since the last call.
    """

    def __init__(
        self,
        sg: Api,
        cache: Any,
        allocator: KvAllocator,
        seed: int,
        *,
        patched: bool,
        printed: Printed,
    ) -> None:
        self.sg, self.cache, self.allocator = sg, cache, allocator
        self.patched, self.printed = patched, printed
        self.rnd = random.Random(seed)
        self.pool = FakeReqToTokenPool(rows=8, width=40)
        cache.req_to_token_pool = self.pool
        self.host: KvController | None = cache.cache_controller
        """The host tier's controller, if the cache has one."""
        self.base = cache.root_node_handle()
        """The first root's id: ids are kept relative to it (the Python core's are process-wide)."""
        self.full = importlib.import_module(
            "sglang.srt.mem_cache.unified_cache.component_type"
        ).ComponentType.FULL
        self.running: list[FakeReq] = []
        self.holds: list[tuple[Any, Any, Any]] = []
        """Locks a second holder keeps across steps: ``(node, lock, host receipt or None)``."""
        self.spent: list[Any] = []
        """Locks whose receipts came back, some from before a reset (a misuse gives one again)."""
        self.seen: list[Any] = []
        """Node ids matched or inserted (some are evicted or reset away later)."""
        self.prefixes = [
            [self.rnd.randint(1, 3) for _ in range(self.rnd.randint(2, 8))] for _ in range(4)
        ]
        self.history: list[list[int]] = []
        self.rid = 0
        self.did = Counter[str]()
        self.broken: list[str] = []
        """What a step left holding other KV than it should (each run's own, compared too)."""

    # -- the scheduler's calls -------------------------------------------------

    def tokens(self) -> list[int]:
        """A prompt: a shared prefix's start or an earlier prompt (a conversation's next turn), and new tokens."""
        rnd = self.rnd
        if self.history and rnd.random() < 0.5:  # often an older one, evicted meanwhile
            prefix = rnd.choice(self.history[: max(2, len(self.history) // 2)])
            tokens = prefix + [rnd.randint(1, 4) for _ in range(rnd.randint(1, 4))]
        else:
            prefix = rnd.choice(self.prefixes)
            tokens = prefix[: rnd.randint(0, len(prefix))] + [
                rnd.randint(1, 4) for _ in range(rnd.randint(1, 12))
            ]
        tokens = (tokens if len(tokens) > 1 else [*tokens, 1])[:24]
        self.history.append(tokens)
        return tokens

    def key(self, tokens: list[int], extra: str | None) -> Any:
        return self.sg.rc.RadixKey(array("q", tokens), extra)

    def alloc(self, need: int) -> Any:
        """``need`` slots, after evicting the shortfall as ``evict_to_free_tokens`` does (None: too few)."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.did["evict_for_alloc"] += 1
            self.cache.evict_for_alloc(self.sg.base.EvictParams(num_tokens=short))
        return self.allocator.alloc(need)

    def admit(self, *, fault: bool = False) -> Any:
        """Match a new request, lock its prefix, give it a row and its first chunk's KV.

        With ``fault``, the tree core fails the lock once first (both runs
        raise; the scheduler locks again).
        """
        self.rid += 1
        tokens = self.tokens()
        extra = self.rnd.choice([None, None, None, "lora"])
        req = FakeReq(self.rid, tokens, extra, None, arrays=True)
        req.priority = self.rnd.choice([None, 0, 1, 5])
        found = self.cache.match_prefix(
            self.sg.base.MatchPrefixParams(key=self.key(tokens[:-1], extra), req=req)
        )
        req.prefix_len = req.cache_protected_len = int(found.device_prefix_len)
        req.last_node = found.last_device_node
        self.seen.append(req.last_node)
        loaded = None
        if self.host is not None and found.host_hit_length > 0:
            self.did["host hit"] += 1
            loaded = self.load_back(req, found)
        prefix = self.cache.prefix_device_indices(req)
        if not self.allocator.ledger.holds(ints(prefix) or [], extra, tokens):
            self.broken.append(f"{req.rid}: its matched prefix does not hold its tokens' KV")
        page = self.cache.page_size
        chunk = self.rnd.choice([len(tokens), len(tokens), 2 * page + 1, 3 * page])
        req.extend_end = min(len(tokens), req.prefix_len + chunk)
        if req.extend_end < len(tokens):  # a chunk ends on a page (the prefix does)
            req.extend_end = req.extend_end // page * page
        failed = self.failing("inc_lock_ref", self.cache.lock, req.last_node) if fault else None
        req.lock = self.cache.lock(req.last_node)
        row = self.pool.alloc()
        slots = self.alloc(req.extend_end - req.prefix_len) if row is not None else None
        if row is None or slots is None:  # not admitted: the lock goes back
            if row is not None:
                self.pool.free(row)
            self.cache.unlock(req.lock)
            self.spent.append(req.lock)
            return "no room", tokens, ints(prefix), loaded, failed
        req.req_pool_idx = row
        self.pool.req_to_token[row, : req.prefix_len] = prefix.to(torch.int32)
        self.pool.req_to_token[row, req.prefix_len : req.extend_end] = slots.to(torch.int32)
        self.allocator.ledger.write(slots, extra, tokens, req.prefix_len)
        req.kv_committed_len = req.kv_allocated_len = req.extend_end
        self.cache.maybe_hand_to_session(req)
        self.running.append(req)
        return tokens, req.prefix_len, req.extend_end, loaded, self.receipt(req.lock), failed

    def load_back(self, req: FakeReq, found: Any) -> Any:
        """Load the host hit back under a lock of the match and its host copy (``_lock_node``).

        What ``init_load_back`` loaded joins the request's prefix, which the
        cache then owns (``load_back_is_cache_owned``).
        """
        node = found.best_match_node
        host = self.cache.inc_host_lock_ref(node).to_dec_params()
        lock = self.cache.lock(node)
        try:
            loaded, req.last_node = self.cache.init_load_back(
                self.sg.base.InitLoadBackParams(
                    best_match_node=node, host_hit_length=found.host_hit_length, req=req
                )
            )
        finally:
            self.cache.unlock(lock)
            self.spent.append(lock)
            self.cache.dec_host_lock_ref(node, host)
        req.prefix_len += loaded
        req.cache_protected_len = req.prefix_len
        self.did["loaded"] += loaded > 0
        return found.host_hit_length, loaded

    def prefill(self) -> Any:
        """A chunked request publishes its chunk (``checkpoint_kv_cache``) and computes the next."""
        waiting = [r for r in self.running if r.extend_end < len(r.origin_input_ids)]
        if not waiting:
            return "none chunked"
        req = self.rnd.choice(waiting)
        self.cache.checkpoint(req, up_to=req.extend_end)
        self.seen.append(req.last_node)
        req.prefix_len = req.extend_end
        step = max(self.cache.page_size, 2) * self.rnd.choice([1, 2, 3])  # ends on a page
        end = min(len(req.origin_input_ids), req.extend_end + step)
        slots = self.alloc(end - req.extend_end)
        if slots is None:
            return "no room", req.cache_protected_len
        self.pool.req_to_token[req.req_pool_idx, req.extend_end : end] = slots.to(torch.int32)
        self.allocator.ledger.write(
            slots, req.extra_key, list(req.origin_input_ids), req.extend_end
        )
        req.extend_end = req.kv_committed_len = req.kv_allocated_len = end
        return req.cache_protected_len, end, self.receipt(req.lock)

    def decode(self) -> Any:
        """One more output token, its KV in the request's row."""
        done = [r for r in self.running if r.extend_end == len(r.origin_input_ids)]
        if not done:
            return "none decoding"
        req = self.rnd.choice(done)
        if req.length() >= self.pool.width:
            return "row full"
        slot = self.alloc(1)
        if slot is None:
            return "no room"
        req.output_ids.append(self.rnd.randint(1, 4))
        req.refresh()
        self.pool.req_to_token[req.req_pool_idx, req.length() - 1] = int(slot[0])
        self.allocator.ledger.write(slot, req.extra_key, list(req.fill_ids), req.length() - 1)
        req.kv_committed_len = req.kv_allocated_len = req.length()
        return req.length()

    def release(self, *, fault: bool = False) -> Any:
        """``release_kv_cache``: finished (its KV into the tree), or aborted or retracted (not).

        With ``fault``, the tree core fails the ``unlock`` once first (both
        runs raise; the caller still holds its lock and releases it again).
        """
        req = self.running.pop(self.rnd.randrange(len(self.running)))
        finished = req.extend_end == len(req.origin_input_ids) and self.rnd.random() < 0.8
        if finished:
            req.finished_reason = "length"
            req.refresh()
            self.cache.checkpoint(req, up_to=req.kv_committed_len)
            self.seen.append(req.last_node)
        self.cache.free_kv_row(req.kv, [(req.cache_protected_len, req.kv_committed_len)])
        failed = self.failing("dec_lock_ref", self.cache.unlock, req.lock) if fault else None
        self.cache.unlock(req.lock)
        self.spent.append(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=finished)
        self.pool.free(req)
        return finished, req.kv_committed_len, req.cache_protected_len, failed

    def touch(self) -> Any:
        """A waiting request refreshes its prefix's recency (``touch_waiting_prefix``)."""
        self.cache.touch_prefix(self.key(self.tokens(), self.rnd.choice([None, "lora"])))
        return "touched"

    def hold(self) -> Any:
        """A second holder locks a running request's node (``_lock_node``), maybe its host copy too."""
        node = self.rnd.choice(self.running).last_node
        host = None
        if self.rnd.random() < 0.5:
            host = self.cache.inc_host_lock_ref(node).to_dec_params()
        lock = self.cache.lock(node)
        if self.rnd.random() < 0.4:  # released as _lock_node's block ends
            self.cache.unlock(lock)
            self.spent.append(lock)
            if host is not None:
                self.cache.dec_host_lock_ref(node, host)
            return "held", self.receipt(lock), host is not None
        self.holds.append((node, lock, host))
        return "kept", self.receipt(lock), host is not None

    def drop(self, *, fault: bool = False) -> Any:
        """The second holder lets go of one lock it kept (with ``fault``, the host release fails once first)."""
        node, lock, host = self.holds.pop(self.rnd.randrange(len(self.holds)))
        self.cache.unlock(lock)
        self.spent.append(lock)
        failed = None
        if host is not None:
            if fault:
                failed = self.failing("dec_host_lock_ref", self.cache.dec_host_lock_ref, node, host)
            self.cache.dec_host_lock_ref(node, host)
        return "dropped", self.cache.protected_size(), failed

    def evict(self) -> Any:
        return repr(self.cache.evict(self.sg.base.EvictParams(num_tokens=self.rnd.randint(1, 16))))

    def idle(self) -> Any:
        """The scheduler's idle self-check: SGLang's own ``sanity_check`` of the tree."""
        if self.running or self.holds:
            return "busy"
        self.cache.sanity_check()
        return "checked"

    def start(self) -> Any:
        """The batch's loads start (``ready_to_load_host_cache``)."""
        return self.cache.ready_to_load_host_cache()

    def settle(self) -> Any:
        """Some copies land, late or in bulk; the scheduler polls them (``check_hicache_events``)."""
        assert self.host is not None
        if self.rnd.random() < 0.8:
            self.host.finish_writes()
        if self.rnd.random() < 0.8:
            self.host.finish_loads()
        self.cache.check_hicache_events()
        return "settled"

    def evict_host(self) -> Any:
        return self.cache.evict_host(self.rnd.randint(1, 16))

    def reset(self) -> Any:
        """``flush_cache``: only when nothing is running or held, as SGLang's scheduler checks."""
        if self.running or self.holds:
            return "busy"
        self.cache.reset()
        self.allocator.clear()
        return "reset"

    # -- faults ------------------------------------------------------------------

    def failing(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` with the tree core's ``name`` failing: what was raised, and the sizes after."""
        with self.core_fails(name):
            try:
                call(*args)
            except OSError as exc:
                self.did[f"failed {name}"] += 1
                return str(exc), self.cache.protected_size(), self.cache.evictable_size()
        return "did not fail"  # a disabled cache calls no core

    @contextmanager
    def core_fails(self, name: str) -> Iterator[None]:
        core = self.cache.tree_core
        stock = getattr(core, name)

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError(f"tree core failed in {name}")

        setattr(core, name, broken)
        try:
            yield
        finally:
            setattr(core, name, stock)

    # -- the misuses the patched run plants --------------------------------------

    def misuse(self) -> Any:
        """Choose a misuse the same way in both runs; plant it in the patched run only.

        Refused, it must leave the cache as the stock run, which never made
        the call, has it: the comparison after the step checks that.
        """
        if self.cache.disable:  # a disabled cache is SGLang's alone: nothing is checked
            return "disabled"
        targets = [(kind, self.planted(kind)) for kind in MISUSES]
        found = [(kind, planted) for kind, planted in targets if planted is not None]
        if not found:
            return "no target"
        kind, (call, error) = self.rnd.choice(found)
        if self.patched:
            with pytest.raises(error) as refused:
                call()
            assert type(refused.value) is error, (kind, refused.value)
            self.did[f"{kind}: {error.__name__}"] += 1
        return kind, error.__name__

    def planted(self, kind: str) -> Planted | None:
        """The call ``kind`` makes here and the error it must get, or None when it has no target."""
        cache, rnd = self.cache, self.rnd
        if kind == "unlock twice" and self.spent:
            # One whose node has no other receipt out, or one whose node has (from both, evenly).
            held = [bool(self.out(lock.node, host=False)) for lock in self.spent]
            other = rnd.choice(sorted(set(held)))
            lock = rnd.choice(
                [lock for lock, out in zip(self.spent, held, strict=True) if out == other]
            )
            return functools.partial(cache.unlock, lock), LeaseError if other else UnlockAtZero
        if kind == "another node" and self.locks():
            lock = rnd.choice(self.locks())
            others = sorted(node for node in self.nodes() if node != lock.node)
            if others:
                call = functools.partial(cache.dec_lock_ref, rnd.choice(others), lock.receipt)
                return call, BadArgument
        if kind == "stale acquire":
            gone = [node for node in self.seen if not self.exists(node)]
            if gone:
                return functools.partial(cache.inc_lock_ref, rnd.choice(gone)), StaleNode
        if kind == "host twice" and self.running:
            node = rnd.choice(self.running).last_node
            out = self.out(node, host=True)

            def twice() -> None:
                receipt = cache.inc_host_lock_ref(node).to_dec_params()
                cache.dec_host_lock_ref(node, receipt)
                cache.dec_host_lock_ref(node, receipt)  # the second release: the misuse

            return twice, LeaseError if out else ReleaseAtZero
        return None

    def locks(self) -> list[Any]:
        """The locks out: the running requests' and the second holder's."""
        return [req.lock for req in self.running] + [lock for _, lock, _ in self.holds]

    def out(self, node: Any, *, host: bool) -> int:
        """How many receipts are out on ``node``: the scheduler's and the cache's own copies'.

        A backup in flight holds a lock on its node (write-through), a load
        back a lock and a host receipt on its anchor, until acknowledged.
        """
        cache = self.cache
        loads = [load.node_id for load in cache.ongoing_load_back.values()]
        if host:
            held = [n for n, _, receipt in self.holds if receipt is not None]
            return (held + loads).count(node)
        writes = [w.node_id for w in cache.ongoing_write_through.values() if w.lock_params]
        return ([lock.node for lock in self.locks()] + writes + loads).count(node)

    def exists(self, node: Any) -> bool:
        """Whether the tree has ``node`` (the core's read-only path walk raises ``KeyError`` if not)."""
        try:
            self.cache.tree_core.collect_path_info([node])
        except KeyError:
            return False
        return True

    # -- what both runs must agree on --------------------------------------------

    def receipt(self, lock: Any) -> Any:
        """A lock's receipt, comparable across runs: its anchor relative to the first root, its maps."""
        if lock is None:
            return None
        params = lock.receipt
        anchor = None if params.node_id is None else params.node_id - self.base
        return anchor, params.skipped_lock_components, self.uuids(params)

    @staticmethod
    def uuids(params: Any) -> tuple[Any, ...]:
        """A receipt's segment marks, without their values (drawn from a process-wide counter)."""
        return tuple(
            sorted((int(ct), uuid is None) for ct, uuid in uuid_map.items())
            for uuid_map in (params.component_lock_uuids, params.component_host_lock_uuids)
        )

    def nodes(self) -> dict[int, tuple[int, int]]:
        """Every node's id with its key length and ``FULL`` lock count, as the core prints them."""
        self.printed()
        self.cache.pretty_print()
        lines = re.findall(r"\[(\d+)\] (\d+) full_lock=(-?\d+)", self.printed())
        return {int(node): (int(length), int(lock)) for node, length, lock in lines}

    def snapshot(self) -> list[tuple[Any, ...]]:
        """Every node, ids relative to the first root: parent, span, device slots, lock count.

        Each node's path must hold one token sequence's KV (:meth:`check_path`).
        """
        core = self.cache.tree_core
        out: list[tuple[Any, ...]] = []
        for node, (length, lock) in sorted(self.nodes().items()):
            if core.is_root(node):
                out.append((node - self.base, length, lock))
                continue
            (path,) = core.collect_path_info([node])
            info = path[-1]
            span = (info.path_start, info.path_end, info.full_value_len, info.num_children)
            value = ints(core.get_component_device_value(node, self.full))
            host = (
                self.cache.is_backuped(node),
                core.component_has_host_value_only(node, self.full),
            )
            out.append((node - self.base, info.parent_id - self.base, span, lock, value, host))
            if value is not None:
                self.check_path(node)
        return out

    def check_path(self, node: Any) -> None:
        """Note it if ``node``'s path does not hold one token sequence's KV, slot by slot."""
        slots = ints(self.cache.path_device_indices(node)) or []
        held = [self.allocator.ledger.kv.get(slot) for slot in slots]
        extras = {kv[0] for kv in held if kv is not None}
        tokens = [kv[1][-1] for kv in held if kv is not None]
        if (
            None in held
            or len(extras) != 1
            or not self.allocator.ledger.holds(slots, extras.pop(), tokens)
        ):
            self.broken.append(f"node {node - self.base}: its path holds {held}")

    def readouts(self) -> tuple[Any, ...]:
        """The sizes, the values, both free lists, the rows and receipts out, what held wrong KV.

        Each running request's row must hold its tokens' KV, position by position.
        """
        cache = self.cache
        rows = []
        for req in self.running:
            row = [int(x) for x in self.pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]]
            if not self.allocator.ledger.holds(row, req.extra_key, list(req.fill_ids)):
                self.broken.append(f"{req.rid}: its row does not hold its tokens' KV")
            rows.append((req.rid, row, req.cache_protected_len, self.receipt(req.lock)))
        return (
            cache.evictable_size(),
            cache.protected_size(),
            cache.total_size(),
            sorted(ints(cache.all_values_flatten()) or []),
            list(self.allocator.free_slots),
            sorted(self.pool.free_rows),
            rows,
            [self.receipt(lock) for _, lock, _ in self.holds],
            self.copies(),
            self.broken[:],
        )

    def copies(self) -> tuple[Any, ...] | None:
        """The host tier: its free list, the copies in flight and their acknowledgements."""
        if self.host is None:
            return None
        host, base = self.host, self.base
        return (
            list(host.mem_pool_host.free_slots),
            sorted(node - base for node in self.cache.ongoing_write_through),
            sorted(node - base for node in self.cache.ongoing_load_back),
            [[node - base for node in ack.node_ids] for ack in host.ack_write_queue],
            [[node - base for node in ack.node_ids] for ack in host.ack_load_queue],
            [copy.node_id - base for copy in host.write_queue + host.load_queue],
        )


STEPS: dict[str, int] = {
    "admit": 6,
    "faulty admit": 1,
    "prefill": 3,
    "decode": 4,
    "release": 4,
    "faulty release": 1,
    "touch": 1,
    "hold": 3,
    "drop": 2,
    "faulty drop": 2,
    "evict": 1,
    "misuse": 3,
    "idle": 1,
    "reset": 1,
}
"""The scheduler's steps and their weights."""

HOST_STEPS: dict[str, int] = {"start": 2, "settle": 4, "evict_host": 1}
"""What it does besides with a host tier: start the loads, poll the copies, evict host copies."""

NEEDS_RUNNING = {"prefill", "decode", "release", "faulty release", "hold"}
NEEDS_HOLDS = {"drop", "faulty drop"}


def run(
    sg: Api, unified: Any, seed: int, *, patched: bool, printed: Printed, **options: Any
) -> tuple[Trace, Counter[str]]:
    """One seed through a ``FULL``-only ``UnifiedRadixCache`` of 40 device slots, 80 steps.

    Args:
        sg: SGLang's API.
        unified: SGLang's ``unified_radix_cache`` module.
        seed: The seed.
        patched: Whether ``patch()`` is applied (the misuses are planted).
        printed: What the test printed since the last call.
        options: ``core``, ``page``, ``policy`` and ``disable``; with a host
            tier, its write ``hicache`` policy and the ``monkeypatch`` that
            attaches it (:func:`attach_host_tier`).
    """
    full = importlib.import_module(
        "sglang.srt.mem_cache.unified_cache.component_type"
    ).ComponentType.FULL
    allocator = KvAllocator(40, options["page"])
    params = sg.cache_params(
        allocator,
        options["page"],
        disable=options["disable"],
        tree_components=(full,),
        tree_core_backend=options["core"],
        eviction_policy=options["policy"],
    )
    cache = unified.UnifiedRadixCache(params)
    rnd = random.Random(seed + 7)
    steps = dict(STEPS)
    if options.get("hicache"):
        attach_host_tier(unified, cache, params, options["monkeypatch"], options["hicache"])
        cache.load_back_threshold = rnd.choice([1, 2, 4])
        steps |= HOST_STEPS
    driver = Driver(sg, cache, allocator, seed, patched=patched, printed=printed)
    calls: dict[str, Callable[[], Any]] = {
        "admit": driver.admit,
        "faulty admit": functools.partial(driver.admit, fault=True),
        "prefill": driver.prefill,
        "decode": driver.decode,
        "release": driver.release,
        "faulty release": functools.partial(driver.release, fault=True),
        "touch": driver.touch,
        "hold": driver.hold,
        "drop": driver.drop,
        "faulty drop": functools.partial(driver.drop, fault=True),
        "evict": driver.evict,
        "misuse": driver.misuse,
        "idle": driver.idle,
        "reset": driver.reset,
        "start": driver.start,
        "settle": driver.settle,
        "evict_host": driver.evict_host,
    }
    trace: Trace = []
    for _ in range(options.get("steps", 80)):
        name = rnd.choices(list(steps), list(steps.values()))[0]
        rec: list[Any] = [name]
        if (name not in NEEDS_RUNNING or driver.running) and (
            name not in NEEDS_HOLDS or driver.holds
        ):
            attempt(rec, calls[name])
            driver.did[name] += 1
        rec.append(driver.snapshot())
        rec.append(driver.readouts())
        trace.append(rec)
    return trace, driver.did


def compare(
    run_once: Callable[[int, bool], tuple[Trace, Counter[str]]], seeds: int, *, trail: bool
) -> Counter[str]:
    """Run each seed stock and patched; assert they never part; count what the runs did.

    Stock SGLang must never raise here, nor leave a slot holding other KV
    than the ledger says it should.
    """
    parted, did = {}, Counter[str]()
    for seed in range(seeds):
        stock, did_stock = run_once(seed, False)
        with patch(trail=trail):
            patched, did_patched = run_once(seed, True)
        parted[seed] = first_parting(stock, patched)
        raised = [rec for rec in stock if type(rec[1]) is tuple and rec[1][:1] == ("raised",)]
        assert raised == [], f"seed {seed}: stock SGLang raised"
        assert stock[-1][-1][-1] == [], f"seed {seed}: stock SGLang's KV is not its tokens'"
        did += did_stock
        did.update({kind: n for kind, n in did_patched.items() if ": " in kind})
        for rec in stock:
            did["deep tree"] += len(rec[-2]) > 2  # the root and more than one node
            did["no room"] += rec[0] == "admit" and len(rec) == 4 and rec[1][0] == "no room"
            did["inserted"] += rec[0] == "release" and len(rec) == 4 and rec[1][0]
            did["reset"] += rec[0] == "reset" and rec[1:2] == ["reset"]
            did["sanity_check"] += rec[0] == "idle" and rec[1:2] == ["checked"]
            did["host only"] += any(node[-1][1] for node in rec[-2] if len(node) > 3)
    assert {seed: where for seed, where in parted.items() if where} == {}
    return did


def assert_reached(did: Counter[str]) -> None:
    """The streams reached what they are meant to: every step, fault and misuse, evictions."""
    assert min(did[step] for step in STEPS) >= 2, did
    for what in ("inserted", "reset", "no room", "evict_for_alloc", "deep tree"):
        assert did[what] >= 3, (what, did)
    assert did["sanity_check"] >= 1, did
    for name in FAULTS:  # each fault reached the core and both runs agreed after it
        assert did[f"failed {name}"] >= 1, (name, did)
    for kind in MISUSES:  # each misuse was planted and refused
        assert sum(n for key, n in did.items() if key.startswith(f"{kind}: ")) >= 1, (kind, did)
    assert did["unlock twice: UnlockAtZero"] >= 1, did  # no other lock out on its node
    assert did["unlock twice: LeaseError"] >= 1, did  # another lock out on its node


@pytest.mark.parametrize(
    ("core", "policy", "page", "trail"),
    [
        ("python", "lru", 1, False),
        ("python", "priority", 4, True),
        ("rust", "lru", 1, True),
        ("rust", "lfu", 4, False),
        ("rust", "tlru", 1, False),
    ],
)
def test_unified_agrees_with_stock_under_the_scheduler(
    sg: Api, unified: Any, printed: Printed, *, core: str, policy: str, page: int, trail: bool
) -> None:
    options = {"core": core, "page": page, "policy": policy, "disable": False}

    def run_once(seed: int, patched: bool) -> tuple[Trace, Counter[str]]:
        return run(sg, unified, seed, patched=patched, printed=printed, **options)

    assert_reached(compare(run_once, seeds=6, trail=trail))


@pytest.mark.parametrize(
    ("core", "hicache", "page"),
    [
        ("python", "write_through", 1),
        ("python", "write_back", 4),
        ("rust", "write_through", 4),
        ("rust", "write_through_selective", 1),
        ("rust", "write_back", 1),
    ],
)
def test_unified_with_a_host_tier_agrees_with_stock_under_the_scheduler(
    sg: Api,
    unified: Any,
    printed: Printed,
    monkeypatch: pytest.MonkeyPatch,
    *,
    core: str,
    hicache: str,
    page: int,
) -> None:
    """``--enable-hierarchical-cache``: SGLang's own locks (write-through, load back) cross the book too.

    A backup locks its node until its acknowledgement, a load back locks the
    match and pins its host copy until its own, and both run inside the
    cache, on the host pool's 24 slots (backups fail when it is full).
    """
    options = {"core": core, "page": page, "policy": "lru", "disable": False}
    options |= {"hicache": hicache, "monkeypatch": monkeypatch, "steps": 160}

    def run_once(seed: int, patched: bool) -> tuple[Trace, Counter[str]]:
        return run(sg, unified, seed, patched=patched, printed=printed, **options)

    did = compare(run_once, seeds=6, trail=core == "rust")
    assert_reached(did)
    assert min(did[step] for step in HOST_STEPS) >= 3, did
    # write_through_selective backs up a prefix only once it is hit twice: fewer host copies.
    assert did["loaded"] >= (1 if hicache == "write_through_selective" else 2), did
    assert did["host only"] >= 3, did


@pytest.mark.parametrize("core", ["python", "rust"])
def test_a_disabled_unified_cache_agrees_with_stock_under_the_scheduler(
    sg: Api, unified: Any, printed: Printed, core: str
) -> None:
    """``--disable-radix-cache`` builds a ``UnifiedRadixCache`` too: it holds nothing, both ways."""
    options = {"core": core, "page": 1, "policy": "lru", "disable": True}

    def run_once(seed: int, patched: bool) -> tuple[Trace, Counter[str]]:
        return run(sg, unified, seed, patched=patched, printed=printed, **options)

    did = compare(run_once, seeds=2, trail=True)
    assert min(did[step] for step in ("admit", "release", "hold", "drop", "reset")) >= 2, did
    assert did["deep tree"] == 0, did
