"""Checks of what callers pass to the cache, before anything changes.

Every public operation of :class:`~fsm_cache.cache.hicache.HiCache` reads its
arguments through these functions first, so wrong input is refused with a
:class:`~fsm_cache.errors.BadArgument` or :class:`~fsm_cache.errors.StaleNode`
that names the operation and the value, and no page, pin or lock is taken.

Token ids and slots may come as any sequence of ints, including a torch
tensor or a numpy array (SGLang passes both): they are converted to a tuple
of Python ints once, so equal prefixes match whatever they were passed as.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, TypeAlias

from fsm_cache.cache.tree import RadixTree, TreeNode
from fsm_cache.errors import BadArgument, StaleNode
from fsm_cache.numeric import as_index, boolean


class TokenArray(Protocol):
    """A 1-d array of ints that converts to a list: a torch tensor, a numpy array."""

    def tolist(self) -> Any:
        """Return the elements as Python values."""
        ...


Tokens: TypeAlias = Sequence[int] | TokenArray
"""Token ids (or slots) as callers pass them: a sequence of ints, or a 1-d tensor or array."""


class TokenKey(tuple[int, ...]):
    """Token ids checked once, for a request's ``match_prefix`` and ``insert`` to share.

    A tuple of non-negative Python ints, checked when it is built, as SGLang's
    scheduler builds a request's ``RadixKey`` once: the cache takes it as it
    is, where a list or tensor is converted and checked at every call.
    """

    __slots__ = ()

    def __new__(cls, tokens: Tokens = ()) -> TokenKey:
        """Check ``tokens`` and hold them.

        Args:
            tokens: The token ids: a sequence of ints, or a 1-d tensor or array.

        Raises:
            BadArgument: ``tokens`` is not a sequence of ints in ``0 <= id < 2**64``.
        """
        return super().__new__(cls, ints(tokens, "TokenKey", "tokens"))


def ints(value: object, op: str, what: str) -> tuple[int, ...]:
    """Return ``value``, token ids, as a tuple of non-negative Python ints.

    Accepts a sequence of ints (a list, tuple, range, array), or anything with
    ``tolist()`` that gives one (a 1-d tensor or array). Not a set, a dict or
    another unordered iterable: their order is not the tokens' order. A
    :class:`TokenKey` was checked when it was built and is returned as it is.

    Not a bool either (a mask passed for the ids, a bool tensor): it equals 0
    or 1, so it would match, and be matched by, the KV of tokens 0 and 1.

    Raises:
        BadArgument: ``value`` is a string, a scalar, not a sequence, nested, or
            holds a value that is not an int in ``0 <= id < 2**64``, or a bool.
    """
    if type(value) is TokenKey:
        return value
    out, words = packed(value, op, what)
    at = _first_bool(out, words)
    if at is not None:
        raise BadArgument(f"{op}: {what}[{at}] is {out[at]!r}, not an int")
    # sum keeps an int over ints and bools only: a 0-d tensor or a numpy int among the
    # ids (a list(tensor)) turns it into one of those; one pass in C either way
    if type(sum(out)) is not int:
        return _standing_for_ints(out, words, op, what)
    return out


def packed(value: object, op: str, what: str) -> tuple[tuple[int, ...], array.array[int]]:
    """Return ``value`` as a tuple of ints, and the same ids packed in an ``array('Q')``.

    The array is the one the check builds anyway. The event log keeps it in
    place of the tuple for long slot lists: eight bytes an id, and no int
    objects in it for the garbage collector to trace, however many entries
    the log keeps.

    A bool passes here (it packs as 0 or 1): slots are checked again, by the
    pool, wherever the cache reads one, and the pool refuses a bool as no
    page (:class:`~fsm_cache.memory.pages.PageAllocator`). Looking for bools
    in every slot list here cost an insert with held slots a fifth of its
    time (``bench cache --against sglang``); token ids, which no pool checks,
    are looked at by :func:`ints`. The cache logs a refused call's slots as
    given, so that a bool it refused replays as one.

    Raises:
        BadArgument: as :func:`ints`, but for bools.
    """
    if type(value) is TokenKey:  # checked when built: only packed here
        return value, array.array("Q", value)
    if not isinstance(value, (list, tuple)):  # the common kinds skip the checks of the rest
        name = type(value).__name__
        if _text_like(value):  # before tolist(): a byte view's is its bytes
            raise BadArgument(f"{op}: {what} must be a sequence of ints, got {name}")
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            try:
                value = tolist()
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
                # a tensor with no values to read: on the meta device, sparse, ...
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise BadArgument(
                    f"{op}: {what} must be a sequence of ints, got a {name} whose values "
                    f"cannot be read: {reason}"
                ) from exc
        # an ordered sequence: a set's or a dict's order is not the tokens' order
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise BadArgument(f"{op}: {what} must be a sequence of ints, got {name}")
    out = tuple(value)
    try:
        words = array.array("Q", out)  # one pass in C: non-negative ints below 2**64, or it raises
    except (TypeError, OverflowError, RuntimeError):  # RuntimeError: a tensor with no value
        _name_culprit(out, op, what)
        raise  # not reached: _name_culprit raises
    return out, words


_FEW = 32
"""Candidate ids (lowest byte 0 or 1) :func:`_first_bool` always looks at one by one."""


def _first_bool(out: tuple[int, ...], words: array.array[int]) -> int | None:
    """Return the position of the first bool in ``out``, or None; ``words`` is it packed.

    ``array('Q')`` packs True and False as 1 and 0, so only the ids whose
    lowest byte is 0 or 1 can be bools, counted in C among the packed lowest
    bytes: random ids leave one in 128, looked at one by one. Past
    :data:`_FEW` of them and one id in 16 (a prompt padded with one repeated
    id), one pass in C over the ids' types answers instead (about 8 times
    cheaper an id than a look at one), so no list of ids costs a Python step
    per id unless it holds a bool.
    """
    raw, size = words.tobytes(), words.itemsize
    lowest = raw[::size] if sys.byteorder == "little" else raw[size - 1 :: size]
    candidates = lowest.count(b"\x00") + lowest.count(b"\x01")
    if not candidates or (candidates > _FEW + len(out) // 16 and bool not in set(map(type, out))):
        return None
    first: int | None = None
    for small in (b"\x00", b"\x01"):  # False's lowest byte, then True's
        at = lowest.find(small)
        while at >= 0 and (first is None or at < first):
            if type(out[at]) is bool:
                first = at
                break
            at = lowest.find(small, at + 1)
    return first


def _standing_for_ints(
    out: tuple[object, ...], words: array.array[int], op: str, what: str
) -> tuple[int, ...]:
    """Return the ids ``out`` stands for as Python ints; ``words`` is it packed.

    An id that is not an int but converts to one (``__index__``: a 0-d
    tensor, a numpy integer, what iterating a tensor or an array gives) is
    kept as its int. Kept as it came, a tensor would hash by identity: the
    prefix would never be matched again, and inserting it again would cache
    the same tokens twice.

    Raises:
        BadArgument: An id is a bool of another kind (a 0-d bool tensor),
            which ``array('Q')`` packs as 0 or 1.
    """
    for i, item in enumerate(out):
        if boolean(item):
            raise BadArgument(f"{op}: {what}[{i}] is {item!r}, not an int")
    return tuple(words)


def _text_like(value: object) -> bool:
    """Whether ``value`` is text or bytes (a ``bytearray``, a view of bytes), not ids."""
    if isinstance(value, (str, bytes, bytearray)):
        return True
    return isinstance(value, memoryview) and value.format in ("B", "b", "c")


def _name_culprit(out: tuple[object, ...], op: str, what: str) -> None:
    """Raise BadArgument naming the first item of ``out`` that is not a token id or slot."""
    for i, item in enumerate(out):
        if type(item) is not int:
            raise BadArgument(f"{op}: {what}[{i}] is {item!r}, not an int")
        if not 0 <= item < 1 << 64:
            raise BadArgument(f"{op}: {what}[{i}] is {item}; ids and slots are 0 <= id < 2**64")


def count(value: object, op: str, what: str = "num_tokens") -> int:
    """Return ``value`` if it is a non-negative int (not a bool).

    Raises:
        BadArgument: It is not an int, is a bool, or is negative.
    """
    number = value if type(value) is int else as_index(value)
    if number is None:
        raise BadArgument(f"{op}: {what} must be an int, got {value!r}")
    if number < 0:
        raise BadArgument(f"{op}: {what} must be >= 0, got {value!r}")
    return number


def namespace(value: object, op: str) -> Hashable:
    """Return ``value`` if it can key a namespace (hashable, and equal to itself).

    Raises:
        BadArgument: It is unhashable (or its hash or its ``repr`` raises), or it or an item
            of a tuple of it is unequal to itself or does not compare as a bool
            (a NaN would open a new namespace at every call; so would a tuple
            holding a new NaN).
    """
    if value is None:
        return value
    name = type(value).__name__
    try:
        hash(value)
    except TypeError:
        raise BadArgument(f"{op}: namespace must be hashable, got {name}") from None
    except Exception as exc:  # a __hash__ of the caller's that raises
        raise BadArgument(f"{op}: namespace's hash raised {type(exc).__name__}: {exc}") from None
    if type(value) is not str and type(value) is not int:  # their repr cannot raise
        try:  # the log, errors and a storage tier's page keys show it
            repr(value)
        except Exception as exc:  # a __repr__ of the caller's that raises
            raise BadArgument(
                f"{op}: namespace's repr raised {type(exc).__name__}: {exc}"
            ) from None
    try:
        itself = _equals_itself(value)
    except Exception as exc:  # a tensor's ==, say: no single bool
        raise BadArgument(
            f"{op}: namespace must compare as one bool, got {name} ({type(exc).__name__})"
        ) from None
    if not itself:
        raise BadArgument(f"{op}: namespace must equal itself, got {value!r}")
    return value


def _equals_itself(value: object) -> bool:
    """Whether ``value`` equals itself, and so does each item of a tuple, at any depth.

    A tuple's ``==`` takes its items as equal to themselves by identity, so a
    NaN inside one would pass ``value == value`` and still differ from the
    NaN of the next call's tuple.
    """
    if isinstance(value, tuple):
        return all(_equals_itself(item) for item in value)
    return bool(value == value)  # noqa: PLR0124 (NaN is the case)


def nodes(tree: RadixTree, value: object, op: str) -> list[TreeNode]:
    """Return ``value``, a sequence of nodes of ``tree`` now, as a list.

    Raises:
        BadArgument: ``value`` is not a sequence (a string and a lone node are
            not), or an item is not a tree node.
        StaleNode: An item was deleted, or belongs to another tree.
    """
    if isinstance(value, (TreeNode, str, bytes)) or not isinstance(value, Sequence):
        raise BadArgument(f"{op}: expected a sequence of tree nodes, got {type(value).__name__}")
    return [node(tree, item, op) for item in value]


def node(tree: RadixTree, value: object, op: str) -> TreeNode:
    """Return ``value`` if it is a node of ``tree`` now (a namespace root counts).

    Raises:
        BadArgument: ``value`` is not a tree node.
        StaleNode: It was deleted, or belongs to another tree (a reset, another cache).
    """
    if not isinstance(value, TreeNode):
        raise BadArgument(f"{op}: expected a tree node, got {type(value).__name__}")
    if value.parent is None:
        if any(root is value for root in tree.roots.values()):
            return value
    elif tree.nodes.get(value.id) is value:
        return value
    raise StaleNode(
        f"node {value.id}: {op} refused: the node is not in this cache"
        " (deleted by eviction, from before a reset, or another cache's)"
    )
