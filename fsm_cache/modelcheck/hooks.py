"""A user's ``--ops`` module: its hooks, guarded so that a fault in them is a typed error.

``fsm-cache check --ops FILE.py`` runs the module's ``insert``, ``born``,
``split`` and ``prune`` (:mod:`fsm_cache.modelcheck.treeops`),
``wants_backup`` (:func:`fsm_cache.policy.wants_backup`) and ``match_prefix``
(:func:`fsm_cache.modelcheck.lookup.match_prefix`) in place of the checker's
own. They are the user's code: one may raise, exit, or return what the
checker cannot use (a lookup answering ``42``). Each hook the module defines
is wrapped (:func:`guarded`) so that any of these is a
:class:`~fsm_cache.errors.ConfigError` naming the module, the hook and what
it raised or returned (``kerr3.py: split raised KeyError('x')``): exit status
2 on the command line, never a traceback, nor a finding (1), nor a silent 0.
The checker's own hooks are used unwrapped, so its fast paths (which test
them by identity) still apply.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fsm_cache import policy
from fsm_cache.errors import ConfigError
from fsm_cache.modelcheck import lookup, treeops


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

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60


def _tree(nodes: Any, given: Any, *, none: bool) -> bool:
    """Whether ``nodes`` is a tree of as many slots as ``given`` (or None where ``none``)."""
    if nodes is None:
        return none
    return (
        isinstance(nodes, tuple)
        and len(nodes) == len(given)
        and all(e is None or isinstance(e, tuple) for e in nodes)
    )


Check = Callable[[tuple[Any, ...], Any], "str | None"]
"""What a hook must return, given its arguments and its result: None if it does, else what it should."""


def _grows(args: tuple[Any, ...], result: Any) -> str | None:
    ok = _tree(result, args[1], none=True)
    return None if ok else f"a tree of {len(args[1])} slots or None"


def _prunes(args: tuple[Any, ...], result: Any) -> str | None:
    return None if _tree(result, args[1], none=False) else f"a tree of {len(args[1])} slots"


def _decides(_args: tuple[Any, ...], result: Any) -> str | None:
    return None if isinstance(result, bool) else "a bool"


def _matches(_args: tuple[Any, ...], result: Any) -> str | None:
    return None if isinstance(result, lookup.Match) else "a Match"


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

    Anything it raises (an exception, or a ``sys.exit``) and anything it
    returns that ``name`` may not (:data:`RETURNS`) becomes a ConfigError
    naming the module, the hook and what it raised or returned.

    Raises:
        ConfigError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise ConfigError(f"{path}: {name} is not a function ({_shown.repr(hook)})")
    check = RETURNS[name]

    def call(*args: Any) -> Any:
        try:
            result = hook(*args)
        except (Exception, SystemExit) as exc:  # the user's code: whatever it raises
            raise ConfigError(f"{path}: {name} raised {_shown.repr(exc)}") from exc
        wanted = check(args, result)
        if wanted is not None:
            raise ConfigError(f"{path}: {name} returned {_shown.repr(result)}, not {wanted}")
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
    for name in ("SPEC", "POLICY"):
        if hasattr(module, name):
            setattr(view, name, getattr(module, name))
    for name in (*TREE_OPS, *OPTIONAL):
        hook = getattr(module, name, None)
        if hook is None or hook is DEFAULTS[name]:
            if name in TREE_OPS:
                setattr(view, name, DEFAULTS[name])
            continue
        setattr(view, name, guarded(path, name, hook))
    return view
