"""Audit one module: find its functions, analyze each, turn events into findings.

This is where the declared hand-offs apply: ``# fsm-cache:`` markers on a call
or a ``def``, and the ``takes_ownership``/``hands_off`` lists of the config.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from fsm_cache.audit import messages
from fsm_cache.audit.calls import Classifier
from fsm_cache.audit.events import Sink
from fsm_cache.audit.flow import analyze
from fsm_cache.audit.markers import HANDS_OFF, TAKES_OWNERSHIP, Markers, read_markers
from fsm_cache.audit.model import AuditConfig, AuditError, Finding
from fsm_cache.audit.scope import FunctionNode, build_scope
from fsm_cache.audit.state import Flow, FlowOutcome, TooComplex


# The line breaks of the parser: not the form feeds and others str.splitlines() knows.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")

# Methods that acquire for their object, and methods that release what it holds: an
# acquire on what hangs off ``self`` is the object's to keep, a release its to give back.
_ACQUIRE_FOR_SELF = frozenset({"__init__", "__post_init__", "__enter__", "__aenter__"})
_RELEASE_FOR_SELF = frozenset({"__exit__", "__aexit__", "__del__"})


@dataclass(frozen=True)
class Module:
    """What applies to every function of one module.

    Attributes:
        path: The source path as given.
        config: The config that applies to it.
        markers: Its ``# fsm-cache:`` markers.
        lines: Its source lines, to turn the parser's byte columns into
            character columns; empty when the source is not at hand.
    """

    path: str
    config: AuditConfig
    markers: Markers
    lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class Function:
    """A function to analyze, with what the module and config declare about it.

    Attributes:
        node: The ``def``.
        qualname: ``Class.method`` or ``outer.inner``.
        nested: Whether it is defined inside another function (a closure).
        hands_off: Its acquires are handed on by design (no FSM101/FSM104).
        takes_ownership: It releases what its callers acquired (no FSM103/FSM105).
    """

    node: FunctionNode
    qualname: str
    nested: bool
    hands_off: bool
    takes_ownership: bool


def parse(source: str, path: str) -> ast.Module:
    """Parse ``source``; a syntax error becomes an :class:`AuditError` naming the place.

    Raises:
        AuditError: The source has a syntax error, a null byte, or nests too deeply.
    """
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}:{exc.offset or 0}" if exc.lineno else path
        raise AuditError(f"{where}: syntax error: {exc.msg}") from None
    except (RecursionError, MemoryError):  # building the tree; the parser's own stack
        raise AuditError(f"{path}: too deeply nested to parse") from None
    except ValueError as exc:  # null bytes, on Python 3.10 (3.11.7 raises SyntaxError)
        raise AuditError(f"{path}: syntax error: {exc}") from None


def check_source(source: str, path: str, config: AuditConfig) -> list[Finding]:
    """Return the findings of one module's source text, sorted by place."""
    return check_tree(parse(source, path), path, config, read_markers(source), source)


def check_tree(
    tree: ast.Module,
    path: str,
    config: AuditConfig,
    markers: Markers | None = None,
    source: str | None = None,
) -> list[Finding]:
    """Return the findings of a parsed module; ``markers`` come from its comments.

    Columns count characters when ``source`` is given, else UTF-8 bytes as
    the parser does.
    """
    lines = tuple(_LINE_BREAK.split(source)) if source is not None else ()
    module = Module(path, config, markers or Markers(), lines)
    functions = list(_functions(tree, "", False, module))
    takers = config.takes_ownership | {fn.node.name for fn in functions if fn.takes_ownership}
    classifier = Classifier(config, frozenset(takers))
    found = [
        Finding(path, line, col, "FSM100", text, "")
        for line, col, text in module.markers.problems
        if not module.markers.ignored(line, "FSM100")
    ]
    for function in functions:
        found.extend(_analyzed(module, function, classifier))
    return sorted({f for f in found if f.code not in config.ignore})


def _analyzed(module: Module, function: Function, classifier: Classifier) -> list[Finding]:
    """Return the findings of one function.

    A function that makes no pair call has none and is not analyzed: most
    functions of a cache's source are such, and following their paths was
    most of the audit's time. A function past the analysis' bounds (nested
    too deeply for the recursion limit, or with too many paths) is one FSM106
    finding at its ``def``, so the rest of a file or folder is still audited
    and the report says what was not. Each finding is checked against the
    ``ignore`` markers once, where it is made.
    """
    if not classifier.may_pair(function.node):
        return []
    try:
        outcome, sink = analyze(function.node, classifier)
        return list(_findings(module, function, outcome, sink))
    except RecursionError:
        why = "is too deeply nested to analyze"
    except TooComplex as exc:
        why = f"is too complex to analyze ({exc})"
    node = function.node
    if module.markers.ignored(node.lineno, "FSM106"):
        return []
    text = f"{function.qualname} {why}; nothing in it is checked"
    return [
        Finding(module.path, node.lineno, node.col_offset + 1, "FSM106", text, function.qualname)
    ]


