"""HiCache under copy faults, its metrics, its event log, and the CLI jobs built on it."""

from __future__ import annotations

import gc

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.metrics import register
from fsm_cache.cache.replay import replay
from fsm_cache.cli.main import main
from fsm_cache.engine import lease as leases
from fsm_cache.errors import CacheClosed, ForeignSlot, ReplayMismatch
from fsm_cache.memory import staging
from fsm_cache.memory.copies import POISON, CopyEngine
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.testing.fakecuda import deferred_copier
from fsm_cache.testing.faults import FaultyCopyEngine


def config(fail: tuple[int, ...] = (), **overrides: object) -> CacheConfig:
    settings: dict[str, object] = {
        "device_pages": 8,
        "host_pages": 16,
        "page_size": 4,
        "layers": 1,
        "heads": 1,
        "head_dim": 4,
        "load_back_threshold": 4,
        "debug": True,
        "copier": FaultyCopyEngine.copier(fail=fail),
    }
    settings.update(overrides)
    return CacheConfig(**settings)  # type: ignore[arg-type]


def _fails(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """A copy that raises at launch, as ``Tensor.copy_`` does when it cannot run."""
    raise RuntimeError("copy_ refused")


class TestCopyFaults:
    """A failed copy is an event like any other: nothing leaks, data already safe stays."""

    def test_failed_backup_frees_its_host_pages(self) -> None:
        """A failed device-to-host copy fires write_failed: unbacked again, host pages free."""
        cache = HiCache(config(fail=(1,)))
        cache.insert(list(range(8)))
        cache.poll()
        (node,) = list(cache.tree)
        assert (node.host, node.host_pages) == ("unbacked", ())
        assert cache.tiers.host.allocator.free_pages == 16
        assert cache.stats().transitions["write_failed"] == 1

    def test_failed_backup_a_holder_pinned_is_copied_again(self) -> None:
        """A pin taken while the copy is in flight waits for it: a failure copies again (issue 14)."""
        cache = HiCache(config(fail=(1,)))
        cache.insert(list(range(8)))
        (node,) = list(cache.tree)
        lease = cache.pin(node)
        assert (node.host, node.pins) == ("writing", 1)
        cache.poll()  # copy 1 fails: still writing, still pinned, queued again
        assert (node.host, node.pins, cache.stats().transitions.get("write_failed", 0)) == (
            "writing",
            1,
            0,
        )
        cache.poll()  # copy 2 lands: the pin now holds a valid copy
        assert (node.host, node.pins) == ("pinned", 1)
        expected = synthetic_kv(cache.tiers.device.layout, node.key)
        assert torch.equal(cache.tiers.host.read(node.host_pages), expected)
        lease.release()
        assert (node.host, node.pins) == ("backed", 0)

    def test_a_split_of_a_pinned_backup_that_fails_copies_both_halves_again(self) -> None:
        """The holder's pin stays on the suffix; the prefix must not give up its backup.

        Otherwise the suffix's second copy lands backed under an unbacked prefix
        (invariant 3), and the prefix can never be evicted (its delete is refused).
        """
        cache = HiCache(config(fail=(1,), page_size=2, write_policy="write_through"))
        tokens = list(range(1, 9))
        cache.insert(tokens)
        lease = cache.pin(cache.match_prefix(tokens).last_device_node)
        cache.match_prefix(tokens[:4])  # splits the node: the same copy serves both halves
        cache.poll()  # copy 1 fails: both halves are copied again
        cache.poll()  # copy 2 lands
        (prefix,) = [n for n in cache.tree if n.parent is not None and n.parent.parent is None]
        (suffix,) = [n for n in cache.tree if n.parent is prefix]
        assert (prefix.key, prefix.host) == ((1, 2, 3, 4), "backed")
        assert (suffix.key, suffix.host, suffix.pins) == ((5, 6, 7, 8), "pinned", 1)
        cache.check_invariants()
        layout = cache.tiers.device.layout
        for node in (prefix, suffix):
            assert torch.equal(
                cache.tiers.host.read(node.host_pages), synthetic_kv(layout, node.key)
            )
        lease.release()
        assert cache.evict(8) == 8
        cache.check_invariants()
        assert cache.tiers.device.allocator.free_pages == 8

    def test_a_load_back_whose_copy_is_refused_returns_none(self) -> None:
        """The copy starts as the operation ends; refused, the chain is host-only again.

        Returning it as loading would send a caller to lock and wait on nodes
        with nothing on the device (docs/hicache.md, "Loads in flight").
        """

        cache = HiCache(config(copier=FaultyCopyEngine.copier(refuse=[2])))
        cache.insert(list(range(8)))
        cache.poll()
        assert cache.evict(8) == 8
        (node,) = list(cache.tree)
        assert cache.load_back(node) is None
        assert (node.host, node.device) == ("backed", "absent")
        assert cache.stats().transitions["load_failed"] == 1
        assert cache.tiers.device.allocator.free_pages == 8
        assert cache.load_back(node) == [node]  # copy 3 starts
        cache.poll()
        assert node.device == "resident"

    def test_an_insert_with_bad_slots_through_a_loading_node_changes_nothing(self) -> None:
        """Its slots are checked before it waits for the load, which would apply copies."""
        cache = HiCache(config(copier=deferred_copier(seed=0, max_polls=0), page_size=2))
        tokens = [1, 2, 3, 4]
        cache.insert(tokens)
        cache.poll()
        assert cache.evict(4) == 4
        cache.load_back(cache.match_prefix(tokens).last_host_node)  # in flight, not applied
        (node,) = list(cache.tree)

        def seen() -> tuple[object, ...]:
            stats = cache.stats()
            free = cache.tiers.device.allocator.free_pages
            return node.residency(), dict(stats.transitions), free, len(cache.issued())

        before = seen()
        with pytest.raises(ForeignSlot) as refused:
            cache.insert([*tokens, 5, 6], device_slots=[0, 1, 2, 3, 4, 5])  # 2 is no slot of it
        assert str(refused.value) == (
            "insert: device page 2 is free; a request's slots come from alloc_slots"
        )
        assert seen() == before
        assert node.device == "loading"
        cache.close()  # the load is still queued on its fake stream

    # the lock is held across close on purpose: its lease reports it when collected
    @pytest.mark.filterwarnings("ignore::ResourceWarning")
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    def test_close_starts_no_copy_it_would_not_apply(self) -> None:
        """A locked load whose copies keep failing: every copy close started is applied."""
        engines: list[FaultyCopyEngine] = []

        def failing(device: KVPool, host: KVPool) -> FaultyCopyEngine:
            engines.append(FaultyCopyEngine(CopyEngine(device, host), fail=range(2, 40)))
            return engines[-1]

        cache = HiCache(config(copier=failing))
        cache.insert(list(range(8)))
        cache.poll()
        assert cache.evict(8) == 8
        (node,) = list(cache.tree)
        chain = cache.load_back(node)
        assert chain == [node]
        lock = cache.lock(node)  # the load can now only finish or be copied again
        cache.close()
        applied = sum(len(acks) for _, acks in cache.log.acknowledgements())
        assert applied == engines[0].started > 2
        assert node.device == "loading"  # still failing when close gave up, never dropped
        with pytest.raises(CacheClosed):
            lock.release()
        known = {id(d) for d in leases.dropped_leases()}
        del lock  # dropped on purpose: the run's leak report must not count it
        gc.collect()
        leases.forget_dropped([d for d in leases.dropped_leases() if id(d) not in known])

    def test_failed_load_leaves_the_host_copy(self) -> None:
        """A failed host-to-device copy fires load_failed: absent again, host copy intact."""
        cache = HiCache(config(fail=(2,)))
        cache.insert(list(range(8)))
        cache.poll()
        cache.evict(8)
        (node,) = list(cache.tree)
        assert cache.load_back(node) == [node]
        cache.poll()
        assert (node.host, node.device, node.pins) == ("backed", "absent", 0)
        assert cache.tiers.device.allocator.free_pages == 8
        expected = synthetic_kv(cache.tiers.device.layout, node.key)
        assert torch.equal(cache.tiers.host.read(node.host_pages), expected)

    @pytest.mark.parametrize("position", [1, 2, 3, 4])
    def test_every_copy_position_conserves_both_pools(self, position: int) -> None:
        """Whichever copy fails, both pools conserve and backed nodes keep their KV."""
        cache = HiCache(config(fail=(position,)))
        for start in (0, 100):
            cache.insert(list(range(start, start + 8)))
            cache.poll()
        cache.evict(16)
        for node in list(cache.tree):
            cache.load_back(node)
            cache.poll()
        cache.check_invariants()
        for node in cache.tree:
            if node.host in ("backed", "pinned"):
                expected = synthetic_kv(cache.tiers.device.layout, node.key)
                assert torch.equal(cache.tiers.host.read(node.host_pages), expected)

    def test_a_real_backup_whose_launch_fails_is_write_failed_over_poisoned_pages(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The plain engine, no injected fault: its host pages hold no half-written KV."""
        cache = HiCache(config(copier=CopyEngine))
        cache.insert(list(range(8)))
        (node,) = list(cache.tree)
        pages = node.host_pages  # the backup's, reserved while it is in flight
        monkeypatch.setattr(staging, "_copy", _fails)
        cache.poll()  # the batch is launched, fails, and is reported
        assert (node.host, node.host_pages) == ("unbacked", ())
        assert cache.stats().transitions["write_failed"] == 1
        assert bool((cache.tiers.host.read(list(pages)).view(torch.uint8) == POISON).all())

    def test_a_real_load_whose_launch_fails_is_load_failed_over_poisoned_pages(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The device pages a failed load was given read as poison, never as the node's KV."""
        cache = HiCache(config(copier=CopyEngine))
        cache.insert(list(range(8)))
        cache.poll()
        cache.evict(8)
        (node,) = list(cache.tree)
        monkeypatch.setattr(staging, "_copy", _fails)
        assert cache.load_back(node) == [node]
        pages = list(node.device_pages)  # the load's, until its failure is applied
        cache.poll()
        assert (node.host, node.device) == ("backed", "absent")
        assert cache.stats().transitions["load_failed"] == 1
        assert bool((cache.tiers.device.read(pages).view(torch.uint8) == POISON).all())
        expected = synthetic_kv(cache.tiers.device.layout, node.key)
        assert torch.equal(cache.tiers.host.read(node.host_pages), expected)

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
    def test_round_trip_is_bit_exact_for_each_dtype(self, dtype: str) -> None:
        """Write, back up, evict, load back: the device KV equals what was written."""
        cache = HiCache(config(dtype=dtype))
        cache.insert(list(range(16)))
        cache.poll()
        (node,) = list(cache.tree)
        written = cache.tiers.read_device(node.device_pages)
        cache.evict(16)
        cache.load_back(node)
        cache.poll()
        assert torch.equal(cache.tiers.read_device(node.device_pages), written)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("adopted", "free_slots: device page 0 belongs to node 1, not to a request"),
        ([4000, 4001, 4002, 4003], "free_slots: device pool: page 1000 outside 0..7"),
        ([1], "free_slots: 1 slots is not a multiple of page_size 4"),
        ([2**63] * 4, "free_slots: slots are not whole pages of size 4"),
    ],
)
def test_free_slots_names_itself_and_the_node_that_holds_the_slots(
    given: object, message: str
) -> None:
    """Slots the tree adopted were refused as ``PageBusy`` of node 0 (the request's owner id)
    while a write-back read them, else as a bare pool message; none named ``free_slots``."""
    cache = HiCache(config())
    adopted = cache.alloc_slots(8)
    cache.insert(list(range(300, 308)), device_slots=adopted)  # its write-back is in flight
    before = cache.tiers.device.allocator.free_pages, [n.residency() for n in cache.tree]
    with pytest.raises(ForeignSlot) as refused:
        cache.free_slots(adopted if given == "adopted" else given)  # type: ignore[arg-type]
    assert str(refused.value) == message
    assert (cache.tiers.device.allocator.free_pages, [n.residency() for n in cache.tree]) == before
    cache.close()


