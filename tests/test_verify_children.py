"""fsm-cache verify gives a record as many children as its spec's children rules tell apart.

With one child, code that reads only the first child, or every child where
the spec says "any child", answered every input as the spec does and was
confirmed; with a family's children over one state per class of the rules,
code that tests a later child against the first state of a rule's list
only. These slips are planted in the tree test the engine's code calls.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import inspect
import itertools
import shutil
import sys
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from tier_specs import TIER

from fsm_cache.contracts import exhaustive, verify
from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.contracts.generate import (
    NEIGHBOURS,
    Generated,
    children_needed,
    family_states,
    generate,
    parameter,
)
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import System, as_system
from fsm_cache.spec.shipped import load_shipped, residency_system, spec_dir


_IMPORT = (
    "from fsm_cache.engine.runtime import child_in as _child_in, effect_failed as _effect_failed\n"
)
_SLIPS = {
    "first": (
        "def _child_in(rec, region, states):\n"
        "    return bool(rec.children) and getattr(rec.children[0], region) in states\n"
    ),
    "every": (
        "def _child_in(rec, region, states):\n"
        "    kids = rec.children\n"
        "    return bool(kids) and all(getattr(kid, region) in states for kid in kids)\n"
    ),
    "later": (
        "def _child_in(rec, region, states):\n"
        "    kids = rec.children\n"
        "    return bool(kids) and (\n"
        "        getattr(kids[0], region) in states\n"
        "        or any(getattr(kid, region) == states[0] for kid in kids[1:])\n"
        "    )\n"
    ),
    "first_two": (
        "def _child_in(rec, region, states):\n"
        "    return any(getattr(kid, region) in states for kid in list(rec.children)[:2])\n"
    ),
}
"""The tree test read as the first child alone, or as every child, for any child; or
with a later child tested against the first state of the condition's list only; or
reading only as many children as the rules tell apart (two)."""


def _with_slip(module: Generated, slip: str) -> Generated:
    """Return ``module`` with its tree test ``_child_in`` replaced by ``slip``."""
    assert _IMPORT in module.source
    replaced = "from fsm_cache.engine.runtime import effect_failed as _effect_failed\n"
    return dataclasses.replace(
        module, source=module.source.replace(_IMPORT, replaced + _SLIPS[slip])
    )


def _slipped(tmp_path: Path, module: Generated, slip: str) -> Path:
    """Write ``module`` with its tree test ``_child_in`` replaced by ``slip``."""
    path = tmp_path / "contracts_slipped.py"
    path.write_text(_with_slip(module, slip).source)
    return path


def _every(system: System, spec: Path, slip: str) -> Callable[[Collection[str]], Generated]:
    """Return the module ``every_family`` checks (each of ``without_extra``), ``slip`` planted."""

    def module(without_extra: Collection[str]) -> Generated:
        return _with_slip(generate(system, spec, without_extra=without_extra), slip)

    return module


def _storage() -> System:
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    return storage


def test_the_shipped_specs_children_rules_take_two_children() -> None:
    storage = _storage()
    needed = {event: children_needed(storage, event) for event in storage.event_names}
    reading = {"evict_host", "load_failed", "fetch_failed", "evict_device", "evict_storage"}
    assert {event for event, n in needed.items() if n} == reading
    assert {needed[event] for event in reading} == {2}
    # writing, backed and pinned refuse evict_host, fetching too; the rest do not
    assert family_states(storage, "evict_host", "host") == ("unbacked", "writing", "fetching")


# Each event that reads a child, on the first input (in the order the domains are
# walked) where the slip answers otherwise than the spec: a child that does not
# meet the rule before one that does, or one that does before one that does not.
_FIRST = {
    "evict_host": "host=HostState.backed, device=DeviceState.resident, "
    "storage=StorageState.unstored, pins=0, locks=0, child1_host=HostState.unbacked, "
    "child2_host=HostState.unbacked, child3_host=HostState.writing",
    "load_failed": "host=HostState.pinned, device=DeviceState.loading, "
    "storage=StorageState.unstored, pins=1, locks=0, "
    "child1_device=DeviceState.absent, child2_device=DeviceState.resident, child3_device=None",
}
_EVERY = {
    "evict_host": "host=HostState.backed, device=DeviceState.resident, "
    "storage=StorageState.unstored, pins=0, locks=0, child1_host=HostState.unbacked, "
    "child2_host=HostState.unbacked, child3_host=HostState.writing",
    "load_failed": "host=HostState.pinned, device=DeviceState.loading, "
    "storage=StorageState.unstored, pins=1, locks=0, child1_device=DeviceState.resident, "
    "child2_device=DeviceState.resident, child3_device=DeviceState.absent",
}

_FIRST_TWO = {
    "evict_host": "host=HostState.backed, device=DeviceState.resident, "
    "storage=StorageState.unstored, pins=0, locks=0, child1_host=HostState.unbacked, "
    "child2_host=HostState.unbacked, child3_host=HostState.writing",
    "load_failed": "host=HostState.pinned, device=DeviceState.loading, "
    "storage=StorageState.unstored, pins=1, locks=0, child1_device=DeviceState.absent, "
    "child2_device=DeviceState.absent, child3_device=DeviceState.resident",
}


@pytest.mark.parametrize(
    ("slip", "calls"), [("first", _FIRST), ("every", _EVERY), ("first_two", _FIRST_TWO)]
)
def test_every_input_finds_code_that_reads_children_otherwise_than_any(
    tmp_path: Path, slip: str, calls: dict[str, str]
) -> None:
    """The slip is in the tree test: checked in the events that call it.

    The module's other events never read a child (the test above); they are
    the shipped code, which the verify stage checks whole. The slips read
    children alone, so each counter is given only the values the code
    compares it with (which :func:`exhaustive.check_module` adds to any
    domain: pins 0 to 3, locks 0 to 2), not the spec's beyond them: each first
    counterexample below is at values among those, and it comes first in the
    smaller product too, walked in the same order.
    """
    storage = _storage()
    module = generate(storage, spec_dir() / "residency_storage.toml")
    path = _slipped(tmp_path, module, slip)
    reading = {f"_event_{e}" for e in storage.event_names if children_needed(storage, e)}
    counters = dict.fromkeys(exhaustive.counter_domains(storage), (0,))
    assert exhaustive.widened(counters, path) == {"pins": (0, 1, 2, 3), "locks": (0, 1, 2)}
    rows = [module.reported(r) for r in exhaustive.check_module("slipped", path, counters, reading)]
    bad = {r.function: r for r in rows if r.failed}
    assert {r.contract for r in bad.values()} == {"the step follows the spec"}
    assert {r.status for r in bad.values()} == {crosshair_run.COUNTEREXAMPLE}
    assert set(bad) == {
        "evict_host",
        "load_failed",
        "fetch_failed",
        "evict_device",
        "evict_storage",
    }
    for event, call in calls.items():
        assert bad[event].detail == f"{event}({call})"


def test_crosshair_finds_code_that_reads_only_the_first_child(tmp_path: Path) -> None:
    """The two-region composition is proved by CrossHair: it is given two children as well."""
    module = generate(residency_system(), spec_dir() / "residency.toml", classes=True)
    reading = ("evict_device",)  # the cheapest to search of the three that read a child
    path = _slipped(tmp_path, module, "first")
    # keep, of the checked functions, one that reads a child, so CrossHair searches it alone
    blocks = path.read_text().split("\n\n\n\n")
    kept = [
        b for b in blocks if "def _event_" not in b or any(f"def _event_{e}(" in b for e in reading)
    ]
    assert len(kept) == len(blocks) - len(module.functions) + len(reading)
    path.write_text("\n\n\n\n".join(kept))
    rows = [
        module.reported(r)
        for r in crosshair_run.prove("residency", path, crosshair_run.Options(), by_function=True)
    ]
    bad = [r for r in rows if r.failed]
    assert {(r.function, r.contract, r.status) for r in bad} == {
        (event, "the step follows the spec", crosshair_run.COUNTEREXAMPLE) for event in reading
    }
    # the one family the slip answers otherwise: a child off the device before one on it
    (row,) = bad
    assert row.detail.endswith(", DeviceState.absent, DeviceState.resident)"), row
    assert {r.status for r in rows if not r.failed} == {crosshair_run.CONFIRMED}


_THREE_CHILDREN = """
[composition]
name = "three_children"
label = "node"
doc = "Residency with a rule that only three children, each in its own host state, meet."

