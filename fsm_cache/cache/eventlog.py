"""The event log of a cache: every operation, transition and acknowledgement, replayable.

Operations (``insert``, ``match_prefix``, ``lock``, ``evict``, ``poll``, ...)
are recorded with their arguments, transitions as ``(node id, event)``, and
every batch of applied copy acknowledgements as the copy numbers it applied,
in order, each with whether it succeeded. An operation that raised is
followed by its refusal. :func:`fsm_cache.cache.replay.replay` runs the log
again on a fresh cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any


Acks = tuple[tuple[int, bool], ...]
"""Applied acknowledgements in order: ``(copy number, ok)``; copies count from 1."""


@dataclass
class EventLog:
    """Operations, transitions and acknowledgements in the order they happened.

    Attributes:
        entries: ``("op", name, args)``, ``("transition", node_id, event)``,
            ``("acks", origin, ((copy, ok), ...))`` (origin: ``poll``,
            ``apply_completions``, or ``wait`` for an allocation that waited for
            write-backs) and ``("refused", name, "ErrorClass: message")`` tuples.
    """

    entries: list[tuple[str, Any, Any]] = field(default_factory=list)

    def op(self, name: str, *args: Hashable) -> None:
        """Record a public operation and its arguments."""
        self.entries.append(("op", name, args))

    def transition(self, node_id: int, event: str) -> None:
        """Record an applied transition."""
        self.entries.append(("transition", node_id, event))

    def acks(self, origin: str, applied: Iterable[tuple[int, bool]]) -> None:
        """Record one batch of applied acknowledgements: copy numbers in order, and success."""
        self.entries.append(("acks", origin, tuple(applied)))

    def refusal(self, name: str, error: BaseException) -> None:
        """Record that operation ``name`` raised ``error``."""
        self.entries.append(("refused", name, f"{type(error).__name__}: {error}"))

    def transitions(self) -> list[tuple[int, str]]:
        """Return the recorded transitions in order."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "transition"]

    def operations(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Return the recorded operations in order."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "op"]

    def acknowledgements(self) -> list[tuple[str, Acks]]:
        """Return the recorded acknowledgement batches in order, each with its origin."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "acks"]

    def refusals(self) -> list[tuple[str, str]]:
        """Return the recorded refusals (operation, ``ErrorClass: message``) in order."""
        return [(e[1], e[2]) for e in self.entries if e[0] == "refused"]
