"""Reports (text, JSON, SARIF 2.1.0) and the flake8 plugin interface."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from fsm_cache.audit import RULES, Finding
from fsm_cache.audit.flake8 import AuditPlugin
from fsm_cache.audit.model import VERSION
from fsm_cache.audit.report import render_report, to_sarif, to_text


FINDINGS = [
    Finding("pkg/cache.py", 12, 9, "FSM102", "release_host() on 'node' can run twice", "C.f"),
    Finding("pkg/cache.py", 30, 1, "FSM100", "empty fsm-cache marker", ""),
]
LEAKY = textwrap.dedent("""
    def load(self, node):
        node.protect_host()
        self.copy(node)
        node.release_host()
""")


def test_text_is_one_linter_line_per_finding() -> None:
    assert to_text(FINDINGS) == [
        "pkg/cache.py:12:9: FSM102 release_host() on 'node' can run twice [C.f]",
        "pkg/cache.py:30:1: FSM100 empty fsm-cache marker",
    ]
    assert render_report([], "text") == ""


def test_json_round_trips() -> None:
    data = json.loads(render_report(FINDINGS, "json"))
    assert data["version"] == VERSION
    assert data["findings"][0] == {
        "path": "pkg/cache.py",
        "line": 12,
        "column": 9,
        "code": "FSM102",
        "message": "release_host() on 'node' can run twice",
        "function": "C.f",
    }


def test_sarif_has_the_2_1_0_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    log = json.loads(to_sarif(FINDINGS))
    assert log["version"] == "2.1.0"
    assert log["$schema"] == "https://json.schemastore.org/sarif-2.1.0.json"
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "fsm-cache-audit"
    assert [rule["id"] for rule in driver["rules"]] == [rule.code for rule in RULES]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == tmp_path.as_uri() + "/"
    first = run["results"][0]
    assert first == {
        "ruleId": "FSM102",
        "ruleIndex": 2,
        "level": "error",
        "message": {"text": "release_host() on 'node' can run twice"},
        "locations": [
            {
                "physicalLocation": {
                    "artifactLocation": {"uri": "pkg/cache.py", "uriBaseId": "%SRCROOT%"},
                    "region": {"startLine": 12, "startColumn": 9},
                },
                "logicalLocations": [{"fullyQualifiedName": "C.f", "kind": "function"}],
            }
        ],
    }
    assert "logicalLocations" not in run["results"][1]["locations"][0]
    assert driver["rules"][first["ruleIndex"]]["id"] == "FSM102"


def test_sarif_paths_under_the_working_directory_become_relative(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    inside = Finding(str(tmp_path / "a b.py"), 1, 1, "FSM103", "m", "f")
    outside = Finding("/elsewhere/x.py", 1, 1, "FSM103", "m", "f")
    results = json.loads(to_sarif([inside, outside]))["runs"][0]["results"]
    uris = [r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results]
    assert uris == ["a%20b.py", "file:///elsewhere/x.py"]


def test_flake8_plugin_has_the_flake8_interface() -> None:
    assert AuditPlugin.name == "fsm-cache-audit"
    assert AuditPlugin.version == VERSION
    plugin = AuditPlugin(ast.parse(LEAKY), "cache.py")
    assert list(plugin.run()) == [
        (
            3,
            4,
            "FSM104 protect_host() on 'node' leaks if line 4 raises; release it in"
            " try/finally or hold it with a lease [load]",
            AuditPlugin,
        )
    ]


def test_flake8_plugin_reads_markers_from_lines_or_the_file(tmp_path: Path) -> None:
    source = LEAKY.replace("node.protect_host()", "node.protect_host()  # fsm-cache: ignore")
    lines = source.splitlines(keepends=True)
    assert list(AuditPlugin(ast.parse(source), "cache.py", lines).run()) == []
    path = tmp_path / "cache.py"
    path.write_text(source)
    assert list(AuditPlugin(ast.parse(source), str(path)).run()) == []


def test_flake8_plugin_reads_the_nearest_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.fsm_cache.audit]\nignore = ['FSM104']\n")
    path = tmp_path / "cache.py"
    path.write_text(LEAKY)
    assert list(AuditPlugin(ast.parse(LEAKY), str(path)).run()) == []


def test_flake8_plugin_reports_a_bad_config_as_a_result(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.fsm_cache.audit]\nbogus = 1\n")
    path = tmp_path / "cache.py"
    path.write_text(LEAKY)
    ((line, col, message, kind),) = AuditPlugin(ast.parse(LEAKY), str(path)).run()
    assert (line, col, kind) == (1, 0, AuditPlugin)
    assert message.startswith("FSM100 ")
    assert message.endswith(
        "unknown key 'bogus' (known: pairs, takes_ownership, hands_off, non_raising, ignore)"
    )


def test_the_flake8_entry_point_is_declared() -> None:
    pyproject = Path(__file__).parent.parent / "pyproject.toml"
    text = pyproject.read_text()
    assert (
        '[project.entry-points."flake8.extension"]\nFSM = "fsm_cache.audit.flake8:AuditPlugin"'
        in text
    )


def test_sarif_paths_outside_the_working_directory_have_no_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "src").mkdir()
    monkeypatch.chdir(tmp_path / "src")
    findings = [
        Finding("a.py", 1, 1, "FSM103", "m", "f"),
        Finding("../b.py", 1, 1, "FSM103", "m", "f"),
        Finding("/elsewhere/x.py", 1, 1, "FSM103", "m", "f"),
    ]
    results = json.loads(to_sarif(findings))["runs"][0]["results"]
    assert [r["locations"][0]["physicalLocation"]["artifactLocation"] for r in results] == [
        {"uri": "a.py", "uriBaseId": "%SRCROOT%"},
        {"uri": (tmp_path / "b.py").as_uri()},
        {"uri": "file:///elsewhere/x.py"},
    ]


@pytest.mark.usefixtures("default_recursion_limit")  # an earlier test may raise it
def test_flake8_plugin_reports_a_function_too_deep_to_analyze_as_a_result() -> None:
    source = (
        "x = 1\n\ndef f(node):\n    node.protect_host()\n    x = " + " + ".join(["a"] * 1500) + "\n"
    )
    lines = source.splitlines(keepends=True)
    message = "FSM106 f is too deeply nested to analyze; nothing in it is checked [f]"
    assert list(AuditPlugin(ast.parse(source), "deep.py", lines).run()) == [
        (3, 0, message, AuditPlugin)
    ]


def test_flake8_plugin_columns_count_characters() -> None:
    source = 'def f(node):\n    s = "ééé"; node.protect_host()\n'
    lines = source.splitlines(keepends=True)
    ((line, col, _, _),) = AuditPlugin(ast.parse(source), "cache.py", lines).run()
    assert (line, col) == (2, 15)
