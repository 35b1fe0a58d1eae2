"""The collectives of a tensor-parallel group, with failures turned into RankFailure.

:class:`~fsm_cache.distributed.agreement.DistributedCache` agrees through these three
calls. Each waits at most the group's timeout (gloo honours it per call; NCCL
uses the group's own timeout and watchdog) and turns a backend error into a
:class:`~fsm_cache.errors.RankFailure` that names the rank, the collective and
how long it waited, so a dead or hung rank ends the run instead of hanging it.

On NCCL the collectives run with their device current (``torch.cuda.device``):
a rank whose cache lives on ``cuda:3`` but never called
``torch.cuda.set_device`` would otherwise have ``torch.distributed`` put the
object collectives' buffers on ``cuda:0``, the same GPU as every other rank's,
and NCCL would fail or hang. Pass the cache's device (:func:`group_device`
does, from :class:`~fsm_cache.distributed.agreement.DistributedCache`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from fsm_cache.errors import ConfigError, RankFailure


T = TypeVar("T")


@dataclass(frozen=True)
class Collectives:
    """One rank's view of its group.

    Attributes:
        group: The process group; None for the default group.
        rank: This rank.
        world_size: Ranks in the group.
        device: Where the tensors of the collectives live.
        timeout: Seconds a collective may wait for the other ranks.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    timeout: float

    @classmethod
    def of(
        cls,
        group: dist.ProcessGroup | None,
        device: torch.device | None,
        timeout: float,
        *,
        cache_device: torch.device | None = None,
    ) -> Collectives:
        """Return the collectives of ``group``.

        Args:
            group: The process group; None for the default group.
            device: Where the collectives' tensors live; None: chosen by
                :func:`group_device` from ``cache_device``.
            timeout: Seconds a collective may wait for the other ranks.
            cache_device: The device of this rank's cache (its device pool).

        Raises:
            ConfigError: An NCCL group was given a device that is not CUDA.
        """
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        where = device if device is not None else group_device(group, cache_device)
        if dist.get_backend(group) == "nccl" and where.type != "cuda":
            raise ConfigError(f"distributed: an NCCL group needs a CUDA device, got {where}")
        return cls(group, rank, size, where, timeout)

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Return the element-wise minimum of ``values`` over the ranks."""
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)

        def call() -> None:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            self._wait(work)

        self._collective("poll agreement (all_reduce MIN)", call)
        return [int(v) for v in tensor.tolist()]

    def all_gather_digest(self, payload: list[int]) -> list[list[int]]:
        """Return every rank's ``payload`` (equal lengths), in rank order."""
        mine = torch.tensor(payload, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]

        def call() -> None:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))

        self._collective("digest verification (all_gather)", call)
        return [[int(v) for v in t.tolist()] for t in out]

    def all_gather_object(self, obj: T) -> list[T]:
        """Return every rank's ``obj`` (picklable), in rank order."""
        out: list[T] = [obj] * self.world_size

        def call() -> None:
            dist.all_gather_object(out, obj, group=self.group)

        self._collective("divergence report (all_gather_object)", call)
        return out

    def _wait(self, work: dist.Work | None) -> None:
        if work is not None:
            work.wait(timeout=timedelta(seconds=self.timeout))

    def _collective(self, what: str, call: Callable[[], None]) -> None:
        started = time.perf_counter()
        current = torch.cuda.device(self.device) if self.device.type == "cuda" else None
        try:
            with current or contextlib.nullcontext():
                call()
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            elapsed = time.perf_counter() - started
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RankFailure(
                f"rank {self.rank} of {self.world_size}: {what} failed after {elapsed:.2f} s "
                f"(timeout {self.timeout:g} s): another rank died or stopped taking part: {detail}"
            ) from exc


def group_device(
    group: dist.ProcessGroup | None, device: torch.device | None = None
) -> torch.device:
    """Return where the collectives of ``group`` put their tensors.

    NCCL needs them on CUDA, on this rank's GPU: ``device`` when it is a CUDA
    device (pass the cache's device; a bare ``cuda`` means the current one),
    else the current CUDA device, which is ``cuda:0`` on every rank that
    never called ``torch.cuda.set_device``, so pass ``device``. Every other
    backend (gloo) uses the CPU.

    Args:
        group: The process group; None for the default group.
        device: The device of this rank's cache.
    """
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())
