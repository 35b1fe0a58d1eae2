"""``fsm-cache check`` reads each spec once: a spec saved over during a run is checked as first read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from shipped_files import STORAGE_FILES

from fsm_cache.cli.main import main
from fsm_cache.modelcheck import check
from fsm_cache.spec.controls import Control, load_finding
from fsm_cache.spec.shipped import spec_dir


_EDITS = pytest.mark.parametrize(
    "edit",
    [
        # the base residency_storage.toml extends drops LoadPinHeld's guard: read again,
        # a client's release while loading is refused, a violation of invariant 6
        ("residency.toml", 'guard = "pins == 1"\nerror = "LoadPinHeld"', 'error = "LoadPinHeld"'),
        # a region of that base no longer TOML: read again, the spec does not load
        ("device_residency.toml", "[machine]", "[machine"),
    ],
    ids=["guard-dropped", "garbled"],
)


def _copied(folder: Path) -> None:
    """Copy ``residency_storage.toml`` and every file it is read from into ``folder``."""
    for name in STORAGE_FILES:
        (folder / name).write_bytes((spec_dir() / name).read_bytes())


def _saved_over(folder: Path, edit: tuple[str, str, str]) -> None:
    """Make ``edit`` (a file of ``folder``, a text in it, its replacement), as an editor saves it."""
    file, old, new = edit
    text = (folder / file).read_text()
    assert old in text
    (folder / file).write_text(text.replace(old, new, 1))


def _checked(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """Run ``check --json`` and return its exit status and its report without the timings."""
    status = main(["check", "--json", *argv])
    result = json.loads(capsys.readouterr().out)
    for spec in result["specs"]:
        assert spec.pop("seconds") >= 0
    return status, result


@_EDITS
@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.parametrize("saved", ["after-targets", "before-searches"])
def test_a_spec_saved_over_while_it_is_checked_is_checked_as_it_was_first_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    saved: str,
    jobs: str,
    edit: tuple[str, str, str],
) -> None:
    """Each step read the files again: ceilings, the search and its workers saw another version."""
    _copied(tmp_path)
    specs = [str(tmp_path / "residency_storage.toml"), str(tmp_path / "residency.toml")]
    argv = [*specs, "--nodes", "1", "--jobs", jobs]
    first = _checked(capsys, *argv)
    assert first[0] == 0
    assert [s["violation"] for s in first[1]["specs"]] == [None, None]
    targets, searched = check.targets, check.searched

    def then_saved_over(*args: Any) -> Any:  # the specs were read: the first read is done
        planned = targets(*args)
        _saved_over(tmp_path, edit)
        return planned

    def saved_over_first(*args: Any, **kwargs: Any) -> Any:  # planned; no search started
        _saved_over(tmp_path, edit)
        return searched(*args, **kwargs)

    if saved == "after-targets":
        monkeypatch.setattr(check, "targets", then_saved_over)
    else:
        monkeypatch.setattr(check, "searched", saved_over_first)
    assert _checked(capsys, *argv) == first
    monkeypatch.undo()
    file, _, new = edit
    assert new in (tmp_path / file).read_text()  # saved over indeed, and read anew next run
    assert main(["check", *argv]) != 0


@_EDITS
def test_a_control_saved_over_while_it_is_checked_is_checked_as_it_was_first_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str, str]
) -> None:
    """A control was read to see it load, then again to size it, then again to search it.

    On 2 nodes, not the controls' 3: the reads are the same whatever the tree
    size, and the dropped guard is found on a node under a parent there too.
    """
    _copied(tmp_path)
    control = Control(tmp_path / "residency.toml", "check", "no finding expected")
    assert check.check_control(control, 2) == ""

    def then_saved_over(path: Path) -> Any:
        loaded = load_finding(path)
        _saved_over(tmp_path, edit)
        return loaded

    monkeypatch.setattr(check, "load_finding", then_saved_over)
    assert check.check_control(control, 2) == ""
    monkeypatch.undo()
    assert check.check_control(control, 2) != ""
