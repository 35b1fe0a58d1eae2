"""The event log of a cache: every operation, transition and acknowledgement, replayable.

Operations (``insert``, ``match_prefix``, ``lock``, ``evict``, ``poll``, ...)
are recorded with their arguments, transitions as ``(node id, event)``, and
every batch of applied copy acknowledgements as the copy numbers it applied,
in order, each with whether it succeeded. An operation that raised is
followed by its refusal (a :class:`~fsm_cache.errors.FsmCacheError`) or its
failure (anything else: a copy engine or an allocator that broke), and a copy
the copy engine refused to start by an entry saying so, so that a replay
refuses the same start on any engine. :func:`fsm_cache.cache.replay.replay` runs the log
again on a fresh cache.

A log keeps at most ``limit`` entries (:data:`DEFAULT_LIMIT` unless told),
dropping the oldest first, so a server that runs for days holds a bounded
log: 20,000 lookups of 512 tokens used to add 81 MiB that nothing ever freed.
What it dropped is counted (:attr:`EventLog.dropped`); a log that dropped
nothing is :attr:`~EventLog.complete`, and only a complete log replays.
Entries keep their arguments as the operation passed them (a lookup's token
tuple is the caller's, not a copy), so an entry costs about a hundred bytes
plus whatever its arguments hold alive.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, SupportsIndex, overload

from fsm_cache.errors import BadArgument
from fsm_cache.numeric import as_index


Acks = tuple[tuple[int, bool], ...]
"""Applied acknowledgements in order: ``(copy number, ok)``; copies count from 1."""

StorageAck = tuple[int, str, int, str]
"""One applied storage copy: ``(copy number, store|fetch, pages acknowledged, outcome)``.

Storage copies count from 1 apart from device-host copies; the outcome is
``ok``, ``full`` (the store had no room for a page), ``missing`` (the store no
longer held a page), ``corrupt`` (a page read back torn or foreign, and was
dropped), ``failed`` (the store raised) or ``timeout`` (no answer in time).
The pages acknowledged are the leading pages that landed whatever the outcome.
"""

RefusedStart = tuple[int, str, tuple[int, ...], str]
"""One copy the engine refused to start: ``(copy number, d2h|h2d, node ids, "ErrorClass: message")``.

