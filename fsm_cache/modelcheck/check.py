"""``fsm-cache check``: an explicit-state bounded model checker of the composed system.

A small tree of ``--nodes`` nodes, in several shapes (a chain, a fan-out, a
binary tree), each node running the spec's machines, with locks, pins, copies
in flight and acknowledgements arriving in any order, plus the cache's tree
operations (insert a leaf, hang a node found in storage, split a node, delete
a node whose data is gone) and, with a storage tier, what the store reports
on its own (``discover``, ``vanish``) at any node at any time.
Every reachable state is explored breadth-first and checked against the
design's invariants (:mod:`fsm_cache.modelcheck.invariants`), the model's account
of pages and copies in flight (:mod:`fsm_cache.modelcheck.copies`) and what
lookups tell callers (:mod:`fsm_cache.modelcheck.lookup`); then every state must
be able to settle (:mod:`fsm_cache.modelcheck.liveness`). On a violation the
shortest event sequence reaching it is printed and the exit status is 1. A
search that would outgrow the machine stops while a sixteenth of its memory
(at least 1 GiB, or a quarter under 4 GiB) is still free, or after ``--max-states`` states or
``--max-seconds`` seconds, and says so, with exit status 3:
what it explored held, but it is not exhaustive
(:mod:`fsm_cache.modelcheck.budget`).
``--policy write_through`` checks HiCache's own choices too: backups start
only where its write policy starts them, and their prefix-closure
(invariant 3) is checked. States that differ only in how their nodes are
numbered are explored once (symmetry reduction,
:class:`~fsm_cache.modelcheck.forest.Trees`); ``--no-symmetry`` explores every
numbering, for the count before the reduction. Without arguments it checks the shipped specs
(a spec with a storage region on :data:`STORAGE_NODES` nodes), the residency
specs under the write-through policy, and the negative controls of
``specs/bugs_detected`` (each of which must still yield its finding). With
``--ops FILE.py`` it checks the spec the module's ``SPEC`` names, under its
``POLICY`` (:func:`with_ops`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from fsm_cache.errors import BadArgument, ConfigError, FsmCacheError, NotCompositional, SpecError
from fsm_cache.modelcheck import treeops, views
from fsm_cache.modelcheck.budget import Budget
from fsm_cache.modelcheck.explore import CEILING, Bounds, Explorer, Result
from fsm_cache.modelcheck.hooks import hooks, never_called, raised
from fsm_cache.modelcheck.progress import PLAIN_EVERY, progress
from fsm_cache.modelcheck.state import Layout, Nodes, reference_states
from fsm_cache.numeric import whole
from fsm_cache.policy import WritePolicy
from fsm_cache.shell import named_once, path_text, spec_path, summary_line
from fsm_cache.spec.controls import Control, controls, load_finding, render_controls
from fsm_cache.spec.loader import load_snapshot, load_spec, unreadable
from fsm_cache.spec.machine import System, as_system, comparisons
from fsm_cache.spec.shipped import shipped_file, shipped_spec_paths


SHAPES: dict[str, Callable[[int], list[int]]] = {
    "chain": lambda n: [i - 1 for i in range(n)],
    "fan-out": lambda n: [-1, *([0] * (n - 1))][:n],
    "binary": lambda n: [(i - 1) // 2 if i else -1 for i in range(n)],
}


def starting_shapes(nodes: int) -> dict[str, list[int]]:
    """Return the shapes a tree of ``nodes`` nodes starts from: each tree once, by its first name.

    Small trees make the shapes coincide: one node is every shape, two are a
    chain whatever the shape, and on three the binary tree is the fan-out.
    Each is then one starting tree, and the report names only the shapes
    started from (``2 nodes (chain)``), not three that are one.
    """
    out: dict[str, list[int]] = {}
    for name, shape in SHAPES.items():
        parents = shape(nodes)
        if parents not in out.values():
            out[name] = parents
    return out


def shapes(layout: Layout, nodes: int) -> dict[str, Nodes]:
    """Return the initial model state of each tree shape: every node fresh, or born.

    A spec with host or device regions grows its trees by births as nodes are
    deleted. One without keeps its starting trees, every slot full, so each
    birth it declares is explored at the start instead: every node of every
    shape either fresh or born each declared way (``chain, node 1 stray``).
    A combination of states that only a birth reaches (one the composition's
    forbids keep its runs out of) is then explored as ``Engine.new`` makes it.

    Raises:
        BadArgument: Those starting trees would be more than
            :data:`MAX_STARTS` (they are built before any budget is read).
    """
    trees = starting_shapes(nodes)
    starts: dict[str, Nodes] = {
        name: tuple(layout.fresh(parent) for parent in parents) for name, parents in trees.items()
    }
    if layout.memory.tiers or not layout.births:
        return starts
    count = len(trees) * (1 + len(layout.births)) ** nodes
    if count > MAX_STARTS:
        raise BadArgument(
            f"check: {nodes} nodes make {count} starting trees, at most {MAX_STARTS}: each "
            f"node of each shape starts fresh or born {' or '.join(layout.births)}, as no "
            "node enters a tree of a spec without host and device regions later"
        )
    for name, above in trees.items():
        for ways in itertools.product((None, *layout.births), repeat=len(above)):
            if any(ways):
                born = ", ".join(f"node {i} {way}" for i, way in enumerate(ways) if way)
                starts[f"{name}, {born}"] = tuple(
                    layout.fresh(p) if way is None else layout.born(p, way)
                    for p, way in zip(above, ways, strict=True)
                )
    return starts


POLICIES: dict[str, WritePolicy | None] = {"none": None, "write_through": WritePolicy.WRITE_THROUGH}
"""``--policy`` choices: none (every step the spec allows), or HiCache's write-through."""

