"""Settings of the audit: the pyproject table, where it is found, ``--pair``, the markers."""

from __future__ import annotations

import argparse
import ast
import textwrap
from pathlib import Path

import pytest
import too_big_toml

from fsm_cache.audit import (
    AuditConfig,
    AuditError,
    Pair,
    audit_paths,
    check_source,
    load_config,
    main,
    parse_pair,
    register,
)
from fsm_cache.audit import config as config_module
from fsm_cache.audit.config import ConfigFinder, parse_pairs
from fsm_cache.audit.flake8 import AuditPlugin
from fsm_cache.audit.markers import read_markers
from fsm_cache.audit.model import DEFAULT_NON_RAISING, DEFAULT_PAIRS
from fsm_cache.shell import find_pyproject


def write_pyproject(folder: Path, table: str) -> Path:
    path = folder / "pyproject.toml"
    path.write_text(f"[project]\nname = 'x'\n\n[tool.fsm_cache.audit]\n{textwrap.dedent(table)}")
    return path


def test_defaults_pair_host_pins_and_device_locks() -> None:
    assert AuditConfig().pairs == (
        Pair("protect_host", "release_host"),
        Pair("inc_lock_ref", "dec_lock_ref"),
    )
    assert load_config(None) == AuditConfig()


def test_pyproject_table_is_read(tmp_path: Path) -> None:
    path = write_pyproject(
        tmp_path,
        """
        pairs = ["pin:unpin"]
        takes_ownership = ["Cache.finish"]
        hands_off = ["start"]
        non_raising = ["record_metric"]
        ignore = ["FSM104"]
        """,
    )
    assert load_config(path) == AuditConfig(
        pairs=(Pair("pin", "unpin"),),
        takes_ownership=frozenset({"Cache.finish"}),
        hands_off=frozenset({"start"}),
        non_raising=DEFAULT_NON_RAISING | {"record_metric"},
        ignore=frozenset({"FSM104"}),
    )


def test_a_pyproject_without_the_table_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[project]\nname = 'x'\n")
    assert load_config(path) == AuditConfig()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            "pair = []",
            "unknown key 'pair' (known: pairs, takes_ownership, hands_off, non_raising, ignore)",
        ),
        ("hands_off = 'start'", "[tool.fsm_cache.audit].hands_off: expected a list of strings"),
        ("ignore = ['FSM999']", "[tool.fsm_cache.audit].ignore: unknown code 'FSM999'"),
        (
            "pairs = ['pin']",
            "[tool.fsm_cache.audit].pairs: bad pair 'pin': expected "
            "ACQUIRE:RELEASE, two call names",
        ),
        (
            "pairs = []",
            "[tool.fsm_cache.audit].pairs: no pairs to check: give at least one ACQUIRE:RELEASE",
        ),
        (
            "takes_ownership = ['']",
            "[tool.fsm_cache.audit].takes_ownership: bad name '':"
            " expected a function name or Class.method",
        ),
        (
            "hands_off = ['Cache.']",
            "[tool.fsm_cache.audit].hands_off: bad name 'Cache.':"
            " expected a function name or Class.method",
        ),
    ],
)
def test_bad_tables_are_refused_with_the_place(tmp_path: Path, table: str, message: str) -> None:
    path = write_pyproject(tmp_path, table)
    with pytest.raises(AuditError) as caught:
        load_config(path)
    assert str(caught.value).endswith(message)
    assert str(caught.value).startswith(str(path))


def test_invalid_toml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.fsm_cache.audit\n")
    with pytest.raises(AuditError, match="invalid TOML"):
        load_config(path)


