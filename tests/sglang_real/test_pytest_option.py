"""``pytest --fsm-sglang``: an SGLang test suite runs with the installed caches checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.sglang_real import standins
standins.install()
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