POLICY_NODES = 3
"""Tree size of the write-through pass of the no-argument run (it keeps ``make test`` short)."""

NODES = 4
"""Tree size of a spec when ``--nodes`` is not given, unless it has a storage region."""

MAX_NODES = 128
"""The largest tree ``check`` takes (``--nodes``); a larger one is refused before anything runs.

The search is exhaustive, so far smaller trees are out of its reach already:
4 nodes of ``residency.toml`` are about 2 million states, 5 nodes about 76
million (``docs/check.md``, *Five nodes*). A larger tree is only ever a partial
search under ``--max-states`` or ``--max-seconds``: on 100 nodes of a
one-machine spec, the budget's own measurements. Past this bound nothing is
gained, and much is lost: the starting trees are built and interned before
the budget is first read, recursively along the chain (``RecursionError``
from a few hundred nodes), and with millions of nodes for minutes and
gigabytes.
"""

MAX_BOUND = 64
"""The largest counter bound ``check`` takes (``--max-pins``, ``--max-locks``, ``--max-count``).

Every value of a counter is a state of its own on every node, so a bound
multiplies the space by itself once per node: 3 nodes of ``residency.toml``
with pins up to 3 are about 700 thousand states. A bound past this one is a
slip (``--max-count 1000000``), which ran for minutes into gigabytes with
nothing to say.
"""

TOO_HIGH_A_BOUND = "each value of a counter is a state of its own on every node"
"""Why :data:`MAX_BOUND` bounds the counter bounds, as a refusal of a higher one says."""

MAX_STARTS = 100_000
"""The most starting trees :func:`shapes` builds: a spec without host and device regions
starts each node fresh or born, so its births multiply the starting trees per node."""

TOO_MANY_NODES = "every state of the tree is explored: 4 nodes are already about 2 million states"
"""Why :data:`MAX_NODES` bounds the tree, as a refusal of a larger one says."""

STORAGE_NODES = 3
"""Tree size of a spec with a ``storage`` region when ``--nodes`` is not given.

A third region multiplies the states of each node about tenfold: four nodes
are out of reach of ``make test``, three take about half a minute.
"""

STORAGE_PINS = 3
"""Pin bound of a spec with a ``storage`` region when ``--max-pins`` is not given.

A node being stored and loaded at once holds two pins, the store's and the
load's, so a rule read there (``residency_storage.toml``'s ``StorePinHeld``,
``pins == 2``) meets a client's pin only at three: at two, dropping that rule
passed the check.
"""

STORAGE_LOCKS = 1
"""Lock bound of a spec with a ``storage`` region when ``--max-locks`` is not given.

Locks live in the device region alone; the two-region residency spec checks
them up to 2 on four nodes. One lock per node keeps locked and unlocked
nodes under every storage step at a third of the states of two.
"""


class Target(NamedTuple):
    """One run of the checker: a spec, the policy it runs under, its tree size, pin and lock bounds.

    ``files`` holds the bytes of every file the spec was read from, read once
    (:func:`~fsm_cache.spec.loader.load_snapshot`): every later step of the
    run builds the spec from them, so one run checks one version of it.
    """

    spec: Path
    policy: str
    nodes: int
    pins: int
    locks: int
    files: dict[str, bytes]
    name: str
    """The spec's file as given: the report says ``./x.toml`` where ``spec`` says ``x.toml``."""


Files = Mapping[str, bytes] | None
"""The bytes a spec is built from (:func:`~fsm_cache.spec.loader.load_snapshot`); None: its files on disk."""


def _system(path: Path, files: Files) -> System:
    """Return the system of the spec at ``path``, built from ``files`` if given.

    Raises:
        SpecError: The spec does not load.
    """
    return as_system(load_spec(path, files))


def sized(
    path: Path, nodes: int | None, pins: int | None, locks: int | None, *, files: Files = None
) -> tuple[int, int, int]:
    """Return the tree size, pin and lock bounds of ``path``: those given, else the spec's defaults.

    A spec with a ``storage`` region defaults to :data:`STORAGE_NODES` nodes,
    :data:`STORAGE_PINS` pins and :data:`STORAGE_LOCKS` locks, any other to
    :data:`NODES` and the default ceiling,
    :data:`CEILING <fsm_cache.modelcheck.explore.CEILING>`.
    The spec is built from ``files`` if given (:data:`Files`).

    Raises:
        SpecError: The spec does not load.
    """
    storage = "storage" in dict(_system(path, files).regions)
    default = CEILING
    own = (STORAGE_NODES, STORAGE_PINS, STORAGE_LOCKS) if storage else (NODES, default, default)
    return (
        own[0] if nodes is None else nodes,
        own[1] if pins is None else pins,
        own[2] if locks is None else locks,
    )


BOUND_BY = {"pins": "--max-pins", "locks": "--max-locks"}
"""The option that bounds a counter of each of these names; any other's is ``--max-count``."""


def bound_by(counter: str) -> str:
    """Return the option that bounds ``counter``: :data:`BOUND_BY`'s, else ``--max-count``."""
    return BOUND_BY.get(counter, "--max-count")