def test_the_nearest_pyproject_is_found(tmp_path: Path) -> None:
    path = write_pyproject(tmp_path, "")
    nested = tmp_path / "pkg" / "sub"
    nested.mkdir(parents=True)
    assert find_pyproject(nested) == path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pin", "bad pair 'pin': expected ACQUIRE:RELEASE, two call names"),
        ("pin:", "bad pair 'pin:': expected ACQUIRE:RELEASE, two call names"),
        ("a.b:c", "bad pair 'a.b:c': expected ACQUIRE:RELEASE, two call names"),
        ("pin:pin", "bad pair 'pin:pin': the acquire and release names must differ"),
        ("class:unpin", "bad pair 'class:unpin': expected ACQUIRE:RELEASE, two call names"),
    ],
)
def test_bad_pairs_are_refused(text: str, message: str) -> None:
    with pytest.raises(AuditError) as caught:
        parse_pair(text)
    assert str(caught.value) == message


def test_a_name_in_two_pairs_is_refused() -> None:
    with pytest.raises(AuditError) as caught:
        parse_pairs(["pin:unpin", "lock:unpin"])
    assert str(caught.value) == "call name 'unpin' appears in more than one pair"


def test_pair_options_replace_configured_pairs_only(tmp_path: Path) -> None:
    write_pyproject(tmp_path, "pairs = ['pin:unpin']\nhands_off = ['start']")
    source = tmp_path / "m.py"
    assert ConfigFinder(pairs=["a:b"]).for_file(source) == AuditConfig(
        pairs=(Pair("a", "b"),), hands_off=frozenset({"start"})
    )
    assert ConfigFinder().for_file(source).pairs == (Pair("pin", "unpin"),)
    assert str(DEFAULT_PAIRS[0]) == "protect_host:release_host"


def test_markers_are_read_from_comments_only() -> None:
    markers = read_markers(
        textwrap.dedent("""
            x = "# fsm-cache: hands-off"
            y = 1  # fsm-cache: hands-off, ignore[FSM104, FSM101] -- reason, with commas
            z = 2  # fsm-cache: takes-ownership
            w = 3  # fsm-cache: ignore
        """)
    )
    assert markers.flags == {3: {"hands-off"}, 4: {"takes-ownership"}}
    assert markers.ignores == {3: {"FSM104", "FSM101"}, 5: set()}
    assert markers.ignored(5, "FSM102")
    assert markers.ignored(3, "FSM101")
    assert not markers.ignored(3, "FSM102")
    assert markers.problems == []


@pytest.mark.parametrize(
    ("comment", "message"),
    [
        (
            "# fsm-cache: hand-off",
            "unknown fsm-cache directive 'hand-off' (expected hands-off, "
            "takes-ownership or ignore[CODE,...])",
        ),
        ("# fsm-cache: ignore[FSM1]", "unknown code 'FSM1' in fsm-cache marker"),
        ("# fsm-cache:", "empty fsm-cache marker"),
        ("# fsm-cache: hands-off!", "cannot read fsm-cache marker 'hands-off!'"),
        (
            "# fsm-cache: hands-off[FSM101]",
            "unknown fsm-cache directive 'hands-off' (expected "
            "hands-off, takes-ownership or ignore[CODE,...])",
        ),
    ],
)
def test_unreadable_markers_are_findings(comment: str, message: str) -> None:
    found = check_source(f"x = 1  {comment}\n", "m.py", AuditConfig())
    assert [(f.line, f.col, f.code, f.message, f.function) for f in found] == [
        (1, 8, "FSM100", message, "")
    ]


@pytest.mark.parametrize(
    "comment",
    [
        "# fsm_cache: hands-off",
        "# FSM-CACHE: hands-off",
        "# fsm-cache hands-off",
        "# Fsm-Cache: ignore[FSM101]",
    ],
)
def test_misspelt_markers_are_findings(comment: str) -> None:
    found = check_source(f"x = 1  {comment}\n", "m.py", AuditConfig())
    message = f"misspelt fsm-cache marker {comment!r} (expected '# fsm-cache: DIRECTIVE')"
    assert [(f.line, f.col, f.code, f.message) for f in found] == [(1, 8, "FSM100", message)]


