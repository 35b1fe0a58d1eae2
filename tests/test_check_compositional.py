"""``fsm-cache check --compositional``: the neighbourhood-view fixpoint (fsm_cache.modelcheck.views)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import NotCompositional
from fsm_cache.modelcheck import views
from fsm_cache.modelcheck.budget import Budget
from fsm_cache.modelcheck.check import check_spec, prepare
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout, Nodes, children
from fsm_cache.spec.controls import Control, controls, load_finding
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import spec_dir


SPECS = spec_dir()
RESIDENCY = SPECS / "residency.toml"
STORAGE = SPECS / "residency_storage.toml"
BOUNDS = Bounds({"pins": 2, "locks": 2})
SMALL = Bounds({"pins": 1, "locks": 1})
"""Bounds for the storage spec's controls and mutations: each is found at them, enumeratively
too, in a fraction of the time (a finding may come only after most of the views)."""
ENUMERATIVE = "use the enumerative check (fsm-cache check without --compositional)"


Fixpoint = tuple[views.Views, views.Proof]


@pytest.fixture(scope="module")
def fixpoints() -> Callable[[Path], Fixpoint]:
    """The fixpoint of a shipped spec, pins and locks up to 2, made once per module.

    About 1 s for the residency spec, 16 s for the storage spec.
    """
    made: dict[Path, Fixpoint] = {}

    def of(spec: Path) -> Fixpoint:
        if spec not in made:
            explorer, _ = prepare(spec, 2, BOUNDS)
            found = views.Views(explorer)
            made[spec] = found, found.run()
        return made[spec]

    return of


def project(found: views.Views, nodes: Nodes) -> list[views.View]:
    """Return the view of every node of a model state, as the fixpoint abstracts it."""
    layout, trees = found.layout, found.trees
    out = []
    for i, e in enumerate(nodes):
        if e is None:
            continue
        kids = [nodes[c] for c in children(nodes, i)]
        atoms = 0
        for k in kids:
            assert k is not None
            atoms |= found.info(trees.lid(k[1:]))[4]
        up = nodes[int(e[0])] if int(e[0]) >= 0 else None
        ps = -1 if up is None else trees.stid[trees.lid(up[1:])]
        ksum = sum(layout.counter(k, "locks") for k in kids if k is not None)
        busy = int(any(layout.unsettled(k) for k in kids if k is not None))
        out.append((ps, trees.lid(e[1:]), atoms, int(bool(kids)), ksum, busy))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "nodes", "most", "least"),
    [
        (RESIDENCY, 3, None, 50_000),
        (RESIDENCY, 4, 30_000, 30_000),
        (STORAGE, 2, None, 7_000),
        (STORAGE, 3, 30_000, 30_000),
    ],
    ids=["residency-3", "residency-4-first", "storage-2", "storage-3-first"],
)
def test_every_explored_state_projects_into_the_fixpoint(
    fixpoints: Callable[[Path], Fixpoint], spec: Path, nodes: int, most: int | None, least: int
) -> None:
    found, proof = fixpoints(spec)
    assert proof.finding is None
    explorer, start = prepare(spec, nodes, BOUNDS)
    result, states = explorer.reachable(start, Budget(max_states=most))
    assert bool(result.stopped) == (most is not None)
    assert len(states) >= least
    outside = {v for s in states for v in project(found, s)} - found.seen
    assert [found.show(v) for v in outside] == []


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "least"), [(RESIDENCY, 1000), (STORAGE, 40_000)])
def test_the_shipped_spec_holds_for_every_tree_size(
    fixpoints: Callable[[Path], Fixpoint], spec: Path, least: int
) -> None:
    found, proof = fixpoints(spec)
    assert (proof.finding, proof.view) == (None, "")
    assert proof.views == len(found.seen) > least


def covered(control: Control) -> bool:
    """Whether a check control is a .toml spec the compositional check takes."""
    if control.path.suffix != ".toml":
        return False
    loaded, _ = load_finding(control.path)
    assert loaded is not None
    return not views.refusal(control.path, Layout.of(as_system(loaded[0])))


TOML = [c for c in controls(tools=("check",)) if c.path.suffix == ".toml"]
"""The .toml check controls: every one is covered (:func:`test_every_toml_control_is_covered`).