def unused_bounds(given: dict[str, int], counters: dict[Path, list[str]]) -> list[str]:
    """Return a refusal of each bound option in ``given`` that bounds no counter of ``counters``.

    ``--max-locks 3`` on a spec that counts pins alone would be dropped
    without a word, and a user who typed the wrong option would believe
    the bound applied; so would ``--max-count`` where every counter is
    named ``pins`` or ``locks``. An option that bounds a counter of any
    spec checked is taken: the report names each spec's ceilings.

    Args:
        given: The value of each bound option on the command line, by option.
        counters: The counters of each spec checked, in the spec's order.
    """
    used = {bound_by(name) for names in counters.values() for name in names}
    have = "; ".join(
        f"{path}: {', '.join(names) or 'no counters'}" for path, names in counters.items()
    )
    bounds = {flag: f"a counter named {name}" for name, flag in BOUND_BY.items()}
    other = f"counters not named {' or '.join(BOUND_BY)}"
    return [
        f"check: {flag} {value} bounds {bounds.get(flag, other)}, and no spec checked has "
        f"one ({have})"
        for flag, value in given.items()
        if flag not in used
    ]


def ceilings(
    path: Path, pins: int, locks: int, count: int, *, files: Files = None
) -> dict[str, int]:
    """Return the ceiling of each counter of the spec at ``path``, in the spec's order.

    ``pins`` bounds a counter named ``pins`` (``--max-pins``), ``locks`` one
    named ``locks`` (``--max-locks``), ``count`` any other (``--max-count``):
    :data:`BOUND_BY`. A spec without counters has none. The spec is built
    from ``files`` if given (:data:`Files`).

    Raises:
        SpecError: The spec does not load.
    """
    given = dict(zip(BOUND_BY, (pins, locks), strict=True))
    return {name: given.get(name, count) for name, _ in _system(path, files).counters}


def unexplored(path: Path, bounded: dict[str, int], *, files: Files = None) -> dict[str, int]:
    """Return the counters ``bounded`` caps below where a comparison of the spec turns, and where.

    A guard ``borrows >= 8`` under ``borrows <= 2`` never holds in the search,
    so what it guards (a refusal, a transition) goes unexplored; the report
    says so, with the ceiling that reaches it
    (:meth:`~fsm_cache.spec.guards.Comparison.turns_at`: an equality's last
    turn, ``pins == 2`` at 3, since where it is read the count may never be
    below 2), rather than passing in silence. The spec is built from
    ``files`` if given (:data:`Files`).

    Raises:
        SpecError: The spec does not load.
    """
    system = _system(path, files)
    machines = [machine for _, machine in system.regions]
    turns: dict[str, int] = {}
    for term in comparisons(machines, *(forbid.guard for forbid in system.forbids)):
        if term.counter in bounded:
            turns[term.counter] = max(turns.get(term.counter, 0), term.turns_at())
    return {name: at for name, at in turns.items() if bounded[name] < at}


def not_explored(bounds: dict[str, int], cut: dict[str, int]) -> list[str]:
    """Return the report's line for each counter :func:`unexplored` found cut by its ceiling.

    One wording for every report of a check, enumerative or compositional
    (and the pytest plugin's ``fsm-check``): ``not explored: pins above 1,
    where a comparison turns at 3 (--max-pins 3 reaches it)``.

    Args:
        bounds: The ceiling of each counter, as the check ran.
        cut: What :func:`unexplored` returned for those ceilings.
    """
    return [
        f"not explored: {name} above {bounds[name]}, where a comparison turns at "
        f"{at} ({bound_by(name)} {at} reaches it)"
        for name, at in cut.items()
    ]


def left_out(entry: dict[str, Any]) -> list[str]:
    """Return the report's ``not explored`` lines of a search's entry (:func:`search`).

    The ceilings' cuts (:func:`not_explored`), then the states that settle
    only past a ceiling.
    """
    lines = not_explored(entry["bounds"], entry["unexplored"])
    if entry["past_ceiling"]:
        lines.append(
            f"not explored: past the ceilings, where {_count(entry['past_ceiling'], 'state')} "
            "settle (each only by a step that takes a counter past its ceiling); liveness "
            "takes them to settle"
        )
    return lines


