"""The GPU check refuses to pass where CUDA is missing, and gpu tests cannot skip there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parent.parent
GPU_TEST = "tests/test_copies.py::test_cuda_poll_never_blocks_and_reports_once"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="shows what happens without CUDA")


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "FSM_CACHE_REQUIRE_GPU"}
    return subprocess.run(
        command,
        check=False,
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@no_cuda
def test_a_gpu_test_skips_without_cuda_but_fails_where_a_gpu_is_required() -> None:
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", GPU_TEST]
    plain = _run(pytest_run)
    assert plain.returncode == 0, plain.stdout
    assert "1 skipped" in plain.stdout
    required = _run(pytest_run, FSM_CACHE_REQUIRE_GPU="1")
    assert required.returncode == 1, required.stdout
    assert (
        "gpu test skipped where FSM_CACHE_REQUIRE_GPU=1 requires it to run: "
        "Skipped: needs a CUDA device"
    ) in required.stdout
    assert "1 skipped" not in required.stdout  # an error at setup, where the skip was


@no_cuda
def test_the_gpu_check_script_fails_at_once_without_cuda(tmp_path: Path) -> None:
    done = _run(["bash", "scripts/gpu_check.sh"], PYTHON=sys.executable, OUT=str(tmp_path))
    assert done.returncode == 1
    assert "FAIL: CUDA is not available" in done.stdout
    assert "== install" not in done.stdout  # nothing installed, nothing run
    assert (tmp_path / "gpu_check.txt").read_text() == done.stdout
