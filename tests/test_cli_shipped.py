"""A corrupt shipped spec: one error line from what needs it, and every other command works.

The shipped specs are never touched: each test runs the CLI from a copy of the
package (sources only, so the copy runs whether or not the checkout is
compiled) whose ``residency.toml`` is corrupt, in a fresh interpreter, since
what is loaded at import time can only be seen there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsm_cache
from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


_MAIN = "import sys; from fsm_cache.cli.main import main; sys.exit(main(sys.argv[1:]))"

FLIP = """\
[machine]
name = "flip"
initial = "up"
[states]
up = {}
down = {}
[[transition]]
event = "flip"
source = "up"
dest = "down"
[[transition]]
event = "flop"
source = "down"
dest = "up"
[[forbid]]
event = "flip"
source = "down"
error = "Flipped"
reason = "already down"
[[forbid]]
event = "flop"
source = "up"
error = "Flopped"
reason = "already up"
"""


SHIPPED = spec_dir().resolve().relative_to(Path(fsm_cache.__file__).resolve().parent.parent)
"""Where the shipped specs are, relative to the folder holding the package."""


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of fsm_cache whose shipped residency.toml is not TOML, beside flip.toml."""
    root = tmp_path_factory.mktemp("broken")
    package = Path(fsm_cache.__file__).resolve().parent
    ignored = shutil.ignore_patterns("*.so", "__pycache__")
    shutil.copytree(package, root / "fsm_cache", ignore=ignored)
    if not (root / SHIPPED).is_dir():  # a checkout keeps them beside the package
        shutil.copytree(spec_dir(), root / SHIPPED, ignore=ignored)
    (root / SHIPPED / "residency.toml").write_text("broken = [\n", encoding="utf-8")
    (root / "flip.toml").write_text(FLIP, encoding="utf-8")
    return root


def cli(root: Path, *argv: str) -> tuple[int, str, str]:
    """Run ``fsm-cache ARGV`` in ``root``, from the copy there; return (status, out, err)."""
    env = {**os.environ, "PYTHONPATH": str(root), "FSM_CACHE_PURE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _MAIN, *argv],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("argv", "out"),
    [
        (
            ["validate", "flip.toml"],
            "ok: flip.toml (machine flip: 2 states, 2 transitions, 2 refusals)\n",
        ),
        (["types", "flip.toml"], '"""Types of the flip spec.'),
    ],
)
def test_commands_that_need_no_shipped_spec_still_work(
    copy: Path, argv: list[str], out: str
) -> None:
    status, stdout, stderr = cli(copy, *argv)
    assert (status, stderr) == (0, "")
    assert stdout.startswith(out)


def test_a_command_that_needs_it_says_which_shipped_spec_is_corrupt(copy: Path) -> None:
    status, stdout, stderr = cli(copy, "demo", "--requests", "1")
    assert (status, stdout) == (2, "")
    assert stderr == (
        f"error: shipped spec residency: {copy / SHIPPED / 'residency.toml'}: invalid TOML: "
        "Invalid value (at end of document)\n"
    )


def test_a_tool_module_that_fails_at_import_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "failing_tool.py").write_text(
        "from fsm_cache.errors import SpecError\nraise SpecError(['x.toml: corrupt'])\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(tmp_path)
    module = sys.modules["fsm_cache.cli.main"]  # the package's name for it is the function
    monkeypatch.setattr(module, "_TOOLS", ("fsm_cache.cli.validate", "failing_tool"))
    assert main(["validate", "x.toml"]) == 2
    assert capsys.readouterr() == ("", "error: x.toml: corrupt\n")
