"""Copy bandwidth: the copy engine against a raw torch gather-and-copy.

``bench_copies`` writes N scattered device pages to host pages through
:class:`~fsm_cache.memory.copies.CopyEngine`, and the same slots through a plain
``index_select`` + ``copy_``, on the same tensors in one run, and reports the
median GB/s of each over several repetitions. On CUDA it also times one large
``copy_`` of the whole pool into pinned memory: the link's ceiling.

Run ``python -m fsm_cache.bench.memory --help``; ``fsm-cache bench copies`` calls
:func:`bench_copies` too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVLayout, KVPool, default_device, device_pool, host_pool
from fsm_cache.memory.pages import slots_of


@dataclass(frozen=True)
class CopyBench:
    """Median bandwidths of one benchmark run, in GB/s (10^9 bytes per second).

    Attributes:
        device: Where the device pool lives (``cuda`` or ``cpu``).
        pages: Pages copied per repetition.
        nbytes: Bytes copied per repetition.
        reps: Repetitions the medians are taken over.
        write_gbps: Device-to-host through the copy engine.
        raw_gbps: Device-to-host by ``index_select`` + ``copy_`` of the same slots.
        ratio: ``write_gbps / raw_gbps``.
        load_gbps: Host-to-device through the copy engine, back into the same pages.
        ceiling_gbps: One contiguous pinned ``copy_`` of the pool (CUDA only).
    """

    device: str
    pages: int
    nbytes: int
    reps: int
    write_gbps: float
    raw_gbps: float
    ratio: float
    load_gbps: float
    ceiling_gbps: float | None

    def render(self) -> str:
        """Return the figures side by side, one per line."""
        ceiling = "n/a" if self.ceiling_gbps is None else f"{self.ceiling_gbps:8.2f} GB/s"
        return "\n".join(
            [
                f"device {self.device}: {self.pages} pages, {self.nbytes / 2**20:.0f} MiB, "
                f"median of {self.reps}",
                f"engine write (D2H)         {self.write_gbps:8.2f} GB/s",
                f"raw index_select + copy_   {self.raw_gbps:8.2f} GB/s",
                f"engine / raw               {self.ratio:8.2f}",
                f"engine load (H2D)          {self.load_gbps:8.2f} GB/s",
                f"one pinned copy_ (ceiling) {ceiling}",
            ]
        )


def bench_copies(
    pages: int | None = None,
    *,
    page_size: int = 16,
    layers: int = 32,
    heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float16,
    reps: int = 5,
    seed: int = 0,
    device: torch.device | None = None,
) -> CopyBench:
    """Measure a batched write-through of ``pages`` pages, engine against raw torch.

    Args:
        pages: Pages per batch; 4,096 on CUDA, 1,024 on CPU by default.
        page_size: Tokens per page.
        layers: Layers of the KV layout.
        heads: KV heads.
        head_dim: Elements per head.
        dtype: KV element type.
        reps: Timed repetitions per path (after one warm-up each).
        seed: Seed of the scattered device pages.
        device: Where the device pool lives; CUDA when available.
    """
    where = device or default_device()
    n = pages or (4096 if where.type == "cuda" else 1024)
    layout = KVLayout(layers, heads, head_dim, dtype, page_size)
    dev = device_pool(layout, n, where)
    host = host_pool(layout, n, pin=where.type == "cuda", device=where)
    try:
        return _measure(dev, host, reps, seed)
    finally:
        host.close()


def _measure(dev: KVPool, host: KVPool, reps: int, seed: int) -> CopyBench:
    dev.tensor.view(torch.uint8).random_(0, 256)
    host.tensor.view(torch.uint8).zero_()
    engine = CopyEngine(dev, host)
    dev_pages = list(range(dev.num_pages))
    random.Random(seed).shuffle(dev_pages)
    host_pages = host.allocator.alloc(host.num_pages * host.layout.page_size)
    sync = _sync(dev.device)
    nbytes = host.nbytes

    def write() -> None:
        engine.start_write(dev_pages, host_pages)
        engine.drain()

    def load() -> None:
        engine.start_load(host_pages, dev_pages)
        engine.drain()

    raw = _raw_gather_copy(dev, host, dev_pages)
    gbps = {name: _median_gbps(fn, nbytes, reps, sync) for name, fn in [("w", write), ("r", raw)]}
    ceiling = None
    if dev.device.type == "cuda":
        ceiling = _median_gbps(ceiling_copy(dev, host, nbytes), nbytes, reps, sync)
    return CopyBench(
        device=str(dev.device),
        pages=dev.num_pages,
        nbytes=nbytes,
        reps=reps,
        write_gbps=gbps["w"],
        raw_gbps=gbps["r"],
        ratio=gbps["w"] / gbps["r"],
        load_gbps=_median_gbps(load, nbytes, reps, sync),
        ceiling_gbps=ceiling,
    )


def _raw_gather_copy(dev: KVPool, host: KVPool, dev_pages: Sequence[int]) -> Callable[[], None]:
    """Return the baseline: gather the slots layer-first, copy into the host pool's bytes."""
    slots = slots_of(dev_pages, dev.layout.page_size)
    target = host.tensor.view(dev.tensor.shape)

    def run() -> None:
        idx = torch.tensor(slots, dtype=torch.long).to(dev.device)
        target.copy_(dev.tensor.index_select(2, idx), non_blocking=True)

    return run


def ceiling_copy(dev: KVPool, host: KVPool, nbytes: int) -> Callable[[], None]:
    """Return one device-to-host ``copy_`` of ``nbytes`` contiguous bytes: the bandwidth ceiling.

    The pools' layouts differ (layer-first on the device, page-first on the
    host) and the host may be larger, so both are seen as flat bytes.

    Raises:
        ValueError: A pool holds fewer than ``nbytes`` bytes.
    """
    if nbytes > min(dev.nbytes, host.nbytes):
        msg = f"ceiling copy of {nbytes} bytes: pools hold {dev.nbytes} and {host.nbytes}"
        raise ValueError(msg)
    dst = host.tensor.view(-1).view(torch.uint8)[:nbytes]
    src = dev.tensor.view(-1).view(torch.uint8)[:nbytes]
    return lambda: _copy(dst, src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _median_gbps(fn: Callable[[], None], nbytes: int, reps: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: first-touch page faults, allocator growth, stream creation
    sync()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def main(argv: Sequence[str] | None = None) -> None:
    """Run :func:`bench_copies` from the command line and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m fsm_cache.bench.memory", description=__doc__)
    parser.add_argument("--pages", type=int, default=None, help="pages per batch")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="keep the device pool on the CPU")
    args = parser.parse_args(argv)
    result = bench_copies(
        args.pages,
        page_size=args.page_size,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        reps=args.reps,
        device=torch.device("cpu") if args.cpu else None,
    )
    print(result.render())


if __name__ == "__main__":
    main()
