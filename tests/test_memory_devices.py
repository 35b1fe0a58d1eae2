"""Host memory stays on the CPU, and small indices reach CUDA without a hidden sync."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fsm_cache.memory import kv, tiers
from fsm_cache.memory.kv import KVLayout, alloc_exact_host, device_pool, host_pool, upload
from fsm_cache.memory.staging import CudaStreams
from fsm_cache.memory.tiers import synthetic_kv


LAYOUT = KVLayout(layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
META = torch.device("meta")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def meta_default() -> Iterator[None]:
    """``torch.set_default_device("meta")`` for the test, as a serving engine sets "cuda"."""
    torch.set_default_device(META)
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.usefixtures("meta_default")
def test_host_memory_is_made_on_the_cpu_whatever_the_default_device() -> None:
    assert torch.empty(1).device == META  # the default applies where no device is named
    assert alloc_exact_host((2, 3), torch.float16, pin=False).device.type == "cpu"
    pool = host_pool(LAYOUT, 4, pin=False)
    assert pool.tensor.device.type == "cpu"
    assert pool.read([]).device.type == "cpu"
    assert synthetic_kv(LAYOUT, list(range(8))).device.type == "cpu"


def test_upload_pins_an_index_and_copies_it_without_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pageable host-to-device copy blocks the host; a pinned non-blocking one does not."""
    calls: list[tuple[object, ...]] = []

    def pin(self: torch.Tensor) -> torch.Tensor:
        calls.append(("pin_memory",))
        return self

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(("to", *args, *sorted(kwargs.items())))
        return self

    index = torch.tensor([3, 1])
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert upload(index, cuda) is index
    assert calls == [("pin_memory",), ("to", cuda, ("non_blocking", True))]
    calls.clear()
    assert upload(index, torch.device("cpu")) is index
    assert calls == []


@pytest.mark.parametrize("where", ["synthetic", "pool"])
def test_index_uploads_off_the_cpu_go_through_upload(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The synthetic insert path and a pool's page index share the one non-blocking upload."""
    seen: list[tuple[list[int], torch.device]] = []

    def spy(index: torch.Tensor, device: torch.device) -> torch.Tensor:
        seen.append((index.tolist(), device))
        return index.to(device)

    monkeypatch.setattr(tiers if where == "synthetic" else kv, "upload", spy)
    if where == "synthetic":
        tiers._pattern(LAYOUT, META).values(list(range(4)))  # noqa: SLF001
        assert seen == [([0, 1, 2, 3], META)]
    else:
        device_pool(LAYOUT, 4, META)._pages_index([2, 0])  # noqa: SLF001
        assert seen == [([2, 0], META)]


@pytest.mark.gpu
@needs_cuda
def test_cuda_insert_path_uploads_without_synchronising() -> None:
    """``set_sync_debug_mode("error")`` raises on a synchronising call, a pageable copy included."""
    cuda = torch.device("cuda")
    pattern = tiers._pattern(LAYOUT, cuda)  # noqa: SLF001
    pool = device_pool(LAYOUT, 8, cuda)
    expected = synthetic_kv(LAYOUT, list(range(8)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        made = pattern.kv(list(range(8)))
        pool._pages_index([3, 1])  # noqa: SLF001
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(made.cpu().view(torch.int16), expected.view(torch.int16))


def test_cuda_events_let_a_waiting_host_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """``drain`` synchronises on these events: a spinning wait would take a core."""
    made: list[dict[str, object]] = []

    def event(**kwargs: object) -> object:
        made.append(kwargs)
        return object()

    monkeypatch.setattr(torch.cuda, "Event", event)
    CudaStreams().new_event()
    assert made == [{"blocking": True}]


def test_the_synthetic_constants_are_synchronised_once_where_they_are_made_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caches on other streams share them: the device is synchronised after their upload.

    Made on CUDA (here as meta tensors, with ``torch.cuda.synchronize``
    recorded), once per layout and device: a second cache finds them made.
    """
    cuda = torch.device("cuda", 0)
    layout = KVLayout(layers=3, heads=1, head_dim=4, dtype=torch.float16, page_size=2)
    synced: list[object] = []
    tensor = torch.tensor

    def on_meta(data: object, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert device == cuda
        return tensor(data, dtype=dtype, device=META)

    tiers._pattern.cache_clear()  # noqa: SLF001
    try:
        with monkeypatch.context() as patched:
            patched.setattr(torch, "tensor", on_meta)
            patched.setattr(torch.cuda, "synchronize", synced.append)
            first = tiers._pattern(layout, cuda)  # noqa: SLF001
            again = tiers._pattern(layout, torch.device("cuda", 0))  # noqa: SLF001
        assert synced == [cuda]
        assert again is first
        assert first.base.device == META
    finally:
        tiers._pattern.cache_clear()  # noqa: SLF001 (no meta constants left for a GPU test)
