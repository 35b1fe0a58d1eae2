"""``check --ops``: a user's module that raises, exits or answers wrongly is exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import ConfigError
from fsm_cache.modelcheck import check, treeops
from fsm_cache.spec.shipped import spec_dir


RESIDENCY = spec_dir() / "residency.toml"


def _ops(tmp_path: Path, body: str, name: str = "ops.py") -> Path:
    path = tmp_path / name
    path.write_text(f"import sys\nSPEC = {str(RESIDENCY)!r}\n{body}")
    return path


def _check(capsys: pytest.CaptureFixture[str], ops: Path, *more: str) -> tuple[int, str]:
    status = main(["check", "--nodes", "2", "--ops", str(ops), *more, str(RESIDENCY)])
    captured = capsys.readouterr()
    return status, captured.err.strip()


@pytest.mark.parametrize(
    ("body", "more", "error"),
    [
        ("def split(*a):\n    raise KeyError('x')\n", (), "split raised KeyError('x')"),
        ("def insert(*a):\n    raise KeyError('x')\n", (), "insert raised KeyError('x')"),
        ("def prune(*a):\n    sys.exit(0)\n", (), "prune raised SystemExit(0)"),
        ("def match_prefix(*a):\n    return 42\n", (), "match_prefix returned 42, not a Match"),
        (
            "def match_prefix(*a):\n    raise ValueError('bad')\n",
            (),
            "match_prefix raised ValueError('bad')",
        ),
        (
            "def split(layout, nodes, index, slot):\n    return [1]\n",
            (),
            "split returned [1], not a tree of 2 slots or None",
        ),
        (
            "def insert(layout, nodes, parent, slot):\n    return nodes[:1]\n",
            (),
            "insert returned ((-1, 'unbacked', 'resident', 0, 0, 0, ...),), "
            "not a tree of 2 slots or None",
        ),
        (
            "def wants_backup(*a):\n    raise ValueError('bad')\n",
            ("--policy", "write_through"),
            "wants_backup raised ValueError('bad')",
        ),
        (
            "def wants_backup(*a):\n    return 1\n",
            ("--policy", "write_through"),
            "wants_backup returned 1, not a bool",
        ),
        ("split = 3\n", (), "split is not a function (3)"),
    ],
    ids=[
        "split-raises",
        "insert-raises",
        "prune-exits",
        "match-returns-int",
        "match-raises",
        "split-returns-list",
        "insert-loses-a-slot",
        "wants-raises",
        "wants-returns-int",
        "not-callable",
    ],
)
def test_a_faulty_hook_is_a_config_error_naming_module_and_hook(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    body: str,
    more: tuple[str, ...],
    error: str,
) -> None:
    ops = _ops(tmp_path, body)
    assert _check(capsys, ops, *more) == (2, f"error: {ops}: {error}")


def test_an_exit_at_import_is_a_config_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ops = _ops(tmp_path, "sys.exit(0)\n")
    assert _check(capsys, ops) == (2, f"error: {ops}: cannot import: SystemExit: 0")
    with pytest.raises(ConfigError, match=r": cannot import: SystemExit: 0$"):
        check.load_ops(ops)


def test_hooks_call_each_other_unguarded_and_defaults_keep_their_identity(
    tmp_path: Path,
) -> None:
    """Only the checker's calls are guarded: one hook's fault inside another names the outer."""
    ops = _ops(
        tmp_path,
        "def prune(layout, nodes):\n    raise KeyError('inner')\n"
        "def split(layout, nodes, index, slot):\n    return prune(layout, nodes)\n",
    )
    _, view = check.load_ops(ops)
    assert view.insert is treeops.insert
    assert view.born is treeops.born
    assert not hasattr(view, "match_prefix")
    with pytest.raises(ConfigError) as info:
        view.split(None, (None,), 0, 0)
    assert str(info.value) == f"{ops}: split raised KeyError('inner')"
