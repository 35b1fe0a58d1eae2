"""One call that makes an installed SGLang's radix caches run with checked residency.

:func:`patch` rebinds ``TreeNode`` in SGLang's cache modules to a checked
subclass (SGLang's class with :class:`~fsm_cache.compat.sglang.node.ResidencyMixin`'s
members in its own namespace, one class deep), points the ``defaultdict`` its
``__init__`` builds ``children`` with at :class:`~fsm_cache.compat.sglang.node.Children`,
and wraps the cache methods that move memory so that each is checked before it does:

============================  ==============================================================
SGLang method                 what the wrapper adds
============================  ==============================================================
``inc_lock_ref(node)``        checks ``lock`` on the path to the root first (root excluded)
``dec_lock_ref(node)``        checks ``unlock`` on the path first; given a receipt
                              (0.5.23), refuses one whose lock came back already, or
                              one taken through ``lock`` on another node
``lock(node)``                (0.5.23 ``RadixCache``) notes the node its receipt is on
``reset()``                   (0.5.23 ``RadixCache``) clears the book of its locks
``write_backup(node)``        fires ``write`` before the controller allocates host slots
                              (and the path's ``lock`` is checked); ``write_failed`` if
                              SGLang then gives up (host memory short)
``write_backup_storage``      checks ``pin`` before the storage write starts
``_evict_backuped(node)``     fires ``evict_device`` before the device slots are freed;
                              inside ``evict``, with a child still on the device (being
                              written back), waits for the end of ``evict``
``evict(n)``                  (HiRadixCache) frees the parents that waited, checked,
                              after SGLang's loop, deepest first; (RadixCache) each
                              victim is checked as the loop pops it, before its slots
                              are freed (:func:`~fsm_cache.compat.sglang.scope.deleting`)
``_evict_regular(node)``      the same check, before the device slots are freed
``load_back(node)``           fires ``load`` on the chain before device slots are allocated;
                              ``load_failed`` if SGLang then gives up; if a refusal inside
                              (its eviction making room) stops it, also releases the lock
                              SGLang took on the chain's resident ancestor; an error raised
                              after SGLang registered the load leaves it in flight, as
                              SGLang does
``evict_host(n)``             fires ``evict_host`` at the controller call freeing a victim
``__init__``                  turns ``ongoing_write_through``/``ongoing_load_back`` into
                              :class:`~fsm_cache.compat.sglang.scope.AckBook`
============================  ==============================================================

Everything else needs no wrapper: field assignments are events of the
checked node (``node.value = value`` on an evicted node is ``adopt``), a
split prefix takes its residency when attached, and counters move only
inside the walks above. Refusals are raised at SGLang's call, with SGLang's
call sites in trail mode, and leave the tree and memory as they were.

SGLang 0.5.23's server builds a ``UnifiedRadixCache`` by default, whose nodes
and counters live in its tree core: :func:`patch` checks it at its lock
boundary only (:mod:`~fsm_cache.compat.sglang.unified`: a release of a lock or
host lock with no acquire left on its node, or of a receipt released already, and
an acquire on a node the tree does not have are refused), and warns where it is
installed that the rest of its residency is not checked (:data:`UNCHECKED`).
"""

from __future__ import annotations

import functools
import heapq
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
import types
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from fsm_cache.compat.sglang import scope, unified
from fsm_cache.compat.sglang.node import Children, ResidencyMixin
from fsm_cache.engine import trail
from fsm_cache.errors import FsmCacheError
from fsm_cache.residency import Event, Residency


trail.internal(__file__)

MODULES = ("sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.hiradix_cache")
"""SGLang's cache modules :func:`patch` takes when given none (those installed)."""

SUPPORTED = ("0.5.6", "0.5.23")
"""SGLang releases whose real cache code ``make test-sglang`` runs with the patch."""

CACHES = ("RadixCache", "HiRadixCache")
"""The cache classes a module may define."""

FORWARDERS = ("sglang.srt.mem_cache.base_prefix_cache",)
"""SGLang modules whose cache methods only forward to the checked ones.

0.5.23's scheduler locks through ``BasePrefixCache.lock``/``unlock``, which
call ``inc_lock_ref``/``dec_lock_ref``. While patched, trail mode skips their
frames as it skips fsm_cache's own, so a refusal names the scheduler's call,
not the forwarding line.
"""

UNCHECKED = {"sglang.srt.mem_cache.unified_radix_cache": "UnifiedRadixCache"}
"""Cache classes an SGLang release's scheduler builds by default that the patch checks only in part.

SGLang 0.5.23's ``registry.default_radix_cache_factory`` builds a
``UnifiedRadixCache`` (its own ``UnifiedTreeNode``, its counters kept in a
tree core by node id) for every model but pure-SWA ones and FlexKV. The
patch wraps its lock methods and ``reset``
(:data:`~fsm_cache.compat.sglang.unified.BOUNDARY`), not its nodes, and
warns where the module is installed, saying which part is checked.
"""


