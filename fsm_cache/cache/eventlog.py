"""The event log of a cache: every operation, transition and acknowledgement, replayable.

Operations (``insert``, ``match_prefix``, ``lock``, ``evict``, ``poll``, ...)
are recorded with their arguments, transitions as ``(node id, event)``, and
every batch of applied copy acknowledgements as the copy numbers it applied,
in order, each with whether it succeeded. An operation that raised is
followed by its refusal. :func:`replay` runs the operations against a fresh
cache of the same configuration, applying exactly the recorded
acknowledgements at the recorded points, so copies that finish late, out of
order or not at all replay as they happened; it checks that the transitions
match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsm_cache.errors import CopyFailed, FsmCacheError, ReplayMismatch
from fsm_cache.memory.tickets import Completion


if TYPE_CHECKING:
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.engine.lease import Lease
    from fsm_cache.memory.tiers import CacheConfig

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


def replay(log: EventLog, config: CacheConfig) -> HiCache:
    """Re-run the operations of ``log`` on a fresh cache and check the transitions match.

    An operation refused in the recording must be refused on replay with the
    same error and message, and only then; locks and pins still held at the
    end of the log stay held in the returned cache.

    Raises:
        ReplayMismatch: The replayed transitions, acknowledgements or refusals
            differ from the recorded ones; names the first difference.
    """
    cache = _replaying(config, log.acknowledgements())
    held: dict[tuple[str, int], list[Lease]] = {}  # receipts by (lock|pin, node id)
    for name, args, refused in _outcomes(log):
        try:
            _apply(cache, name, args, held)
        except ReplayMismatch:
            raise
        except FsmCacheError as exc:
            _same_refusal(name, f"{type(exc).__name__}: {exc}", refused, exc)
            continue
        if refused is not None:
            raise ReplayMismatch(f"{name} was refused in the recording, not on replay: {refused}")
    _compare(log, cache.log)
    return cache


def _outcomes(log: EventLog) -> list[tuple[str, tuple[Any, ...], str | None]]:
    """Return each operation with its arguments and its recorded refusal, if it raised."""
    out: list[tuple[str, tuple[Any, ...], str | None]] = []
    for kind, first, second in log.entries:
        if kind == "op":
            out.append((first, second, None))
        elif kind == "refused" and out:
            out[-1] = (*out[-1][:2], second)
    return out


def _same_refusal(name: str, text: str, refused: str | None, exc: FsmCacheError) -> None:
    if refused is None:
        raise ReplayMismatch(f"{name} raised on replay, not in the recording: {text}") from exc
    if text != refused:
        msg = f"{name} raised on replay: {text}; in the recording: {refused}"
        raise ReplayMismatch(msg) from exc


def _compare(want: EventLog, got: EventLog) -> None:
    recorded, replayed = want.transitions(), got.transitions()
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a != b:
            raise ReplayMismatch(
                f"transition {i}: recorded node {a[0]} {a[1]}, replayed node {b[0]} {b[1]}"
            )
    if len(recorded) != len(replayed):
        raise ReplayMismatch(f"recorded {len(recorded)} transitions, replayed {len(replayed)}")
    many, again = len(want.acknowledgements()), len(got.acknowledgements())
    if many != again:
        raise ReplayMismatch(f"recorded {many} acknowledgement batches, replayed {again}")


def _replaying(config: CacheConfig, script: list[tuple[str, Acks]]) -> HiCache:
    """Return a fresh cache whose copies are acknowledged as ``script`` says, batch by batch."""
    from fsm_cache.cache.hicache import HiCache

    class Replaying(HiCache):
        def _collect(self, wait: bool) -> list[Completion]:
            return _scripted(self, wait, pending, finished)

    pending = deque(script)
    finished: dict[int, Completion] = {}
    return Replaying(config)


def _scripted(
    cache: HiCache, wait: bool, pending: deque[tuple[str, Acks]], finished: dict[int, Completion]
) -> list[Completion]:
    """Return the next recorded batch of acknowledgements, as completions of the replay's copies."""
    if not pending:
        raise ReplayMismatch("the replay applies more acknowledgement batches than were recorded")
    origin, batch = pending.popleft()
    if (origin == "wait") != wait:
        here = "an allocation's wait" if wait else "a poll"
        raise ReplayMismatch(f"acknowledgements recorded from {origin}, replayed from {here}")
    finished.update((c.ticket.id, c) for c in cache.tiers.copier.drain())
    by_number = {t.number: ident for ident, t in cache._tickets.items()}
    out = []
    for number, ok in batch:
        completion = finished.pop(by_number.get(number, -1), None)
        if completion is None:
            raise ReplayMismatch(
                f"recorded acknowledgement of copy {number}: not in flight on replay"
            )
        if completion.ok != ok:
            error = None if ok else CopyFailed(f"copy {number} failed in the recording")
            completion = Completion(completion.ticket, error)
        out.append(completion)
    return out


def _apply(
    cache: HiCache, name: str, args: tuple[Any, ...], held: dict[tuple[str, int], list[Lease]]
) -> None:
    if name == "insert":
        cache.insert(args[0], args[2], namespace=args[1])
    elif name == "match_prefix":
        cache.match_prefix(args[0], namespace=args[1])
    elif name in ("lock", "pin"):
        take = cache.lock if name == "lock" else cache.pin
        held.setdefault((name, args[0]), []).append(take(cache.tree.nodes[args[0]]))
    elif name in ("unlock", "release"):
        held[("lock" if name == "unlock" else "pin", args[0])].pop(0).release()
    elif name == "backup":
        cache.backup([cache.tree.nodes[i] for i in args[0]])
    elif name == "load_back":
        cache.load_back(cache.tree.nodes[args[0]])
    elif name in ("evict", "evict_host", "alloc_slots", "free_slots"):
        getattr(cache, name)(args[0])
    elif name == "poll":
        cache.poll()
    elif name == "apply_completions":
        cache.apply_completions(cache._collect(wait=False))
    # "agreed_poll" (fsm_cache.distributed.agreement) only precedes the apply_completions it chose