def test_prometheus_exposes_the_stats() -> None:
    """A scrape shows tokens per tier and applied transitions."""
    cache = HiCache(config())
    cache.insert(list(range(8)))
    cache.poll()
    registry = CollectorRegistry()
    register(cache, registry, name="main")
    text = generate_latest(registry).decode()
    assert 'fsm_cache_tokens{cache="main",tier="device"} 8.0' in text
    assert 'fsm_cache_transitions_total{cache="main",event="write_done"} 1.0' in text


def test_event_log_replays_into_the_same_tree() -> None:
    """Replaying a log rebuilds the same nodes in the same states."""
    cache = HiCache(config())
    for start in (0, 0, 100, 200):
        cache.insert(list(range(start, start + 12)))
        cache.poll()
    cache.evict(12)
    lock = cache.lock(next(iter(cache.tree)))
    cache.unlock(lock)
    rebuilt = replay(cache.log, cache.config)
    assert [(n.id, n.residency()) for n in rebuilt.tree] == [
        (n.id, n.residency()) for n in cache.tree
    ]


def test_replay_reports_the_first_difference() -> None:
    """A log whose transitions were tampered with does not replay."""
    cache = HiCache(config())
    cache.insert(list(range(8)))
    cache.log.entries[-1] = ("transition", 1, "write_done")
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, cache.config)
    assert str(caught.value) == "transition 0: recorded node 1 write_done, replayed node 1 write"


