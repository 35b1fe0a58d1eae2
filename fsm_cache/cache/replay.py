"""Replay of an event log: the same operations and acknowledgements on a fresh cache.

:func:`replay` runs the operations of an :class:`~fsm_cache.cache.eventlog.EventLog`
against a fresh cache of the same configuration whose acknowledgement source
is the log itself (:class:`ScriptedAcks`): exactly the recorded
acknowledgements at the recorded points, so copies that finish late, out of
order or not at all replay as they happened. It checks that the transitions,
acknowledgements and refusals match.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from fsm_cache.cache.eventlog import Acks, EventLog
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.transfers import IssuedCopies
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import CopyFailed, FsmCacheError, ReplayMismatch
from fsm_cache.memory.tickets import Completion, Copier
from fsm_cache.memory.tiers import CacheConfig


def replay(log: EventLog, config: CacheConfig) -> HiCache:
    """Re-run the operations of ``log`` on a fresh cache and check the transitions match.

    An operation refused in the recording must be refused on replay with the
    same error and message, and only then; locks and pins still held at the
    end of the log stay held in the returned cache.

    The log must be :attr:`~fsm_cache.cache.eventlog.EventLog.complete`: a
    replay starts from an empty cache, so it needs the log from its first
    entry. The replaying cache keeps its own log whole (``log_limit=None``),
    however long the recording, so the comparison sees every transition.

    Raises:
        ReplayMismatch: The log dropped its oldest entries (nothing is
            replayed), or the replayed transitions, acknowledgements or
            refusals differ from the recorded ones; names the first difference.
    """
    if not log.complete:
        raise ReplayMismatch(
            f"replay: the log dropped its first {log.dropped} entries (limit {log.limit});"
            " record with log_limit=None to replay from the start"
        )
    script = log.acknowledgements()
    cache = HiCache(
        replace(config, log_limit=None),
        acks=lambda copier, copies: ScriptedAcks(script, copier, copies),
    )
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


class ScriptedAcks:
    """Acknowledgements as a log recorded them, batch by batch, for a replaying cache.

    Args:
        script: The recorded batches, each with its origin (``poll``, ``wait``, ...).
        copier: The replaying cache's copy engine, drained for the completions.
        copies: The replaying cache's copies in flight, to map copy numbers to tickets.
    """

    def __init__(
        self, script: list[tuple[str, Acks]], copier: Copier, copies: IssuedCopies
    ) -> None:
        self._pending = deque(script)
        self._finished: dict[int, Completion] = {}
        self._copier = copier
        self._copies = copies

    def collect(self, wait: bool) -> list[Completion]:
        """Return the next recorded batch, as completions of the replay's own copies.

        Raises:
            ReplayMismatch: No batch is left, the batch was recorded from the
                other kind of collection, or it names a copy not in flight.
        """
        if not self._pending:
            raise ReplayMismatch(
                "the replay applies more acknowledgement batches than were recorded"
            )
        origin, batch = self._pending.popleft()
        if (origin == "wait") != wait:
            here = "an allocation's wait" if wait else "a poll"
            raise ReplayMismatch(f"acknowledgements recorded from {origin}, replayed from {here}")
        self._finished.update((c.ticket.id, c) for c in self._copier.drain())
        by_number = self._copies.numbers()
        out = []
        for number, ok in batch:
            completion = self._finished.pop(by_number.get(number, -1), None)
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
        cache.apply_completions(cache.transfers.collect(wait=False))
    # "agreed_poll" (fsm_cache.distributed.agreement) only precedes the apply_completions it chose