def as_command(path: Path, nodes: int, bounds: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Return what ``fsm-cache check PATH --nodes NODES`` finds: its entry of :func:`run`'s specs.

    The command line is parsed as the command parses it, every other option
    at its default but the ceilings in ``bounds`` (``{"--max-count": 4}``):
    the spec is sized as the command sizes a SPEC argument (:func:`sized`
    and :func:`ceilings`: a spec with a storage region up to
    :data:`STORAGE_PINS` pins and :data:`STORAGE_LOCKS` lock) and runs under
    no write policy, as a SPEC argument does. A ceiling in ``bounds`` that
    bounds no counter of the spec is left out, where the command would
    refuse it (:func:`unused_bounds`): one setting serves every spec of a
    project. No progress is shown. This is the pytest plugin's ``fsm-check``
    (``docs/verify.md``): one path from command line to search, so a spec
    the command fails cannot pass there.

    Raises:
        FsmCacheError: As :func:`run`: the spec does not load, or is refused.
    """
    parser = argparse.ArgumentParser(prog="fsm-cache")
    register(parser.add_subparsers())
    line = ["check", str(path), "--nodes", str(nodes)]
    if bounds:
        used = {bound_by(name) for name, _ in _system(path, None).counters}
        line += [str(x) for flag, value in bounds.items() if flag in used for x in (flag, value)]
    args = parser.parse_args(line)
    args.progress = False
    (entry,) = run(args)["specs"]
    return dict(entry)


def starts_past_ceiling(
    name: str, counters: Sequence[tuple[str, int]], bounds: Bounds
) -> str | None:
    """Return the refusal of the first counter that starts above its ceiling, or None.

    No step is taken past a ceiling, and the starting value of such a counter
    is past it already: every event would be refused at the start (whatever
    counter it moves), so the check would explore the starting trees alone
    and report them clean. A node born of a birth starts with the same values.

    Args:
        name: The spec's name, as the refusal names it.
        counters: The spec's counters and their starting values, in order.
        bounds: The ceilings of the check.
    """
    for counter, start in counters:
        most = bounds.ceiling(counter)
        if start > most:
            flag = bound_by(counter)
            advice = (
                f"give {flag} {start} or more"
                if start <= MAX_BOUND
                else f"no ceiling check takes reaches it ({flag} is at most {MAX_BOUND}: "
                f"{TOO_HIGH_A_BOUND}); start it lower"
            )
            return (
                f"check: {name}: {counter} starts at {start}, above its ceiling {most} "
                f"({flag}): no step is taken past a ceiling, so nothing would be explored; "
                f"{advice}"
            )
    return None


def check_spec(
    path: Path,
    nodes: int,
    bounds: Bounds,
    ops: ModuleType | Any = treeops,
    *,
    tick: Callable[[int], None] | None = None,
    policy: WritePolicy | None = None,
    symmetry: bool = True,
    budget: Budget | None = None,
    files: Files = None,
) -> Result:
    """Model-check the spec at ``path``, under the cache's write ``policy`` if one is given.

    With ``symmetry`` (the default) a tree is one state whatever its node
    numbering; without, every numbering is explored (same verdict, more states).
    ``budget`` says when to stop short (default: while a sixteenth of the
    memory, at least 1 GiB or a quarter under 4 GiB, is free); :attr:`Result.stopped` then says why.
    The spec is built from ``files`` if given (:data:`Files`), else read once from ``path``.

    Raises:
        BadArgument: ``nodes`` is not an int >= 1 (no tree, nothing checked),
            or is more than :data:`MAX_NODES`; or a counter starts above its
            ceiling in ``bounds`` (:func:`starts_past_ceiling`).
        SpecError: The spec does not load, or a policy is given for a spec
            without host and device regions.
        ConfigError: A ``host``, ``device`` or ``storage`` region lacks a state
            the residency checks read by name
            (:func:`~fsm_cache.modelcheck.state.reference_states`), or ``ops``
            defines a hook the check never calls
            (:func:`~fsm_cache.modelcheck.hooks.never_called`).
    """
    explorer, start = prepare(
        path, nodes, bounds, ops, policy=policy, symmetry=symmetry, files=files
    )
    return explorer.run(start, tick, budget)


def prepare(
    path: Path,
    nodes: int,
    bounds: Bounds,
    ops: ModuleType | Any = treeops,
    *,
    policy: WritePolicy | None = None,
    symmetry: bool = True,
    files: Files = None,
) -> tuple[Explorer, dict[str, Nodes]]:
    """Return the explorer of :func:`check_spec` and the tree of each shape it starts from.

    Everything that refuses a check is done here, before anything is
    explored, so :func:`run` can refuse a run with several specs at once.

    Raises:
        BadArgument, SpecError, ConfigError: As :func:`check_spec`.
    """
    if not whole(nodes, 1):
        raise BadArgument(f"check: nodes must be an int >= 1, got {nodes!r}")
    if nodes > MAX_NODES:
        raise BadArgument(
            f"check: nodes must be at most {MAX_NODES}, got {nodes} ({TOO_MANY_NODES})"
        )
    system = _system(path, files)
    reference_states(system)
    past = starts_past_ceiling(system.name, system.counters, bounds)
    if past is not None:
        raise BadArgument(past)
    layout = Layout.of(system)
    unused = never_called(ops, layout, policy, path)
    if unused is not None:
        raise ConfigError(unused)
    return Explorer(layout, bounds, ops, policy, symmetry=symmetry), shapes(layout, nodes)


def load_ops(path: Path) -> tuple[Path, ModuleType]:
    """Load a control module: its ``SPEC`` path and the tree operations it overrides.

    The module may also replace ``wants_backup`` (where the write policy
    starts backups) or ``match_prefix`` (the lookup,
    :func:`fsm_cache.modelcheck.lookup.match_prefix`), and name the ``POLICY``
    to check under (default none). What is returned is the checker's view of
    it (:func:`fsm_cache.modelcheck.hooks.hooks`): each hook it defines
    raises only a ConfigError naming the module and the hook.

    Raises:
        ConfigError: The module cannot be imported (not a regular file, a
            syntax error, an exception, any BaseException but a
            KeyboardInterrupt, or a ``sys.exit`` at import), or a hook is not
            callable.
        SpecError: The module names no ``SPEC`` (a path relative to the
            module, or ``fsm_cache:NAME``), a shipped spec that is none, or
            an unknown ``POLICY``.
    """
    problem = unreadable(path)  # a named pipe would make the import wait for a writer
    if problem is not None:
        raise ConfigError(f"{path}: cannot import: {problem}")
    spec = importlib.util.spec_from_file_location(f"fsm_cache_ops_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot import: not a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:  # the user's interrupt, not the module's fault
        raise
    except BaseException as exc:  # the user's module: a syntax error, its own raise or exit
        raise ConfigError(f"{path}: cannot import: {raised(exc)}") from None
    names = vars(module)  # what it defines: never its own __getattr__, which may raise
    target = names.get("SPEC")
    if not isinstance(target, str):
        raise SpecError([f"{path}: names no SPEC = 'path/to/spec.toml'"])
    policy = names.get("POLICY", "none")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise SpecError([f"{path}: POLICY must be one of {', '.join(POLICIES)}"])
    try:
        shipped = shipped_file(target)  # a shipped spec by name, as extends reads one
    except SpecError as exc:
        raise SpecError([f"{path}: SPEC: {exc.problems[0]}"]) from None
    return (shipped or path.parent / target).resolve(), hooks(path, module)


STOPPED = 3
"""Exit status of a check that stopped short of exhaustive with no finding (1: a finding)."""

CONTROL_NODES = 3
"""Controls run on a fixed tree size, so their expected findings do not move with --nodes."""


def check_control(
    control: Control,
    nodes: int = CONTROL_NODES,
    bounds: Bounds | None = None,
    *,
    symmetry: bool = True,
) -> str:
    """Return the first finding of ``validate`` or ``check`` on a control (``""`` if none).

    Without ``bounds``, counters are bounded by 2, locks as :func:`sized` says.
    The control's spec is read once, as a target's is (:class:`Target`).
    """
    path, ops = (control.path, treeops)
    if path.suffix == ".py":
        path, ops = load_ops(path)
    loaded, problem = load_finding(path)
    if loaded is None:
        return f"validate: {problem}"
    _, files = loaded
    if bounds is None:
        bounds = Bounds({"locks": sized(path, nodes, None, None, files=files)[2]})
    policy = POLICIES[getattr(ops, "POLICY", "none")]
    result = check_spec(path, nodes, bounds, ops, policy=policy, symmetry=symmetry, files=files)
    if result.violation:
        return f"check: violation: {result.violation}"
    return f"check: stopped: {result.stopped}" if result.stopped else ""


def with_ops(args: argparse.Namespace, spec: Path, policy: str | None) -> argparse.Namespace:
    """Return ``args`` aimed at what the ``--ops`` module names: its ``SPEC``, under its ``POLICY``.

    A module's hooks build and read the node entries of one spec, the one its
    ``SPEC`` names, so that is the spec it is checked on: SPEC arguments may
    name it again (however spelled) and ``--policy`` may repeat its
    ``POLICY``, but another spec or policy is refused rather than one side
    silently dropped. A module without ``POLICY`` runs under ``--policy``
    (default none). With the module's spec as the target, the negative
    controls (which the run without SPEC arguments adds) are not run.

    Args:
        args: The parsed command line.
        spec: The module's ``SPEC``, resolved (:func:`load_ops`).
        policy: The module's ``POLICY``, or None if it names none.

    Raises:
        SpecError: A SPEC argument is another file than the module's
            ``SPEC``, or ``--policy`` is another policy than its ``POLICY``;
            one line each, and nothing is checked.
    """
    problems = [
        f"check: {args.ops}: its SPEC is {spec}, not {given}; give that spec or none"
        for given in args.specs
        if os.path.realpath(given) != os.path.realpath(spec)
    ]
    if policy is not None and args.policy not in (None, policy):
        problems.append(
            f"check: {args.ops}: its POLICY is {policy}, not --policy {args.policy}; "
            "give that policy or none"
        )
    if problems:
        raise SpecError(problems)
    chosen = args.policy if args.policy is not None else policy
    return argparse.Namespace(
        **{**vars(args), "specs": args.specs or [str(spec)], "policy": chosen}
    )


def targets(args: argparse.Namespace) -> list[Target]:
    """Return what to check, in order.

    Named specs run under ``--policy`` (default none), each once however
    often and however spelled it is named. Without specs, the
    shipped specs run with no policy, then those of the residency layout under
    the write-through policy on at most :data:`POLICY_NODES` nodes; an explicit
    ``--policy`` runs the shipped specs it applies to under it instead. Each
    spec runs on ``--nodes`` and ``--max-locks``, or its own defaults
    (:func:`sized`: a spec with a storage region on fewer).

    Each spec's files are read here, once, though it runs under two policies
    (:attr:`Target.files`).

    Raises:
        SpecError: A spec does not load; its problems and those of every other
            spec that does not load, as ``validate`` reports them all.
    """
    given = named_once(args.specs) if args.specs else shipped_spec_paths()
    paths = [Path(p) for p in given]
    names = {path: str(p) for path, p in zip(paths, given, strict=True)}
    read = {}
    problems: list[str] = []
    for path in paths:
        try:
            read[path] = load_snapshot(names[path])  # a problem names the file as given
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError(problems)

    def target(path: Path, policy: str, most: int | None = None) -> Target:
        files = read[path][1]
        nodes, pins, locks = sized(path, args.nodes, args.max_pins, args.max_locks, files=files)
        nodes = nodes if most is None else min(nodes, most)
        return Target(path, policy, nodes, pins, locks, files, names[path])

    if args.specs:
        return [target(path, args.policy or "none") for path in paths]
    shipped = paths
    residency = [p for p in shipped if Layout.of(as_system(read[p][0])).residency]
    if args.policy is not None:
        return [target(p, args.policy) for p in (residency if POLICIES[args.policy] else shipped)]
    return [
        *(target(p, "none") for p in shipped),
        *(target(p, "write_through", POLICY_NODES) for p in residency),
    ]


def bounded_targets(args: argparse.Namespace) -> tuple[list[Target], list[dict[str, int]], int]:
    """Return :func:`targets`, each one's counter ceilings, and the ceiling of other counters.

    Raises:
        SpecError: A spec does not load, or a bound flag names a counter no
            spec has (:func:`unused_bounds`).
    """
    runs = targets(args)
    count = CEILING if args.max_count is None else args.max_count
    ceiling = [ceilings(run.spec, run.pins, run.locks, count, files=run.files) for run in runs]
    flags = zip(
        ("--max-pins", "--max-locks", "--max-count"),
        (args.max_pins, args.max_locks, args.max_count),
        strict=True,
    )
    counters = {run.spec: list(bounded) for run, bounded in zip(runs, ceiling, strict=True)}
    problems = unused_bounds({flag: n for flag, n in flags if n is not None}, counters)
    if problems:
        raise SpecError(problems)
    return runs, ceiling, count


class Search(NamedTuple):
    """One planned search of :func:`run`, whole enough to run in another process (``--jobs``).

    It carries the bytes of the spec's files (:attr:`Target.files`, a few
    kilobytes), not the spec: a worker builds the version :func:`run`
    planned from them, whatever the files on disk hold by then.
    """

    spec: Path
    policy: str
    nodes: int
    bounded: dict[str, int]
    bounds: Bounds
    symmetry: bool
    budget: Budget
    progress: bool | None
    files: dict[str, bytes]
    name: str = ""
    """The spec's file as given (:attr:`Target.name`); ``spec``'s own text where empty."""


def search(
    planned: Search, ops: ModuleType | Any = treeops, *, plain: bool = False
) -> dict[str, Any]:
    """Explore one planned target; return its entry of :func:`run`'s ``specs``.

    ``plain`` shows progress as lines, never as a bar (searches side by side).
    """
    title = _title(planned.spec.name, planned.policy)
    started = time.perf_counter()
    with progress(planned.progress, title, plain=plain) as tick:
        result = check_spec(
            planned.spec,
            planned.nodes,
            planned.bounds,
            ops,
            tick=tick,
            policy=POLICIES[planned.policy],
            symmetry=planned.symmetry,
            budget=planned.budget,
            files=planned.files,
        )
    return {
        "spec": planned.name or str(planned.spec),
        "policy": planned.policy,
        "nodes": planned.nodes,
        "shapes": list(starting_shapes(planned.nodes)),
        "bounds": planned.bounded,
        "unexplored": unexplored(planned.spec, planned.bounded, files=planned.files),
        "symmetry": planned.symmetry,
        "seconds": time.perf_counter() - started,
        **dataclasses.asdict(result),
    }


def searched(
    searches: list[Search],
    chosen: list[Control],
    ops: ModuleType | Any,
    *,
    jobs: int,
    symmetry: bool,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Run the searches, then the controls' checks; return their results in that order.

    With ``jobs`` above 1 they run in that many processes, each search whole
    in one (a search is not split); the results are the same, and the
    report's order is the command line's. An ``--ops`` module is not sent to
    other processes: a run with one has a single target and no controls.
    """
    if jobs == 1 or ops is not treeops or len(searches) + len(chosen) < 2:
        specs = [search(s, ops) for s in searches]
        return specs, [check_control(c, symmetry=symmetry) for c in chosen]
    context = multiprocessing.get_context("spawn")
    count = min(jobs, len(searches) + len(chosen))
    with ProcessPoolExecutor(count, mp_context=context, initializer=_uninterrupted) as pool:
        others = set(multiprocessing.active_children())
        started: set[multiprocessing.process.BaseProcess] = set()
        try:
            with _interrupts_held_off():  # the workers start as work is submitted
                runs = [pool.submit(search, s, plain=True) for s in searches]
                checks = [pool.submit(check_control, c, symmetry=symmetry) for c in chosen]
                started = set(multiprocessing.active_children()) - others
            return [r.result() for r in runs], [c.result() for c in checks]
        except BrokenProcessPool:  # the pool has ended the other workers
            raise FsmCacheError(WORKER_LOST) from None
        except BaseException:  # an interrupt or a failed search: the others are not waited for
            for process in started:
                process.terminate()
            raise


