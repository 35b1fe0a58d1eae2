"""``pytest --fsm-sglang`` and the SGLang benchmarks, on the installed SGLang."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fsm_cache.compat.sglang import ResidencyMixin, patch


CONFTEST = """
from fsm_cache.testing import sglang
sglang.install()
"""

SUITE = """
import pytest
from sglang.srt.mem_cache import radix_cache
from fsm_cache.compat.sglang import HostRefCounterZero, ResidencyMixin


def test_the_installed_cache_builds_checked_nodes():
    assert issubclass(radix_cache.TreeNode, ResidencyMixin)
    node = radix_cache.TreeNode()
    with pytest.raises(HostRefCounterZero):
        node.release_host()
"""


def test_the_option_patches_the_run_and_undoes_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--fsm-sglang", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    without = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert without.returncode == 1, without.stdout  # stock SGLang: no checked node


def test_the_overhead_bench_runs_on_the_installed_sglang() -> None:
    from fsm_cache.bench.sglang import run_sglang_bench

    bench = run_sglang_bench(requests=60, repeat=1, nodes=200)
    assert bench.operations == 240
    assert set(bench.ns_per_op) == set(bench.node_bytes) == {"stock", "patched"}
    assert all(v > 0 for v in (*bench.ns_per_op.values(), *bench.node_bytes.values()))
    assert "target: time <= 1.15x" in bench.format()


def test_the_overhead_bench_charges_only_what_a_request_adds() -> None:
    """The scheduler frees the duplicate of a matched prefix: only new tokens stay taken."""
    import torch

    from fsm_cache.bench.sglang import Driver, chat_trace

    driver = Driver()
    trace = chat_trace(80)
    slots = sum(len(t) for t in trace)  # room for everything: nothing is evicted
    cache, allocator = driver.build(slots)
    driver.serve(cache, allocator, [(driver.key(t), torch.arange(len(t))) for t in trace])
    assert allocator.free_count == slots - cache.total_size()


def test_the_cache_bench_runs_against_the_installed_sglang() -> None:
    """At the smoke run's size every side does SGLang's work: the run reports it, not refuses."""
    from fsm_cache.bench.against import MODES, QUICK_REQUESTS, run_against_sglang

    bench = run_against_sglang(num_requests=QUICK_REQUESTS, rounds=1)
    assert set(bench.rps) == set(bench.work) == {"page 1", "page 16", "page 1 + evictions"}
    for figures in bench.rps.values():
        assert set(figures) == {"sglang", *MODES}
        assert all(v > 0 for v in figures.values())
    assert bench.work["page 1"].evicted_tokens == 0
    assert bench.work["page 1 + evictions"].evicted_tokens > 0
    assert "targets: held >= 1.8x" in bench.format()


def test_the_cache_bench_refuses_a_trace_whose_sides_did_other_work() -> None:
    """40 requests: with write-through HiCache evicts other leaves than SGLang, so no ratio."""
    from fsm_cache.bench.against import run_against_sglang
    from fsm_cache.bench.cache import UnequalWork

    with pytest.raises(UnequalWork) as refused:
        run_against_sglang(num_requests=40, rounds=1)
    assert str(refused.value) == (
        "bench cache --against sglang, page 1 + evictions trace: write-through did "
        "other work than SGLang (4,208 tokens hit, 4,784 evicted; SGLang 4,080 tokens hit, "
        "5,088 evicted), so their ratio would compare different work"
    )


UNIFIED = "sglang.srt.mem_cache.unified_radix_cache"


def test_patch_warns_that_the_default_cache_of_sglang_is_checked_at_its_lock_boundary_only() -> (
    None
):
    if importlib.util.find_spec(UNIFIED) is None:
        pytest.skip("this SGLang has no UnifiedRadixCache")
    with pytest.warns(UserWarning, match="UnifiedRadixCache") as caught, patch() as applied:
        assert "UnifiedRadixCache.dec_lock_ref" in applied.wrapped
    assert [str(w.message) for w in caught] == [
        f"UnifiedRadixCache ({UNIFIED}) is checked at its lock boundary only: patch() "
        "refuses a dec_lock_ref or dec_host_lock_ref with no inc_lock_ref or "
        "inc_host_lock_ref left on its node (counting FULL's locks), given a receipt released "
        "already or another node's, and an inc_lock_ref or inc_host_lock_ref on a node the "
        "tree does not have; it checks none of its residency (evictions, loads, write-backs, "
        "the tree core's own locks and full pins, the SWA and Mamba parts of a lock); SGLang's "
        "scheduler builds it by default (registry.default_radix_cache_factory); see "
        "docs/sglang.md"
    ]
    core = importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_tree_core")
    assert not issubclass(core.UnifiedTreeNode, ResidencyMixin)  # what the warning is about


def test_patch_given_other_modules_warns_that_the_default_cache_is_not_checked() -> None:
    if importlib.util.find_spec(UNIFIED) is None:
        pytest.skip("this SGLang has no UnifiedRadixCache")
    radix = "sglang.srt.mem_cache.radix_cache"
    with pytest.warns(UserWarning, match="UnifiedRadixCache") as caught, patch(radix) as applied:
        assert not [w for w in applied.wrapped if w.startswith("UnifiedRadixCache.")]
    assert [str(w.message) for w in caught] == [
        f"UnifiedRadixCache ({UNIFIED}) is not checked: patch() was not given its module; "
        "SGLang's scheduler builds it by default (registry.default_radix_cache_factory); "
        "see docs/sglang.md"
    ]


def test_patch_is_silent_where_sglang_builds_only_what_it_checks() -> None:
    if importlib.util.find_spec(UNIFIED) is not None:
        pytest.skip("this SGLang builds UnifiedRadixCache by default")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch().undo()


BROKEN = """
import sys
from fsm_cache.testing import sglang
sglang.install()
sys.modules["torch"] = None  # a broken install: a module SGLang's cache code imports is missing
from fsm_cache.compat.sglang import PatchError, patch
try:
    patch()
except PatchError as exc:
    print(exc)
"""


def test_a_broken_sglang_install_is_reported_with_its_import_error() -> None:
    run = subprocess.run(
        [sys.executable, "-c", BROKEN], capture_output=True, text=True, check=False
    )
    assert (run.returncode, run.stderr) == (0, "")
    assert run.stdout == (
        "sglang.srt.mem_cache.radix_cache is installed but cannot be imported: "
        "import of torch halted; None in sys.modules\n"
    )
