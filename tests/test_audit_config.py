"""Settings of the audit: the pyproject table, ``--pair``, and the comment markers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fsm_cache.audit import AuditConfig, AuditError, Pair, check_source, load_config, parse_pair
from fsm_cache.audit.config import config_from_table, find_pyproject, parse_pairs, with_pairs
from fsm_cache.audit.markers import read_markers
from fsm_cache.audit.model import DEFAULT_NON_RAISING, DEFAULT_PAIRS


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


def test_pair_options_replace_configured_pairs() -> None:
    config = config_from_table({"pairs": ["pin:unpin"]}, "t")
    assert with_pairs(config, ["a:b"]).pairs == (Pair("a", "b"),)
    assert with_pairs(config, []).pairs == (Pair("pin", "unpin"),)
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