def _functions(node: ast.AST, prefix: str, nested: bool, module: Module) -> Iterator[Function]:
    """Yield every function under ``node`` with its qualified name, outermost first.

    Only statements are searched (a ``def`` is one), so a deeply nested
    expression is left to the analysis of its function.
    """
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            continue
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            qualname = prefix + child.name
            yield _declared(child, qualname, nested, module)
            yield from _functions(child, qualname + ".", True, module)
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.", nested, module)
        else:
            yield from _functions(child, prefix, nested, module)


def _declared(node: FunctionNode, qualname: str, nested: bool, module: Module) -> Function:
    """Return the function with the hand-offs its signature markers and the config declare."""
    signature = range(node.lineno, node.body[0].lineno)
    names = {qualname, node.name}
    config, markers = module.config, module.markers
    return Function(
        node,
        qualname,
        nested,
        hands_off=markers.has(signature, HANDS_OFF) or bool(names & config.hands_off),
        takes_ownership=(
            markers.has(signature, TAKES_OWNERSHIP) or bool(names & config.takes_ownership)
        ),
    )


def _findings(module: Module, fn: Function, outcome: FlowOutcome, sink: Sink) -> Iterator[Finding]:
    """Record the leaks of the paths leaving ``fn``, then render every event as a finding."""
    end = fn.node.end_lineno or fn.node.lineno
    exits = [
        *((state, end, "ends") for state in outcome.get(Flow.NORMAL, {})),
        *((state, state.site, "returns") for state in outcome.get(Flow.RETURN, {})),
        *((state, state.site, "raises") for state in outcome.get(Flow.RAISE, {})),
    ]
    kept = _self_owned(fn, _ACQUIRE_FOR_SELF)
    for state, line, how in exits:
        for held in state.held:
            site = (held.line, held.col, held.key)
            if held.handed:
                continue
            if how == "raises":
                sink.raised(site, line)
            elif messages.root_of(held.key) not in kept:
                sink.leak(site, line, how)
    own = _implemented_pairs(fn.node, module.config)
    ends = _call_ends(fn.node)
    markers = module.markers
    for item in messages.render_events(sink, module.config.pairs):
        last = ends.get((item.line, item.col), item.line)
        lines = (item.line,) if last == item.line else (item.line, last)
        if item.key[0] in own or _declared_away(fn, item, markers, lines):
            continue
        if any(markers.ignored(line, item.code) for line in lines):
            continue
        col = _char_col(module.lines, item.line, item.col)
        yield Finding(module.path, item.line, col, item.code, item.message, fn.qualname)


def _call_ends(node: FunctionNode) -> dict[tuple[int, int], int]:
    """Return the last line of each call in ``node``, by its place (line, 1-based byte column).

    A marker on a call's last line covers it as one on its first line does:
    a formatter puts the comment of a call split over lines after its ``)``.
    """
    return {
        (sub.lineno, sub.col_offset + 1): sub.end_lineno or sub.lineno
        for sub in ast.walk(node)
        if isinstance(sub, ast.Call)
    }


def _implemented_pairs(node: FunctionNode, config: AuditConfig) -> frozenset[int]:
    """Return the pairs ``node`` implements: its name is their acquire or release.

    A method named ``inc_lock_ref`` that forwards to ``self.tree.inc_lock_ref(node)``
    is the pair's own implementation, not a caller that leaks it.
    """
    return frozenset(
        index
        for index, pair in enumerate(config.pairs)
        if node.name in (pair.acquire, pair.release)
    )


def _char_col(lines: tuple[str, ...], line: int, col: int) -> int:
    """Return the 1-based character column of the 1-based UTF-8 byte column ``col``."""
    if not 0 < line <= len(lines):
        return col
    prefix = lines[line - 1].encode("utf-8")[: col - 1]
    return len(prefix.decode("utf-8", errors="ignore")) + 1


def _declared_away(
    fn: Function, item: messages.Rendered, markers: Markers, lines: tuple[int, ...]
) -> bool:
    """Return whether a documented hand-off covers this finding, placed at a call on ``lines``.

    A release in a closure of a resource the closure captures is a hand-off too:
    the enclosing function gave the resource to the callback.
    """
    if item.code in ("FSM101", "FSM104"):
        return fn.hands_off or markers.has(lines, HANDS_OFF)
    if item.code in ("FSM103", "FSM105"):
        root = messages.root_of(item.key)
        captured = fn.nested and root not in _own_names(fn.node)
        given_back = root in _self_owned(fn, _RELEASE_FOR_SELF)
        return fn.takes_ownership or markers.has(lines, TAKES_OWNERSHIP) or captured or given_back
    return False


def _self_owned(fn: Function, methods: frozenset[str]) -> frozenset[str]:
    """Return the name of ``self`` when ``fn`` is one of ``methods``, else nothing.

    ``__enter__`` that pins ``self.node`` leaves the pin to the object, and
    ``__exit__`` that releases it gives back what ``__enter__`` took: neither
    is a leak or an unmatched release. An exception out of ``__enter__`` or
    ``__init__`` still leaks (FSM104): no ``__exit__`` runs for it.
    """
    positional = [*fn.node.args.posonlyargs, *fn.node.args.args]
    method = "." in fn.qualname and not fn.nested
    if not method or fn.node.name not in methods or not positional:
        return frozenset()
    return frozenset({positional[0].arg})


def _own_names(node: FunctionNode) -> frozenset[str]:
    scope = build_scope(node)
    return scope.params | scope.locals
