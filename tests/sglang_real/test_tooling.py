"""``pytest --fsm-sglang`` and the SGLang benchmarks, on the installed SGLang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
    from fsm_cache.bench.against import MODES, run_against_sglang

    bench = run_against_sglang(num_requests=40, rounds=1)
    assert set(bench.rps) == {"page 1", "page 16", "page 1 + evictions"}
    for figures in bench.rps.values():
        assert set(figures) == {"sglang", *MODES}
        assert all(v > 0 for v in figures.values())
    assert "targets: held >= 1.8x" in bench.format()


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