def test_prose_about_fsm_cache_is_not_a_marker() -> None:
    source = "x = 1  # fsm_cache.engine leases; fsm-cache audit is run in CI\n"
    assert check_source(source, "m.py", AuditConfig()) == []


def test_a_marker_may_follow_another_comment() -> None:
    markers = read_markers(
        textwrap.dedent("""
            y = 1  # noqa  # fsm-cache: hands-off
            z = 2  # type: ignore[attr-defined]  # fsm-cache: ignore[FSM104] -- why
            w = 3  # fsm-cache: takes-ownership  # noqa: E501
        """)
    )
    assert markers.flags == {2: {"hands-off"}, 4: {"takes-ownership"}}
    assert markers.ignores == {3: {"FSM104"}}
    assert markers.problems == []


def test_a_bad_marker_after_another_comment_is_placed_at_the_marker() -> None:
    found = check_source("x = 1  # noqa  # fsm-cache: hand-off\n", "m.py", AuditConfig())
    assert [(f.line, f.col, f.code) for f in found] == [(1, 16, "FSM100")]


def test_signature_markers_cover_the_whole_function() -> None:
    source = textwrap.dedent("""
        def start(
            node,  # fsm-cache: hands-off
        ):
            node.protect_host()

        def finish(node):  # fsm-cache: takes-ownership
            node.release_host()
            node.release_host()
    """)
    found = check_source(source, "m.py", AuditConfig())
    assert [(f.line, f.code) for f in found] == [(9, "FSM102")]


def test_a_takes_ownership_function_hands_on_what_is_passed_to_it() -> None:
    source = textwrap.dedent("""
        class Cache:
            def start(self, node):
                node.protect_host()
                self.track(node)

            def track(self, node):  # fsm-cache: takes-ownership
                self.pending.add(node.id)
    """)
    assert check_source(source, "m.py", AuditConfig()) == []


def test_an_ignore_marker_silences_one_line() -> None:
    source = textwrap.dedent("""
        def f(node):
            node.protect_host()  # fsm-cache: ignore[FSM104]
            work()
            node.release_host()
            node.release_host()  # fsm-cache: ignore
    """)
    assert check_source(source, "m.py", AuditConfig()) == []


def test_a_marker_after_a_split_calls_closing_parenthesis_covers_it() -> None:
    """Formatters put a split call's comment after its ``)``: the marker documented nothing there."""
    source = textwrap.dedent("""
        class Cache:
            def stage(self, node):
                self.controller.inc_lock_ref(
                    node
                )  # fsm-cache: hands-off -- the ack handler releases it

            def finish(self, rid):
                self.controller.dec_lock_ref(
                    self.ongoing.pop(rid)
                )  # fsm-cache: takes-ownership

            def tolerated(self, node):
                self.controller.inc_lock_ref(
                    node,
                )  # fsm-cache: ignore[FSM101]
    """)
    assert check_source(source, "m.py", AuditConfig()) == []


def test_a_marker_inside_a_split_call_covers_only_its_own_line() -> None:
    source = textwrap.dedent("""
        def f(node, other):
            node.inc_lock_ref(
                other.protect_host(),  # fsm-cache: hands-off
            )
    """)
    found = check_source(source, "m.py", AuditConfig())
    assert [(f.line, f.code) for f in found] == [(3, "FSM101")]


# Where the config is found: the nearest pyproject.toml at or above each audited file.

HANDOFFS = """
    takes_ownership = ["Tracker.track", "Cache.finish"]
    hands_off = ["Cache.start_prefetch"]
"""
CACHE = textwrap.dedent("""\
    class Cache:
        def write(self, node):
            self.inc_lock_ref(node)
            self.tracker.track(node)

        def start_prefetch(self, node):
            node.protect_host()

        def finish(self, node):
            self.dec_lock_ref(node)

        def other(self, node):
            node.release_host()
""")
WRITE = (
    "3:9: FSM101 inc_lock_ref() on 'node' is not released or handed on"
    " when the function ends at line 4 [Cache.write]"
)
PREFETCH = (
    "7:9: FSM101 protect_host() on 'node' is not released or handed on"
    " when the function ends at line 7 [Cache.start_prefetch]"
)
FINISH = (
    "10:9: FSM103 dec_lock_ref() on 'node' has no inc_lock_ref() in reach"
    " and no documented hand-off [Cache.finish]"
)
OTHER = (
    "13:9: FSM103 release_host() on 'node' has no protect_host() in reach"
    " and no documented hand-off [Cache.other]"
)


