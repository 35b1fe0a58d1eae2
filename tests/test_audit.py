"""End-to-end tests of ``fsm-cache audit``: the corpus, the CLI, exit codes and formats."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache.audit import AuditConfig, audit_paths, check_source, register
from fsm_cache.audit.report import to_text


CORPUS = Path(__file__).parent / "audit_corpus"
REPO = Path(__file__).parent.parent
MODULES = sorted(CORPUS.glob("*.py"))
CLEAN = [
    "callbacks_clean.py",
    "flag_idiom.py",
    "guarded_locks.py",
    "idioms_clean.py",
    "load_back_fixed.py",
    "prefill_adder.py",
    "write_through_clean.py",
]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the audit through its own ``register`` on a fresh parser, like the CLI shell."""
    parser = argparse.ArgumentParser(prog="fsm-cache")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", *argv])
    status: int = args.handler(args)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("module", MODULES, ids=[path.stem for path in MODULES])
def test_corpus_module_has_exactly_its_expected_findings(
    module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CORPUS)
    findings = check_source(module.read_text(encoding="utf-8"), module.name, AuditConfig())
    expected = module.with_suffix(".expected").read_text(encoding="utf-8").splitlines()
    assert to_text(findings) == expected


def test_every_corpus_module_has_a_sidecar_and_every_code_is_exercised() -> None:
    assert all(path.with_suffix(".expected").is_file() for path in MODULES)
    text = "".join(path.with_suffix(".expected").read_text() for path in MODULES)
    for code in ("FSM100", "FSM101", "FSM102", "FSM103", "FSM104"):
        assert f": {code} " in text


@pytest.mark.parametrize("name", CLEAN)
def test_clean_modules_exit_zero_and_print_nothing(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli([str(CORPUS / name)], capsys)
    assert (status, out, err) == (0, "", "")


def test_findings_exit_one_with_one_linter_line_each(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CORPUS)
    status, out, _ = run_cli(["prefetch.py"], capsys)
    assert status == 1
    assert out.splitlines() == (CORPUS / "prefetch.expected").read_text().splitlines()


def test_a_folder_is_searched_for_python_files_in_order(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CORPUS)
    status, out, _ = run_cli(["."], capsys)
    expected = "".join(module.with_suffix(".expected").read_text() for module in MODULES)
    assert (status, out) == (1, expected)


def test_pair_option_replaces_the_default_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "slots.py"
    source.write_text("def f(pool, node):\n    pool.alloc_host(node)\n    node.protect_host()\n")
    status, out, _ = run_cli([str(source), "--pair", "alloc_host:free_host"], capsys)
    assert status == 1
    assert out == (
        f"{source}:2:5: FSM101 alloc_host() on 'node' is not released or handed on"
        " when the function ends at line 3 [f]\n"
    )


def test_json_format_lists_every_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CORPUS)
    status, out, _ = run_cli(["--format", "json", "write_back_staging.py"], capsys)
    assert status == 1
    assert json.loads(out) == {
        "version": "0.1.0",
        "findings": [
            {
                "path": "write_back_staging.py",
                "line": 13,
                "column": 13,
                "code": "FSM104",
                "message": (
                    "protect_host() on 'self.collect_leaves(num_tokens)[*]' leaks if line 16"
                    " raises; release it in try/finally or hold it with a lease"
                ),
                "function": "WriteBackEviction.evict",
            }
        ],
    }


def test_json_format_of_a_clean_run_is_an_empty_list(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["--format", "json", str(CORPUS / "load_back_fixed.py")], capsys)
    assert (status, json.loads(out)["findings"]) == (0, [])


def test_audit_paths_returns_sorted_findings_across_files() -> None:
    paths = [str(CORPUS / "prefetch.py"), str(CORPUS / "abort_retract.py")]
    findings = audit_paths(paths, AuditConfig())
    assert findings == sorted(findings)
    assert [f.code for f in findings] == [
        "FSM103",
        "FSM102",
        "FSM102",
        "FSM104",
        "FSM102",
        "FSM103",
    ]


def test_a_syntax_error_is_reported_as_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    status, out, err = run_main([str(broken)], capsys)
    assert (status, out) == (2, "")
    assert err == f"error: {broken}:1:7: syntax error: invalid syntax\n"


def test_a_missing_file_is_reported_as_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_main([str(tmp_path / "nope.py")], capsys)
    assert (status, err) == (2, f"error: {tmp_path / 'nope.py'}: no such file or directory\n")


def test_a_folder_without_python_files_is_named_not_passed_in_silence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("not python\n")
    status, out, err = run_main([str(tmp_path)], capsys)
    assert (status, out) == (0, "")
    assert err == f"warning: no Python files under {tmp_path}: nothing was audited\n"
    forged = tmp_path / "d\nerror: forged.toml"  # a folder whose name would forge a line
    forged.mkdir()
    status, out, err = run_main([str(forged)], capsys)
    assert (status, out) == (0, "")
    assert (
        err
        == f"warning: no Python files under {tmp_path}/d\\nerror: forged.toml: nothing was audited\n"
    )


def test_an_undecodable_file_is_reported_as_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"x = '\xe9'\n")
    status, _, err = run_main([str(latin)], capsys)
    assert status == 2
    assert err.startswith(f"error: {latin}: cannot decode: ")


