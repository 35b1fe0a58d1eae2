"""A command whose extra is not installed: one ``error:`` line naming the extra, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache import shell


def without(package: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m fsm_cache ARGV`` where importing ``package`` fails as a missing one does."""
    stand_in = tmp_path / package
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n",
        encoding="utf-8",
    )
    path = os.pathsep.join([str(tmp_path), *sys.path])
    return subprocess.run(
        [sys.executable, "-m", "fsm_cache", *argv],
        env={**os.environ, "FSM_CACHE_PURE": "1", "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )


def test_bench_engine_without_the_reference_extra_names_it(tmp_path: Path) -> None:
    """The message named the extra, under a ``ModuleNotFoundError`` traceback, exit 1."""
    done = without("transitions", tmp_path, "bench", "engine", "--quick")
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        "error: the reference executor is built on transitions, which comes with the reference "
        "extra: pip install 'fsm-cache[reference]'\n",
    )


def test_a_missing_module_of_fsm_cache_itself_keeps_its_traceback() -> None:
    """That is a broken install or a bug, no input of the user's: its traceback is the report."""

    def broken() -> int:
        raise ModuleNotFoundError("No module named 'fsm_cache.gone'", name="fsm_cache.gone")

    with pytest.raises(ModuleNotFoundError):
        shell.run_command(broken)