def project(folder: Path, table: str) -> Path:
    """Write a project with ``table`` as its audit config and ``src/m.py``; return its folder."""
    (folder / "src").mkdir(parents=True)
    write_pyproject(folder, table)
    (folder / "src" / "m.py").write_text(CACHE)
    return folder


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Run the audit handler through its own ``register``, as the CLI shell does."""
    parser = argparse.ArgumentParser(prog="fsm-cache")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", *argv])
    status: int = args.handler(args)
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    ("cwd", "target"),
    [("proj", "src"), (".", "proj/src"), ("elsewhere", "../proj/src")],
    ids=["in-the-project", "from-the-parent", "from-a-sibling"],
)
def test_the_project_config_applies_from_any_working_directory(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    cwd: str,
    target: str,
) -> None:
    project(tmp_path / "proj", HANDOFFS)
    # The working directory's own config must not apply to the project's files.
    write_pyproject(tmp_path, "ignore = ['FSM103']")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / cwd)
    assert run_cli([target], capsys) == (1, [f"{target}/m.py:{OTHER}"])


def test_each_audited_tree_gets_its_own_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project(tmp_path / "a", HANDOFFS)
    project(tmp_path / "b", "ignore = ['FSM101']")
    monkeypatch.chdir(tmp_path)
    assert run_cli(["a", "b/src/m.py"], capsys) == (
        1,
        [f"a/src/m.py:{OTHER}", f"b/src/m.py:{FINISH}", f"b/src/m.py:{OTHER}"],
    )


def test_audit_paths_finds_each_files_config_by_default(tmp_path: Path) -> None:
    project(tmp_path / "a", HANDOFFS)
    project(tmp_path / "b", "")
    findings = audit_paths([str(tmp_path / "a"), str(tmp_path / "b")])
    assert [(Path(f.path).parts[-3], f.line, f.code) for f in findings] == [
        ("a", 13, "FSM103"),
        ("b", 3, "FSM101"),
        ("b", 7, "FSM101"),
        ("b", 10, "FSM103"),
        ("b", 13, "FSM103"),
    ]
    fixed = audit_paths([str(tmp_path / "a")], AuditConfig())
    assert [(f.line, f.code) for f in fixed] == [
        (3, "FSM101"),
        (7, "FSM101"),
        (10, "FSM103"),
        (13, "FSM103"),
    ]


def test_the_config_option_applies_to_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project(tmp_path / "a", HANDOFFS)
    project(tmp_path / "b", "ignore = ['FSM101']")
    monkeypatch.chdir(tmp_path)
    assert run_cli(["a", "b", "--config", "b/pyproject.toml"], capsys) == (
        1,
        [
            f"a/src/m.py:{FINISH}",
            f"a/src/m.py:{OTHER}",
            f"b/src/m.py:{FINISH}",
            f"b/src/m.py:{OTHER}",
        ],
    )


def test_pair_options_apply_to_every_found_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project(tmp_path / "a", HANDOFFS)
    project(tmp_path / "b", "")
    monkeypatch.chdir(tmp_path)
    status, out = run_cli(["a", "b", "--pair", "inc_lock_ref:dec_lock_ref"], capsys)
    assert (status, out) == (1, [f"b/src/m.py:{WRITE}", f"b/src/m.py:{FINISH}"])


def test_the_flake8_plugin_finds_the_config_as_the_cli_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project(tmp_path / "proj", HANDOFFS)
    write_pyproject(tmp_path, "ignore = ['FSM103']")
    monkeypatch.chdir(tmp_path)
    results = AuditPlugin(ast.parse(CACHE), "proj/src/m.py").run()
    flake8 = [f"proj/src/m.py:{line}:{col + 1}: {text}" for line, col, text, _ in results]
    assert run_cli(["proj/src/m.py"], capsys) == (1, flake8)
    assert flake8 == [f"proj/src/m.py:{OTHER}"]


def test_a_bad_config_in_one_tree_is_bad_input_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project(tmp_path / "a", HANDOFFS)
    bad = project(tmp_path / "b", "hands_off = 'start'")
    status = main([str(tmp_path / "a"), str(bad)])
    out, err = capsys.readouterr()
    assert (status, out, err) == (
        2,
        "",
        f"error: {(bad / 'pyproject.toml').resolve()}: [tool.fsm_cache.audit].hands_off:"
        " expected a list of strings\n",
    )


@pytest.mark.usefixtures("default_recursion_limit")
@too_big_toml.CASES
def test_a_pyproject_too_big_for_tomllib_is_bad_input_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    root = project(tmp_path / "a", "")
    (root / "pyproject.toml").write_text(content, encoding="utf-8")
    config = root / "pyproject.toml"
    for argv in ([str(root)], [str(tmp_path / "a" / "src"), "--config", str(config)]):
        status = main(argv)
        out, err = capsys.readouterr()
        shown = config.resolve() if "--config" not in argv else config
        assert (status, out, err) == (2, "", f"error: {shown}: invalid TOML: {message}\n")


def test_a_config_option_that_is_no_regular_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project(tmp_path / "a", "")
    status = main([str(tmp_path / "a"), "--config", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (status, out, err) == (2, "", f"error: {tmp_path}: not a regular file\n")


def test_a_missing_config_option_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project(tmp_path / "a", "")
    status = main([str(tmp_path / "a"), "--config", str(tmp_path / "nope.toml")])
    out, err = capsys.readouterr()
    assert (status, out, err) == (2, "", f"error: {tmp_path / 'nope.toml'}: no such config file\n")


@pytest.mark.usefixtures("default_recursion_limit")
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"tool = 1\n", "[tool]: expected a table"),
        (b"[tool]\nfsm_cache = 3\n", "[tool.fsm_cache]: expected a table"),
        (b"[tool.fsm_cache]\naudit = [1]\n", "[tool.fsm_cache.audit]: expected a table"),
        (
            b"\xff\n",
            "invalid TOML: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
        (b"x = " + b"9" * 5000 + b"\n", f"invalid TOML: {too_big_toml.TOO_MANY_DIGITS}"),
        (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "invalid TOML: nested too deeply"),
    ],
)
def test_misshapen_pyprojects_are_refused_with_the_place(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_bytes(content)
    with pytest.raises(AuditError) as caught:
        ConfigFinder().for_file(tmp_path / "m.py")
    assert str(caught.value) == f"{path.resolve()}: {message}"


def test_each_pyproject_is_read_once_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = project(tmp_path / "a", HANDOFFS)
    (root / "src" / "sub").mkdir()
    read: list[Path | None] = []

    def counting(path: Path | None) -> AuditConfig:
        read.append(path)
        return load_config(path)

    monkeypatch.setattr(config_module, "load_config", counting)
    finder = ConfigFinder()
    names = ["src/m.py", "src/n.py", "src/sub/o.py", "p.py"]
    configs = {finder.for_file(root / name) for name in names}
    assert configs == {load_config(root / "pyproject.toml")}
    assert read == [(root / "pyproject.toml").resolve()]


def test_a_file_outside_any_folder_takes_the_working_directorys_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = project(tmp_path / "a", HANDOFFS)
    monkeypatch.chdir(root / "src")
    assert ConfigFinder().for_file("stdin") == load_config(root / "pyproject.toml")
    assert ConfigFinder().for_file("no/such/dir/m.py") == load_config(root / "pyproject.toml")
