"""CacheConfig: every bad value is a ConfigError naming it, before torch sees it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fsm_cache.cache.hicache import HiCache
from fsm_cache.errors import ConfigError, PinnedMemoryError
from fsm_cache.memory import tiers
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.tiers import TENSOR_BYTES, CacheConfig, Tiers, memory_capacity


CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
CPU_MEMORY = memory_capacity(torch.device("cpu"))
PAGE_BYTES = CacheConfig().layout().page_bytes  # 2 layers x 2 planes x 2 heads x 16 x 2 bytes x 16
SMALL = {"device_pages": 8, "host_pages": 8, "page_size": 4, "layers": 1, "heads": 1, "head_dim": 4}
SMALL_PAGE_BYTES = 1 * 2 * 1 * 4 * 2 * 4  # layers x planes x heads x head_dim x 2 bytes x page_size
DEVICE_USAGE = "config: device must be None, 'cpu', 'cuda' or 'cuda:N'"
DTYPE_USAGE = "config: dtype must be one of float16, bfloat16, float32, float8_e4m3fn"


def _int(name: str, least: int, value: object) -> object:
    return pytest.param(
        {name: value},
        f"config: {name} must be an int >= {least}, got {value!r}",
        id=f"{name}={value!r}",
    )


def _case(kwargs: dict[str, object], message: str) -> object:
    return pytest.param(kwargs, message, id=",".join(f"{k}={v!r}" for k, v in kwargs.items()))


BAD = [
    *(_int("device_pages", 1, v) for v in (2.5, 0, -1, True, "8", math.nan, None, 10.0)),
    *(
        _case({"host_pages": v}, f"config: host_pages must be None or an int >= 0, got {v!r}")
        for v in (-1, 2.0, True, "16")
    ),
    *(
        _case({"host_ratio": v}, f"config: host_ratio must be a finite real >= 0, got {v!r}")
        for v in (-0.5, math.nan, math.inf, -math.inf, True, "2", None, 1j)
    ),
    # too large for a float: math.isfinite raised OverflowError
    _case(
        {"host_ratio": 10**400},
        "config: host_ratio must be a finite real >= 0, got an int of 1329 bits",
    ),
    *(_int("page_size", 1, v) for v in (0, 1.0, False, -16)),
    *(_int("layers", 1, v) for v in (0, 2.0)),
    *(_int("heads", 1, v) for v in (-2, None)),
    *(_int("head_dim", 1, v) for v in (0, 16.0, True)),
    *(
        _case({"dtype": v}, f"{DTYPE_USAGE}, got {v!r}")
        for v in ("float64", "banana", "fp16", torch.float16, None)
    ),
    *(
        _case({"device": v}, f"{DEVICE_USAGE}, got {v!r}")
        for v in ("tpu", "banana", "mps", "meta", "cuda:x", "", 0, torch.device("cpu"))
    ),
    *(
        _case(
            {"write_policy": v},
            "config: write_policy must be one of write_through, write_through_selective, "
            f"write_back, got {v!r}",
        )
        for v in ("lru", 3, None)
    ),
    *(_int("selective_threshold", 1, v) for v in (0, 1.5, True)),
    *(_int("load_back_threshold", 0, v) for v in (-1, 0.5, False)),
    *(_case({"debug": v}, f"config: debug must be a bool, got {v!r}") for v in (1, "yes", None)),
    *(_case({"trail": v}, f"config: trail must be a bool or None, got {v!r}") for v in (1, "on")),
    *(
        _case(
            {"copier": v},
            "config: copier must be None or a callable (device_pool, host_pool) -> Copier, "
            f"got {v!r}",
        )
        for v in (3, "CopyEngine")
    ),
    *(
        _case({"log_limit": v}, f"config: log_limit must be None or an int >= 1, got {v!r}")
        for v in (0, -5, 1.5, True, "100")
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_a_bad_value_is_a_config_error_naming_it(kwargs: dict[str, object], message: str) -> None:
    config = CacheConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        config.check()
    assert str(caught.value) == message
    with pytest.raises(ConfigError) as caught:
        HiCache(config)
    assert str(caught.value) == message
    with pytest.raises(ConfigError) as caught:
        Tiers(config)
    assert str(caught.value) == message


def test_the_first_bad_field_in_order_is_named() -> None:
    config = CacheConfig(device_pages=0, dtype="banana", log_limit=0)
    with pytest.raises(ConfigError, match=r"^config: device_pages must be an int >= 1, got 0$"):
        config.check()


@pytest.mark.skipif(CUDA_COUNT > 0, reason="CUDA is available here")
def test_cuda_without_a_gpu_is_refused() -> None:
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError) as caught:
            HiCache(CacheConfig(device=name, **SMALL))  # type: ignore[arg-type]
        assert str(caught.value) == (
            f"config: device {name!r} is not available: torch sees 0 CUDA devices"
        )


@pytest.mark.skipif(CUDA_COUNT > 7, reason="this machine has a cuda:7")
def test_a_gpu_index_past_the_last_is_refused() -> None:
    plural = "device" if CUDA_COUNT == 1 else "devices"
    with pytest.raises(ConfigError) as caught:
        CacheConfig(device="cuda:7").check()
    assert str(caught.value) == (
        f"config: device 'cuda:7' is not available: torch sees {CUDA_COUNT} CUDA {plural}"
    )


def test_a_dtype_this_torch_lacks_is_refused_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    config = CacheConfig(dtype="float8_e4m3fn", **SMALL)  # type: ignore[arg-type]
    message = f"config: dtype float8_e4m3fn is not available in torch {torch.__version__}"
    for call in (config.check, config.layout, lambda: HiCache(config)):
        with pytest.raises(ConfigError) as caught:
            call()
        assert str(caught.value) == message


needs_memory_size = pytest.mark.skipif(CPU_MEMORY is None, reason="no sysconf memory size here")


@needs_memory_size
@pytest.mark.parametrize("pages", [10**15, 10**30])
def test_an_absurd_device_pool_is_refused(pages: int) -> None:
    with pytest.raises(ConfigError) as caught:
        HiCache(CacheConfig(device_pages=pages, device="cpu"))
    assert str(caught.value) == (
        f"config: device_pages={pages} needs {pages * PAGE_BYTES} bytes, "
        f"more than the {CPU_MEMORY} bytes of memory of cpu"
    )


@needs_memory_size
def test_an_absurd_host_pool_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        CacheConfig(host_pages=10**15, device="cpu").check()
    assert str(caught.value) == (
        f"config: host_pages={10**15} needs {10**15 * PAGE_BYTES} bytes, "
        f"more than the {CPU_MEMORY} bytes of memory of cpu"
    )
    host = int(256 * 1e300)
    with pytest.raises(ConfigError) as caught:
        CacheConfig(host_ratio=1e300, device="cpu").check()
    assert str(caught.value) == (
        f"config: host_ratio=1e+300 gives {host} host pages, which need "
        f"{host * PAGE_BYTES} bytes, more than the {CPU_MEMORY} bytes of memory of cpu"
    )
    with pytest.raises(ConfigError) as caught:
        CacheConfig(host_ratio=1e308, device="cpu").check()
    assert str(caught.value) == (
        "config: host_ratio=1e+308 times device_pages=256 is infinitely many host pages, "
        f"more than the {CPU_MEMORY} bytes of memory of cpu"
    )


@needs_memory_size
def test_two_cpu_pools_that_fit_alone_but_not_together_are_refused() -> None:
    assert CPU_MEMORY is not None
    pages = CPU_MEMORY * 3 // 5 // PAGE_BYTES
    with pytest.raises(ConfigError) as caught:
        CacheConfig(device_pages=pages, host_pages=pages, device="cpu").check()
    assert str(caught.value) == (
        f"config: device_pages={pages} and {pages} host pages need {2 * pages * PAGE_BYTES} "
        f"bytes together, more than the {CPU_MEMORY} bytes of memory of cpu"
    )


def test_without_a_memory_size_the_limit_is_what_a_tensor_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tiers, "memory_capacity", lambda device: None)
    pages = 3 * 10**15
    with pytest.raises(ConfigError) as caught:
        CacheConfig(device_pages=pages, device="cpu").check()
    assert str(caught.value) == (
        f"config: device_pages={pages} needs {pages * PAGE_BYTES} bytes, "
        f"more than the {TENSOR_BYTES} bytes a tensor can hold"
    )


@pytest.mark.parametrize(
    ("pool", "error", "reason"),
    [
        ("device_pool", torch.OutOfMemoryError, "out of memory. Tried to allocate 2.00 GiB"),
        ("device_pool", RuntimeError, "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPU"),
        ("host_pool", PinnedMemoryError, "cudaHostRegister of 512 bytes failed"),
        ("host_pool", MemoryError, "no memory"),
    ],
)
def test_a_pool_the_allocator_refuses_is_a_config_error_naming_its_size(
    monkeypatch: pytest.MonkeyPatch, pool: str, error: type[Exception], reason: str
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise error(f"{reason}\nmore detail")

    monkeypatch.setattr(tiers, pool, refuse)
    config = CacheConfig(device="cpu", **SMALL)  # type: ignore[arg-type]
    name = pool.removesuffix("_pool")
    with pytest.raises(ConfigError) as caught:
        HiCache(config)
    assert str(caught.value) == (
        f"config: cannot allocate the {name} pool of 8 pages ({8 * SMALL_PAGE_BYTES} bytes) "
        f"on cpu: {reason}"
    )
    assert isinstance(caught.value.__cause__, error)


def test_good_values_pass() -> None:
    for config in (
        CacheConfig(),
        CacheConfig(host_pages=0, host_ratio=0, device="cpu", trail=True, log_limit=None),
        CacheConfig(host_ratio=1, dtype="bfloat16", copier=CopyEngine, log_limit=1),
        CacheConfig(dtype="float8_e4m3fn", write_policy="write_back", debug=True, trail=False),
        CacheConfig(device="cpu:0", load_back_threshold=0, selective_threshold=1),
    ):
        config.check()


def test_log_limit_defaults_to_100000_and_is_a_keyword_only_field() -> None:
    config = CacheConfig()
    assert config.log_limit == 100_000
    assert CacheConfig(log_limit=None).log_limit is None
    assert dataclasses.replace(config, log_limit=5).log_limit == 5
    assert CacheConfig(log_limit=5) != config
    assert "log_limit" in {f.name for f in dataclasses.fields(CacheConfig)}
    with pytest.raises(TypeError):
        CacheConfig(*([None] * 16))  # type: ignore[arg-type]


def test_audit_alias_still_works() -> None:
    with pytest.warns(DeprecationWarning, match=r"^CacheConfig\(audit=\.\.\.\) is deprecated"):
        config = CacheConfig(audit=True, log_limit=7)
    assert (config.trail, config.audit, config.log_limit) == (True, True, 7)