WORKER_LOST = (
    "check: a search process of --jobs ended without its result (killed: out of memory?); "
    "the other searches were stopped"
)
"""The error of a ``--jobs`` run whose worker died: a pool would wait for its result for ever."""


@contextlib.contextmanager
def _interrupts_held_off() -> Iterator[None]:
    """Ignore and block SIGINT while workers are spawned here, so they start ignoring it.

    A terminal's Ctrl-C reaches every process of its group: each worker
    printed its own interrupt (a traceback, or ``Process SpawnPoolWorker-2:``)
    around the command's one line, ``interrupted``. This process takes the
    interrupt and ends them all. A process keeps an ignored signal across
    ``exec``, so a worker spawned meanwhile is never exposed while it
    starts; then :func:`_uninterrupted` keeps it so. Off the main thread,
    where no handler can be set, only :func:`_uninterrupted` does.

    Blocked, an interrupt sent in the few milliseconds held off waits,
    though ignored (Linux keeps a blocked signal pending whatever its
    handler; POSIX lets a system drop it), and is taken here as
    ``KeyboardInterrupt`` once the handler is back: ignored alone, it was lost.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if signal.SIGINT not in blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one: now


def _uninterrupted() -> None:
    """Ignore SIGINT in a ``--jobs`` worker: the process that started it handles it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the targets (the shipped specs when none) and, without targets, the controls.

    With ``--ops`` the target is the module's ``SPEC`` (:func:`with_ops`).

    Raises:
        SpecError: The ``--ops`` module names no ``SPEC``, an unknown
            ``POLICY``, or another spec or policy than the command line; a
            counter bound given bounds no counter of any target
            (:func:`unused_bounds`); or a target is refused
            (:func:`prepare`). Each before any target is explored.
        ConfigError: The ``--ops`` module cannot be imported, or a hook fails.
    """
    ops: ModuleType = treeops
    if args.ops is not None:
        spec, ops = load_ops(Path(args.ops))
        args = with_ops(args, spec, getattr(ops, "POLICY", None))
    symmetry = not args.no_symmetry
    budget = Budget(max_states=args.max_states, max_seconds=args.max_seconds)
    runs, ceiling, count = bounded_targets(args)
    searches = []
    for (path, policy, nodes, _, _, files, name), bounded in zip(runs, ceiling, strict=True):
        bounds = Bounds(bounded, count)
        # every target is refused or taken before one is explored: a refusal after a
        # search (minutes on four nodes) would throw its result away
        prepare(path, nodes, bounds, ops, policy=POLICIES[policy], symmetry=symmetry, files=files)
        searches.append(
            Search(
                path, policy, nodes, bounded, bounds, symmetry, budget, args.progress, files, name
            )
        )
    chosen = (
        controls(tools=("validate", "check")) if not args.specs and not args.no_controls else []
    )
    specs, found = searched(searches, chosen, ops, jobs=args.jobs, symmetry=symmetry)
    checked = [
        {
            "control": control.name,
            "expected": control.expected,
            "found": finding,
            "ok": control.matches(finding),
        }
        for control, finding in zip(chosen, found, strict=True)
    ]
    return {"specs": specs, "controls": checked}


def report(result: dict[str, Any]) -> str:
    """Return the human summary of a :func:`run` result."""
    lines = []
    for s in result["specs"]:
        rate = s["states"] / s["seconds"] if s["seconds"] else 0.0
        lines.append(
            f"{_title(s['spec'], s['policy'])}: {_tree(s['nodes'], s['shapes'])}, "
            f"{_bounds(s['bounds'])}"
        )
        lines += [f"  {line}" for line in left_out(s)]
        lines.append(f"  states explored: {s['states']} ({_symmetry(s['symmetry'])})")
        if s["symmetry"]:
            lines.append(
                f"  before reduction: {s['numbered']} numbered states (each tree in every "
                f"numbering of its {_count(s['nodes'], 'slot')})"
            )
        lines.append(f"  states/s: {rate:.0f}")
        lines.append(f"  time: {s['seconds']:.2f} s")
        if s["violation"]:
            lines.append(f"  violation: {s['violation']}")
            if s["trace"]:  # none for a finding about the spec, made before exploring
                lines.append(f"  shortest trace ({_count(len(s['trace']) - 1, 'step')}):")
                lines += [f"    {step}" for step in s["trace"]]
        elif s["stopped"]:
            lines.append(f"  stopped: {s['stopped']}")
            lines.append("  no invariant violated in the states explored; NOT exhaustive")
        else:
            lines.append("  no invariant violated")
    lines += render_controls(result["controls"])
    return "\n".join(lines)


def _count(number: int, noun: str) -> str:
    """Return ``1 node`` or ``3 nodes``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _tree(nodes: int, shapes: list[str]) -> str:
    """Return how the report names a run's trees: ``1 node``, ``3 nodes (chain, fan-out)``.

    A single node has no shape to name.
    """
    return _count(nodes, "node") if nodes == 1 else f"{nodes} nodes ({', '.join(shapes)})"


