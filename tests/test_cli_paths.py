"""Path arguments of every subcommand: a path that names nothing, or a folder, is a usage error.

``fsm-cache validate``, ``diagram`` and ``types`` refused an empty path from
the start; ``check``, ``verify`` and ``audit`` took it as the working
directory (``audit ''`` audited it, ``--config ''`` read ``.``) or as no
argument at all (``check --ops ''`` ran every shipped spec and control).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    """Run ``fsm-cache ARGV``, which must be refused by the parser; return (stdout, last stderr line)."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    return out, err.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["check", ""], "SPEC"),
        (["check", "--ops", ""], "--ops"),
        (["verify", ""], "SPEC_OR_MODULE"),
        (["audit", ""], "PATH"),
        (["audit", "{spec}", "--config", ""], "--config"),
    ],
)
def test_an_empty_path_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], argument: str
) -> None:
    spec = str(spec_dir() / "host_residency.toml")
    command = argv[0]
    assert usage_error(capsys, *(a.format(spec=spec) for a in argv)) == (
        "",
        f"fsm-cache {command}: error: argument {argument}: an empty path names no file",
    )


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["types", "{spec}", "--write", "out/"], "--write"),
        (["types", "{spec}", "--write", "new/."], "--write"),
        (["types", "{spec}", "--check", "out/"], "--check"),
        (["diagram", "{spec}", "-o", "drawn/"], "-o/--output"),
        (["diagram", "{spec}", "--write", "-o", "drawn/.."], "-o/--output"),
    ],
)
def test_an_output_file_that_names_a_folder_is_refused(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    argument: str,
) -> None:
    """``--write out/`` wrote a file named ``out``: the path asks for a folder, not a file."""
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "residency.toml")
    assert usage_error(capsys, *(a.format(spec=spec) for a in argv)) == (
        "",
        f"fsm-cache {argv[0]}: error: argument {argument}: {argv[-1]}: names a folder, not a file",
    )
    assert list(tmp_path.iterdir()) == []
