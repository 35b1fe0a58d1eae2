"""``fsm-cache types --check``: it never advises a ``--write`` that ``--write`` refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


SPEC = spec_dir() / "device_residency.toml"


@pytest.mark.parametrize(
    "content",
    [b"def keep_me() -> None: ...\n", b"\xff\xfe not UTF-8\n"],
    ids=["user-code", "not-utf8"],
)
def test_check_of_a_file_that_is_no_stub_is_the_error_write_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    """``--check`` called such a file stale and advised ``--write FILE``, which refuses it."""
    target = tmp_path / "door.py"
    target.write_bytes(content)
    assert main(["types", str(SPEC), "--check", str(target)]) == 2
    assert capsys.readouterr() == ("", f"error: {target}: is not a types file fsm-cache wrote\n")
    assert main(["types", str(SPEC), "--write", str(target)]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: {target}: is not a types file fsm-cache wrote; no types file was changed\n",
    )
    assert target.read_bytes() == content


def test_check_of_an_empty_file_advises_the_write_that_fills_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "door_types.py"
    target.touch()
    assert main(["types", str(SPEC), "--check", str(target)]) == 1
    assert capsys.readouterr().out == (
        f"{target} differs from the types of {SPEC}: run fsm-cache types {SPEC} --write {target}\n"
    )
    assert main(["types", str(SPEC), "--write", str(target)]) == 0
    assert main(["types", str(SPEC), "--check", str(target)]) == 0
