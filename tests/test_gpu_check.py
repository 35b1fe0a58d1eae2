"""``scripts/gpu_check.sh`` on a fresh CUDA machine, with its interpreter stood in for.

The script only ever runs on a lent GPU machine, once, so what it runs is
checked here: the interpreter it picks, the test modules it hands pytest, its
exit status, and the report it leaves in ``$OUT``. A stand-in ``python3`` logs
each call instead of running it; ``pip`` fails, as it does on the CUDA image,
which has no hatchling to build the package with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAND_IN = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
if [ "$1 $2" = "-m pip" ]; then exit 1; fi
echo "ran $*"
"""
"""The image's ``python3``: logs its arguments, fails ``pip``, and succeeds at the rest."""
GPU_MARK = ".".join(("pytest", "mark", "gpu"))
"""The marker the script looks for, spelt so that this module holds no such text."""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _stand_in(path: Path, body: str) -> None:
    path.write_text(body)
    path.chmod(0o755)


@pytest.fixture
def run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    """Run the script as on the CUDA image: ``python3`` holds torch, ``python`` does not."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    _stand_in(bin_dir / "python3", STAND_IN)
    _stand_in(bin_dir / "python", "#!/usr/bin/env bash\necho 'no torch here' >&2\nexit 1\n")
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "CALLS": str(calls),
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    logged = calls.read_text().splitlines() if calls.exists() else []
    return done, logged, out / "gpu_check.txt"


def test_the_check_runs_with_python3_and_passes_when_every_step_does(
    run: tuple[subprocess.CompletedProcess[str], list[str], Path],
) -> None:
    done, calls, _ = run
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no torch here" not in done.stdout + done.stderr
    assert calls[0].startswith("-c import torch")
    assert calls[-1] == "-m fsm_cache bench copies"
    assert "pip install failed; using PYTHONPATH=" in done.stdout


def test_pytest_collects_only_the_modules_that_hold_gpu_tests(
    run: tuple[subprocess.CompletedProcess[str], list[str], Path],
) -> None:
    """Other modules import packages the image lacks; their collection errors would fail it."""
    _, calls, _ = run
    (pytest_call,) = [call for call in calls if call.startswith("-m pytest")]
    given = {arg for arg in pytest_call.split() if arg.endswith(".py")}
    holding = {
        f"tests/{path.name}"
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if GPU_MARK in path.read_text()
    }
    assert "tests/test_gpu.py" in holding
    assert given == holding
    assert " -m gpu " in f" {pytest_call} "


def test_the_report_in_out_is_the_whole_output_figures_last(
    run: tuple[subprocess.CompletedProcess[str], list[str], Path],
) -> None:
    done, _, report = run
    assert report.read_text() == done.stdout
    assert done.stdout.splitlines()[-1] == "ran -m fsm_cache bench copies"