def test_demo_serves_and_refuses_the_planted_double_release(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The demo exits 0, reports no refused transitions and shows both call sites."""
    assert main(["demo", "--requests", "150"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "refused transitions │ 0" in out
    assert "pinned at demo.py:" in out
    assert "released at demo.py:" in out
    assert "in drain_backup" in out


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_demo_serves_under_every_policy(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Under memory pressure every write policy serves the workload with nothing refused."""
    assert main(["demo", "--requests", "150", "--policy", policy]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"tokens, {policy})" in out
    assert "refused transitions │ 0" in out


@pytest.mark.parametrize(
    ("what", "ratio"),
    [("engine", "x bare"), ("cache", "x baseline"), ("copies", "machine / raw = ")],
)
def test_bench_smoke(what: str, ratio: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each benchmark runs at small sizes and prints its side-by-side ratio."""
    assert main(["bench", what, "--quick"]) == 0
    assert ratio in capsys.readouterr().out


@pytest.mark.gpu
def test_cuda_round_trip_through_streams_and_events() -> None:
    """On CUDA: backup on the copy stream, evict, load back; KV equal, no page freed early."""
    cache = HiCache(config(device="cuda", layers=4, heads=8, head_dim=128, device_pages=64))
    cache.insert(list(range(64)))
    (node,) = list(cache.tree)
    written = cache.tiers.read_device(node.device_pages)
    while cache.issued():
        cache.poll()
    cache.evict(64)
    cache.load_back(node)
    while cache.issued():
        cache.poll()
    assert torch.equal(cache.tiers.read_device(node.device_pages), written)
    assert cache.tiers.host.pinned


@pytest.mark.gpu
def test_cuda_write_back_waits_on_events_and_reset_keeps_pinned_memory() -> None:
    """On CUDA: an insert waits for the write-back it needs; reset reuses the pools."""
    cache = HiCache(config(device="cuda", write_policy="write_back", device_pages=4))
    cache.insert(list(range(16)))
    (first,) = list(cache.tree)
    written = cache.tiers.read_device(first.device_pages)
    assert cache.insert(list(range(100, 108))) == 0
    assert (first.host, first.device) == ("backed", "absent")
    assert cache.issued() == []
    expected = synthetic_kv(cache.tiers.device.layout, first.key)
    assert torch.equal(cache.tiers.host.read(first.host_pages), expected)
    assert torch.equal(written, expected)
    device, host = cache.tiers.device.tensor, cache.tiers.host.tensor
    cache.reset()
    assert cache.tiers.device.tensor is device
    assert cache.tiers.host.tensor is host
    assert cache.tiers.host.pinned
    assert cache.insert(list(range(16))) == 0
