"""Replay of an event log: the same operations and acknowledgements on a fresh cache.

:func:`replay` runs the operations of an :class:`~fsm_cache.cache.eventlog.EventLog`
against a fresh cache of the same configuration whose acknowledgement source
is the log itself (:class:`ScriptedAcks`): exactly the recorded
acknowledgements at the recorded points, so copies that finish late, out of
order or not at all replay as they happened. Copy starts come through the log
too (:class:`ScriptedStarts`): a start the copy engine refused in the
recording is refused again at the same point, without asking the replay's
engine, so a log with refused starts replays on an engine that refuses none.
It checks that the transitions, acknowledgements, refused starts and
refusals match. An operation that failed in the recording with an error from
outside the cache (a copy engine or an allocator that broke, in an effect or
not, logged as ``failed``) is not run again, since a sound engine would not fail it: the
cache leaves itself as it was when such an error comes before any change,
and a log whose failed operation had changed the cache first (logged
transitions or acknowledgements before the failure) is refused as not replayable. Once the log is used up the returned
cache takes its acknowledgements from its copy engine again, and works as any
other cache.

A log is checked whole before anything runs: an entry of an unknown kind, an
unknown operation, an operation with the wrong number of arguments, or an
acknowledgement batch of another shape than ``(origin, ((copy, ok), ...))`` raises
:class:`~fsm_cache.errors.BadArgument` naming its position and content, and so
does the log of a cache with a storage tier, which a replay cannot rebuild,
and so does a log that is no event log or a configuration that is no
:class:`~fsm_cache.memory.tiers.CacheConfig`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from functools import cache as memoized

from fsm_cache.cache.eventlog import Acks, Entry, EventLog, RefusedStart, refusal_text
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.transfers import IssuedCopies, ReplayedRefusal
from fsm_cache.cache.tree import NamespaceRoot, TreeNode
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import (
    BadArgument,
    CopyFailed,
    DuplicateAck,
    FsmCacheError,
    ReplayMismatch,
)
from fsm_cache.memory.tickets import Completion, Copier, Ticket
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.numeric import whole
from fsm_cache.spec.shipped import load_shipped


_ARITY = {
    "insert": 3,
    "match_prefix": 2,
    "lock": 1,
    "pin": 1,
    "unlock": 1,
    "release": 1,
    "fire": 2,
    "backup": 1,
    "load_back": 1,
    "wait_loaded": 1,
    "evict": 1,
    "evict_host": 1,
    "alloc_slots": 1,
    "free_slots": 1,
    "poll": 0,
    "apply_completions": 0,
    "close": 0,
    "agreed_poll": 1,
    "agreed_hits": 2,
}
"""The operations a replay knows, and how many arguments each is logged with."""

_KINDS = frozenset({"op", "transition", "acks", "refused", "failed", "copy_refused"})
"""The entry kinds of a two-tier cache's log (``storage`` entries are a storage tier's)."""

_ANY_ROOT = frozenset({"backup", "load_back"})
"""The operations that log a namespace root as node 0, every root's id: a root holds
nothing to back up or load, so each one answers them alike (none is started)."""

Step = tuple[int, Entry, str | None, str | None]
"""One operation to replay: its position in the log, its entry, its recorded refusal, and
its recorded failure (an error from outside the cache; the operation is then not run)."""


def replay(log: EventLog, config: CacheConfig) -> HiCache:
    """Re-run the operations of ``log`` on a fresh cache and check the transitions match.

    An operation refused in the recording must be refused on replay with the
    same error and message, and only then (a refused ``apply_completions``, and
    a poll refused for a stray acknowledgement before it applied any, changed
    nothing and are skipped: the replay's engine reports no such copy). Locks
    and pins still held at the end of the log stay held in the returned cache,
    which takes its acknowledgements from its own copy engine from then on
    (completions the replay drained and the log did not apply included).

    The log must be :attr:`~fsm_cache.cache.eventlog.EventLog.complete`: a
    replay starts from an empty cache, so it needs the log from its first
    entry. The replaying cache keeps its own log whole (``log_limit=None``),
    however long the recording, so the comparison sees every transition.

    Raises:
        BadArgument: ``log`` is no :class:`~fsm_cache.cache.eventlog.EventLog`
            or ``config`` no :class:`~fsm_cache.memory.tiers.CacheConfig`; an
            entry is of an unknown kind, names an unknown operation, has the
            wrong number of arguments or is a malformed acknowledgement batch,
            or the log is a storage-tier cache's;
            nothing is replayed.
        ReplayMismatch: The log dropped its oldest entries, or an operation
            failed in it from outside the cache after changing the cache
            (nothing is replayed); an entry names a node, lock or pin the replay does not
            have, or the replayed transitions, acknowledgements or refusals
            differ from the recorded ones; names the first difference.
    """
    if not isinstance(log, EventLog):
        raise BadArgument(f"replay: log must be an EventLog, got {log!r}")
    if not isinstance(config, CacheConfig):
        raise BadArgument(f"replay: config must be a CacheConfig, got {config!r}")
    if not log.complete:
        raise ReplayMismatch(
            f"replay: the log dropped its first {log.dropped} entries (limit {log.limit});"
            " record with log_limit=None to replay from the start"
        )
    steps = _steps(log)
    script = log.acknowledgements()
    sources: list[ScriptedAcks] = []

    def scripted(copier: Copier, copies: IssuedCopies) -> ScriptedAcks:
        sources.append(ScriptedAcks(script, copier, copies))
        return sources[-1]

    cache = HiCache(replace(config, log_limit=None), acks=scripted)
    engine = cache.tiers.copier
    cache.transfers.start_copies_with(ScriptedStarts(log.refused_starts(), engine, cache.transfers))
    held: dict[tuple[str, int], list[Lease]] = {}  # receipts by (lock|pin, node id)
    for at, entry, refused, failed in steps:
        if failed is None:  # a failed operation changed nothing (checked by _steps): skipped
            _step(cache, at, entry, refused, held)
    _compare(log, cache.log)
    cache.transfers.start_copies_with(engine)
    sources[0].hand_back()
    return cache


def _step(
    cache: HiCache,
    at: int,
    entry: Entry,
    refused: str | None,
    held: dict[tuple[str, int], list[Lease]],
) -> None:
    """Replay the operation logged at position ``at`` and check its outcome."""
    name = entry[1]
    if name == "apply_completions" and refused is not None:
        return  # refused before any completion was taken: what the caller passed is not logged
    try:
        _apply(cache, at, entry, held)
    except ReplayMismatch:
        raise
    except FsmCacheError as exc:
        _same_refusal(name, refusal_text(exc), refused, exc)
        return
    except (LookupError, TypeError, ValueError) as exc:
        msg = f"replay: entry {at} {entry!r} cannot be applied: {type(exc).__name__}: {exc}"
        raise ReplayMismatch(msg) from exc
    if refused is not None:
        raise ReplayMismatch(f"{name} was refused in the recording, not on replay: {refused}")


_STRAY = f"{DuplicateAck.__name__}: "
"""How the refusal of a batch with a stray or repeated acknowledgement begins in the log."""


def _steps(log: EventLog) -> list[Step]:
    """Return each operation with its position and its recorded refusal or failure; check every entry.

    Raises:
        BadArgument: See :func:`replay`.
        ReplayMismatch: An operation failed from outside the cache after it
            had changed the cache (entries logged between it and its failure).
    """
    out: list[Step] = []
    for at, entry in enumerate(log.entries):
        _check_entry(at, entry)
        kind = entry[0]
        if kind == "op":
            out.append((at, entry, None, None))
        elif kind in ("refused", "failed"):
            if not out or not isinstance(entry[2], str):
                what = "refusal" if kind == "refused" else "failure"
                raise BadArgument(f"replay: entry {at} {entry!r}: a {what} of no operation")
            start, op, refused, failed = out[-1]
            stray = kind == "refused" and entry[2].startswith(_STRAY)
            if stray and op[1] == "poll" and at == start + 1:
                # refused before it applied a copy, so it logged no batch; the copies it held
                # back are the next poll's batch, which a poll here would take too early
                out.pop()
                continue
            if kind == "refused":  # after a failure too: the copies its end started were refused
                out[-1] = (start, op, entry[2], failed)
                continue
            if at > start + 1:
                raise ReplayMismatch(
                    f"replay: entry {start} {op!r} failed in the recording ({entry[2]}) after it"
                    f" changed the cache (entries {start + 1} to {at - 1}); a failure from"
                    " outside the cache replays only where the operation changed nothing"
                )
            out[-1] = (start, op, refused, entry[2])
    return out


def _check_entry(at: int, entry: object) -> None:
    """Raise BadArgument unless ``entry`` is one a two-tier cache's log holds."""
    if not isinstance(entry, tuple) or len(entry) != 3:
        raise BadArgument(f"replay: entry {at} {entry!r}: not a (kind, first, second) tuple")
    kind, first, second = entry
    if _storage_entry(kind, first, second):
        raise BadArgument(
            "replay: logs of a cache with a storage tier are not replayable:"
            f" entry {at} {entry!r} needs the store, which a replay does not rebuild"
        )
    if not isinstance(kind, str) or kind not in _KINDS:
        raise BadArgument(f"replay: entry {at} {entry!r}: unknown entry kind {kind!r}")
    if kind == "copy_refused" and not _refused_start(first, second):
        raise BadArgument(
            f"replay: entry {at} {entry!r}: a refused copy start is"
            " ((copy, 'd2h' or 'h2d', (node id, ...)), 'ErrorClass: message')"
        )
    if kind == "acks" and not _acks(first, second):
        raise BadArgument(
            f"replay: entry {at} {entry!r}: an acknowledgement batch is"
            " (origin, ((copy, True or False), ...))"
        )
    if kind != "op":
        return
    if not isinstance(first, str) or first not in _ARITY:
        raise BadArgument(f"replay: entry {at} {entry!r}: unknown operation {first!r}")
    if not isinstance(second, tuple) or len(second) != _ARITY[first]:
        raise BadArgument(
            f"replay: entry {at} {entry!r}: {first} is logged with {_ARITY[first]} arguments"
        )


def _refused_start(first: object, second: object) -> bool:
    """Return whether ``first`` and ``second`` are those of a ``copy_refused`` entry."""
    if not isinstance(first, tuple) or len(first) != 3 or not isinstance(second, str):
        return False
    number, direction, nodes = first
    return (
        isinstance(number, int)
        and direction in ("d2h", "h2d")
        and isinstance(nodes, tuple)
        and all(isinstance(n, int) for n in nodes)
    )


def _acks(first: object, second: object) -> bool:
    """Return whether ``first`` and ``second`` are those of an ``acks`` entry."""
    return (
        isinstance(first, str)
        and isinstance(second, tuple)
        and all(
            isinstance(ack, tuple)
            and len(ack) == 2
            and whole(ack[0])  # a copy's number: not a bool
            and isinstance(ack[1], bool)
            for ack in second
        )
    )


def _storage_entry(kind: object, first: object, second: object) -> bool:
    """Return whether an entry is a storage tier's: its copies, operations or events."""
    if kind == "storage" or (kind == "op" and first == "evict_storage"):
        return True
    if kind == "op" and first == "fire" and isinstance(second, tuple) and second:
        return isinstance(second[0], str) and second[0] in _storage_events()
    if kind == "transition" and isinstance(second, str):
        return second.startswith("born:") or second in _storage_events()
    return False


@memoized
def _storage_events() -> frozenset[str]:
    """The events only a cache with a storage tier has."""
    both = set(load_shipped("residency_storage").event_names)
    return frozenset(both - set(load_shipped("residency").event_names))


def _same_refusal(name: str, text: str, refused: str | None, exc: FsmCacheError) -> None:
    if refused is None:
        raise ReplayMismatch(f"{name} raised on replay, not in the recording: {text}") from exc
    if text != refused:
        msg = f"{name} raised on replay: {text}; in the recording: {refused}"
        raise ReplayMismatch(msg) from exc


def _compare(want: EventLog, got: EventLog) -> None:
    _compare_starts(want.refused_starts(), got.refused_starts())
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


def _compare_starts(recorded: list[RefusedStart], replayed: list[RefusedStart]) -> None:
    for a, b in zip(recorded, replayed, strict=False):
        if a != b:
            raise ReplayMismatch(
                f"refused copy start: recorded {_start_text(a)}, replayed {_start_text(b)}"
            )
    if len(recorded) != len(replayed):
        raise ReplayMismatch(
            f"recorded {len(recorded)} refused copy starts, replayed {len(replayed)}"
        )


def _start_text(start: RefusedStart) -> str:
    number, direction, nodes, text = start
    return f"copy {number} ({direction} of nodes {list(nodes)}) refused with {text}"


class ScriptedStarts:
    """Copy starts as a log recorded them: the refused ones refused again, the others started.

    A recorded refusal is raised as a :class:`ReplayedRefusal` with the
    recorded error text when the start it names comes, without asking the
    engine: the engine the replay runs on need not refuse anything. Any
    other start goes to the engine.

    Args:
        script: The recorded refused starts, in order (:data:`RefusedStart`).
        copier: The replaying cache's copy engine, which starts every other copy.
        copies: The replaying cache's copies, whose count of starts numbers
            the next one as the log does.
    """

    def __init__(self, script: list[RefusedStart], copier: Copier, copies: IssuedCopies) -> None:
        self._pending = deque(script)
        self._copier = copier
        self._copies = copies

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Refuse the write if the log refused it here; otherwise start it on the engine."""
        self._refuse()
        return self._copier.start_write(device_pages, host_pages)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Refuse the load if the log refused it here; otherwise start it on the engine."""
        self._refuse()
        return self._copier.start_load(host_pages, device_pages)

    def _refuse(self) -> None:
        """Raise the recorded refusal if the next one names this start's copy number.

        A refusal recorded for the other direction is raised all the same:
        the replay's log then records the start as it came, and the final
        comparison names the difference.
        """
        if self._pending and self._pending[0][0] == self._copies.started() + 1:
            raise ReplayedRefusal(self._pending.popleft()[3])


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
        self._scripted = True

    def hand_back(self) -> None:
        """From now on report what the copy engine reports, as the default source does.

        Completions drained while the script ran and not yet applied come first.
        """
        self._scripted = False

    def collect(self, wait: bool) -> list[Completion]:
        """Return the next recorded batch, as completions of the replay's own copies.

        After :meth:`hand_back`: what the copy engine reports finished (with
        ``wait``, every copy in flight, in issue order), completions drained
        earlier first.

        Raises:
            ReplayMismatch: No batch is left, the batch was recorded from the
                other kind of collection, or it names a copy not in flight.
        """
        if not self._scripted:
            return self._engine_reports(wait)
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

    def _engine_reports(self, wait: bool) -> list[Completion]:
        """Return the held completions, then what the engine reports, as the default source."""
        out = [*self._finished.values(), *(self._copier.drain() if wait else self._copier.poll())]
        self._finished.clear()
        if wait:
            order = {ident: i for i, ident in enumerate(self._copies.issued())}
            out.sort(key=lambda c: order.get(c.ticket.id, len(order)))
        return out


def _apply(cache: HiCache, at: int, entry: Entry, held: dict[tuple[str, int], list[Lease]]) -> None:
    name, args = entry[1], entry[2]
    if name == "insert":
        cache.insert(args[0], args[2], namespace=args[1])
    elif name == "match_prefix":
        cache.match_prefix(args[0], namespace=args[1])
    elif name in ("lock", "pin", "unlock", "release"):
        _lease(cache, at, entry, held)
    elif name == "fire":
        cache.fire(args[0], _node(cache, at, entry, args[1]))
    elif name == "backup":
        cache.backup([_node(cache, at, entry, i) for i in args[0]])
    elif name == "load_back":
        cache.load_back(_node(cache, at, entry, args[0]))
    elif name in ("evict", "evict_host", "alloc_slots", "free_slots"):
        getattr(cache, name)(args[0])
    elif name == "poll":
        cache.poll()
    elif name == "apply_completions":
        cache.apply_completions(cache.transfers.collect(wait=False))
    elif name == "close":
        cache.close()
    # "wait_loaded" changes nothing; "agreed_poll" and "agreed_hits"
    # (fsm_cache.distributed.agreement) only precede the operations they chose


def _lease(cache: HiCache, at: int, entry: Entry, held: dict[tuple[str, int], list[Lease]]) -> None:
    """Take a lock or pin again, or release the oldest one held on the node."""
    name, ident = entry[1], entry[2][0]
    if name in ("lock", "pin"):
        take = cache.lock if name == "lock" else cache.pin
        node = _node(cache, at, entry, ident)  # first: it refuses a name no dict can hold
        held.setdefault((name, ident), []).append(take(node))
        return
    kind = "lock" if name == "unlock" else "pin"
    receipts = held.get((kind, ident))
    if not receipts:
        raise ReplayMismatch(
            f"replay: entry {at} {entry!r}: no {kind} of node {ident} is held on replay"
        )
    receipts[0].release()  # a refused release leaves the receipt held, to be released again
    receipts.pop(0)


def _node(cache: HiCache, at: int, entry: Entry, ident: object) -> TreeNode:
    """Return the replayed node ``ident`` an entry names.

    A lock or unlock names a namespace root by its namespace
    (:class:`~fsm_cache.cache.tree.NamespaceRoot`); :data:`_ANY_ROOT`'s
    operations name one as node 0, and take any root of the replayed tree.

    Raises:
        ReplayMismatch: The replayed tree has no such node.
    """
    tree = cache.tree
    node: TreeNode | None = None
    if isinstance(ident, NamespaceRoot):
        try:
            node = tree.roots.get(ident.namespace)
        except TypeError:  # an unhashable namespace, which no root has
            node = None
    elif isinstance(ident, int):
        node = tree.nodes.get(ident)
        if node is None and ident == 0 and entry[1] in _ANY_ROOT:
            node = next(iter(tree.roots.values()), None)
    if node is None:
        raise ReplayMismatch(
            f"replay: entry {at} {entry!r}: node {ident!r} is not in the replayed tree"
        )
    return node
