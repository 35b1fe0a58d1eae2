"""A user's ``--ops`` module: its hooks, guarded so that a fault in them is a typed error.

``fsm-cache check --ops FILE.py`` runs the module's ``insert``, ``born``,
``split`` and ``prune`` (:mod:`fsm_cache.modelcheck.treeops`),
``wants_backup`` (:func:`fsm_cache.policy.wants_backup`) and ``match_prefix``
(:func:`fsm_cache.modelcheck.lookup.match_prefix`) in place of the checker's
own. They are the user's code: one may raise, exit, or return what the
checker cannot use (a lookup answering ``42``, a split whose nodes are not
node entries of the spec). Each hook the module defines is wrapped
(:func:`guarded`) so that any of these is a
:class:`~fsm_cache.errors.ConfigError` naming the module, the hook and what
it raised or returned (``kerr3.py: split raised KeyError('x')``): exit status
2 on the command line, never a traceback, nor a finding (1), nor a silent 0.
Only a ``KeyboardInterrupt`` goes through, as the user's own interrupt.
What is checked is the shape and the types of what a hook returns (a tree
of node entries of the spec, a :class:`~fsm_cache.modelcheck.lookup.Match`
of positions), not what it means: a hook that drops a pin or reports a
node past a ``loading`` one returns a well-formed answer, and the checker's
invariants are what find it. A hook the check of its spec would never call
(:func:`never_called`) is refused too, rather than ignored by a check that
passes as if it had tried it. The checker's own hooks are used unwrapped, so
its fast paths (which test them by identity) still apply.

Slot numbers are names to a hook: under the symmetry reduction it is given
each tree in one numbering (canonical preorder, free slots last), so a hook
whose answer depends on the numbers must be checked with ``--no-symmetry``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from fsm_cache import policy
from fsm_cache.errors import ConfigError
from fsm_cache.modelcheck import lookup, treeops
from fsm_cache.modelcheck.copies import COPIES, FREE, VALID, failed, filling
from fsm_cache.modelcheck.state import Layout


TREE_OPS = ("insert", "born", "split", "prune")
"""The tree operations an ops module may replace (the checker's own where it does not)."""

OPTIONAL = ("wants_backup", "match_prefix")
"""The decisions an ops module may replace (the checker's own where it does not)."""

DEFAULTS: dict[str, Callable[..., Any]] = {
    "insert": treeops.insert,
    "born": treeops.born,
    "split": treeops.split,
    "prune": treeops.prune,
    "wants_backup": policy.wants_backup,
    "match_prefix": lookup.match_prefix,
}
"""Each hook's own implementation in the checker."""


class _Shown(reprlib.Repr):
    """reprlib's short quoting, naming a value whose ``repr`` fails by its type, not its address."""

    def repr_instance(self, x: object, level: int) -> str:  # noqa: ARG002 (reprlib's signature)
        """Return ``repr(x)``, its middle cut past ``maxother``; ``a T that cannot be shown`` if it raises."""
        try:
            text = repr(x)
        except KeyboardInterrupt:
            raise
        except BaseException:  # a repr that raises or exits: the value is named by its type
            return f"a {type(x).__name__} that cannot be shown"
        if len(text) <= self.maxother:
            return text
        head = max(0, (self.maxother - 3) // 2)
        tail = max(0, self.maxother - 3 - head)
        return f"{text[:head]}...{text[len(text) - tail :]}"


_shown = _Shown()
_shown.maxstring = _shown.maxother = 60


def shown(value: object) -> str:
    """Return ``value`` quoted short for a message, whatever its ``repr`` does.

    The value is the user's: its ``repr`` may raise anything, even exit, and
    a message about it must still be made.
    """
    return _shown.repr(value)


def raised(exc: BaseException) -> str:
    """Return ``TYPE: TEXT`` for what the user's code raised, whatever its ``str`` does."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        raise
    except BaseException:  # a __str__ that raises or exits: the type alone
        return type(exc).__name__


STATUSES = frozenset({FREE, VALID, *(filling(c) for c in COPIES), *(failed(c) for c in COPIES)})
"""What a node's pages in a tier may be (:mod:`fsm_cache.modelcheck.copies`)."""

Field = tuple[str, "frozenset[str] | type[int] | type[str]"]
"""A field of a node entry after the parent: its name, and the strings it may hold or its type."""


_fields: list[tuple[Layout, tuple[Field, ...]]] = []
"""The layout :func:`fields` last answered for, and its answer: a check asks for one layout."""


def fields(layout: Layout) -> tuple[Field, ...]:
    """Return the fields of the spec's node entries after the parent (:mod:`fsm_cache.modelcheck.state`)."""
    if _fields and _fields[0][0] is layout:
        return _fields[0][1]
    found = (
        *((f"{region} state", frozenset(m.state_names)) for region, m in layout.system.regions),
        *((f"counter {name}", int) for name in layout.counters),
        *((f"hold of {counter}", int) for counter, _ in layout.holders.kinds),
        *((f"{tier} memory", STATUSES) for tier in layout.memory.tiers),
        *((("memory fault", str),) if layout.memory.tiers else ()),
    )
    _fields[:] = [(layout, found)]
    return found


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _field(i: int, name: str, value: object, wanted: frozenset[str] | type) -> str | None:
    """Return what is wrong with field ``name`` of node ``i``, or None."""
    if isinstance(wanted, frozenset):
        if type(value) is str and value in wanted:
            return None
        return f"node {i}'s {name} is {shown(value)}, not one of {', '.join(sorted(wanted))}"
    if type(value) is wanted:
        return None
    return f"node {i}'s {name} is {shown(value)}, not {'an int' if wanted is int else 'a string'}"


def malformed(layout: Layout, slots: int, nodes: object) -> str | None:
    """Return why ``nodes`` is not a tree of the spec's node entries in ``slots`` slots, or None.

    A tree is a tuple with one entry per slot: None, or a node entry (a
    tuple: its parent, then :func:`fields`, each of its type, states and
    pages among their values), every parent ``-1`` (the root) or another
    node, and every node under the root. Only the exact types count: a
    subclass of the user's could answer anything when the checker reads it.
    """
    if type(nodes) is not tuple or len(nodes) != slots:
        return ""
    schema = fields(layout)
    for i, entry in enumerate(nodes):
        wrong = None if entry is None else _entry(nodes, i, entry, schema)
        if wrong is not None:
            return wrong
    parents = {i: cast("tuple[int, ...]", e)[0] for i, e in enumerate(nodes) if e is not None}
    for i in parents:
        at = i
        for _ in parents:
            at = parents[at]
            if at < 0:
                break
        else:
            return f"node {i} is not under the root: its parents go round in a cycle"
    return None


def _entry(
    nodes: tuple[object, ...], i: int, entry: object, schema: tuple[Field, ...]
) -> str | None:
    """Return why ``entry``, in slot ``i`` of ``nodes``, is not a node entry of ``schema``, or None."""
    if type(entry) is not tuple:
        return f"slot {i} holds {shown(entry)}, not a node entry (a tuple) or None"
    if len(entry) != 1 + len(schema):
        return f"node {i} has {_plural(len(entry), 'field')}, not {1 + len(schema)}"
    parent = entry[0]
    if type(parent) is not int or not -1 <= parent < len(nodes) or parent == i:
        return f"node {i}'s parent is {shown(parent)}, not -1 (the root) or another node's slot"
    if parent >= 0 and nodes[parent] is None:
        return f"node {i}'s parent is slot {parent}, which holds no node"
    return next(
        (
            wrong
            for (name, wanted), value in zip(schema, entry[1:], strict=True)
            if (wrong := _field(i, name, value, wanted)) is not None
        ),
        None,
    )


Check = Callable[[tuple[Any, ...], Any], "str | None"]
"""What a hook must return, given its arguments and its result: None if it does, else what it should."""


def _grows(args: tuple[Any, ...], result: Any) -> str | None:
    if result is None:
        return None
    wrong = malformed(args[0], len(args[1]), result)
    wanted = f"a tree of {len(args[1])} slots or None"
    return None if wrong is None else f"{wanted}: {wrong}" if wrong else wanted


def _prunes(args: tuple[Any, ...], result: Any) -> str | None:
    wrong = malformed(args[0], len(args[1]), result)
    wanted = f"a tree of {len(args[1])} slots"
    return None if wrong is None else f"{wanted}: {wrong}" if wrong else wanted


def _decides(_args: tuple[Any, ...], result: Any) -> str | None:
    return None if type(result) is bool else "a bool"


def _matches(_args: tuple[Any, ...], result: Any) -> str | None:
    if type(result) is not lookup.Match:
        return "a Match"
    for name in ("device", "host"):
        value = result.__dict__.get(name)  # a Match made without __init__ has none
        if type(value) is not tuple or any(type(p) is not int for p in value):
            return f"a Match whose {name} is a tuple of positions on the path (ints)"
    return None


RETURNS: dict[str, Check] = {
    "insert": _grows,
    "born": _grows,
    "split": _grows,
    "prune": _prunes,
    "wants_backup": _decides,
    "match_prefix": _matches,
}
"""What each hook must return."""


def guarded(path: Path, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``hook`` (the ops module ``path``'s ``name``) raising only ConfigError.

    Anything it raises (an exception, a ``sys.exit``, any BaseException but
    a KeyboardInterrupt) and anything it returns that ``name`` may not
    (:data:`RETURNS`) becomes a ConfigError naming the module, the hook and
    what it raised or returned.

    Raises:
        ConfigError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise ConfigError(f"{path}: {name} is not a function ({shown(hook)})")
    check = RETURNS[name]

    def call(*args: Any) -> Any:
        try:
            result = hook(*args)
        except KeyboardInterrupt:  # the user's interrupt, not the hook's fault
            raise
        except BaseException as exc:  # the user's code: whatever it raises, or an exit
            raise ConfigError(f"{path}: {name} raised {shown(exc)}") from exc
        wanted = check(args, result)
        if wanted is not None:
            raise ConfigError(f"{path}: {name} returned {shown(result)}, not {wanted}")
        return result

    call.__name__ = call.__qualname__ = name
    call.__doc__ = getattr(hook, "__doc__", None)
    return call


def hooks(path: Path, module: ModuleType) -> ModuleType:
    """Return the checker's view of the ops module ``path``: its names, its hooks guarded.

    A new module holding the user's ``SPEC`` and ``POLICY`` (where given),
    each hook the user's module defines wrapped by :func:`guarded`, and the
    checker's own tree operations where it defines none. The user's module is
    left as it is, so its hooks call each other unwrapped.

    Raises:
        ConfigError: A hook it defines is not callable.
    """
    view = ModuleType(module.__name__, module.__doc__)
    view.__file__ = str(path)  # named by what refuses its hooks (never_called)
    names = vars(module)  # what it defines: never its own __getattr__, which may raise
    for name in ("SPEC", "POLICY"):
        if name in names:
            setattr(view, name, names[name])
    for name in (*TREE_OPS, *OPTIONAL):
        hook = names.get(name)
        if hook is None or hook is DEFAULTS[name]:
            if name in TREE_OPS:
                setattr(view, name, DEFAULTS[name])
            continue
        setattr(view, name, guarded(path, name, hook))
    return view


_NO_PAGES = (
    "its nodes keep no pages (it has no host and device regions), so no node is ever "
    "deleted and the tree keeps its starting shape"
)


def _never(layout: Layout, write_policy: object, name: str) -> str | None:
    """Return why the check of ``layout`` never calls the hook ``name``, or None if it may."""
    if name in TREE_OPS and not layout.memory.tiers:
        # only a node whose data is gone is deleted, and the starting trees fill every slot
        return _NO_PAGES
    if name == "born" and not layout.births:
        return "it declares no [composition.births]"
    if name == "match_prefix" and not lookup.applies(layout):
        return "its nodes have no device copy to look up (it has no host and device regions)"
    if name == "wants_backup" and write_policy is None:
        return (
            "it is checked under no write policy (give the module POLICY = 'write_through', "
            "or --policy write_through)"
        )
    return None


def never_called(
    ops: ModuleType | Any, layout: Layout, write_policy: object, spec: Path
) -> str | None:
    """Return which hooks of the ops module ``ops`` a check of ``spec`` never calls, and why.

    A hook the search never reaches would be ignored, and the check would
    pass as if it had tried it: on a spec without host and device regions
    no node is deleted, so the starting trees keep every slot full and no
    tree operation applies; a lookup needs a device tier, a backup decision
    a write policy, and a birth hook a declared birth. None when every hook
    the module defines is called (the checker's own are not asked about).

    Args:
        ops: The checker's view of the module (:func:`hooks`), or the checker's own operations.
        layout: The node layout of the spec checked.
        write_policy: The write policy checked under, or None.
        spec: The spec checked, as the message names it.
    """
    reasons: dict[str, list[str]] = {}
    for name in (*TREE_OPS, *OPTIONAL):
        hook = getattr(ops, name, None)
        why = None if hook is None or hook is DEFAULTS[name] else _never(layout, write_policy, name)
        if why is not None:
            reasons.setdefault(why, []).append(name)
    if not reasons:
        return None
    parts = [
        f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} never called in a check of "
        f"{spec}: {why}"
        for why, names in reasons.items()
    ]
    return f"{getattr(ops, '__file__', ops.__name__)}: {'; '.join(parts)}"
