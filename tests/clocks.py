"""A clock moved by hand, for the modules that time out on ``time.monotonic()``.

A test puts it in place of such a module's ``time``, or passes its
``monotonic`` where the clock is a setting (``StorageConfig.clock``): the
timeouts then pass when the test moves the clock, however slowly a loaded
machine runs the test, while real waits (events, collectives) keep their real seconds.
"""

from __future__ import annotations


class HandClock:
    """A ``time`` module whose ``monotonic()`` is ``now``, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        """Return ``now``."""
        return self.now
