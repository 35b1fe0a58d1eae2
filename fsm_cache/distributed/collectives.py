"""The collectives of a tensor-parallel group, on the CPU, with failures turned into RankFailure.

:class:`~fsm_cache.distributed.agreement.DistributedCache` agrees through these three
calls. They always run on CPU tensors over a gloo group, even when the model's
group is NCCL: an NCCL all-reduce is queued on the GPU behind the forward pass,
and reading its result back (``.tolist()``) waits for every kernel queued
before it, so each agreement would stall the scheduler until the compute
stream drained. SGLang keeps a CPU side group (``tp_cpu_group``) for the same
reason; :func:`cpu_group` uses a gloo group as it is and builds a gloo side
group over the ranks of any other. Their tensors are made on the CPU by name,
whatever torch's default device: a model loader's
``torch.set_default_device("cuda")`` put the divergence report's on the GPU.

The MIN all-reduce is an ``all_gather`` reduced on every rank: gloo's
``all_reduce`` passes round the ring twice (a reduce-scatter, then an all-gather),
an ``all_gather`` once, and at a few dozen integers the passes are the cost.

Each call waits at most the group's timeout (``Work.wait(timeout)``) and turns
a backend error into a :class:`~fsm_cache.errors.RankFailure` that names the
rank, the collective and how long it waited, so a dead or hung rank ends the
run instead of hanging it.
"""

from __future__ import annotations

import array
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from fsm_cache.errors import ConfigError, RankFailure


T = TypeVar("T")


CPU = torch.device("cpu")
"""Where every agreement tensor lives."""


def cpu_group(group: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup | None:
    """Return a gloo group over the ranks of ``group``: ``group`` itself if it is one.

    A group whose backend is not gloo (NCCL) gets a new gloo side group over
    the same ranks, in the same order (``new_group(backend="gloo")``), which
    every rank of the world must build at the same point: so only for the
    default group, or a group that spans the whole world. For a smaller NCCL
    group, build its gloo twin once on every rank of the world
    (``torch.distributed.new_group(ranks, backend="gloo")``, as SGLang builds
    ``tp_cpu_group``) and pass that.

    Args:
        group: The ranks that agree; None for the default group.
        timeout: Seconds a collective of a new side group may wait.

    Raises:
        ConfigError: ``group`` is an NCCL (or other non-gloo) group smaller than the world.
    """
    if "gloo" in str(dist.get_backend(group)):  # "gloo", or "cpu:gloo,cuda:nccl"
        return group
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ConfigError(
            f"distributed: the agreement needs a gloo group, and a {dist.get_backend(group)} "
            f"group of {dist.get_world_size(group)} of {dist.get_world_size()} ranks cannot "
            "get one here (every rank of the world would have to build it); build it on every "
            'rank with torch.distributed.new_group(ranks, backend="gloo") and pass that'
        )
    side: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return side


class _Gathered:
    """The buffers of one width of :meth:`Collectives.all_reduce_min`, kept between calls.

    Tensors that share arrays' memory: filling and reading them stay in Python,
    where ``torch.tensor(list)`` and ``.tolist()`` took about 50 us a step once the
    step's own work had left the caches cold, and buffers made afresh each call
    cost about as much again (``fsm-cache bench tp``).
    """

    def __init__(self, width: int, world: int) -> None:
        self.width, self.world = width, world
        self.mine = array.array("q", bytes(8 * width))
        self.sent = torch.frombuffer(self.mine, dtype=torch.int64)
        self.every = array.array("q", bytes(8 * width * world))
        rows = torch.frombuffer(self.every, dtype=torch.int64).view(world, width)
        self.rows = list(rows.unbind(0))

    def minimum(self) -> list[int]:
        """Return the element-wise minimum of the rows gathered last."""
        flat, width = self.every.tolist(), self.width
        rows = (flat[r * width : (r + 1) * width] for r in range(self.world))
        return [min(column) for column in zip(*rows, strict=True)]


@dataclass(frozen=True)
class Collectives:
    """One rank's view of its CPU (gloo) agreement group.

    Attributes:
        group: The gloo group the collectives run on; None for the default group.
        rank: This rank.
        world_size: Ranks in the group.
        timeout: Seconds a collective may wait for the other ranks.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    timeout: float
    _gathered: dict[int, _Gathered] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, timeout: float) -> Collectives:
        """Return the collectives of ``group``'s ranks, over a gloo group (see :func:`cpu_group`).

        Raises:
            ConfigError: ``group`` is a non-gloo group smaller than the world.
        """
        cpu = cpu_group(group, timeout)
        return cls(cpu, dist.get_rank(cpu), dist.get_world_size(cpu), timeout)

    @property
    def device(self) -> torch.device:
        """Where the collectives' tensors live: always the CPU."""
        return CPU

    def all_reduce_min(
        self, values: list[int], what: str = "step agreement (all_gather MIN)"
    ) -> list[int]:
        """Return the element-wise minimum of ``values`` over the ranks.

        Args:
            values: This rank's values; the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.
        """
        if not values:
            return []
        gathered = self._gathered.get(len(values))
        if gathered is None:
            gathered = self._gathered[len(values)] = _Gathered(len(values), self.world_size)
        gathered.mine[:] = array.array("q", values)

        def call() -> None:
            work = dist.all_gather(gathered.rows, gathered.sent, group=self.group, async_op=True)
            self._wait(work)

        self._collective(what, call)
        return gathered.minimum()

    def all_gather_digest(
        self, payload: list[int], what: str = "digest verification (all_gather)"
    ) -> list[list[int]]:
        """Return every rank's ``payload`` (equal lengths), in rank order.

        Args:
            payload: This rank's values; the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.
        """
        mine = torch.tensor(payload, dtype=torch.int64, device=CPU)  # whatever the default device
        out = [torch.empty_like(mine) for _ in range(self.world_size)]

        def call() -> None:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))

        self._collective(what, call)
        return [[int(v) for v in t.tolist()] for t in out]

    def all_gather_object(self, obj: T) -> list[T]:
        """Return every rank's ``obj`` (picklable), in rank order.

        Pickled and gathered as bytes in two timed collectives (the sizes, then
        the padded bytes), so that it waits at most ``timeout`` like the others:
        ``dist.all_gather_object`` would wait for the group's own timeout.
        """
        data = pickle.dumps(obj)
        sizes = self.all_gather_digest([len(data)], "divergence report (all_gather sizes)")
        longest = max(size for (size,) in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=CPU)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]

        def call() -> None:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))

        self._collective("divergence report (all_gather_object)", call)
        return [
            pickle.loads(bytes(t[:size].tolist())) for t, (size,) in zip(out, sizes, strict=True)
        ]

    def _wait(self, work: dist.Work | None) -> None:
        if work is not None:
            work.wait(timeout=timedelta(seconds=self.timeout))

    def _collective(self, what: str, call: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            call()
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            elapsed = time.perf_counter() - started
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RankFailure(
                f"rank {self.rank} of {self.world_size}: {what} failed after {elapsed:.2f} s "
                f"(timeout {self.timeout:g} s): another rank died or stopped taking part: {detail}"
            ) from exc
