"""How much the checked engine costs: a pin+release pair against a bare guarded counter.

One run measures, side by side and interleaved (so machine noise hits all
alike), the nanoseconds of CPU time per pin+release pair of

* the bare guarded counter SGLang uses (``if count > 0: count -= 1 else: raise``),
* the checked engine on the shipped host residency machine, on a record that
  is not pinned (``backed``: pins 0 -> 1 -> 0) and on one already pinned
  (pins 1 -> 2 -> 1): two paths of the generated code,
* the same engine in trail mode (call sites kept per event), on both,
* the ``transitions`` machine the reference executor builds from the same spec,

and, with tracemalloc, the bytes per record of the composed residency engine.
Times are the process's CPU time (:func:`time.process_time`), best of a few
timings: on a shared machine, time spent running other jobs is not counted.
Targets: the slower engine path at most :data:`ENGINE_TARGET` times bare and
in trail mode :data:`TRAIL_TARGET` times (issue 15), transitions at least 20x
the engine, and under 100 bytes per record.

The ``transitions`` package comes with the ``reference`` extra
(``pip install "fsm-cache[reference]"``); without it this module does not import.
"""

from __future__ import annotations

import time
import timeit
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsm_cache.engine.core import Engine
from fsm_cache.spec.shipped import host_machine, residency_system
from fsm_cache.testing.reference import Reference


TRANSITIONS_SHARE = 50
"""The transitions machine runs n / TRANSITIONS_SHARE pairs: it is that much slower."""


ENGINE_TARGET = 1.25
"""Issue 15's most for a checked pin + release, as a multiple of a bare guarded counter."""
TRAIL_TARGET = 3.0
"""Issue 15's most for the same in trail mode (call sites noted), over the bare counter."""


@dataclass(frozen=True)
class EngineBench:
    """Measured costs; times are CPU nanoseconds per pin+release pair, best of ``repeat``.

    Attributes:
        n: Pairs per timing of the bare counter and the engines.
        repeat: Timings per implementation; the best is kept.
        bare_ns: The bare guarded counter.
        engine_ns: The checked engine (``engine.verb``), pins 0 -> 1 -> 0.
        trail_ns: The checked engine in trail mode, pins 0 -> 1 -> 0.
        pinned_ns: The checked engine on a pinned record, pins 1 -> 2 -> 1.
        pinned_trail_ns: The same in trail mode.
        transitions_ns: The ``transitions`` machine of the reference executor.
        bytes_per_record: tracemalloc bytes per composed residency record.
        records: How many records the memory figure is averaged over.
    """

    n: int
    repeat: int
    bare_ns: float
    engine_ns: float
    trail_ns: float
    pinned_ns: float
    pinned_trail_ns: float
    transitions_ns: float
    bytes_per_record: float
    records: int

    @property
    def engine_ratio(self) -> float:
        """Engine time over bare time, the slower of the two paths (target <= 1.25, issue 15)."""
        return max(self.engine_ns, self.pinned_ns) / self.bare_ns

    @property
    def trail_ratio(self) -> float:
        """Trail-mode time over bare time, the slower path (target <= 3.0, issue 15)."""
        return max(self.trail_ns, self.pinned_trail_ns) / self.bare_ns

    @property
    def transitions_ratio(self) -> float:
        """Time of the transitions machine over engine time (target >= 20)."""
        return self.transitions_ns / self.engine_ns

    def targets(self) -> dict[str, bool]:
        """Return whether each target is met, by name."""
        return {
            "engine <= 1.25x bare": self.engine_ratio <= ENGINE_TARGET,
            "trail <= 3.0x bare": self.trail_ratio <= TRAIL_TARGET,
            "transitions >= 20x engine": self.transitions_ratio >= 20.0,
            "< 100 bytes per record": self.bytes_per_record < 100.0,
        }

    def format(self) -> str:
        """Return the figures as a plain-text table."""
        rows = [
            ("bare guarded counter", self.bare_ns, "1.00x bare"),
            ("checked engine", self.engine_ns, f"{self.engine_ns / self.bare_ns:.2f}x bare"),
            (
                "  on a pinned record",
                self.pinned_ns,
                f"{self.pinned_ns / self.bare_ns:.2f}x bare; slower path: "
                f"{self.engine_ratio:.2f}x (target <= {ENGINE_TARGET})",
            ),
            ("checked engine, trail", self.trail_ns, f"{self.trail_ns / self.bare_ns:.2f}x bare"),
            (
                "  on a pinned record",
                self.pinned_trail_ns,
                f"{self.pinned_trail_ns / self.bare_ns:.2f}x bare; slower path: "
                f"{self.trail_ratio:.2f}x (target <= {TRAIL_TARGET})",
            ),
            (
                "transitions machine",
                self.transitions_ns,
                f"{self.transitions_ratio:.0f}x engine (target >= 20)",
            ),
        ]
        lines = [f"pin+release pairs: n={self.n}, best of {self.repeat} in CPU time", ""]
        lines.append(f"{'implementation':<24}{'ns/pair':>10}  ratio")
        lines += [f"{name:<24}{ns:>10.1f}  {ratio}" for name, ns, ratio in rows]
        lines.append("")
        lines.append(
            f"bytes per residency record: {self.bytes_per_record:.1f} "
            f"(tracemalloc over {self.records} records; target < 100)"
        )
        missed = [name for name, met in self.targets().items() if not met]
        lines.append("targets met" if not missed else f"targets missed: {', '.join(missed)}")
        return "\n".join(lines)