class UncheckedCacheWarning(UserWarning):
    """SGLang's server would build a cache class :func:`patch` checks only in part, or not at all (:data:`UNCHECKED`).

    A category of its own, so that code that knowingly drives a checked class
    (a benchmark of ``RadixCache``) can silence it and nothing else.
    """


class PatchError(FsmCacheError, TypeError):
    """A module cannot be patched: it has no ``TreeNode`` or no cache class, or fails to import."""


Method = Callable[..., Any]


def _write_backup(original: Method) -> Method:
    @functools.wraps(original)
    def write_backup(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        scope.require_checked(node, "write_backup")
        scope.require_books(self, "write_backup")
        write_back = bool(kwargs.get("write_back", args[0] if args else False))
        if not write_back:
            scope.check(list(node.path_to_root()), "lock")
        node.seal()
        node.machine().write(node)
        try:
            result = original(self, node, *args, **kwargs)
        finally:
            if node.host == "writing" and node.host_value is None:  # SGLang gave up
                node.machine().write_failed(node)
        return result

    return write_backup


def _write_backup_storage(original: Method) -> Method:
    @functools.wraps(original)
    def write_backup_storage(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        scope.require_checked(node, "write_backup_storage")
        scope.check([node], "pin")
        return original(self, node, *args, **kwargs)

    return write_backup_storage


def _evict_backuped(original: Method) -> Method:
    @functools.wraps(original)
    def evict_backuped(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        scope.require_checked(node, "_evict_backuped")
        node.seal()
        if scope.defer_eviction(node):
            return len(node.value)  # what SGLang's controller reports freeing, later
        node.machine().evict_device(node)
        return original(self, node, *args, **kwargs)

    return evict_backuped


def _evict(original: Method) -> Method:
    @functools.wraps(original)
    def evict(self: Any, *args: Any, **kwargs: Any) -> Any:
        with scope.device_evictions() as deferred:
            result = original(self, *args, **kwargs)
        for node in scope.deepest_first(deferred):
            self._evict_backuped(node)
        return result

    return evict


def _evict_regular(original: Method) -> Method:
    @functools.wraps(original)
    def evict_regular(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        scope.deleting(node)
        return original(self, node, *args, **kwargs)

    return evict_regular


def _checked_heappop(pop: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``heapq.heappop`` for ``RadixCache.evict``'s loop: the victim is checked before it is taken.

    SGLang's loop frees every entry it pops (``free(x.value)``, then
    ``_delete_leaf(x)``) with no check in between: the pop is the last
    point before the free, and a refusal there leaves the tree, the
    allocator and the cache's counts as they were.
    """

    def heappop(heap: list[Any]) -> Any:
        if heap and type(heap[0]) is tuple and len(heap[0]) == 2:  # (priority, node)
            scope.deleting(heap[0][1])
        return pop(heap)

    return heappop


def _check_victims(result: Patch, module: ModuleType) -> None:
    """Have ``module``'s ``evict`` loop pop its victims through :func:`_checked_heappop`.

    SGLang's cache modules call ``heapq.heappop`` through their global name,
    and only in ``evict`` loops: the name is pointed at a copy of ``heapq``
    whose ``heappop`` checks.
    """
    if getattr(module, "heapq", None) is not heapq:
        return
    names = {k: v for k, v in vars(heapq).items() if not k.startswith("_")}
    checked = types.SimpleNamespace(**{**names, "heappop": _checked_heappop(heapq.heappop)})
    result.record(module, "heapq", checked)


def _load_back(original: Method) -> Method:
    @functools.wraps(original)
    def load_back(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        scope.require_books(self, "load_back")
        chain = scope.absent_chain(node)
        scope.loading(chain)
        held = chain[0].parent if chain else node  # the resident ancestor SGLang locks first
        locks = held.locks
        book = self.ongoing_load_back
        was_registered = book.get(node.id) is node  # none for an evicted node
        try:
            result = original(self, node, *args, **kwargs)
        except BaseException:
            if not was_registered and book.get(node.id) is node:
                # Raised after SGLang registered the load (its metrics call): the
                # load is in flight, its locks are the load's, loading_check ends it.
                scope.ride(chain, node)
                raise
            # Raised before (a refusal in the eviction that makes room): undo it all.
            scope.back_out(chain)
            if held.locks > locks:  # SGLang's lock on the ancestor, its release skipped
                self.dec_lock_ref(held)  # fsm-cache: takes-ownership -- the lock SGLang took
            raise
        if result is None:
            scope.back_out(chain)
        else:
            scope.ride(chain, node)
        return result

    return load_back


def _evict_host(original: Method) -> Method:
    @functools.wraps(original)
    def evict_host(self: Any, *args: Any, **kwargs: Any) -> Any:
        with scope.host_evictions(self.root_node):
            return original(self, *args, **kwargs)

    return evict_host


def _init(original: Method) -> Method:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for name, event in zip(scope.BOOKS, ("write_done", "load_done"), strict=True):
            book = getattr(self, name, None)
            if isinstance(book, dict) and not isinstance(book, scope.AckBook):
                setattr(self, name, scope.AckBook(event, book))  # type: ignore[arg-type]
        controller = getattr(self, "cache_controller", None)
        if controller is not None and not getattr(controller.evict_host, "fsm_checked", False):
            controller.evict_host = _checked_host_free(controller.evict_host)

    return init


def _checked_host_free(free: Method) -> Method:
    @functools.wraps(free)
    def evict_host(host_indices: Any, *args: Any, **kwargs: Any) -> Any:
        scope.host_eviction(host_indices)
        return free(host_indices, *args, **kwargs)

    evict_host.fsm_checked = True  # type: ignore[attr-defined]
    return evict_host


WALKS: dict[str, Event] = {"inc_lock_ref": "lock", "dec_lock_ref": "unlock"}
"""SGLang's lock walks and the event each checks on the path first (:func:`scope.walked`)."""

WRAPPERS: dict[str, Callable[[Method], Method]] = {
    "__init__": _init,
    "write_backup": _write_backup,
    "write_backup_storage": _write_backup_storage,
    "_evict_backuped": _evict_backuped,
    "evict": _evict,
    "_evict_regular": _evict_regular,
    "load_back": _load_back,
    "evict_host": _evict_host,
}
"""SGLang cache method name to the wrapper that checks it first."""


@dataclass
class Patch:
    """The changes :func:`patch` made, to undo them (also a context manager).

    Attributes:
        modules: The patched modules' names.
        node_class: The checked ``TreeNode`` the modules now build.
        wrapped: ``Class.method`` for each wrapped cache method (a subclass's
            too, added as one defined while patched is adopted).
        originals: SGLang's class of each checked class the patch built.
        counts: SGLang's node classes whose ``counter`` is a :class:`_NodeCount`
            while the patch holds (:func:`_share_count`), an ``int`` again after the undo.
        spent: Per cache whose ``dec_lock_ref`` takes a receipt (SGLang
            0.5.23's ``RadixCache``), by its ``id`` while it lives
            (:meth:`book`), its locks out and come back (:func:`_released_once`).
    """

    modules: tuple[str, ...]
    node_class: type[ResidencyMixin]
    wrapped: tuple[str, ...]
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    _skipped: list[str] = field(default_factory=list, repr=False)
    originals: dict[type, type] = field(default_factory=dict, repr=False)
    counts: list[type] = field(default_factory=list, repr=False)
    spent: dict[int, unified.LockBook] = field(default_factory=dict, repr=False)

    def book(self, cache: Any, machine: Residency) -> unified.LockBook:
        """``cache``'s book in :attr:`spent`, made on first use.

        Keyed by ``id``, not weakly by the cache: a lookup per lock and
        release builds no weak reference. The entry goes as the cache dies
        (a finalizer, run before its id can be another object's).
        """
        book = self.spent.get(id(cache))
        if book is None:
            book = self.spent[id(cache)] = unified.LockBook(machine)
            weakref.finalize(cache, self.spent.pop, id(cache), None)
        return book

    def record(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` to ``value``, keeping the old value for :meth:`undo`.

        A class's old value is what its own namespace held (a descriptor as
        it is, or none: the undo deletes the name, and the class inherits again).
        """
        old = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)
        self._saved.append((owner, name, old))
        setattr(owner, name, value)

    def skip(self, filename: str) -> None:
        """Have trail mode skip ``filename``'s frames (as fsm_cache's), until :meth:`undo`."""
        if not trail.is_internal(filename):
            trail.internal(filename)
            self._skipped.append(filename)

    def undo(self) -> None:
        """Restore every patched module and class as it was."""
        with _PATCHING:
            for owner, name, old in reversed(self._saved):
                if name == "TreeNode":  # its nodes' counters now have no walk to drive them
                    getattr(owner, name).undone = True
                if old is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)
            self._saved.clear()
            for original in self.counts:
                _count_back(original)
            self.counts.clear()
            self._restore_importers()
            for filename in self._skipped:
                trail.forget(filename)
            self._skipped.clear()
            for name in self.modules:
                if _ACTIVE.get(name) is self:
                    del _ACTIVE[name]

    def _restore_importers(self) -> None:
        """Point back at SGLang's class each module that imported a checked one while patched.

        ``from sglang.srt.mem_cache.radix_cache import TreeNode`` in a module
        first imported under the patch (a storage backend's cache, loaded on
        demand) binds the checked class; after the undo, that module would
        still build checked nodes that SGLang's own walks cannot drive.
        """
        for module in list(sys.modules.values()):
            if not isinstance(module, ModuleType):
                continue
            held = vars(module).get("TreeNode")
            if isinstance(held, type) and held in self.originals:
                module.TreeNode = self.originals[held]  # type: ignore[attr-defined]

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


_ABSENT = object()
"""What :meth:`Patch.record` keeps for a name the class did not define itself."""

_ACTIVE: dict[str, Patch] = {}
"""The patch each patched module's name is under, until its ``undo()``."""

_PATCHING = threading.RLock()
"""Held while :func:`patch` checks and changes SGLang, and while :meth:`Patch.undo` restores it."""


def patch(
    *modules: ModuleType | str, residency: Residency | None = None, trail: bool | None = None
) -> Patch:
    """Make SGLang's radix caches in ``modules`` run with checked residency.

    Args:
        modules: SGLang cache modules (objects or dotted names); none: every
            one of :data:`MODULES` and :data:`UNCHECKED` that is installed.
        residency: The engine the nodes fire through; default a new one.
        trail: Trail mode for the default engine (refusals name call sites);
            None reads ``FSM_CACHE_TRAIL``.

    Returns:
        The :class:`Patch`; ``undo()`` (or leaving its ``with`` block) restores SGLang.

    Raises:
        PatchError: A module has no ``TreeNode`` or no cache class, is
            patched already by another call, or (none given) an installed
            one fails to import for want of another module.
    """
    found = [_module(m) for m in modules] if modules else _installed()
    with _PATCHING:  # one patch() or undo() at a time: each checks, then changes, SGLang
        already = [m.__name__ for m in found if m.__name__ in _ACTIVE]
        if already:
            raise PatchError(f"{', '.join(already)}: patched already; undo that patch first")
        _warn_unsupported()
        _warn_unchecked({m.__name__ for m in found})
        engine = residency or Residency(trail=trail)
        result = Patch(tuple(m.__name__ for m in found), ResidencyMixin, ())
        try:
            result.wrapped = _apply(result, found, engine)
        except BaseException:  # a module that cannot be patched: the ones before it are restored
            result.undo()
            raise
        for name in result.modules:
            _ACTIVE[name] = result
    return result


def _apply(result: Patch, found: list[ModuleType], engine: Residency) -> tuple[str, ...]:
    """Patch each of ``found``, recording every change in ``result``; return what was wrapped."""
    checked: dict[type, type[ResidencyMixin]] = {}
    wrapped: list[str] = []
    for module in [m for m in found if m.__name__ in UNCHECKED]:
        wrapped += _wrap_boundary(result, module, engine)
    found = [m for m in found if m.__name__ not in UNCHECKED]
    for module in found:
        original = _tree_node(module)
        if original not in checked:
            born = _children_built_checked(result, original)
            _share_count(result, original)
            checked[original] = _checked_class(original, engine, children_property=not born)
            result.originals[checked[original]] = original
        result.node_class = checked[original]
        result.record(module, "TreeNode", result.node_class)
        wrapped += _wrap_caches(result, module, engine)
    wrapped += _adopt_subclasses(result, found, checked, engine)
    for name in FORWARDERS:
        forwarder = sys.modules.get(name)
        if forwarder is not None and forwarder.__file__:
            result.skip(forwarder.__file__)
    return tuple(wrapped)


def _wrap_boundary(result: Patch, module: ModuleType, machine: Residency) -> list[str]:
    """Check the cache class of ``module`` (one of :data:`UNCHECKED`) at its lock boundary.

    Its lock methods and ``reset`` (:data:`~fsm_cache.compat.sglang.unified.BOUNDARY`)
    are wrapped to keep one :class:`~fsm_cache.compat.sglang.unified.ReceiptBook`
    per cache. A subclass's overrides of them are wrapped too, those defined
    before the patch and, through an ``__init_subclass__`` (:func:`_adopting`),
    those defined while it holds (LMCache's cache is imported on demand): an
    override that skips its base's (``self.tree_core`` called directly) is
    checked all the same, and one that calls it is recorded once, by the
    base's wrapper (``Receipts.wrap``'s ``override``). An override a mixin
    ahead of the class in a subclass's MRO defines (``class
    Sub(Mixin, UnifiedRadixCache)``) is the subclass's: it is wrapped on the
    subclass (the undo deletes it there), the mixin left as it is.

    Raises:
        PatchError: The module defines no such class, or the class none of the methods.
    """
    name = UNCHECKED[module.__name__]
    cls = getattr(module, name, None)
    names = [*unified.BOUNDARY, "reset"]
    if not isinstance(cls, type) or any(n not in vars(cls) for n in names):
        raise PatchError(
            f"{module.__name__}: no {name} defining {', '.join(names)} to check; "
            "see docs/sglang.md for the releases patch() supports"
        )
    receipts = unified.Receipts(machine)
    for method in names:
        result.record(cls, method, receipts.wrap(method, vars(cls)[method]))

    def adopt(sub: type) -> list[str]:
        own = []
        for method in names:
            owner = _definer(sub, method)  # cls defines every name: found
            if owner is not sub and issubclass(owner, cls):  # cls's, or a subclass's adopted
                continue
            found = vars(owner)[method]  # sub's own, or a mixin's ahead of cls
            if isinstance(found, types.FunctionType):
                result.record(sub, method, receipts.wrap(method, found, override=True))
                own.append(f"{sub.__name__}.{method}")
        return own

    out = [f"{name}.{method}" for method in names]
    for sub in _descendants(cls):
        out += adopt(sub)
    result.record(cls, "__init_subclass__", _adopting(result, cls, adopt))
    return out


def _definer(sub: type, name: str) -> type:
    """The class whose ``name`` an instance of ``sub`` calls: the first in its MRO defining it."""
    return next(owner for owner in sub.__mro__ if name in vars(owner))


def _descendants(cls: type) -> list[type]:
    """Every subclass of ``cls``, at any depth, each once, parents before their children."""
    out: list[type] = []
    stack = [cls]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            if sub not in out:
                out.append(sub)
                stack.append(sub)
    return out


def _module(given: ModuleType | str) -> ModuleType:
    return importlib.import_module(given) if isinstance(given, str) else given


def _installed() -> list[ModuleType]:
    out = []
    for name in (*MODULES, *UNCHECKED):
        try:
            out.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if not _is_absent(name, exc):
                raise PatchError(f"{name} is installed but cannot be imported: {exc}") from exc
    if not out:
        raise PatchError(f"none of {', '.join(MODULES)} is installed")
    return out


def _is_absent(name: str, exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` says ``name`` itself (or a package above it) is not there.

    Any other missing module is one the installed SGLang imports, missing
    from a broken install: the patch must say so rather than take SGLang
    for absent.
    """
    parts = name.split(".")
    return exc.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _warn_unsupported() -> None:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return
    if version not in SUPPORTED:
        warnings.warn(
            f"sglang {version} is not among the releases fsm_cache tests the patch on "
            f"({', '.join(SUPPORTED)}); run its tests with --fsm-sglang first",
            UserWarning,
            stacklevel=3,
        )


def _warn_unchecked(patched: set[str]) -> None:
    """Warn where SGLang's server would build a cache :func:`patch` checks in part, or not at all.

    Args:
        patched: The names of the modules this patch takes.
    """
    for name, cls in UNCHECKED.items():
        try:
            present = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # no SGLang package at all
            present = False
        if not present:
            continue
        if name in patched:
            what = (
                "is checked at its lock boundary only: patch() refuses a dec_lock_ref or "
                "dec_host_lock_ref with no inc_lock_ref or inc_host_lock_ref left on its "
                "node (counting FULL's locks), given a receipt released already or "
                "another node's, and an inc_lock_ref or inc_host_lock_ref on a node the "
                "tree does not have; it checks none of its residency (evictions, loads, "
                "write-backs, the tree core's own locks and full pins, the SWA and Mamba "
                "parts of a lock)"
            )
        else:
            what = "is not checked: patch() was not given its module"
        warnings.warn(
            f"{cls} ({name}) {what}; SGLang's scheduler builds it by default "
            "(registry.default_radix_cache_factory); see docs/sglang.md",
            UncheckedCacheWarning,
            stacklevel=3,
        )


def _tree_node(module: ModuleType) -> type:
    node = getattr(module, "TreeNode", None)
    if not isinstance(node, type):
        raise PatchError(f"{module.__name__}: no TreeNode class to check")
    if issubclass(node, ResidencyMixin):
        raise PatchError(f"{module.__name__}: TreeNode is checked already")
    return node


def _children_built_checked(result: Patch, original: type) -> bool:
    """Let SGLang's ``TreeNode.__init__`` build its ``children`` as :class:`Children`.

    It calls ``defaultdict(TreeNode)`` through its module's global name; pointed
    at :class:`Children` (a ``defaultdict`` whose attach and removal are
    checked), a node has its checked mapping from birth, and ``children`` can
    stay SGLang's plain attribute instead of the mixin's property (SGLang reads
    it at every level of every walk). Nothing else in SGLang's cache modules
    uses the name, and a ``Children`` holding anything but nodes behaves as a
    ``defaultdict``.

    Returns:
        Whether the name was there to point (else the node keeps the property).
    """
    init = getattr(vars(original).get("__init__"), "__globals__", {})
    if init.get("defaultdict") is not defaultdict:
        return False
    result.record(importlib.import_module(original.__module__), "defaultdict", Children)
    return True


def _checked_class(
    original: type, engine: Residency, children_property: bool = True
) -> type[ResidencyMixin]:
    """SGLang's node class with :class:`ResidencyMixin`'s members in its own namespace.

    Not ``class TreeNode(ResidencyMixin, original)``: SGLang's ``TreeNode()``
    bumps the class's ``counter``, which resets Python's attribute caches for
    the class each time, and every later attribute lookup on a node then walks
    the whole MRO; one class less in it is one dictionary less per lookup.
    The class is registered as a virtual subclass, so ``isinstance`` and
    ``issubclass`` with :class:`ResidencyMixin` hold. Without
    ``children_property``, ``children`` stays a plain attribute (SGLang's
    ``__init__`` builds a :class:`Children` itself).
    """
    doc = f"SGLang's {original.__qualname__}, its residency checked by fsm_cache."
    skip = _NOT_COPIED if children_property else _NOT_COPIED | {"children", "_set_children"}
    members = {k: v for k, v in vars(ResidencyMixin).items() if k not in skip}
    members.update(residency=engine, __module__=original.__module__, __doc__=doc)
    made = _ids_of(original)(original.__name__, (original,), members)
    made.__qualname__ = original.__qualname__
    ResidencyMixin.register(made)
    return cast("type[ResidencyMixin]", made)


def _ids_of(original: type) -> type[type]:
    """The metaclass of ``original``'s checked class: one that numbers nodes with ``original``'s ``counter``.

    SGLang numbers nodes ``self.id = TreeNode.counter``, then ``TreeNode.counter
    += 1``, through its module's global name (0.5.6 and 0.5.23 alike; 0.5.6's
    ``HiRadixCache.reset`` sets it back to 0). Patched, that name is the checked
    class, and the ``+=`` would give it a ``counter`` of its own: SGLang's own
    class, still built by modules that imported it before the patch, would
    hand out the same ids meanwhile, and again after ``undo()``, over nodes
    still alive. The name is one count for both classes instead (a
    :class:`_NodeCount` in SGLang's class, :func:`_share_count`), so that a node
    id a refusal or a trail names is one node's, patched or not. The numbering
    is SGLang's, resets included: SGLang's results depend on it
    (tests/sglang_real/test_differential.py).

    A read of ``TreeNode.counter`` finds the count in SGLang's class, as any
    class attribute is found. A write goes to the count through this
    metaclass's ``__setattr__``, not into a class's namespace: a class whose
    namespace changes (or whose base's does) loses its version in CPython's
    attribute caches, and with it every lookup cached on its nodes; SGLang
    builds a node per request, so a write per node would cost the checked
    class every cached lookup, each request. Code holding SGLang's own class
    (imported before the patch) that sets ``TreeNode.counter`` puts an ``int``
    over the count, as stock; the next write through the checked class puts a
    count back, from that value on.
    """
    meta = type(original)
    names = vars(original)
    if not isinstance(names.get("counter"), (int, _NodeCount)):
        return meta  # no counter of SGLang's to share

    def set_class_attribute(cls: type, name: str, value: Any) -> None:
        if name != "counter":
            meta.__setattr__(cls, name, value)
            return
        count = names.get("counter")
        if isinstance(count, _NodeCount):
            count.value = value
        elif cls.undone:  # type: ignore[attr-defined]  # the patch is gone: SGLang's int, as stock
            meta.__setattr__(original, "counter", value)
        else:  # SGLang's own class wrote an int over it: a count again, from here on
            meta.__setattr__(original, "counter", _NodeCount(value))

    return type(
        f"{original.__name__}Ids",
        (meta,),
        {"__setattr__": set_class_attribute, "__module__": __name__},
    )


class _NodeCount:
    """SGLang's node counter while patched, in its ``TreeNode``'s namespace (:func:`_ids_of`).

    Read as ``TreeNode.counter`` (a descriptor: reading it gives the count),
    through SGLang's class or the checked one; written through the checked
    class's metaclass. A write through SGLang's own class replaces it with the
    ``int`` written, as stock.

    Attributes:
        value: The next node's id.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __get__(self, node: object, owner: type | None = None) -> Any:
        """The count."""
        return self.value


def _share_count(result: Patch, original: type) -> None:
    """Put one :class:`_NodeCount` in ``original``'s namespace for its ``counter``, until the undo.

    A count a patch still holding put there already (two patches over two
    modules importing one ``TreeNode``) is kept, and what has no integer
    ``counter`` is left alone (nothing to share). The undo puts the count
    back as an ``int`` (:func:`_count_back`).
    """
    held = vars(original).get("counter")
    if isinstance(held, int):
        setattr(original, "counter", _NodeCount(held))  # noqa: B010 (a type has no counter to type-check)
    if isinstance(held, (int, _NodeCount)):
        result.counts.append(original)


def _count_back(original: type) -> None:
    """Put ``original``'s ``counter`` back as an ``int`` (its count, if one is there)."""
    held = vars(original).get("counter")
    if isinstance(held, _NodeCount):
        setattr(original, "counter", held.value)  # noqa: B010 (as above)


_NOT_COPIED = frozenset(
    {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__abstractmethods__"}
    | {name for name in vars(ResidencyMixin) if name.startswith("_abc_")}
)


def _wrap_caches(result: Patch, module: ModuleType, machine: Residency) -> list[str]:
    classes = [
        cls
        for name in CACHES
        if isinstance(cls := getattr(module, name, None), type)
        and cls.__module__ == module.__name__
    ]
    if not classes:
        raise PatchError(f"{module.__name__}: none of {', '.join(CACHES)} is defined there")
    return [name for cls in classes for name in _wrap_class(result, module, cls, machine)]


def _wrap_class(result: Patch, module: ModuleType, cls: type, machine: Residency) -> list[str]:
    """Wrap the cache methods ``cls`` defines itself (defined in ``module``); return their names.

    A ``dec_lock_ref`` that takes a receipt (SGLang 0.5.23's ``RadixCache``)
    brings the ``lock`` and ``reset`` its instances call (:data:`RECEIPTS`),
    inherited or not, so that its book knows each lock's node and forgets
    the tree ``reset`` drops.
    """
    out = []
    receipts = False
    for name, method in list(vars(cls).items()):
        if name in WALKS:
            checked = scope.walked(WALKS[name], machine)(method)
            if name == "dec_lock_ref" and _takes_receipt(method):
                checked = _released_once(result, machine)(checked)
                receipts = True
        elif name == "evict" and not hasattr(cls, "_evict_backuped"):
            _check_victims(result, module)  # nothing to defer: RadixCache frees leaves only
            continue
        elif name in WRAPPERS:
            checked = WRAPPERS[name](method)
        else:
            continue
        result.record(cls, name, checked)
        out.append(f"{cls.__name__}.{name}")
    for name, wrapper in RECEIPTS.items() if receipts else ():
        method = getattr(cls, name, None)
        if callable(method) and not getattr(method, "fsm_receipts", False):
            checked = wrapper(result, machine)(method)
            checked.fsm_receipts = True  # type: ignore[attr-defined]
            result.record(cls, name, checked)
            out.append(f"{cls.__name__}.{name}")
    return out


def _takes_receipt(method: Method) -> bool:
    """Whether a ``dec_lock_ref(self, node, ...)`` takes more than the node (0.5.23's receipt)."""
    try:
        return len(inspect.signature(method).parameters) > 2
    except (TypeError, ValueError):  # no signature to read: take it as one that may
        return True


def _released_once(result: Patch, machine: Residency) -> Callable[[Method], Method]:
    """Refuse a ``dec_lock_ref`` given a receipt whose lock came back already, or taken on another node.

    SGLang 0.5.23's ``RadixCache`` releases a lock with the receipt ``lock``
    made (``unlock(lock)`` is ``dec_lock_ref(lock.node, lock.receipt)``), but
    counts per node only: a lock released twice, while another request's
    lock holds its node, passes the count check and takes the other lock off
    the node, which becomes evictable under it. The receipt's objects tell
    its lock (:class:`~fsm_cache.compat.sglang.unified.SpentLocks`), one
    :class:`~fsm_cache.compat.sglang.unified.LockBook` per cache
    (:meth:`Patch.book`), shared by a subclass's override and the base's
    wrapper (an override that calls ``super()`` records the lock twice,
    after both released it). A release with no lock left on its node is
    left to the walk, which refuses it (``UnlockAtZero``).

    The receipt names no node on ``RadixCache``: a lock taken through
    ``lock`` (:func:`_noting_node`) and released on another node (the root
    included) is refused first (``BadArgument``), whatever that node holds.

    A call without a receipt (``dec_lock_ref(node)``, as FlexKV's cache
    makes), or with one that has no uuid maps of its own
    (:func:`~fsm_cache.compat.sglang.unified.told_by_maps`), is only counted.
    A lock on the root (an empty match) moves no count, stock or patched, and
    its release is not remembered either.

    Args:
        result: The patch whose books the wrapper keeps.
        machine: The engine the books read trail mode from.

    Returns:
        A decorator for ``dec_lock_ref`` already :func:`~scope.walked`.
    """
    books = result.spent

    def decorate(walked: Method) -> Method:
        @functools.wraps(walked)
        def dec_lock_ref(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs:  # no receipt: only counted (what told_by_maps(None) says)
                return walked(self, node)
            receipt = args[0] if args else kwargs.get("params")
            if getattr(self, "disable", False):
                return walked(self, node, *args, **kwargs)
            told = unified.told_by_maps(receipt)
            if told is None:
                return walked(self, node, *args, **kwargs)
            book = books.get(id(self))
            if book is None:
                book = result.book(self, machine)
            book.refuse_elsewhere(node, receipt, told, "dec_lock_ref")
            if getattr(node, "parent", None) is None:  # the root: its walk moves nothing
                released = walked(self, node, *args, **kwargs)
                book.give_back(told)
                return released
            locks = getattr(node, "locks", 0)
            if locks:  # with none, the walk refuses the release itself
                held = f"the {locks} lock(s) on the node"
                book.refuse_spent(unified.node_id(node), receipt, "dec_lock_ref", held, told)
            released = walked(self, node, *args, **kwargs)
            book.spend(receipt, told)
            return released

        return dec_lock_ref

    return decorate


def _noting_node(result: Patch, machine: Residency) -> Callable[[Method], Method]:
    """Have ``lock(node)`` note in the cache's book the node its receipt is taken on.

    SGLang 0.5.23's ``BasePrefixCache.lock`` returns ``TreeLock(node,
    receipt)``; the receipt (``to_dec_params``'s, its uuid maps made afresh)
    is noted with the node (:meth:`~fsm_cache.compat.sglang.unified.LockBook.take`),
    so that :func:`_released_once` refuses it on another node. The
    ``TreeLock`` and the receipt are SGLang's, unchanged.

    The book is made and readied (:meth:`~fsm_cache.compat.sglang.unified.LockBook.ready`)
    before SGLang takes the lock, and after it only noted in: a book that
    raised after would leave the node locked, with no ``TreeLock`` returned
    to release it by.

    Args:
        result: The patch whose books the wrapper keeps.
        machine: The engine the books read trail mode from.

    Returns:
        A decorator for ``lock``.
    """
    books = result.spent

    def decorate(original: Method) -> Method:
        @functools.wraps(original)
        def lock(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "disable", False):
                return original(self, node, *args, **kwargs)
            book = books.get(id(self))
            if book is None:
                book = result.book(self, machine)
            spot = book.ready()
            taken = original(self, node, *args, **kwargs)
            told = unified.told_by_maps(getattr(taken, "receipt", None))
            if told is not None:
                book.take(node, told, spot)
            return taken

        return lock

    return decorate


def _reset_forgets(result: Patch, machine: Residency) -> Callable[[Method], Method]:
    """Have ``reset()`` clear the cache's book: the tree its locks were on is gone.

    Args:
        result: The patch whose books the wrapper keeps.
        machine: Unused (the signature :data:`RECEIPTS` shares).

    Returns:
        A decorator for ``reset``.
    """
    del machine
    books = result.spent

    def decorate(original: Method) -> Method:
        @functools.wraps(original)
        def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            book = books.get(id(self))
            if book is not None:
                book.clear()
            return out

        return reset

    return decorate


RECEIPTS: dict[str, Callable[[Patch, Residency], Callable[[Method], Method]]] = {
    "lock": _noting_node,
    "reset": _reset_forgets,
}
"""The methods wrapped with a ``dec_lock_ref`` that takes a receipt, and their wrappers."""


def _adopt_subclasses(
    result: Patch,
    found: list[ModuleType],
    checked: dict[type, type[ResidencyMixin]],
    machine: Residency,
) -> list[str]:
    """Patch the subclasses of the patched caches, those defined before the patch and after.

    Such a subclass (SGLang's ``LMCRadixCache``, ``FlexKVRadixCache``,
    ``PureSWARadixCache``, a fork's cache) inherits the wrapped methods, but
    builds nodes through the ``TreeNode`` its module imported, SGLang's own
    class if it was imported before the patch: nodes nothing checks, in a
    checked tree, whose first lock walk was refused as "built before
    patch()". Its module's name is pointed at the checked class and the
    cache methods it overrides are wrapped too (:func:`_adopt`), all undone
    with the rest. SGLang's own cache modules (:data:`MODULES`) are patched
    when named, only.

    A subclass defined while the patch holds (a storage backend's module,
    imported on demand when the server builds its cache) is adopted the
    same way as Python creates it: each patched cache class with no patched
    ancestor gets an ``__init_subclass__`` (:func:`_adopting`), until the
    undo, so that whether a subclass's overrides are checked does not depend
    on when its module was imported.
    """
    skipped = {m.__name__ for m in found} | set(MODULES)
    out: list[str] = []
    roots: list[type] = [
        cls
        for module in found
        for name in CACHES
        if isinstance(cls := getattr(module, name, None), type)
        and cls.__module__ == module.__name__
    ]
    for sub in dict.fromkeys(sub for cls in roots for sub in _descendants(cls)):
        out += _adopt(result, sub, checked, machine, skipped)
    for cls in roots:
        if not any(base in roots for base in cls.__mro__[1:]):  # its ancestor's hook runs
            hook = _adopting(
                result, cls, lambda sub: _adopt(result, sub, checked, machine, skipped)
            )
            result.record(cls, "__init_subclass__", hook)
    return out


def _adopt(
    result: Patch,
    sub: type,
    checked: dict[type, type[ResidencyMixin]],
    machine: Residency,
    skipped: set[str],
) -> list[str]:
    """Point ``sub``'s module at the checked ``TreeNode`` and wrap its overrides; return them."""
    module = sys.modules.get(sub.__module__)
    if sub.__module__ in skipped or not isinstance(module, ModuleType):
        return []
    held = vars(module).get("TreeNode")
    if isinstance(held, type) and held in checked:
        result.record(module, "TreeNode", checked[held])
    return _wrap_class(result, module, sub, machine)


def _adopting(result: Patch, cls: type, adopt: Callable[[type], list[str]]) -> Any:
    """``cls``'s ``__init_subclass__`` while ``result`` holds: the one it had, then ``adopt``.

    ``adopt`` patches a new subclass and returns what it wrapped (:func:`_adopt`
    for the node-checked caches, the boundary's own for ``UnifiedRadixCache``).

    A subclass created after :meth:`Patch.undo` began is left alone (the
    undo would not see what an adoption recorded after it).
    """
    own = vars(cls).get("__init_subclass__")
    base: Any = cls

    def init_subclass(sub: type, /, **kwargs: Any) -> None:
        if own is None:
            super(base, sub).__init_subclass__(**kwargs)
        else:
            own.__get__(None, sub)(**kwargs)
        with _PATCHING:
            if any(_ACTIVE.get(name) is result for name in result.modules):
                result.wrapped += tuple(adopt(sub))

    return classmethod(init_subclass)