The copy number is the one the copy would have had; the next copy started
gets it, since a refused start is numbered as no copy.
"""

Entry = tuple[str, Any, Any]
"""One entry of the log: ``(kind, first, second)``; see :class:`EventLog`."""

DEFAULT_LIMIT = 100_000
"""The entries a log keeps unless told otherwise (``CacheConfig.log_limit``'s default)."""


class Entries(Sequence[Entry]):
    """The entries a log keeps, oldest first: a read-mostly view of the log's deque.

    It reads like the list the log used to be (``len``, iteration, ``[-1]``,
    slices, ``index``, ``in``, and ``==`` with a list), without copying the
    entries. Positions count from the oldest entry kept, not from the first
    ever recorded; :meth:`EventLog.since` takes positions that do. Item
    assignment is allowed so that tests can tamper with a recording.

    Args:
        items: The log's deque of entries (the view shares it, and sees appends).
    """

    __slots__ = ("_items",)

    def __init__(self, items: deque[Entry]) -> None:
        self._items = items

    def __reduce__(self) -> tuple[type[Entries], tuple[deque[Entry]]]:
        """Copy and pickle as the view of its deque (a compiled class has no other way)."""
        return Entries, (self._items,)

    def __len__(self) -> int:
        """Return how many entries are kept."""
        return len(self._items)

    def __iter__(self) -> Iterator[Entry]:
        """Iterate the kept entries, oldest first."""
        return iter(self._items)

    def __reversed__(self) -> Iterator[Entry]:
        """Iterate the kept entries, newest first."""
        return reversed(self._items)

    def __contains__(self, entry: object) -> bool:
        """Return whether ``entry`` is one of the kept entries."""
        return entry in self._items

    @overload
    def __getitem__(self, index: int) -> Entry: ...

    @overload
    def __getitem__(self, index: slice) -> list[Entry]: ...

    def __getitem__(self, index: int | slice) -> Entry | list[Entry]:
        """Return one entry, or a list of the entries a slice selects.

        A slice walks the deque from its nearer end, so ``[-4:]`` of a full
        log costs four steps, not a hundred thousand.
        """
        if isinstance(index, int):
            return self._items[index]
        size = len(self._items)
        start, stop, step = index.indices(size)
        if step < 0:
            return list(self._items)[index]
        if stop <= start:
            return []
        if start >= size - stop:  # nearer the newest end
            window = list(itertools.islice(reversed(self._items), size - stop, size - start))
            window.reverse()
        else:
            window = list(itertools.islice(self._items, start, stop))
        return window[::step]

    def __setitem__(self, index: int, entry: Entry) -> None:
        """Replace one kept entry (tests tamper with recordings to see replay refuse them)."""
        self._items[index] = entry

    def index(self, value: Any, start: int = 0, stop: int = sys.maxsize) -> int:
        """Return the position of the first kept entry equal to ``value``.

        Raises:
            ValueError: No kept entry between ``start`` and ``stop`` equals it.
        """
        return self._items.index(value, start, stop)

    def count(self, value: Any) -> int:
        """Return how many kept entries equal ``value``."""
        return self._items.count(value)

    def __eq__(self, other: object) -> bool:
        """Compare entry by entry with another view or a list, as the old list compared."""
        # Two tests, not isinstance(other, (Entries, list)): mypyc narrows that to a
        # union it then checks every other type against (a tuple raised TypeError).
        if isinstance(other, Entries) or isinstance(other, list):  # noqa: SIM101
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like the list it replaces

    def __repr__(self) -> str:
        """Return ``Entries([...])`` with every kept entry (for assertion messages)."""
        return f"Entries({list(self._items)!r})"


def _limit(limit: object) -> int | None:
    """``limit`` as an int (a numpy integer is the int it stands for), or None.

    Raises:
        BadArgument: It is neither None nor an int >= 1; a bool (or a bool
            tensor) is not an int here.
    """
    if limit is None:
        return None
    kept = as_index(limit)
    if kept is None or kept < 1:
        raise BadArgument(f"EventLog: limit must be None or an int >= 1, got {limit!r}")
    return kept


class EventLog:
    """Operations, transitions and acknowledgements in the order they happened.

    Args:
        limit: The most entries kept; past it each new entry drops the oldest.
            None keeps every entry, for a run that must replay from its start.

    Attributes:
        entries: ``("op", name, args)`` (slot lists in ``args`` as an
            ``array('Q')``), ``("transition", node_id, event)``,
            ``("acks", origin, ((copy, ok), ...))`` (origin: ``poll``,
            ``apply_completions``, or ``wait`` for an allocation that waited for
            write-backs), ``("storage", origin, ((copy, kind, pages, outcome), ...))``
            for applied copies to and from a storage tier (:data:`StorageAck`),
            ``("copy_refused", (copy, d2h|h2d, (node_id, ...)), "ErrorClass:
            message")`` for a copy the engine refused to start (see
            :data:`RefusedStart`), ``("refused", name, "ErrorClass: message")`` tuples (the
            message without the call-site account a trail-mode refusal ends
            with, see :func:`refusal_text`), and ``("failed", name, "ErrorClass:
            message")`` for an operation that raised something other than a
            :class:`~fsm_cache.errors.FsmCacheError`, or an
            :class:`~fsm_cache.errors.EffectFailed` from such an error (an
            allocator that broke in an effect); the kept ones, oldest first, as an
            :class:`Entries` view. :meth:`~fsm_cache.cache.hicache.HiCache.fire`
            is recorded as ``("op", "fire", (event, node_id))``; a lock or
            unlock of a namespace root names it by a
            :class:`~fsm_cache.cache.tree.NamespaceRoot` (every root's id is 0). New leaves
            are not logged, but for one an insert hung before it failed:
            ``("transition", leaf_id, "add")`` then precedes the failure.

    Raises:
        BadArgument: ``limit`` is neither None nor an int >= 1 (one past
            ``sys.maxsize`` keeps every entry, as None does).
    """

    __slots__ = ("_items", "_recorded", "entries")

    def __init__(self, limit: SupportsIndex | None = DEFAULT_LIMIT) -> None:
        kept = _limit(limit)
        self._items: deque[Entry] = deque(maxlen=None if kept is None else min(kept, sys.maxsize))
        self._recorded = 0
        self.entries = Entries(self._items)

    def __reduce__(self) -> tuple[Any, tuple[int | None, tuple[Entry, ...], int]]:
        """Copy and pickle as its limit, its kept entries and its count of entries recorded.

        A compiled class has no other way; a copy keeps counting from where
        the original was, so positions (:meth:`since`) mean the same in both.
        """
        return EventLog._restored, (self.limit, tuple(self._items), self._recorded)

    @classmethod
    def _restored(cls, limit: int | None, items: tuple[Entry, ...], recorded: int) -> EventLog:
        """The log :meth:`__reduce__` describes."""
        log = cls(limit)
        log._items.extend(items)
        log._recorded = recorded
        return log

    @property
    def limit(self) -> int | None:
        """The most entries kept, or None when the log keeps every one."""
        return self._items.maxlen

    @property
    def recorded(self) -> int:
        """Entries recorded since the log was created, kept or dropped.

        It is also the position the next entry will have: positions count
        every entry ever recorded, from 0, as :meth:`since` takes them.
        """
        return self._recorded

    @property
    def dropped(self) -> int:
        """Entries dropped, oldest first, to stay within :attr:`limit`."""
        return self._recorded - len(self._items)

    @property
    def complete(self) -> bool:
        """Whether the log still holds every entry since it was created (it dropped none)."""
        return self._recorded == len(self._items)

    def since(self, start: int, stop: int | None = None) -> list[Entry]:
        """Return the kept entries recorded at positions ``start`` up to ``stop`` (exclusive).

        Positions count every entry ever recorded (see :attr:`recorded`), so a
        reader that remembers where it stopped, as the tensor-parallel digest
        does, resumes at the right entry however many were dropped meanwhile.
        Entries dropped before the reader came back are not returned: a reader
        that must see every entry checks ``dropped <= start``.
        """
        stop = self._recorded if stop is None else min(stop, self._recorded)
        first = self.dropped
        return self.entries[max(start, first) - first : max(stop, first) - first]

    def append(self, entry: Entry) -> None:
        """Record ``entry`` as another log holds it (to rebuild a log entry by entry).

        A log rebuilt this way counts only the entries appended: copying one
        that dropped entries gives a log that claims to be complete. Copy a
        log with :meth:`copy`, which keeps what it dropped.
        """
        self._recorded += 1
        self._items.append(entry)

    def retract(self, entry: Entry) -> bool:
        """Take back the last entry if it is ``entry``; return whether it was.

        For a step an operation took and then took back before it returned (a
        split undone): the log reads as if it had never been logged. An entry
        the limit dropped to make room for it stays dropped.
        """
        if not self._items or self._items[-1] != entry:
            return False
        self._items.pop()
        self._recorded -= 1
        return True

    def copy(self) -> EventLog:
        """Return a copy with the same limit, entries and count of entries dropped."""
        out = EventLog(self.limit)
        out._items.extend(self._items)
        out._recorded = self._recorded
        return out

    def op(self, name: str, *args: object) -> None:
        """Record a public operation and its arguments.

        Slot lists come as an ``array('Q')`` (:func:`~fsm_cache.cache.arguments.packed`).
        """
        self._recorded += 1
        self._items.append(("op", name, args))

    def as_given(self, name: str, args: tuple[object, ...]) -> None:
        """Record ``args`` as the arguments of the latest operation, ``name``, in place of its own.

        A refused call's slot list is kept as it was given rather than packed
        (:meth:`op`): ``array('Q')`` packs a bool as page 0 or 1, which the
        pool would take on replay where it refused the bool. Nothing is done
        if that operation's record was dropped already.
        """
        for at in range(len(self._items) - 1, -1, -1):
            entry = self._items[at]
            if entry[0] == "op":
                if entry[1] == name:
                    self._items[at] = ("op", name, args)
                return

    def transition(self, node_id: int, event: str) -> None:
        """Record an applied transition."""
        self._recorded += 1
        self._items.append(("transition", node_id, event))

    def acks(self, origin: str, applied: Iterable[tuple[int, bool]]) -> None:
        """Record one batch of applied acknowledgements: copy numbers in order, and success."""
        self._recorded += 1
        self._items.append(("acks", origin, tuple(applied)))

    def cut_acks(self, at: int, applied: Iterable[tuple[int, bool]]) -> None:
        """List only ``applied`` in the acknowledgement batch recorded at position ``at``.

        For a batch whose applying stopped part-way (an effect that broke):
        the copies it did not take are applied, and listed, by a later batch,
        so no copy is listed as applied that was not, nor twice. ``at`` counts
        from the first entry ever recorded (:attr:`recorded` before it was
        logged); nothing is done where the limit dropped the entry.
        """
        index = at - self.dropped
        if index >= 0 and self._items[index][0] == "acks":
            self._items[index] = ("acks", self._items[index][1], tuple(applied))

    def storage(self, origin: str, applied: Iterable[StorageAck]) -> None:
        """Record one batch of applied storage copies (see :data:`StorageAck`)."""
        self._recorded += 1
        self._items.append(("storage", origin, tuple(applied)))

    def refusal(self, name: str, error: BaseException) -> None:
        """Record that operation ``name`` raised ``error``."""
        self._recorded += 1
        self._items.append(("refused", name, refusal_text(error)))

    def failure(self, name: str, error: BaseException) -> None:
        """Record that operation ``name`` failed with ``error``, which is no refusal of the cache's.

        A copy engine, an allocator or torch raised it, not the cache's own
        checks: unlike a refusal, a replay on a sound engine cannot raise it again.
        """
        self._recorded += 1
        self._items.append(("failed", name, refusal_text(error)))

    def copy_refused(self, number: int, direction: str, nodes: tuple[int, ...], text: str) -> None:
        """Record that the engine refused to start copy ``number`` of ``nodes`` with ``text``.

        ``text`` is ``"ErrorClass: message"`` (:func:`refusal_text`); logged
        only when a start is refused, so a start that succeeds costs nothing here.
        """
        self._recorded += 1
        self._items.append(("copy_refused", (number, direction, nodes), text))

    def transitions(self) -> list[tuple[int, str]]:
        """Return the kept transitions in order."""
        return [(e[1], e[2]) for e in self._items if e[0] == "transition"]

    def operations(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Return the kept operations in order."""
        return [(e[1], e[2]) for e in self._items if e[0] == "op"]

    def acknowledgements(self) -> list[tuple[str, Acks]]:
        """Return the kept acknowledgement batches in order, each with its origin."""
        return [(e[1], e[2]) for e in self._items if e[0] == "acks"]

    def storage_acks(self) -> list[tuple[str, tuple[StorageAck, ...]]]:
        """Return the kept storage acknowledgement batches in order, each with its origin."""
        return [(e[1], e[2]) for e in self._items if e[0] == "storage"]

    def refused_starts(self) -> list[RefusedStart]:
        """Return the kept copies the engine refused to start, in order (:data:`RefusedStart`)."""
        return [(e[1][0], e[1][1], e[1][2], e[2]) for e in self._items if e[0] == "copy_refused"]

    def refusals(self) -> list[tuple[str, str]]:
        """Return the kept refusals (operation, ``ErrorClass: message``) in order."""
        return [(e[1], e[2]) for e in self._items if e[0] == "refused"]

    def failures(self) -> list[tuple[str, str]]:
        """Return the kept failures (operation, ``ErrorClass: message``) in order."""
        return [(e[1], e[2]) for e in self._items if e[0] == "failed"]

    def __repr__(self) -> str:
        """Return ``EventLog(limit=..., recorded=..., dropped=...)``; the entries are many."""
        return f"EventLog(limit={self.limit}, recorded={self._recorded}, dropped={self.dropped})"


def refusal_text(error: BaseException) -> str:
    """Return ``"ErrorClass: message"`` as the log records a refusal.

    A refusal raised in trail mode ends its message with an account of call
    sites (``...; pinned at a.py:10 in f; refused at b.py:3 in g``); the log
    keeps the message without it, since the sites belong to the caller and
    not to the run: a replay makes its calls from elsewhere.
    """
    text = str(error)
    history = getattr(error, "history", "")
    if isinstance(history, str) and history and text.endswith(f"; {history}"):
        text = text[: -len(history) - 2]
    return f"{type(error).__name__}: {text}"