def test_a_bad_pair_is_reported_as_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_main([str(CORPUS / "prefetch.py"), "--pair", "protect_host"], capsys)
    assert (status, err) == (
        2,
        "error: bad pair 'protect_host': expected ACQUIRE:RELEASE, two call names\n",
    )


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from fsm_cache.audit import main

    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def run_module(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "fsm_cache.audit", *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def test_python_dash_m_reports_findings_with_exit_one() -> None:
    result = run_module("abort_retract.py", cwd=CORPUS)
    assert result.returncode == 1
    assert result.stdout == (CORPUS / "abort_retract.expected").read_text()
    assert result.stderr == ""


def test_python_dash_m_exits_zero_on_clean_code() -> None:
    result = run_module(str(CORPUS / "callbacks_clean.py"))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_python_dash_m_exits_two_without_a_traceback_on_a_syntax_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("class C:\nreturn\n")
    result = run_module(str(broken))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {broken}:2:1: syntax error: ")
    assert "Traceback" not in result.stderr


def test_python_dash_m_sarif_is_valid_json() -> None:
    result = run_module("--format", "sarif", "load_back.py", cwd=CORPUS)
    assert result.returncode == 1
    log = json.loads(result.stdout)
    assert [r["ruleId"] for r in log["runs"][0]["results"]] == ["FSM101", "FSM104"]


@pytest.mark.usefixtures("default_recursion_limit")  # an earlier test (mypy) may raise it
@pytest.mark.parametrize(
    "expression",
    [
        # Python 3.11 builds the tree under the recursion limit; 3.10 builds any depth
        pytest.param(
            " + ".join(["a"] * 3000),
            marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 parses it"),
            id="deep-tree",
        ),
        pytest.param("-" * 20000 + "a", id="parser-stack"),  # MemoryError, on 3.10 too
    ],
)
def test_a_source_too_deeply_nested_to_parse_is_bad_input(
    expression: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.py"
    deep.write_text(f"x = {expression}\n")
    status, out, err = run_main([str(deep)], capsys)
    assert (status, out, err) == (2, "", f"error: {deep}: too deeply nested to parse\n")


def test_a_function_too_deeply_nested_is_a_finding_and_the_rest_is_audited(tmp_path: Path) -> None:
    deep = tmp_path / "deep.py"
    deep.write_text(
        "def f(node):\n    node.release_host()\n    x = " + " + ".join(["a"] * 1500) + "\n\n"
        "def g(node):\n    node.protect_host()\n"
    )
    result = run_module(str(deep))
    assert (result.returncode, result.stderr) == (1, "")
    assert result.stdout.splitlines()[:2] == [
        f"{deep}:1:1: FSM106 f is too deeply nested to analyze; nothing in it is checked [f]",
        f"{deep}:6:5: FSM101 protect_host() on 'node' is not released or handed on"
        " when the function ends at line 6 [g]",
    ]


def test_a_null_byte_is_reported_without_a_bogus_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"x = 1\0\n")
    status, _, err = run_main([str(nul)], capsys)
    assert (status, err) == (
        2,
        f"error: {nul}: syntax error: source code string cannot contain null bytes\n",
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_named_pipe_is_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    status, _, err = run_main([str(fifo)], capsys)
    assert (status, err) == (
        2,
        f"error: {fifo}: cannot read: not a regular file (a named pipe)\n",
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_named_pipe_under_a_folder_is_bad_input_not_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``.py`` entry the walk cannot read was skipped: its code passed unread, exit 0."""
    (tmp_path / "ok.py").write_text("x = 1\n")
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    status, out, err = run_main([str(tmp_path)], capsys)
    assert (status, out, err) == (
        2,
        "",
        f"error: {fifo}: cannot read: not a regular file (a named pipe)\n",
    )


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("missing.py", "No such file or directory"),
        ("loop.py", "Too many levels of symbolic links"),
    ],
    ids=["dangling", "loop"],
)
def test_a_broken_link_under_a_folder_is_bad_input_not_skipped(
    target: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ok.py").write_text("x = 1\n")
    link = tmp_path / "loop.py"
    link.symlink_to(tmp_path / target)
    status, out, err = run_main([str(tmp_path)], capsys)
    assert (status, out, err) == (2, "", f"error: {link}: cannot read: {why}\n")
    status, out, err = run_main([str(link)], capsys)
    assert (status, out, err) == (2, "", f"error: {link}: cannot read: {why}\n")


def test_a_link_to_a_folder_is_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link loop between folders ends the walk; the folder's own files are audited."""
    (tmp_path / "leak.py").write_text("def f(node):\n    node.protect_host()\n")
    (tmp_path / "again").symlink_to(tmp_path)
    status, out, _ = run_main([str(tmp_path)], capsys)
    assert (status, out.count("FSM101")) == (1, 1)


@pytest.mark.parametrize("name", ["pyproject.toml", "notes", "stub.pyi"])
def test_a_named_file_that_is_not_python_is_bad_input(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``audit x.toml`` read the TOML as Python: a syntax error, or silence on one that parsed."""
    other = tmp_path / name
    other.write_text("x = 1\n")
    status, out, err = run_main([str(other)], capsys)
    assert (status, out, err) == (
        2,
        "",
        f"error: {other}: not a Python source: its name does not end in .py\n",
    )


def test_a_folder_that_cannot_be_listed_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "pkg" / "locked"
    locked.mkdir(parents=True)
    (locked / "leak.py").write_text("def f(node):\n    node.protect_host()\n")
    scandir = os.scandir

    def refuse(path: str) -> object:
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    status, out, err = run_main([str(tmp_path / "pkg")], capsys)
    assert (status, out, err) == (2, "", f"error: {locked}: cannot list: Permission denied\n")


def test_a_file_named_twice_is_audited_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CORPUS)
    status, out, _ = run_cli(["load_back.py", "./load_back.py", "load_back.py", "."], capsys)
    others = "".join(
        m.with_suffix(".expected").read_text() for m in MODULES if m.stem != "load_back"
    )
    assert status == 1
    assert sorted(out.splitlines()) == sorted(
        ((CORPUS / "load_back.expected").read_text() + others).splitlines()
    )