def _bounds(bounds: dict[str, int]) -> str:
    """Return how the report names a run's counter ceilings: ``pins <= 2, locks <= 2``."""
    return ", ".join(f"{name} <= {most}" for name, most in bounds.items()) or "no counters"


def _symmetry(on: bool) -> str:
    """Return how the report names the symmetry reduction of a run."""
    return "symmetry reduced" if on else "no symmetry reduction"


def _title(spec: str, policy: str) -> str:
    """Return how a spec is named in the report: its path, and its policy if any."""
    return spec if policy == "none" else f"{spec} ({policy} policy)"


def handle(args: argparse.Namespace) -> int:
    """Run ``fsm-cache check`` and return its exit status.

    Raises:
        SpecError: ``--nodes`` is below 1 or above :data:`MAX_NODES`, a
            counter bound is negative or above :data:`MAX_BOUND`, or ``--no-controls`` is given to a run
            that has no controls (one of SPEC arguments or ``--ops``);
            nothing is loaded or checked. Or the
            ``--ops`` module names another spec or policy than the command
            line (:func:`with_ops`); nothing is checked.
    """
    if args.no_controls and (args.specs or args.ops is not None):
        raise SpecError(
            [
                "check: --no-controls skips the negative controls, which run only without "
                "SPEC arguments and --ops; this run has none to skip"
            ]
        )
    least = [("--nodes", args.nodes, 1), ("--max-pins", args.max_pins, 0)]
    least += [("--max-locks", args.max_locks, 0), ("--max-count", args.max_count, 0)]
    least.append(("--jobs", args.jobs, 1))
    for flag, value, bound in least:
        if value is not None and value < bound:
            raise SpecError([f"check: {flag} must be >= {bound}, got {value}"])
    for flag, value, _ in least[1:4]:
        if value is not None and value > MAX_BOUND:
            raise SpecError(
                [f"check: {flag} must be at most {MAX_BOUND}, got {value} ({TOO_HIGH_A_BOUND})"]
            )
    if args.nodes is not None and args.nodes > MAX_NODES:
        raise SpecError(
            [f"check: --nodes must be at most {MAX_NODES}, got {args.nodes} ({TOO_MANY_NODES})"]
        )
    if args.compositional:
        return compositional(args)
    if args.json:  # what an --ops module prints goes to stderr: stdout is the JSON alone
        with contextlib.redirect_stdout(sys.stderr):
            result = run(args)
    else:
        result = run(args)
    print(json.dumps(result, indent=2) if args.json else report(result))
    bad = any(s["violation"] for s in result["specs"])
    if bad or not all(c["ok"] for c in result["controls"]):
        return 1
    return STOPPED if any(s["stopped"] for s in result["specs"]) else 0