Which are covered is asked there, not at collection (each worker collects the
module): :func:`test_a_covered_control_is_a_finding_never_a_proof` takes
every one, and its :class:`~fsm_cache.modelcheck.views.Views` refuses one
that is not (:func:`views.refusal`)."""
SLOW = {"fetch_failed_refused_on_device.toml"}  # a liveness finding after every view


def finding_class(finding: str) -> str:
    """Return a finding's class: ``invariant 6``, ``liveness``, ``copy load``, ``valid data``."""
    return finding.removeprefix("check: violation: ").split(":")[0]


@pytest.mark.parametrize(
    "control",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW else []) for c in TOML],
)
def test_a_covered_control_is_a_finding_never_a_proof(control: Control) -> None:
    """A two-region control is a finding of the enumerative check's class; a storage one, a finding.

    The views of a storage spec may stop at an earlier step of the same bug
    (a node holding its data in storage alone over a child holding a copy,
    before that node loses its data), or at another invariant it breaks.
    """
    loaded, _ = load_finding(control.path)
    assert loaded is not None
    storage = "storage" in control.path.read_text()
    explorer, _ = prepare(control.path, 2, SMALL if storage else BOUNDS, files=loaded[1])
    proof = views.Views(explorer).run()
    assert proof.finding is not None
    if not explorer.layout.has("storage"):
        assert finding_class(proof.finding) == finding_class(control.expected)


FINDING = """
from fsm_cache.modelcheck import views
from fsm_cache.modelcheck.check import prepare
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.spec.controls import controls, load_finding
(c,) = [c for c in controls(tools=("check",)) if c.name == "evict_host_leaves_writing.toml"]
explorer, _ = prepare(c.path, 2, Bounds({"pins": 2, "locks": 2}), files=load_finding(c.path)[0][1])
proof = views.Views(explorer).run()
print(proof.views, proof.finding, proof.view)
"""