[composition.regions]
host = "host_residency.toml"
device = "device_residency.toml"

[[forbid]]
event = "evict_host"
when = ["any child host in [writing]", "any child host in [backed]", "any child host in [pinned]"]
error = "NotAHostLeaf"
reason = "children write, hold and pin host copies under this node"
"""


def test_a_rule_that_takes_three_children_is_given_three(tmp_path: Path) -> None:
    """One child, or a constant two, never fired this refusal: code that lost it passed.

    The rule reads children alone, so each counter is given only the values
    the code compares it with (pins and locks 0 to 2, which
    :func:`exhaustive.check_module` adds to any domain), not the spec's
    beyond them: the refusal lost is met at pins 0, and comes first in the
    smaller product too, walked in the same order.
    """
    for name in ("host_residency.toml", "device_residency.toml"):
        shutil.copy(spec_dir() / name, tmp_path / name)
    spec = tmp_path / "three_children.toml"
    spec.write_text(_THREE_CHILDREN)
    system = as_system(load_spec(spec))
    assert children_needed(system, "evict_host") == 3
    assert (
        "child1_host: _Optional[_HostState], child2_host: _Optional[_HostState_evict_host], "
        "child3_host: _Optional[_HostState_evict_host]) -> _Result:"
        in generate(system, spec, classes=True).source
    )
    module = generate(system, spec)
    assert (
        "child1_host: _Optional[_HostState], child2_host: _Optional[_HostState], "
        "child3_host: _Optional[_HostState], child4_host: _Optional[_HostState_evict_host]) "
        "-> _Result:" in module.source
    )
    domains = dict.fromkeys(exhaustive.counter_domains(system), (0,))
    clean = module.write(tmp_path)
    assert exhaustive.widened(domains, clean) == {"pins": (0, 1, 2), "locks": (0, 1, 2)}
    assert not [r for r in exhaustive.check_module("clean", clean, domains) if r.failed]
    dropped = module.source.replace(
        "_child_in(rec, 'host', ('writing',)) and _child_in(rec, 'host', ('backed',))", "False", 1
    )
    assert dropped != module.source
    path = tmp_path / "contracts_dropped.py"
    path.write_text(dropped)
    bad = [module.reported(r) for r in exhaustive.check_module("dropped", path, domains)]
    assert [(r.function, r.contract, r.detail) for r in bad if r.failed] == [
        (
            "evict_host",
            "the step follows the spec",
            "evict_host(host=HostState.backed, device=DeviceState.resident, pins=0, locks=0, "
            "child1_host=HostState.unbacked, child2_host=HostState.writing, "
            "child3_host=HostState.backed, child4_host=HostState.pinned)",
        )
    ]


def test_every_family_finds_a_later_child_read_against_the_first_state_only(
    tmp_path: Path,
) -> None:
    """CrossHair's classes (``unbacked``, ``writing``) never meet the slip; every state does.

    ``evict_host`` is refused when any child's host is in ``[writing, backed,
    pinned]``, and the slip tests a later child against ``writing`` alone, as
    a review found ``verify`` passed it.
    """
    system = residency_system()
    spec = spec_dir() / "residency.toml"
    domains = exhaustive.counter_domains(system)
    classes = _with_slip(generate(system, spec, classes=True), "later")
    rows = exhaustive.check_module("residency", classes.write(tmp_path), domains)
    assert [r for r in rows if r.failed] == []
    found = [
        classes.reported(r)
        for r in verify.every_family(system, _every(system, spec, "later"), tmp_path, rows)
    ]
    assert len(found) == len(rows)
    bad = {r.function: r for r in found if r.failed}
    assert sorted(bad) == ["evict_device", "evict_host", "load_failed"]
    assert {(r.contract, r.status) for r in bad.values()} == {
        ("the step follows the spec", crosshair_run.COUNTEREXAMPLE)
    }
    assert bad["evict_host"].detail == (
        "evict_host(host=HostState.backed, device=DeviceState.resident, pins=0, locks=0, "
        "child1_host=HostState.unbacked, child2_host=HostState.backed, child3_host=None)"
    )


def test_one_child_more_than_the_rules_tell_apart_finds_code_that_reads_only_so_many(
    tmp_path: Path,
) -> None:
    """Code that reads only the first two children answers every family of two as the spec does.

    The rules tell two children apart, so families of two never showed it;
    every family is also given a third child (one state per class), whose
    ``writing`` below two that meet no rule finds it.
    """
    system = residency_system()
    spec = spec_dir() / "residency.toml"
    domains = exhaustive.counter_domains(system)
    classes = _with_slip(generate(system, spec, classes=True), "first_two")
    assert "child3_host" not in classes.source  # CrossHair's families stay at two
    rows = exhaustive.check_module("residency", classes.write(tmp_path), domains)
    assert [r for r in rows if r.failed] == []
    found = [
        classes.reported(r)
        for r in verify.every_family(system, _every(system, spec, "first_two"), tmp_path, rows)
    ]
    bad = {r.function: r for r in found if r.failed}
    assert sorted(bad) == ["evict_device", "evict_host", "load_failed"]
    assert {(r.contract, r.status) for r in bad.values()} == {
        ("the step follows the spec", crosshair_run.COUNTEREXAMPLE)
    }
    assert bad["evict_host"].detail == (
        "evict_host(host=HostState.backed, device=DeviceState.resident, pins=0, locks=0, "
        "child1_host=HostState.unbacked, child2_host=HostState.unbacked, "
        "child3_host=HostState.writing)"
    )
    assert (
        "child1_host: _Optional[_HostState], child2_host: _Optional[_HostState], "
        "child3_host: _Optional[_HostState_evict_host]) -> _Result:"
        in generate(system, spec).source
    )
    (tmp_path / "clean").mkdir()
    clean = generate(system, spec).write(tmp_path / "clean")
    checked = exhaustive.check_module("clean", clean, domains)
    assert [r for r in checked if r.failed] == []


def _reference(
    path: Path, counters: Mapping[str, Sequence[int]], functions: Collection[str]
) -> list[crosshair_run.Row]:
    """Return :func:`exhaustive.check_module`'s rows as its docstring defines them, slowly.

    Every input of the parameters' product, in its order (a neighbour's
    states all ``None`` or none, else not an input), is counted; those every
    precondition holds on are called, and each postcondition is evaluated on
    the result by name until its first counterexample.
    """
    counters = exhaustive.widened(counters, path)
    loaded = importlib.util.spec_from_file_location("_reference_contracts", path)
    assert loaded is not None
    assert loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module
    try:
        loaded.loader.exec_module(module)
    finally:
        del sys.modules[loaded.name]
    by_param = {parameter(name): values for name, values in counters.items()}

    def domain(name: str, hint: Any) -> Sequence[Any]:
        if hint is int:
            return by_param[name]
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        return (None, *members[0]) if members else tuple(hint)

    def shown(func: Any, args: Mapping[str, Any]) -> str:
        text = ", ".join(
            f"{k}={type(v).__name__}.{v.name}" if isinstance(v, enum.Enum) else f"{k}={v!r}"
            for k, v in args.items()
        )
        return f"{func.__name__}({text})"

    def holds(contract: Any, given: Mapping[str, Any]) -> bool:
        return bool(contract.condition(**{a: given[a] for a in contract.condition_args}))

    rows = []
    for name in dict.fromkeys(c.function for c in crosshair_run.contracts(path)):
        if name not in functions:
            continue
        func = vars(module)[name]
        raw = inspect.unwrap(func)
        hints = typing.get_type_hints(raw)
        names = list(inspect.signature(func).parameters)
        groups = vars(module)[NEIGHBOURS].get(name, ())
        pre = [c for group in func.__preconditions__ for c in group]
        post = func.__postconditions__
        found: dict[int, str] = {}
        size = 0
        for values in itertools.product(*(domain(n, hints[n]) for n in names)):
            args = dict(zip(names, values, strict=True))
            if any(len({args[n] is None for n in group}) > 1 for group in groups):
                continue
            size += 1
            if len(found) == len(post) or not all(holds(c, args) for c in pre):
                continue
            try:
                result = raw(**args)
            except Exception as exc:
                for i in range(len(post)):
                    found.setdefault(i, f"{shown(func, args)} raises {type(exc).__name__}: {exc}")
                continue
            for i, c in enumerate(post):
                if i not in found and not holds(c, {**args, "result": result}):
                    found[i] = shown(func, args)
        rows += [
            crosshair_run.Row("ref", name, c.description, crosshair_run.COUNTEREXAMPLE, found[i])
            if i in found
            else crosshair_run.Row(
                "ref", name, c.description, exhaustive.CONFIRMED_EVERY_INPUT, f"{size} inputs"
            )
            for i, c in enumerate(post)
        ]
    return rows


def test_every_input_gives_the_rows_of_the_parameters_product_walked_by_name(
    tmp_path: Path,
) -> None:
    """The checker reads each condition's arguments by position off one list per input.

    Its rows (each contract's verdict, its first counterexample, the inputs
    counted) are those of the product of the parameters' domains walked
    input by input, each condition called by name; the functions that read
    children take neighbours all ``None`` or none, and the slip breaks one
    contract of one while the others hold. One function that reads children
    (their axes, the slip's counterexample) and one that reads none (its
    counter's constants widened) show each way an input is walked.
    """
    system = residency_system()
    path = _slipped(tmp_path, generate(system, spec_dir() / "residency.toml"), "later")
    functions = {"_event_evict_device", "_event_release"}
    domains = exhaustive.counter_domains(system)
    rows = exhaustive.check_module("ref", path, domains, functions)
    assert rows == _reference(path, domains, functions)
    assert {r.function for r in rows if r.failed} == {"_event_evict_device"}
    assert {r.function for r in rows if not r.failed} == functions


_BAD_LATER = ["evict_device", "evict_host", "load_failed"]


@pytest.mark.parametrize(
    ("slip", "bad"),
    [("first_two", ["evict_device", "load_failed"]), ("later", _BAD_LATER)],
)
def test_a_function_past_max_inputs_is_checked_without_its_extra_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slip: str, bad: list[str]
) -> None:
    """The extra child took a function's inputs past the most called: ``not analysed``, exit 1.

    With at most 20,000 inputs, ``evict_host`` (32,400 with a third child,
    10,800 without) is checked without it, and says so; ``load_failed`` and
    ``evict_device`` (14,400) keep theirs, so the slip that reads only the
    first two children is still found there, and every state of two children
    still finds the slip that reads a later child against ``writing`` alone.
    """
    monkeypatch.setattr(exhaustive, "MAX_INPUTS", 20_000)
    system = residency_system()
    spec = spec_dir() / "residency.toml"
    domains = exhaustive.counter_domains(system)
    classes = generate(system, spec, classes=True)
    rows = exhaustive.check_module("residency", classes.write(tmp_path), domains)
    assert [r for r in rows if r.failed] == []
    found = [
        classes.reported(r)
        for r in verify.every_family(system, _every(system, spec, slip), tmp_path, rows)
    ]
    assert len(found) == len(rows)
    failed = {r.function: r for r in found if r.failed}
    assert sorted(failed) == bad
    assert {r.status for r in failed.values()} == {crosshair_run.COUNTEREXAMPLE}
    note = "families without their extra child (32400 inputs with it, more than 20000)"
    host = [r for r in found if r.function == "evict_host"]
    assert len(host) == 6
    assert all(r.detail.endswith(f"; {note}") for r in host)
    assert not [r for r in found if r.function != "evict_host" and "extra" in r.detail]
    if "evict_host" in failed:
        assert failed["evict_host"].detail == (
            "evict_host(host=HostState.backed, device=DeviceState.resident, pins=0, "
            f"locks=0, child1_host=HostState.unbacked, child2_host=HostState.backed); {note}"
        )


_TWO_REGIONS = """
[composition]
extends = "fsm_cache:residency"
name = "two_child_regions"

[[forbid]]
event = "evict_host"
when = "any child device in [loading]"
error = "CopyInFlight"
reason = "a child is loading"
"""


def test_a_spec_whose_rules_read_two_regions_of_the_children_is_checked_whole(
    tmp_path: Path,
) -> None:
    """A user's spec passed, then its ``evict_host`` was ``not analysed`` (1,555,200 inputs).

    Each child's host and device were counted apart, ``None`` beside a
    state (the extra child's 3 x 3 where 2 x 2 + 1 are called): counted as
    called, 384,000, it is checked with its extra child.
    """
    spec = tmp_path / "two.toml"
    spec.write_text(_TWO_REGIONS)
    system = as_system(load_spec(spec))
    module = generate(system, spec).write(tmp_path)
    domains = exhaustive.counter_domains(system)
    rows = exhaustive.check_module("two", module, domains, functions=["_event_evict_host"])
    assert {r.verdict() for r in rows} == {
        f"{exhaustive.CONFIRMED_EVERY_INPUT}: {300 * (5 * 3 + 1) ** 2 * (2 * 2 + 1)} inputs"
    }


_TIERS = """
[composition]
name = "tiers"
label = "node"
doc = "A tier whose copies are prefix-closed, beside another."

[composition.regions]
tier = "tier.toml"
mark = "mark.toml"

[[forbid]]
event = "drop"
when = "any child tier in [filling, full]"
error = "NotAHostLeaf"
reason = "a child still has a copy in the tier"
"""


def test_verify_finds_a_later_child_read_against_the_first_state_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec CrossHair proves, run as ``fsm-cache verify`` runs it, with the slip planted.

    CrossHair proves ``drop`` over the classes ``empty`` and ``filling``, which
    the slip (a later child tested against ``filling`` alone) answers as the
    spec does; a child ``full`` after an ``empty`` one is refused by the spec
    and not by the slip.
    """
    for name in ("tier", "mark"):
        (tmp_path / f"{name}.toml").write_text(TIER.format(name=name))
    spec = tmp_path / "tiers.toml"
    spec.write_text(_TIERS)

    def slipped(*args: Any, **kwargs: Any) -> Generated:
        return _with_slip(generate(*args, **kwargs), "later")

    monkeypatch.setattr(verify, "generate", slipped)
    rows = verify.verify_spec(spec, crosshair_run.Options(), tmp_path)
    assert [(r.function, r.contract, r.status, r.detail) for r in rows if r.failed] == [
        (
            "drop",
            "the step follows the spec",
            crosshair_run.COUNTEREXAMPLE,
            "drop(tier=TierState.filling, mark=MarkState.filling, "
            "child1_tier=TierState.empty, child2_tier=TierState.full, child3_tier=None)",
        )
    ]
    assert {r.status for r in rows if not r.failed} == {crosshair_run.CONFIRMED}
    assert len(rows) == 6


@pytest.mark.parametrize(
    ("first", "second", "kept"),
    [
        (crosshair_run.CONFIRMED, crosshair_run.COUNTEREXAMPLE, "second"),
        (crosshair_run.CONFIRMED, crosshair_run.NOT_ANALYSED, "second"),
        (crosshair_run.WITHIN_BUDGET, crosshair_run.COUNTEREXAMPLE, "second"),
        (crosshair_run.NOT_ANALYSED, crosshair_run.WITHIN_BUDGET, "first"),
        (crosshair_run.COUNTEREXAMPLE, crosshair_run.COUNTEREXAMPLE, "first"),
        (crosshair_run.CONFIRMED, exhaustive.CONFIRMED_EVERY_INPUT, "first"),
    ],
)
def test_a_contract_keeps_the_worse_of_two_verdicts(first: str, second: str, kept: str) -> None:
    """CrossHair's verdict over the classes, and every family's: a failure of either fails it."""
    rows = {
        "first": crosshair_run.Row("t", "f", "c", first, "f(1)"),
        "second": crosshair_run.Row("t", "f", "c", second, "f(2)"),
    }
    assert crosshair_run.worse(rows["first"], rows["second"]) is rows[kept]
