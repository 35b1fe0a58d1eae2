"""The event log of a cache: every operation and every transition, replayable.

Operations (``insert``, ``match_prefix``, ``lock``, ``evict``, ``poll``, ...)
are recorded with their arguments, transitions as ``(node id, event)``.
:func:`replay` runs the operations against a fresh cache of the same
configuration; with synchronous copies (CPU) the result is the same tree,
which :func:`replay` checks against the recorded transitions.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsm_cache.errors import ReplayMismatch


if TYPE_CHECKING:
    from fsm_cache.cache import HiCache
    from fsm_cache.lease import Lease
    from fsm_cache.tickets import Completion
    from fsm_cache.tiers import CacheConfig


@dataclass
class EventLog:
    """Operations and transitions in the order they happened.

    Attributes:
        entries: ``("op", name, args)`` and ``("transition", node_id, event)`` tuples.
    """

    entries: list[tuple[str, Any, Any]] = field(default_factory=list)

    def op(self, name: str, *args: Hashable) -> None:
        """Record a public operation and its arguments."""
        self.entries.append(("op", name, args))

    def transition(self, node_id: int, event: str) -> None:
        """Record an applied transition."""
        self.entries.append(("transition", node_id, event))

    def transitions(self) -> list[tuple[int, str]]:
        """Return the recorded transitions in order."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "transition"]

    def operations(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Return the recorded operations in order."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "op"]


def replay(log: EventLog, config: CacheConfig) -> HiCache:
    """Re-run the operations of ``log`` on a fresh cache and check the transitions match.

    Raises:
        ReplayMismatch: The replayed transitions differ; names the first difference.
    """
    from fsm_cache.cache import HiCache

    cache = HiCache(config)
    held: dict[tuple[str, int], list[Lease]] = {}  # receipts by (lock|pin, node id)
    finished: dict[int, Completion] = {}
    for name, args in log.operations():
        if name == "agreed_poll":  # a tensor-parallel group applied the first k issued copies
            finished.update((c.ticket.id, c) for c in cache.tiers.copier.drain())
            cache.apply_completions([finished.pop(t) for t in cache.issued()[: args[0]]])
        else:
            _apply(cache, name, args, held)
    want, got = log.transitions(), cache.log.transitions()
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            raise ReplayMismatch(
                f"transition {i}: recorded node {a[0]} {a[1]}, replayed node {b[0]} {b[1]}"
            )
    if len(want) != len(got):
        raise ReplayMismatch(f"recorded {len(want)} transitions, replayed {len(got)}")
    return cache


def _apply(
    cache: HiCache, name: str, args: tuple[Any, ...], held: dict[tuple[str, int], list[Lease]]
) -> None:
    if name == "insert":
        cache.insert(args[0], args[2], namespace=args[1])
    elif name == "match_prefix":
        cache.match_prefix(args[0], namespace=args[1])
    elif name == "lock":
        held.setdefault(("lock", args[0]), []).append(cache.lock(cache.tree.nodes[args[0]]))
    elif name == "unlock":
        cache.unlock(held[("lock", args[0])].pop(0))
    elif name == "pin":
        held.setdefault(("pin", args[0]), []).append(cache.pin(cache.tree.nodes[args[0]]))
    elif name == "release":
        held[("pin", args[0])].pop(0).release()
    elif name == "backup":
        cache.backup([cache.tree.nodes[i] for i in args[0]])
    elif name == "load_back":
        cache.load_back(cache.tree.nodes[args[0]])
    elif name in ("evict", "evict_host"):
        getattr(cache, name)(args[0])
    elif name == "poll":
        cache.poll()
