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
import zlib
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


ROW = 68
"""Words (int64) each rank sends first in every collective of :class:`Collectives`: a row.

Every collective on the group starts with an ``all_gather`` of one row per
rank: four words of header (its kind, the kind's negation, the length of its
whole payload, and for an object gather the purpose it was called for) and
up to 64 words of payload. gloo aborts the process (``std::terminate``, which
Python cannot catch) when a message is longer than the buffer it arrives in,
so ranks that reach different collectives (one in a step, another building
its wrapper or gathering a divergence report) must still send rows of one
size; the headers then say that they differ, on every rank at once. A longer
payload sends the rest in one more ``all_gather``, once every rank's header
has said it is in the same collective with the same length.
"""

_HEADER = 4
_PAYLOAD = ROW - _HEADER

_MIN, _INTS, _SIZES, _BYTES = 1, 2, 3, 4
"""The kinds of row: an element-wise MIN, a gather of ints, an object gather's sizes, its bytes."""

_ROW_KINDS = {
    _MIN: "a MIN all-reduce",
    _INTS: "a gather of integers",
    _SIZES: "an object gather (sizes)",
    _BYTES: "an object gather (bytes)",
}

DIVERGENCE_REPORT = "divergence report"
CONSTRUCTION = "construction agreement"
_PURPOSES = {zlib.crc32(what.encode()): what for what in (DIVERGENCE_REPORT, CONSTRUCTION)}
"""The purposes of the library's own object gathers, by the word their rows carry."""


def _reached(header: list[int]) -> str:
    """Name the collective a row's header says its rank reached."""
    kind, negated, length, purpose = header
    if kind != -negated or kind not in _ROW_KINDS:
        return "something else"
    named = f"{_ROW_KINDS[kind]} of {length} word{'' if length == 1 else 's'}"
    if kind in (_SIZES, _BYTES):
        named += f" for a {_PURPOSES.get(purpose, 'purpose of its own')}"
    return named


class _Rows:
    """The buffers of one rank's rows, kept between collectives.

    Tensors that share arrays' memory: filling and reading them stay in
    Python, where ``torch.tensor(list)`` and ``.tolist()`` took about 50 us a
    step once the step's own work had left the caches cold, and buffers made
    afresh each call cost about as much again (``fsm-cache bench tp``). A
    collective that failed may still write into its buffers later (gloo
    finishes an operation a rank stopped waiting for), so they are made anew
    after a failure (:meth:`renew`).
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.renew()

    def renew(self) -> None:
        """Make new buffers; the old ones stay with whatever collective still holds them."""
        self.mine = array.array("q", bytes(8 * ROW))
        self.sent = torch.frombuffer(self.mine, dtype=torch.int64)
        self.every = array.array("q", bytes(8 * ROW * self.world))
        rows = torch.frombuffer(self.every, dtype=torch.int64).view(self.world, ROW)
        self.received = list(rows.unbind(0))


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
    _rows: _Rows = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Make this rank's row buffers (a frozen dataclass sets its own fields so)."""
        object.__setattr__(self, "_rows", _Rows(self.world_size))

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

        An ``all_gather`` of every rank's values (a row each, :data:`ROW`),
        reduced here: gloo's ``all_reduce`` passes around the ring twice (a
        reduce-scatter, then an all-gather), an ``all_gather`` once.

        Args:
            values: This rank's values (signed 64-bit); the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.

        Raises:
            RankFailure: The collective failed or timed out, or another rank
                reached a different collective.
        """
        return [min(column) for column in zip(*self._gather(_MIN, values, what), strict=True)]

    def all_gather_digest(
        self, payload: list[int], what: str = "digest verification (all_gather)"
    ) -> list[list[int]]:
        """Return every rank's ``payload`` (signed 64-bit, equal lengths), in rank order.

        Args:
            payload: This rank's values; the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.

        Raises:
            RankFailure: As :meth:`all_reduce_min`.
        """
        return self._gather(_INTS, payload, what)

    def all_gather_object(self, obj: T, what: str = DIVERGENCE_REPORT) -> list[T]:
        """Return every rank's ``obj`` (picklable), in rank order.

        Pickled and gathered as words: first the sizes (a row), then the bytes
        (a row, and the rest in one more gather), each timed, so that it waits
        at most three times ``timeout`` (``dist.all_gather_object`` would wait
        for the group's own timeout).

        Args:
            obj: This rank's object.
            what: What the gather is for: its name in a :class:`RankFailure`,
                and carried in its rows, so that ranks gathering for different
                purposes (a report on one, a construction on another) raise.

        Raises:
            RankFailure: As :meth:`all_reduce_min`.
        """
        data = pickle.dumps(obj)
        purpose = zlib.crc32(what.encode())
        said = f"{what} (all_gather sizes)"
        sizes = [size for (size,) in self._gather(_SIZES, [len(data)], said, purpose)]
        padded = data.ljust(-(-max(sizes) // 8) * 8, b"\0")
        said = f"{what} (all_gather_object)"
        words = self._gather(_BYTES, array.array("q", padded).tolist(), said, purpose)
        return [
            pickle.loads(array.array("q", each).tobytes()[:size])
            for each, size in zip(words, sizes, strict=True)
        ]

    def _gather(
        self, kind: int, payload: list[int], what: str, purpose: int = 0
    ) -> list[list[int]]:
        """Gather every rank's ``payload`` as a collective of ``kind``; return them in rank order.

        The first :data:`_PAYLOAD` words go in a row with the header (an empty
        payload too, so that every call is a collective on every rank); the
        rest, once every header agreed, in one more ``all_gather``.

        Raises:
            RankFailure: A collective failed or timed out, or another rank sent
                a row of another kind, payload length or purpose (it reached a
                different collective: every rank raises it, at the first row).
        """
        head = payload[:_PAYLOAD]
        rows = self._row([kind, -kind, len(payload), purpose], head, what)
        each = [row[_HEADER : _HEADER + len(head)] for row in rows]
        rest = payload[_PAYLOAD:]
        if rest:
            mine = torch.tensor(rest, dtype=torch.int64, device=CPU)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]

            def call() -> None:
                self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))

            self._collective(what, call)
            for row, theirs in zip(each, out, strict=True):
                row.extend(theirs.tolist())
        return each

    def _row(self, header: list[int], part: list[int], what: str) -> list[list[int]]:
        """One ``all_gather`` of a row of ``header`` and ``part``; return every rank's row."""
        rows = self._rows
        rows.mine[:] = array.array("q", [*header, *part, *[0] * (_PAYLOAD - len(part))])

        def call() -> None:
            work = dist.all_gather(rows.received, rows.sent, group=self.group, async_op=True)
            self._wait(work)

        try:
            self._collective(what, call)
        except BaseException:  # gloo may still finish into these buffers
            rows.renew()
            raise
        flat = rows.every.tolist()
        each = [flat[r * ROW : (r + 1) * ROW] for r in range(self.world_size)]
        if any(row[:_HEADER] != header for row in each):
            raise RankFailure(self._mismatch(what, [row[:_HEADER] for row in each]))
        return each

    def _mismatch(self, what: str, headers: list[list[int]]) -> str:
        """Say which collective each rank reached (its rows' headers), where they differ."""
        named = ", ".join(f"rank {rank} {_reached(header)}" for rank, header in enumerate(headers))
        return (
            f"rank {self.rank} of {self.world_size}: {what}: the ranks reached different "
            f"collectives ({named}): they called the group in different orders, so its "
            "collectives no longer pair; tear the group down and rebuild it"
        )

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