class _Bare:
    """SGLang's host reference counter: a guarded int on a slotted object."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def pin(self) -> None:
        self.count += 1

    def release(self) -> None:
        if self.count > 0:
            self.count -= 1
        else:
            raise RuntimeError("Host reference counter is already zero.")


def run_engine_bench(n: int = 200_000, repeat: int = 7) -> EngineBench:
    """Measure the engine against the bare counter and transitions; see the module doc.

    Args:
        n: pin+release pairs per timing (transitions runs ``n // 50`` of them).
        repeat: Timings per implementation, interleaved; the best is kept.
    """
    loops = {
        "bare": (_bare_loop(n), n),
        "engine": (_engine_loop(n, trail=False), n),
        "trail": (_engine_loop(n, trail=True), n),
        "pinned": (_engine_loop(n, trail=False, pins=1), n),
        "pinned_trail": (_engine_loop(n, trail=True, pins=1), n),
        "transitions": (_transitions_loop(max(1, n // TRANSITIONS_SHARE)), n // TRANSITIONS_SHARE),
    }
    best = dict.fromkeys(loops, float("inf"))
    for _ in range(repeat):
        for name, (loop, pairs) in loops.items():
            seconds = timeit.timeit(loop, number=1, timer=time.process_time)
            best[name] = min(best[name], seconds * 1e9 / max(1, pairs))
    records = 100_000
    return EngineBench(
        n=n,
        repeat=repeat,
        bare_ns=best["bare"],
        engine_ns=best["engine"],
        trail_ns=best["trail"],
        pinned_ns=best["pinned"],
        pinned_trail_ns=best["pinned_trail"],
        transitions_ns=best["transitions"],
        bytes_per_record=record_bytes(records),
        records=records,
    )


def _bare_loop(n: int) -> Callable[[], None]:
    counter = _Bare()
    pin, release = counter.pin, counter.release

    def loop() -> None:
        for _ in range(n):
            pin()
            release()

    return loop


def _engine_loop(n: int, *, trail: bool, pins: int = 0) -> Callable[[], None]:
    engine = Engine(host_machine(), trail=trail)
    rec = engine.new(1)
    rec.state = "pinned" if pins else "backed"
    rec.pins = pins
    pin, release = engine.verb("pin"), engine.verb("release")

    def loop() -> None:
        for _ in range(n):
            pin(rec)
            release(rec)

    return loop


def _transitions_loop(n: int) -> Callable[[], None]:
    reference = Reference(host_machine())
    events = reference.machines["state"].events
    pin, release = events["pin"].trigger, events["release"].trigger
    model = _Model()

    def loop() -> None:
        for _ in range(n):
            pin(model)
            release(model)
        model.chosen.clear()

    return loop


class _Model:
    """What the reference's callbacks read and write: the state, the counter, the logs."""

    def __init__(self) -> None:
        self.state = "backed"
        self.pins = 0
        self.effects: list[str] = []
        self.chosen: list[Any] = []


def record_bytes(count: int) -> float:
    """Return tracemalloc bytes per record of the composed residency engine.

    Ids and the list holding the records are allocated before tracing starts,
    so the figure is the records' own memory.
    """
    engine = Engine(residency_system(), trail=False)
    ids = list(range(count))
    held: list[Any] = [None] * count
    new = engine.new
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in ids:
            held[i] = new(i)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / count