def compositional(args: argparse.Namespace) -> int:
    """Run ``check --compositional``: prove each SPEC for every tree size; return the exit status.

    A spec or option outside the class the method is sound for is refused
    first (:func:`~fsm_cache.modelcheck.views.refusal`). The method proves
    but does not refute: on a finding the enumerative check runs on 2, then
    3 nodes for a trace; without one the spec is "not proven". Exit status 1
    on a finding either way, else 0.

    Raises:
        SpecError: An option that does not apply, or no SPEC.
        NotCompositional: A spec or option outside the class.
    """
    given = {"--nodes": args.nodes, "--max-states": args.max_states}
    given |= {"--max-seconds": args.max_seconds, "--no-symmetry": args.no_symmetry or None}
    given |= {"--jobs": None if args.jobs == 1 else args.jobs}
    problems = [
        f"check: --compositional decides every tree size at once; {flag} does not apply"
        for flag, value in given.items()
        if value is not None
    ]
    if not args.specs and args.ops is None:  # an --ops module names its spec: refused below
        problems.append("check: --compositional needs SPEC arguments (it runs no controls)")
    if problems:
        raise SpecError(problems)
    problems = views.option_refusal({"--policy": args.policy, "--ops": args.ops})
    if problems:
        raise NotCompositional(problems)
    runs, ceiling, count = bounded_targets(args)
    planned = []
    for r, most in zip(runs, ceiling, strict=True):
        explorer, _ = prepare(r.spec, 2, Bounds(most, count), files=r.files)
        problems += views.refusal(r.name, explorer.layout)
        planned.append((r, most, explorer))
    if problems:
        raise NotCompositional(problems)
    out = []
    for r, most, explorer in planned:
        started = time.perf_counter()
        proof = views.Views(explorer).run()
        entry: dict[str, Any] = {"spec": r.name, "bounds": most, **vars(proof)}
        entry["unexplored"] = unexplored(r.spec, most, files=r.files)
        entry["wall_seconds"] = time.perf_counter() - started
        entry["trace"] = None
        for nodes in (2, 3) if proof.finding else ():
            plan = Search(
                r.spec,
                "none",
                nodes,
                most,
                Bounds(most, count),
                True,
                Budget(),
                args.progress,
                r.files,
                r.name,
            )
            entry["trace"] = search(plan)
            if entry["trace"]["violation"]:
                break
        out.append(entry)
    print(json.dumps(out, indent=2) if args.json else views.report(out, report, not_explored))
    return 1 if any(e["finding"] for e in out) else 0


