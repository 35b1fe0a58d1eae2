"""The one writer of generated files: all of them or none, and nothing left behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from fsm_cache.cli.files import OutputError, write_files


def test_a_failed_rename_puts_back_the_files_renamed_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = {tmp_path / "a.md": "old a", tmp_path / "b.md": "old b"}
    for path, text in old.items():
        path.write_text(text)
    new = {**{path: f"new {path.stem}" for path in old}, tmp_path / "c.md": "new c"}
    renamed: list[Path] = []
    replace = Path.replace

    def refuse_the_third(self: Path, target: Path) -> Path:
        if len(renamed) == 2:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        renamed.append(Path(target))
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", refuse_the_third)
    with pytest.raises(OutputError) as caught:
        write_files(new, "diagram")
    assert str(caught.value) == (
        f"{tmp_path / 'c.md'}: cannot write: Operation not permitted; no diagram file was changed"
    )
    assert renamed == [tmp_path / "a.md", tmp_path / "b.md"]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a.md": "old a", "b.md": "old b"}


def test_folders_made_before_a_deeper_one_failed_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "new" / "sub" / ("a" * 300) / "t.py"
    with pytest.raises(OutputError) as caught:
        write_files({target: "x"}, "types")
    assert str(caught.value) == (
        f"{target}: cannot write: File name too long; no types file was changed"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_written_set_leaves_no_spare_files(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("old")
    assert write_files({tmp_path / "a.md": "new", tmp_path / "b.md": "b"}, "diagram") == [
        tmp_path / "a.md",
        tmp_path / "b.md",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "b.md"]
    assert (tmp_path / "a.md").read_text() == "new"


def test_a_link_to_a_toml_file_and_a_file_ours_does_not_know_are_refused(tmp_path: Path) -> None:
    spec, link = tmp_path / "spec.toml", tmp_path / "drawn.md"
    spec.write_text("[machine]\n")
    link.symlink_to(spec)
    with pytest.raises(OutputError) as caught:
        write_files({link: "x"}, "diagram")
    assert str(caught.value) == (
        f"{link}: is a .toml file (a spec or settings), never one fsm-cache generates; "
        "no diagram file was changed"
    )
    binary = tmp_path / "t.py"
    binary.write_bytes(b"\xff\xfe mark\n")
    with pytest.raises(OutputError) as caught:
        write_files({binary: "mark\n"}, "types", ours=lambda text: text.startswith("mark"))
    assert (
        str(caught.value)
        == f"{binary}: is not a types file fsm-cache wrote; no types file was changed"
    )
    assert (spec.read_text(), binary.read_bytes()) == ("[machine]\n", b"\xff\xfe mark\n")


def test_a_link_into_a_missing_folder_is_refused_and_makes_no_folder(tmp_path: Path) -> None:
    """The folders of a dangling link's target were made: a write outside the path named."""
    link, target = tmp_path / "drawn.mmd", tmp_path / "elsewhere" / "deep" / "x.mmd"
    link.symlink_to(target)
    with pytest.raises(OutputError) as caught:
        write_files({link: "graph\n"}, "diagram")
    assert str(caught.value) == (
        f"{link}: cannot write: it links to {target}, in a folder that does not exist; "
        "no diagram file was changed"
    )
    assert not (tmp_path / "elsewhere").exists()
    assert link.is_symlink()
    nested = tmp_path / "new" / "drawn.mmd"  # the named path's own folders are still made
    assert write_files({nested: "graph\n"}, "diagram") == [nested]
    assert nested.read_text() == "graph\n"