def test_a_finding_and_its_view_do_not_depend_on_the_hash_seed() -> None:
    """The views explored before a finding, and the one shown, followed the order of sets.

    Under three hash seeds the same control stopped after 102, 99 and 58 views
    and showed three different parents.
    """
    runs = {
        subprocess.run(
            [sys.executable, "-c", FINDING],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(runs) == 1
    assert "invariant 5" in runs.pop()


def test_every_toml_control_is_covered() -> None:
    # the 12 two-region controls and the 7 with a storage region
    found = [c for c in controls(tools=("check",)) if covered(c)]
    assert found == TOML
    assert len(found) == 19
    assert sum((c.path.parent / c.path.name).read_text().count("storage") > 0 for c in found) >= 7


def test_a_finding_is_reported_with_the_enumerative_trace_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = SPECS / "bugs_detected" / "write_failed_lands_backed.toml"
    assert main(["check", "--compositional", str(path)]) == 1
    out = capsys.readouterr().out
    assert "  compositional finding: valid data: node 0: write_failed marks" in out
    assert "  found by the enumerative check on 2 nodes:\n" in out
    assert "        node 0: write_failed\n" in out


def planted(tmp_path: Path, old: str, new: str) -> Path:
    """Write residency.toml with its device machine's ``old`` text replaced by ``new``."""
    device = (SPECS / "device_residency.toml").read_text()
    assert old in device
    (tmp_path / "device.toml").write_text(device.replace(old, new, 1))
    (tmp_path / "host_residency.toml").write_text((SPECS / "host_residency.toml").read_text())
    text = RESIDENCY.read_text().replace('"device_residency.toml"', '"device.toml"')
    (tmp_path / "spec.toml").write_text(text)
    return tmp_path / "spec.toml"


LOCK = 'event = "lock"\nsource = "resident"\ndest = "resident"\nupdate = "locks += 1"\n'


def test_a_lock_that_skips_the_ancestors_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = planted(tmp_path, LOCK + 'propagate = "ancestors"\n', LOCK)
    assert main(["check", "--compositional", str(path)]) == 1
    out = capsys.readouterr().out
    assert "  compositional finding: invariant 6: locks is " in out
    assert "violation: invariant 6: node 0: locks is 0 but its holders account for 1" in out


def test_a_propagating_step_of_two_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = planted(tmp_path, 'update = "locks += 1"\npropagate', 'update = "locks += 2"\npropagate')
    assert main(["check", "--compositional", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: check --compositional: {path}: side condition 2 (propagation): device "
        "transition lock from resident to resident propagates (locks += 2), not as a self-loop "
        f"moving one counter by 1; {ENUMERATIVE}\n"
    )


def test_a_spec_without_residency_regions_is_refused_naming_its_condition(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = SPECS / "host_residency.toml"
    assert main(["check", "--compositional", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: check --compositional: {path}: side condition 4 (residency regions): its "
        "regions are state, not host and device with pins and locks, and no other but storage; "
        f"{ENUMERATIVE}\n"
    )


def test_a_write_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--compositional", "--policy", "write_through", str(RESIDENCY)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: check --compositional: --policy write_through: side condition 5 (no write "
        "policy): a policy's acknowledgements change several nodes' states at once; "
        f"{ENUMERATIVE}\n"
    )


def test_an_ops_module_is_refused_for_what_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An ``--ops`` module names its spec, yet the refusal asked for SPEC arguments."""
    ops = tmp_path / "ops_rec.py"
    ops.write_text('SPEC = "fsm_cache:residency"\n')
    assert main(["check", "--compositional", "--ops", str(ops)]) == 2
    assert capsys.readouterr().err == (
        f"error: check --compositional: --ops {ops}: side condition 6 (the checker's own tree "
        "operations): an ops module's hooks may read or change any node; "
        f"{ENUMERATIVE}\n"
    )


def test_a_tree_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--compositional", "--nodes", "5", str(RESIDENCY)]) == 2
    assert capsys.readouterr().err == (
        "error: check: --compositional decides every tree size at once; --nodes does not apply\n"
    )


def test_views_refuse_an_explorer_of_a_spec_outside_the_class() -> None:
    explorer, _ = prepare(SPECS / "host_residency.toml", 2, BOUNDS)
    with pytest.raises(NotCompositional, match=r"side condition 4 \(residency regions\)"):
        views.Views(explorer)


def test_a_finding_without_an_enumerative_trace_is_not_proven_with_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host = SPECS / "host_residency.toml"
    monkeypatch.setattr(views, "refusal", lambda _path, _layout: [])
    monkeypatch.setattr(views.Views, "__init__", lambda self, _explorer: None)
    monkeypatch.setattr(views.Views, "run", lambda _self: views.Proof(7, "invariant 6: x", "", 0.0))
    assert main(["check", "--compositional", str(host)]) == 1
    out = capsys.readouterr().out
    assert out.endswith(
        "  compositional finding: invariant 6: x\n"
        "  not proven: the enumerative check on 2 and 3 nodes finds no violation (the views "
        "over-approximate; try more nodes without --compositional)\n"
    )
    assert "  views explored: 7\n" in out


LOAD_PIN_HELD = (
    '\n[[forbid]]\nevent = "release"\nwhen = "device in [loading]"\nguard = "pins == 2"\n'
    'error = "LoadPinHeld"\nreason = "a client that pinned a loading node never releases"\n'
)


def test_a_proof_under_a_ceiling_that_cuts_a_guard_says_what_it_left_unexplored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pins == 2`` turns at 3: a proof under ``--max-pins 1`` says so, as the enumerative check does."""
    path = planted(tmp_path, LOCK, LOCK)  # the shipped spec, copied
    path.write_text(path.read_text() + LOAD_PIN_HELD)
    assert main(["check", "--compositional", str(path), "--max-pins", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        f"{path}: every tree size (compositional), pins <= 1, locks <= 2",
        "  not explored: pins above 1, where a comparison turns at 3 (--max-pins 3 reaches it)",
    ]
    assert out[-1] == "  no invariant violated: holds for every tree size"
    assert main(["check", "--compositional", str(path), "--max-pins", "1", "--json"]) == 0
    assert [e["unexplored"] for e in json.loads(capsys.readouterr().out)] == [{"pins": 3}]
    assert main(["check", "--compositional", str(RESIDENCY), "--json"]) == 0
    assert [e["unexplored"] for e in json.loads(capsys.readouterr().out)] == [{}]


LOCK_LOADING = 'event = "lock"\nsource = "loading"\ndest = "loading"\nupdate = "locks += 1"\n'


def test_a_propagating_event_that_changes_an_ancestors_states_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A lock fired at a resident node propagates; a loading ancestor takes the
    # event's other transition and leaves loading, which its children read.
    moved = LOCK_LOADING.replace('dest = "loading"', 'dest = "resident"')
    path = planted(tmp_path, LOCK_LOADING + 'propagate = "ancestors"\n', moved)
    assert main(["check", "--compositional", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: check --compositional: {path}: side condition 2 (propagation): device "
        "transition lock from loading to resident changes the states of the ancestors lock "
        f"propagates to (they take it too), not as a self-loop; {ENUMERATIVE}\n"
    )


def test_a_propagating_event_with_an_effect_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = planted(
        tmp_path,
        LOCK + 'propagate = "ancestors"\n',
        LOCK + 'propagate = "ancestors"\neffect = "free_host"\n',
    )
    assert main(["check", "--compositional", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: check --compositional: {path}: side condition 2 (propagation): device "
        "transition lock from resident to resident runs free_host at the ancestors lock "
        f"propagates to (they take it too); {ENUMERATIVE}\n"
    )


def test_a_propagating_settling_step_settles_only_as_a_give_back_of_the_propagated_count() -> None:
    # The pair check accepts a give-back of locks at the ancestors above the
    # parent; any other propagating event is not known to reach the top.
    explorer, _ = prepare(RESIDENCY, 2, Bounds({"pins": 1, "locks": 1}))
    found = views.Views(explorer)
    assert found.run().finding is None
    unlocking = [
        (v, ev)
        for v in found.seen
        if v[0] >= 0 and found.info(v[1])[2]
        for ev in found.answers.enabled(found.context(v))
        if ev[0] == "unlock"
    ]
    assert unlocking
    assert all(found.settles(v, ev) for v, ev in unlocking)
    found.gives = []
    assert not any(found.settles(v, ev) for v, ev in unlocking)


def test_two_propagated_counters_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A view sums its children's propagated counts as one: pins and locks would be mixed.

    A parent with locks 1 and refs 1 over a child with locks 1 and refs 0
    matched the one sum on both counters, though refs is wrong.
    """
    path = planted(tmp_path, LOCK, LOCK)
    host = (SPECS / "host_residency.toml").read_text()
    waits = 'source = "writing"\ndest = "writing"\nupdate = "pins += 1"\n'
    assert waits in host
    (tmp_path / "host_residency.toml").write_text(
        host.replace(waits, waits + 'propagate = "ancestors"\n', 1)
    )
    assert main(["check", "--compositional", str(path)]) == 2
    assert (
        f"error: check --compositional: {path}: side condition 3 (propagated counts): "
        "propagating transitions move locks and pins: a view carries one sum of its "
        f"children's counts, so one counter may propagate; {ENUMERATIVE}\n"
    ) in capsys.readouterr().err


MUTATIONS = {
    # a client release may take the store's pin
    "store_pin_guard": (
        'guard = "pins == 1"\nerror = "StorePinHeld"',
        'guard = "pins == 0"\nerror = "StorePinHeld"',
    ),
    # a fetch fails under a child holding a host copy
    "fetch_failed_leaf": (
        'when = "any child host in [fetching, backed, pinned]"',
        'when = "any child host in [pinned]"',
    ),
    # a fetch starts under a parent that holds its data in storage alone
    "fetch_parent_cached": (
        'when = ["parent device in [absent]", "parent host in [unbacked, evicted]"]',
        'when = ["parent device in [absent]", "parent host in [unbacked]"]',
    ),
    # a backup starts under a parent still being fetched (a liveness finding, after every view)
    "write_parent_fetching": (
        'event = "write"\nwhen = "parent host in [fetching]"',
        'event = "write"\nwhen = "parent host in [writing]"',
    ),
}
SLOW_MUTATIONS = {"write_parent_fetching"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_MUTATIONS else [])
        for n in sorted(MUTATIONS)
    ],
)
def test_a_mutation_the_enumerative_check_finds_is_not_proven(tmp_path: Path, name: str) -> None:
    """A rule of ``residency_storage.toml`` weakened: found on 2 nodes, never proven here."""
    old, new = MUTATIONS[name]
    text = STORAGE.read_text()
    assert old in text
    for spec in SPECS.glob("*.toml"):
        (tmp_path / spec.name).write_text(spec.read_text())
    (tmp_path / STORAGE.name).write_text(text.replace(old, new, 1))
    path = tmp_path / STORAGE.name
    assert check_spec(path, 2, SMALL).violation is not None
    explorer, _ = prepare(path, 2, SMALL)
    assert views.Views(explorer).run().finding is not None
