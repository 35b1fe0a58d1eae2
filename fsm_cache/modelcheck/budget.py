"""How far a check may go: a cap on the states explored, and the machine's memory.

The explorer keeps every state it has seen (about 3 KB each on five nodes of
the residency spec), so a tree a little too large for the machine does not
run slowly: it runs the machine out of memory, and the kernel ends the
process without a word, or it swaps for hours. A :class:`Budget` stops the
search first, once ``max_states`` states are explored, once ``max_seconds``
have passed (a CI job's time limit ends it as silently), or once the memory the
machine (or the process's cgroup) has available drops under ``floor`` bytes:
by default a sixteenth of its memory, and at least 1 GiB (a quarter of it on
a machine or container of under 4 GiB), since the tables of the states held
grow in steps (a dict doubles) between two readings.
The result then says where and why it stopped: the states explored held
every invariant, but the run is not exhaustive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fsm_cache.errors import ConfigError


MEMORY_FLOOR = 1 << 30
"""The least available memory a check keeps free, in bytes (1 GiB); see :func:`default_floor`."""

FLOOR_SHARE = 16
"""A check keeps at least this fraction of the memory it may use free (1/16)."""

SMALL_SHARE = 4
"""On a machine or container of under 4 GiB, the floor is this fraction of it instead of 1 GiB."""

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def available_memory(
    meminfo: Path = MEMINFO, cgroup: Path = CGROUP, membership: Path = MEMBERSHIP
) -> int | None:
    """Return the bytes this process may still allocate, or None where the system does not say.

    The machine's ``MemAvailable`` (Linux), lowered to what the process's
    cgroup and each cgroup above it (v2: ``memory.max`` less ``memory.current``)
    still allow, since a container's or a service's limit is where its
    out-of-memory killer acts.

    Args:
        meminfo: The kernel's memory report.
        cgroup: Where the cgroup v2 hierarchy is mounted.
        membership: The process's cgroups (its ``0::`` line names its v2 cgroup).
    """
    dirs = _cgroups(cgroup, membership)
    found = [_meminfo(meminfo, "MemAvailable:"), *(_cgroup_available(d) for d in dirs)]
    known = [x for x in found if x is not None]
    return min(known) if known else None


def default_floor(
    meminfo: Path = MEMINFO, cgroup: Path = CGROUP, membership: Path = MEMBERSHIP
) -> int:
    """Return the bytes a check keeps free: 1/16 of the memory it may use, at least 1 GiB.

    The memory it may use is the machine's ``MemTotal``, or the lowest
    ``memory.max`` of the process's cgroups where that is lower. Under 4 GiB
    the least is a quarter of it instead of 1 GiB, so that a check in a small
    container can run at all; unknown, the floor is 1 GiB.
    """
    dirs = _cgroups(cgroup, membership)
    found = [_meminfo(meminfo, "MemTotal:"), *(_cgroup_limit(d) for d in dirs)]
    known = [x for x in found if x is not None]
    if not known:
        return MEMORY_FLOOR
    total = min(known)
    return max(min(MEMORY_FLOOR, total // SMALL_SHARE), total // FLOOR_SHARE)


def _cgroups(root: Path, membership: Path) -> list[Path]:
    """Return the process's cgroup v2 directory and those above it, up to ``root``, that exist.

    Without a ``0::`` line in ``membership`` (no cgroup v2, or not Linux), ``root`` alone.
    """
    relative = ""
    try:
        for line in membership.read_text(encoding="ascii").splitlines():
            if line.startswith("0::"):
                relative = line[3:].strip().strip("/")
    except (OSError, UnicodeDecodeError):
        relative = ""
    parts = [p for p in relative.split("/") if p and p not in (".", "..")]
    dirs = [root.joinpath(*parts[:n]) for n in range(len(parts), 0, -1)]
    return [d for d in dirs if d.is_dir()] + [root]


def _meminfo(meminfo: Path, key: str) -> int | None:
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit(cgroup: Path) -> int | None:
    try:
        limit = (cgroup / "memory.max").read_text(encoding="ascii").strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def _cgroup_available(cgroup: Path) -> int | None:
    limit = _cgroup_limit(cgroup)
    if limit is None:
        return None
    try:
        used = (cgroup / "memory.current").read_text(encoding="ascii").strip()
        return max(0, limit - int(used))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Budget:
    """When an exploration stops before it is exhaustive.

    Attributes:
        max_states: Stop once this many states are explored; None: no cap.
        max_seconds: Stop once this many seconds have passed since the search
            began; None: no limit.
        floor: Stop once fewer bytes than this are available (default:
            :func:`default_floor`); None: never for memory.
        available: Where the available bytes are read (None from it: unknown,
            never a reason to stop).
        clock: Where the time is read, in seconds.

    Raises:
        ConfigError: ``max_states`` is below 1, or ``max_seconds`` is not above 0.
    """

    max_states: int | None = None
    max_seconds: float | None = None
    floor: int | None = field(default_factory=default_floor)
    available: Callable[[], int | None] = field(default=available_memory, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        if self.max_states is not None and self.max_states < 1:
            raise ConfigError(f"check: --max-states must be >= 1, got {self.max_states}")
        if self.max_seconds is not None and not self.max_seconds > 0:  # NaN too
            raise ConfigError(f"check: --max-seconds must be > 0, got {self.max_seconds:g}")

    def cap(self) -> int:
        """Return the most states to explore (a number no search reaches when there is no cap)."""
        return self.max_states if self.max_states is not None else 1 << 62

    def capped(self) -> str:
        """Return why a search stopped at :meth:`cap`."""
        return f"the cap of {self.max_states} states (--max-states) was reached"

    def deadline(self) -> float | None:
        """Return when a search that begins now must stop (:attr:`clock` time), None for never."""
        return None if self.max_seconds is None else self.clock() + self.max_seconds

    def exhausted(self, deadline: float | None) -> str | None:
        """Return why the search must stop now (time, then memory), or None while it may go on.

        Args:
            deadline: What :meth:`deadline` returned when the search began.
        """
        return self.late(deadline) or self.short_of_memory()

    def late(self, deadline: float | None) -> str | None:
        """Return why the search must stop for time now, or None while it may go on.

        Reads :attr:`clock` only when there is a ``deadline``, so it is cheap
        enough to ask often.

        Args:
            deadline: What :meth:`deadline` returned when the search began.
        """
        if deadline is not None and self.clock() >= deadline:
            return f"the limit of {self.max_seconds:g} s (--max-seconds) was reached"
        return None

    def short_of_memory(self) -> str | None:
        """Return why the search must stop for memory now, or None while there is enough."""
        if self.floor is None:
            return None
        left = self.available()
        if left is None or left >= self.floor:
            return None
        return (
            f"{left / (1 << 30):.2f} GiB of memory left, under the "
            f"{self.floor / (1 << 30):.2f} GiB a check keeps free"
        )
