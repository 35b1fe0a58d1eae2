"""What the tests that stop CrossHair's processes ask of a process: whether it has ended."""

from __future__ import annotations

import time
from pathlib import Path


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no longer there, or a zombie left to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def all_gone(pids: list[int], seconds: float = 10) -> bool:
    """Whether every process of ``pids`` has ended, waiting up to ``seconds`` for them."""
    deadline = time.monotonic() + seconds
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(gone(pid) for pid in pids)