def register(subparsers: Any) -> None:
    """Add the ``check`` subcommand."""
    parser = subparsers.add_parser(
        "check", help="model-check specs on a small tree", description=summary_line(__doc__)
    )
    parser.add_argument(
        "specs",
        nargs="*",
        type=spec_path,
        metavar="SPEC",
        help="spec .toml files, or fsm_cache:NAME for a shipped spec; default: the shipped "
        "specs and the negative controls",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        help=f"nodes in the tree (default {NODES}; {STORAGE_NODES} for a spec with a storage "
        f"region; at most {MAX_NODES})",
    )
    parser.add_argument(
        "--max-pins",
        type=int,
        help=f"pins per node at most (default {CEILING}; {STORAGE_PINS} for a spec with a storage region)",
    )
    parser.add_argument(
        "--max-locks",
        type=int,
        help=f"locks per node at most (default {CEILING}; {STORAGE_LOCKS} for a spec with a storage region)",
    )
    parser.add_argument(
        "--max-count", type=int, help=f"bound of any other counter (default {CEILING})"
    )
    parser.add_argument(
        "--max-states",
        type=int,
        metavar="N",
        help="stop after N states, not exhaustive (exit status 3); a check always stops "
        "while 1/16 of the memory (at least 1 GiB, or 1/4 under 4 GiB) is still free",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="stop each spec's search after S seconds, not exhaustive (exit status 3)",
    )
    parser.add_argument(
        "--policy",
        choices=tuple(POLICIES),
        help="the cache's write policy: none (every step the spec allows) or write_through "
        "(backups start where HiCache starts them; invariant 3 checked); default: none, and "
        f"without SPEC also the residency specs under write_through on {POLICY_NODES} nodes",
    )
    parser.add_argument(
        "--ops",
        type=path_text,
        metavar="FILE.py",
        help="a module replacing tree operations (insert, born, split, prune), wants_backup "
        "or match_prefix, checked on the spec its SPEC names under its POLICY (default: "
        "--policy); a SPEC argument or --policy naming another is an error",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="show progress on stderr: a bar on a terminal, else a line every "
        f"{PLAIN_EVERY:.0f} s (default: when stderr is a terminal)",
    )
    parser.add_argument(
        "--no-symmetry",
        action="store_true",
        help="explore every numbering of each tree as its own state (default: one state per "
        "tree up to interchangeable sibling subtrees; same verdicts, fewer states; an --ops "
        "module's hooks then see one numbering of each tree: one that reads slot numbers "
        "needs this)",
    )
    parser.add_argument(
        "--no-controls",
        action="store_true",
        help="skip the negative controls (they run only without SPEC and --ops)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N searches at once, each in its own process (default 1); the report "
        "is the same; every search stops at the same machine-wide memory floor",
    )
    parser.add_argument(
        "--compositional",
        action="store_true",
        help="prove each SPEC for every tree size at once from neighbourhood views (no "
        "--nodes); a residency spec (host and device, and storage or no other region) without "
        "--policy or --ops, else refused; on a finding, a trace from 2 or 3 nodes, or 'not proven' (exit 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=handle)
