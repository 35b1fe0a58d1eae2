"""Running digests of the transitions a cache applied, and where two ranks' streams part.

Ranks of a tensor-parallel group must apply the same transitions in the same
order (design invariant 10), and serve the same operations with the same
arguments. Comparing whole trees across ranks is costly; a running hash of
what each rank did is 16 bytes, so ranks can compare it often. The hash
covers the transitions (node births, splits and deletions included) and the
operations that shape the tree, each with a hash of its keys and slots: an
insert that adds a node logs no transition of its own (none at all under
``write_through_selective``), so two ranks that cached different keys, or the
same keys in another order, would otherwise hash alike. When hashes differ,
:func:`first_difference` and :func:`divergence_message` turn the transitions
each rank applied since the last agreed point into a message naming the
transition, the operation it was applied in, the node and the node's state on
every rank, and
:func:`operation_message` names the first operation that differs where the
transitions do not.

Pure Python and torch-free: :mod:`fsm_cache.distributed.agreement` moves the bytes.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import hashlib
import struct
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence

from fsm_cache.cache.eventlog import EventLog
from fsm_cache.errors import ConfigError


AppliedTransition = tuple[int, str]
"""``(node id, event)`` of a transition a cache applied, as
:class:`~fsm_cache.cache.eventlog.EventLog` records it (not a spec's
:class:`~fsm_cache.spec.machine.Transition`)."""

AppliedOperation = tuple[int, str]
"""``(transitions applied before it, what the rank did)`` for an operation a cache
served (``called insert(...)``, after :func:`operation_text`) or refused
(``had insert refused (PoolExhausted)``)."""

AppliedFailure = tuple[int, str, str]
"""``(transitions applied before it, the operation as every rank renders it, "ErrorClass:
message")`` for an operation that failed from outside the cache (:meth:`TransitionDigest.failures`)."""

DIGEST_BYTES = 16

_LOCAL_OPERATIONS = frozenset({"poll", "apply_completions"})
"""Operations the digest leaves out: under agreement they apply only what the group
agreed (logged as transitions), and ``poll()`` may be called on one rank alone."""
_NAMESPACED = frozenset({"match_prefix", "insert"})
"""Operations whose second argument is a namespace, not ids."""
_LOOKBACK = 64
"""Entries before the agreed point searched for the operation that a transition after it
was applied in (:meth:`TransitionDigest.operation_of`)."""
_SHOWN = 8
"""Id sequences up to this long are shown in full; longer ones by length and hash."""
_MASK = (1 << 64) - 1
_HUGE = -(1 << 63)
"""The least signed 64-bit integer: the marker of a word out of range (:func:`_pack`)."""


def shared_arguments(name: str, args: tuple[object, ...]) -> tuple[object, ...] | None:
    """Return the arguments of a logged operation that every rank must share; None to leave it out.

    Rank-local values are left out: the pages each rank's own store found for
    a prefetch query (``agreed_hits`` keeps only the agreed counts), and the
    operations that apply only agreed copies (``poll``, ``apply_completions``).
    The digest folds what this returns, and :func:`operation_text` shows it.

    Args:
        name: The operation, as :meth:`~fsm_cache.cache.eventlog.EventLog.op` logged it.
        args: Its arguments, as logged.
    """
    if name in _LOCAL_OPERATIONS:
        return None
    return args[1:] if name == "agreed_hits" else args


def operation_text(name: str, args: tuple[object, ...]) -> str | None:
    """Describe a logged operation by what every rank must share; None to leave it out.

    Keys, slots and node ids longer than a few are shown by length and a
    64-bit hash (``hash()`` of a tuple of ints is the same in every process,
    unlike a string's). What is left out is :func:`shared_arguments`'.

    Args:
        name: The operation, as :meth:`~fsm_cache.cache.eventlog.EventLog.op` logged it.
        args: Its arguments, as logged.
    """
    shared = shared_arguments(name, args)
    if shared is None:
        return None
    if name in _NAMESPACED:  # (tokens, namespace, slots or none): most of what is logged
        shown = [ids_text(shared[0]), namespace_text(shared[1]), *map(ids_text, shared[2:])]
    else:
        shown = list(map(ids_text, shared))
    return f"{name}({', '.join(shown)})"


def ids_text(value: object) -> str:
    """A count, or ids (a tuple, or an ``array('Q')`` of slots), as every rank renders them."""
    if value is None or type(value) is int:
        return str(value)
    if isinstance(value, tuple):
        if len(value) <= _SHOWN:
            return repr(tuple(value))
        return f"<{len(value)} ids {hash(value) & _MASK:016x}>"
    if isinstance(value, array.array):
        if len(value) <= _SHOWN:
            return repr(value.tolist())
        return f"<{len(value)} ids {hashlib.blake2b(value, digest_size=8).hexdigest()}>"
    return namespace_text(value)


def namespace_text(value: object) -> str:
    """A namespace as every rank renders it: by value where that is the same everywhere.

    Plain values and tuples of them in full; an enum member by its class and
    name; a frozenset by its members' renderings, sorted (its own order
    follows ``hash()``, which differs between processes for strings); a
    dataclass that compares by value by the fields it compares. Any other
    object by its type only, since its own ``repr`` may hold its address,
    which differs between ranks. Rendering distinct namespaces alike would let
    ranks that served different ones fold to the same digest.
    """
    if value is None or isinstance(value, (str, bytes, int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(namespace_text(v) for v in value) + ")"
    kind = type(value)
    if isinstance(value, enum.Enum):
        return f"{kind.__qualname__}.{value.name}"
    if isinstance(value, frozenset):
        return "frozenset({" + ", ".join(sorted(namespace_text(v) for v in value)) + "})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(kind, "__dataclass_params__", None)
        if params is not None and params.eq:  # compared field by field, as a namespace key is
            shown = (
                f"{f.name}={namespace_text(getattr(value, f.name))}"
                for f in dataclasses.fields(value)
                if f.compare
            )
            return f"{kind.__qualname__}({', '.join(shown)})"
    return f"<{kind.__qualname__}>"


_TRANSITION, _OPERATION, _REFUSED, _FAILED = -1, -2, -3, -4
"""The first word of an entry's words, for the entries without a shorter form."""
_OUTCOMES = {"refused": _REFUSED, "failed": _FAILED}
"""The first word of an operation's outcome by its entry's kind: a refusal of the cache's own,
or a failure from outside the cache (a copy engine or an allocator that raised)."""
_NODE_BITS = 32
"""A transition of a node id below ``2**31`` folds in as one word: the id, then the event's code
in the low 32 bits; the word is at least 0, which no other entry's first word is."""
_SHORT_OPERATION = -16
"""An operation with one int argument (``lock``, ``evict``, ...) folds in as two words: this
less its name's code, then the int. Below every other first word, above a word's marker."""
_INT, _NONE, _IDS, _ARRAY, _TEXT = 0, 1, 2, 3, 4
"""The first word of each argument's words: how the words after it encode it."""


def _code(codes: dict[str, int], name: str) -> int:
    """Return ``name``'s stable word: the CRC-32 of its UTF-8 bytes, kept in ``codes``.

    ``hash()`` of a string differs between processes; this does not.
    """
    code = codes.get(name)
    if code is None:
        code = codes[name] = zlib.crc32(name.encode())
    return code


def _argument_words(value: object, namespace: bool) -> tuple[int, ...]:
    """Return the words an operation's argument folds in as: what :func:`ids_text` shows, as ints.

    A count as itself, None as a tag, a tuple of ids by its length and
    ``hash()`` (the same in every process for ints), slots (``array('Q')``) by
    length and CRC-32 (an Adler-32 beside it cost more than the rest of an
    insert's words), and anything else (namespaces) by the CRC-32 of its text.
    """
    if type(value) is int:
        return (_INT, value)
    if value is None:
        return (_NONE,)
    if namespace:
        return (_TEXT, zlib.crc32(namespace_text(value).encode()))
    if isinstance(value, tuple):  # a TokenKey too; numpy integers hash as the ints they are
        return (_IDS, len(value), hash(value))
    if isinstance(value, array.array):
        return (_ARRAY, len(value), zlib.crc32(value))
    return (_TEXT, zlib.crc32(ids_text(value).encode()))


def _pack(words: list[int]) -> bytes:
    """Return ``words`` as little-endian 64-bit integers; a word out of range as several.

    A word out of the signed 64-bit range is written as a marker word (the
    least 64-bit integer, which a count never is), its byte count and its
    bytes. Each word's bytes depend on that word alone, whichever form the
    update took, so how the entries are split between updates does not
    change the digest. ``struct`` packs a list about twice as fast as ``array``.
    """
    try:
        return struct.pack(f"<{len(words)}q", *words)
    except struct.error:
        return b"".join(map(_word_bytes, words))


def _word_bytes(word: int) -> bytes:
    """One word's bytes, as :func:`_pack` writes them."""
    if _HUGE <= word < -_HUGE:
        return word.to_bytes(8, "little", signed=True)
    raw = word.to_bytes((word.bit_length() + 8) // 8, "little", signed=True)
    return _HUGE.to_bytes(8, "little", signed=True) + len(raw).to_bytes(8, "little") + raw


class TransitionDigest:
    """A blake2b hash over the transitions and operations of one event log, folded in as logged.

    Each entry is folded in as 64-bit words (:func:`_pack`): a transition as
    its node and its event's code (one word for a node id below ``2**31``), an
    operation as its name's code and the words of its
    :func:`shared_arguments` (:func:`_argument_words`; two words in all for
    one int argument), and a
    refusal as the operation's and the error class's codes (a call refused on
    one rank only changed nothing there); acknowledgement batches are not (the
    transitions they fire are, and a storage batch holds each rank's own
    outcome), and a failure (an error from outside the cache: a copy engine or
    an allocator that raised) as the operation's and the error class's codes,
    apart from a refusal. Names are coded by CRC-32 (:func:`_code`), never by ``hash()``
    of a string, which differs between processes. Words rather than text: a
    32-request step's log folds in about a quarter of the time its text took.

    Args:
        log: The cache's event log; only appended to, never rewritten.
        start: The position in ``log`` (:attr:`~fsm_cache.cache.eventlog.EventLog.recorded`
            counts them) of the first entry folded in: 0 for the whole log;
            ``log.recorded`` for what is logged from now on, for a cache that
            served before it was wrapped, whose acknowledgements each rank
            applied in its own order then.

    Attributes:
        count: Transitions folded in so far (operations are not counted).
        agreed: Transitions folded in when the group last agreed (see :meth:`agree`).
    """

    def __init__(self, log: EventLog, start: int = 0) -> None:
        self._log = log
        self._hash = hashlib.blake2b(digest_size=DIGEST_BYTES)
        self._codes: dict[str, int] = {}
        self._scanned = start
        self._agreed_entry = start
        self.count = 0
        self.agreed = 0

    def update(self) -> bytes:
        """Fold in the transitions and operations logged since the last update; return the digest."""
        if self._log.dropped > self._scanned:
            raise ConfigError(
                f"distributed: the event log dropped {self._log.dropped - self._scanned} entries"
                " the transition digest had not read; raise CacheConfig.log_limit"
            )
        # one update of the packed words: a streaming hash of the whole is the hash of its parts
        words: list[int] = []
        codes, count = self._codes, 0
        for kind, first, second in self._log.since(self._scanned):
            if kind == "transition":
                count += 1
                if type(first) is int and 0 <= first < 1 << (_NODE_BITS - 1):
                    words.append(first << _NODE_BITS | _code(codes, second))
                else:
                    words.extend((_TRANSITION, first, _code(codes, second)))
            elif kind == "op":
                if len(second) == 1 and type(second[0]) is int:  # lock, unlock, evict, ...
                    if first not in _LOCAL_OPERATIONS:
                        words.append(_SHORT_OPERATION - _code(codes, first))
                        words.append(second[0])
                    continue
                shared = shared_arguments(first, second)
                if shared is not None:
                    words.extend((_OPERATION, _code(codes, first), len(shared)))
                    namespaced = first in _NAMESPACED
                    for i, value in enumerate(shared):
                        words.extend(_argument_words(value, namespaced and i == 1))
            elif kind in _OUTCOMES:  # a refusal, or a failure from outside the cache
                error = _error_class(second)
                words.extend((_OUTCOMES[kind], _code(codes, first), _code(codes, error)))
        if words:
            self._hash.update(_pack(words))
        self.count += count
        self._scanned = self._log.recorded
        return self._hash.digest()

    def agree(self) -> None:
        """Mark everything folded in so far as agreed by the group."""
        self.agreed = self.count
        self._agreed_entry = self._scanned

    def tail(self) -> list[AppliedTransition]:
        """Return the transitions folded in since the last agreed point, in order."""
        entries = self._log.since(self._agreed_entry, self._scanned)
        return [(node, event) for kind, node, event in entries if kind == "transition"]

    def operation_of(self, index: int) -> str | None:
        """Return the operation the transition at ``index`` of :meth:`tail` was applied in.

        As every rank renders it (:func:`operation_text`, or its name where
        that leaves it out: ``apply_completions`` for what a step applied);
        None where this rank applied fewer transitions. An operation that
        agreed inside itself (a load wait) was logged before the agreed point,
        so the last :data:`_LOOKBACK` entries before it are searched too;
        ``an operation`` where none is found.
        """
        before = self._log.since(max(self._agreed_entry - _LOOKBACK, 0), self._agreed_entry)
        last = next(
            (
                operation_text(name, args) or name
                for kind, name, args in reversed(before)
                if kind == "op"
            ),
            "an operation",
        )
        applied = 0
        for kind, first, second in self._log.since(self._agreed_entry, self._scanned):
            if kind == "op":
                last = operation_text(first, second) or first
            elif kind == "transition":
                if applied == index:
                    return last
                applied += 1
        return None

    def failures(self) -> list[AppliedFailure]:
        """Return the operations that failed from outside the cache since the last agreed point.

        Each as ``(transitions applied before it, "insert(...)", "RuntimeError: ...")``:
        the operation as every rank renders it, then the error and its message.
        """
        applied, found, last = self.agreed, [], "an operation"
        for kind, first, second in self._log.since(self._agreed_entry, self._scanned):
            if kind == "transition":
                applied += 1
            elif kind == "op":
                last = operation_text(first, second) or first
            elif kind == "failed":
                found.append((applied, last, second))
        return found

    def operations(self) -> list[AppliedOperation]:
        """Return the operations and refusals folded in since the last agreed point, in order.

        Each comes with the number of transitions applied before it, so a
        report can place it among the transitions.
        """
        applied, found = self.agreed, []
        for kind, first, second in self._log.since(self._agreed_entry, self._scanned):
            if kind == "transition":
                applied += 1
            elif kind == "op":
                text = operation_text(first, second)
                if text is not None:
                    found.append((applied, f"called {text}"))
            elif kind == "refused":
                found.append((applied, f"had {first} refused ({second.partition(':')[0]})"))
        return found


StatePart = tuple[str, tuple[tuple[str, str], ...]]
"""One part of a cache's state, as every rank renders it (:func:`ids_text`, :func:`namespace_text`):
what it is and its fields by name, e.g. ``("node 3", (("parent", "node 1"), ("state",
"backed/resident (pins=0, locks=0)"), ...))``. The ranks compare theirs when they wrap their
caches (:func:`state_fingerprint`, :func:`state_difference`)."""


def state_fingerprint(parts: Sequence[StatePart]) -> bytes:
    """Return a 16-byte blake2b hash of ``parts``, the same on every rank whose parts are equal.

    The parts are text as every rank renders it, so their ``repr`` is too.
    """
    return hashlib.blake2b(repr(list(parts)).encode(), digest_size=DIGEST_BYTES).digest()


def state_difference(states: Sequence[Sequence[StatePart]]) -> str | None:
    """Name the first part of the ranks' states that differs, with each rank's value of it.

    A part that only some ranks list (a node some trees lack) is named first,
    as in the tree or not; else the first part whose fields differ, and the
    first of them that does. Parts are taken in the order the ranks list them.

    Args:
        states: Per rank, its parts (:data:`StatePart`).

    Returns:
        ``node 3 state: rank 0 backed/resident (pins=0, locks=0), rank 1
        writing/resident (pins=0, locks=0)``, or ``node 5: rank 0 in the tree,
        rank 1 not in the tree``; None where every rank's parts are equal.
    """
    found = [dict(parts) for parts in states]
    listed = list(dict.fromkeys(what for parts in states for what, _ in parts))
    for what in listed:
        if any(what not in fields for fields in found):
            held = ("in the tree" if what in fields else "not in the tree" for fields in found)
            return f"{what}: " + ", ".join(f"rank {r} {h}" for r, h in enumerate(held))
    for what in listed:
        named = [dict(fields[what]) for fields in found]
        for field in dict.fromkeys(name for fields in named for name in fields):
            values = [fields.get(field, "none") for fields in named]
            if any(value != values[0] for value in values):
                shown = ", ".join(f"rank {r} {value}" for r, value in enumerate(values))
                return f"{what} {field}: {shown}"
    return None


def first_difference(tails: Sequence[Sequence[Hashable]]) -> int | None:
    """Return the first index at which the ranks' entries differ, or None if none does.

    Entries are transitions, operations or failures, per rank, in order.

    A rank with fewer entries differs at the index just past its last one.
    """
    longest = max((len(t) for t in tails), default=0)
    for i in range(longest):
        seen = {tail[i] if i < len(tail) else None for tail in tails}
        if len(seen) > 1:
            return i
    return None


def divergence_message(
    start: int,
    index: int,
    tails: Sequence[Sequence[AppliedTransition]],
    states: Sequence[Mapping[int, str]],
    operations: Sequence[str | None],
) -> str:
    """Describe the first differing transition, its operation and the nodes' states on every rank.

    Args:
        start: Transitions every rank had agreed on before ``tails`` begin.
        index: Where the tails first differ (from :func:`first_difference`).
        tails: Per rank, the transitions applied since the agreed point.
        states: Per rank, the residency of each involved node now (absent: not in the tree).
        operations: Per rank, the operation its transition at ``index`` was
            applied in (:meth:`TransitionDigest.operation_of`; None where it applied fewer).

    Returns:
        ``rank divergence at transition 41: rank 0 applied node 7 write_done in
        apply_completions, rank 1 applied node 7 write_failed in insert((0, 1, 2),
        None, None); node 7 now: rank 0 backed/resident (pins=0, locks=0), rank 1
        unbacked/resident (pins=0, locks=0)``.
    """
    applied = []
    for rank, tail in enumerate(tails):
        if index < len(tail):
            node, event = tail[index]
            applied.append(f"rank {rank} applied node {node} {event} in {operations[rank]}")
        else:
            applied.append(f"rank {rank} applied nothing (only {start + len(tail)} transitions)")
    now = _now(involved_nodes(tails, index), states)
    return f"rank divergence at transition {start + index}: " + "; ".join(
        [", ".join(applied), *now]
    )


def operation_message(index: int, operations: Sequence[Sequence[AppliedOperation]]) -> str:
    """Describe the first operation the ranks served differently, where the transitions agree.

    Args:
        index: Where the ranks' operations first differ (from :func:`first_difference`).
        operations: Per rank, the operations since the agreed point (see
            :meth:`TransitionDigest.operations`).

    Returns:
        ``rank divergence after transition 12: the ranks served different
        operations: rank 0 called insert(<16 ids 53b8a4e4c4a1c2f0>, None, None),
        rank 1 called insert(<64 ids 0e9bd5b1a3d6e2c7>, None, None)``.
    """
    return _apart(
        index, operations, "the ranks served different operations", "rank {} {}", "did nothing more"
    )


def failure_difference(failures: Sequence[Sequence[AppliedFailure]]) -> int | None:
    """Return the first index at which the ranks' failures differ, as the digest tells them apart.

    Failures compare by where they came, their operation and their error's
    class, not by its message, which may name what differs between ranks (a
    device, an address): an operation that failed alike everywhere is no
    divergence, and whatever parted the ranks is to be named instead.
    """
    return first_difference(
        [[(at, operation, _error_class(error)) for at, operation, error in f] for f in failures]
    )


def _error_class(error: str) -> str:
    """The class of a logged ``"ErrorClass: message"``, as the digest folds it in."""
    return error.partition(":")[0]


def failure_message(index: int, failures: Sequence[Sequence[AppliedFailure]]) -> str:
    """Describe the first operation that failed from outside the cache on some ranks only.

    Args:
        index: Where the ranks' failures first differ (from :func:`failure_difference`).
        failures: Per rank, its failures since the agreed point (see
            :meth:`TransitionDigest.failures`).

    Returns:
        ``rank divergence after transition 8: an operation failed on some ranks
        only: rank 0 had no failure, rank 1's insert(<32 ids 13514aa7e54a0922>,
        None, None) raised RuntimeError: allocator broke``.
    """
    shown = [[(at, f"{operation} raised {error}") for at, operation, error in f] for f in failures]
    return _apart(
        index, shown, "an operation failed on some ranks only", "rank {}'s {}", "had no failure"
    )


def _apart(
    index: int, per_rank: Sequence[Sequence[AppliedOperation]], what: str, said: str, unsaid: str
) -> str:
    """Name each rank's entry at ``index`` (``said`` of its rank and the entry) or ``unsaid``.

    The divergence is dated by the fewest transitions applied before any
    rank's entry there.
    """
    parts = [
        said.format(rank, entries[index][1]) if index < len(entries) else f"rank {rank} {unsaid}"
        for rank, entries in enumerate(per_rank)
    ]
    applied = min(entries[index][0] for entries in per_rank if index < len(entries))
    return f"rank divergence after transition {applied}: {what}: " + ", ".join(parts)


def queued_message(
    start: int,
    queued: Sequence[Sequence[tuple[str, Sequence[int]]]],
    states: Sequence[Mapping[int, str]],
) -> str:
    """Describe ranks that did the same but have different nodes waiting for a copy to start.

    Args:
        start: Transitions every rank applied.
        queued: Per rank, per direction with any, the nodes waiting for their copy to start.
        states: Per rank, the residency of each node named in ``queued``.

    Returns:
        ``rank divergence after transition 8: the ranks have different copies
        waiting to start: rank 0 none, rank 1 d2h of nodes [1]; node 1 now:
        rank 0 backed/resident (pins=0, locks=0), rank 1 backed/resident
        (pins=0, locks=0)``.
    """
    waiting = []
    for rank, copies in enumerate(queued):
        named = " and ".join(f"{direction} of nodes {list(nodes)}" for direction, nodes in copies)
        waiting.append(f"rank {rank} {named or 'none'}")
    nodes = dict.fromkeys(n for copies in queued for _, ids in copies for n in ids)
    return (
        f"rank divergence after transition {start}: the ranks have different copies waiting "
        "to start: " + "; ".join([", ".join(waiting), *_now(nodes, states)])
    )


def reset_message(resets: Sequence[int]) -> str:
    """Describe ranks whose caches were reset a different number of times.

    Args:
        resets: Per rank, the resets of its cache its wrapper followed.

    Returns:
        ``rank divergence: the cache was reset on rank 1 and not on rank 0
        (resets: rank 0 0, rank 1 1); every rank must reset its cache at the
        same point``.
    """
    fewest = min(resets)
    behind = [rank for rank, n in enumerate(resets) if n == fewest]
    ahead = [rank for rank, n in enumerate(resets) if n != fewest]
    counts = ", ".join(f"rank {rank} {n}" for rank, n in enumerate(resets))
    return (
        f"rank divergence: the cache was reset on {_ranks(ahead)} and not on {_ranks(behind)} "
        f"(resets: {counts}); every rank must reset its cache at the same point"
    )


def collectives_message(start: int, reached: Sequence[str], why: str) -> str:
    """Describe ranks that reached different agreement collectives, naming each rank's.

    Args:
        start: Transitions every rank had agreed on.
        reached: Per rank, the collective it reached (``a step``, ``a drain``, ...).
        why: What that says about the ranks' calls.

    Returns:
        ``rank divergence after transition 12: the ranks reached different
        collectives: ranks 0, 1 a step, rank 2 a digest verification, rank 3 a
        drain (the ranks called different DistributedCache methods)``.
    """
    ranks: dict[str, list[int]] = {}
    for rank, what in enumerate(reached):
        ranks.setdefault(what, []).append(rank)
    each = ", ".join(f"{_ranks(group)} {what}" for what, group in ranks.items())
    return (
        f"rank divergence after transition {start}: the ranks reached different collectives: "
        f"{each} ({why})"
    )


def waiting_message(
    start: int, waits: Sequence[Sequence[Sequence[int]]], states: Sequence[Mapping[int, str]]
) -> str:
    """Describe ranks that applied the same transitions but wait on different copies.

    Args:
        start: Transitions every rank applied.
        waits: Per rank, per copy in flight (issue order), the nodes it copies.
        states: Per rank, the residency of each node named in ``waits``.

    Returns:
        ``rank divergence after transition 38: the ranks wait on different copies:
        rank 0 on 1 copy of nodes [9], rank 1 on 0 copies; node 9 now: rank 0
        writing/resident (pins=0, locks=0), rank 1 writing/resident (pins=0, locks=0)``.
    """
    waiting = []
    for rank, copies in enumerate(waits):
        plural = "copy" if len(copies) == 1 else "copies"
        nodes = " then ".join(str(list(copy)) for copy in copies)
        waiting.append(
            f"rank {rank} on {len(copies)} {plural}" + (f" of nodes {nodes}" if nodes else "")
        )
    named = dict.fromkeys(n for copies in waits for copy in copies for n in copy)
    return f"rank divergence after transition {start}: the ranks wait on different copies: " + (
        "; ".join([", ".join(waiting), *_now(named, states)])
    )


def storage_waiting_message(
    start: int, waits: Sequence[Sequence[tuple[str, Sequence[int]]]]
) -> str:
    """Describe ranks that applied the same transitions but wait on different storage copies.

    Args:
        start: Transitions every rank applied.
        waits: Per rank, per storage copy in flight (number order), its kind and nodes.

    Returns:
        ``rank divergence after transition 30: the ranks wait on different storage
        copies: rank 0 on store of nodes [4] then fetch of nodes [9], rank 1 on
        store of nodes [4]``.
    """
    waiting = []
    for rank, copies in enumerate(waits):
        named = " then ".join(f"{kind} of nodes {list(nodes)}" for kind, nodes in copies)
        waiting.append(f"rank {rank} on {named or 'none'}")
    return (
        f"rank divergence after transition {start}: the ranks wait on different storage copies: "
        + ", ".join(waiting)
    )


def copy_nodes(waits: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Per copy in flight, its nodes as seen by the first rank that still holds its ticket.

    A rank that lost a copy's completion no longer knows which pages it
    copied; the other ranks do. ``waits`` holds, per rank, per copy in issue
    order, the nodes it copies; every rank has the same number of copies.
    """
    count = min((len(w) for w in waits), default=0)
    return [next((list(w[k]) for w in waits if w[k]), []) for k in range(count)]


def lost_message(
    start: int,
    copies: Sequence[Sequence[int]],
    ready: Sequence[int],
    states: Sequence[Mapping[int, str]],
) -> str:
    """Describe ranks whose copy engine drained without reporting every copy they started.

    Args:
        start: Transitions every rank applied.
        copies: Per copy in flight (issue order), the nodes it copies.
        ready: Per rank, how many copies at the head of the issue order finished.
        states: Per rank, the residency of each node of the missing copies.

    Returns:
        ``rank divergence after transition 24: a completion was lost: rank 1
        drained its copy engine without the completion of copy 1 of 2 in
        flight (nodes [8]); node 8 now: rank 0 writing/resident (pins=0,
        locks=0), rank 1 writing/resident (pins=0, locks=0)``.
    """
    total = len(copies)
    short = {rank: k for rank, k in enumerate(ready) if k < total}
    missing = [
        f"rank {rank} drained its copy engine without the completion of "
        f"copy {k + 1} of {total} in flight (nodes {list(copies[k])})"
        for rank, k in short.items()
    ]
    named = dict.fromkeys(n for k in short.values() for n in copies[k])
    return f"rank divergence after transition {start}: a completion was lost: " + "; ".join(
        [", ".join(missing), *_now(named, states)]
    )


def stalled_message(
    start: int,
    copies: Sequence[Sequence[int]],
    ready: Sequence[int],
    timeout: float,
    states: Sequence[Mapping[int, str]],
) -> str:
    """Describe an oldest copy that finished on some ranks and not on the others in time.

    Args:
        start: Transitions every rank applied.
        copies: Per copy in flight (issue order), the nodes it copies.
        ready: Per rank, how many copies at the head of the issue order finished.
        timeout: Seconds the group waited.
        states: Per rank, the residency of each node of the oldest copy.

    Returns:
        ``rank divergence after transition 24: copy 1 of 2 in flight (nodes [8])
        finished on rank 0 and not on rank 1 for longer than the timeout (1 s);
        node 8 now: rank 0 writing/resident (pins=0, locks=0), rank 1
        writing/resident (pins=0, locks=0)``.
    """
    done = [rank for rank, k in enumerate(ready) if k]
    late = [rank for rank, k in enumerate(ready) if not k]
    head = list(copies[0]) if copies else []
    return f"rank divergence after transition {start}: " + "; ".join(
        [
            f"copy 1 of {len(copies)} in flight (nodes {head}) finished on {_ranks(done)} "
            f"and not on {_ranks(late)} for longer than the timeout ({timeout:g} s)",
            *_now(head, states),
        ]
    )


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _now(nodes: Iterable[int], states: Sequence[Mapping[int, str]]) -> list[str]:
    """``node 7 now: rank 0 <state>, rank 1 <state>`` for each node."""
    return [
        f"node {node} now: "
        + ", ".join(
            f"rank {rank} {found.get(node, 'not in the tree')}" for rank, found in enumerate(states)
        )
        for node in nodes
    ]


def involved_nodes(tails: Sequence[Sequence[AppliedTransition]], index: int) -> list[int]:
    """Return the nodes any rank applied a transition to at ``index``, in rank order."""
    nodes = (tail[index][0] for tail in tails if index < len(tail))
    return list(dict.fromkeys(nodes))
