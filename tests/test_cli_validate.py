"""``fsm-cache validate``: one line per file or problem, exit 2 on any failure, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    status = main(["validate", *args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def test_the_shipped_specs_are_ok(capsys: pytest.CaptureFixture[str]) -> None:
    host, residency = spec_dir() / "host_residency.toml", spec_dir() / "residency.toml"
    status, out, err = run(capsys, str(host), str(residency))
    assert (status, err) == (0, [])
    assert len(out) == 2
    assert out[0].startswith(f"ok: {host} (machine host_residency: 5 states, ")
    assert out[1].startswith(f"ok: {residency} (composition residency of host, device: 8 states, ")


def test_the_summary_counts_what_the_file_declares(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "flip.toml"
    path.write_text(FLIP, encoding="utf-8")
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(path), str(comp)) == (
        0,
        [
            f"ok: {path} (machine flip: 2 states, 2 transitions, 2 refusals)",
            f"ok: {comp} (composition pair of one: 2 states, 2 transitions, 3 refusals)",
        ],
        [],
    )


FLIP = """
[machine]
name = "flip"
initial = "a"
[states]
a = {}
b = {}
[[transition]]
event = "flip"
source = "a"
dest = "b"
[[transition]]
event = "flop"
source = "b"
dest = "a"
[[forbid]]
event = "flip"
source = "b"
error = "Flipped"
reason = "already flipped"
[[forbid]]
event = "flop"
source = "a"
error = "Flopped"
reason = "already flopped"
"""
PAIR = """
[composition]
name = "pair"
[composition.regions]
one = "flip.toml"
[[forbid]]
event = "flip"
when = "one in [a]"
error = "Stuck"
reason = "stuck"
"""


def test_every_problem_of_every_file_is_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = tmp_path / "flip.toml"
    good.write_text(FLIP, encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        FLIP.replace('source = "b"\ndest', 'source = "c"\ndest').replace(
            "= {}\n[[", "= {}\nc = { final = true }\n[[", 1
        ),
        encoding="utf-8",
    )
    toml = tmp_path / "broken.toml"
    toml.write_text("[machine\n", encoding="utf-8")
    missing = tmp_path / "missing.toml"
    status, out, err = run(capsys, str(bad), str(good), str(toml), str(missing), str(tmp_path))
    assert status == 2
    assert out == [f"ok: {good} (machine flip: 2 states, 2 transitions, 2 refusals)"]
    assert err == [
        f"error: {bad}: states.b: event 'flop' is neither a transition nor a forbid (not total)",
        f"error: {bad}: states.b: not final and has no transition out",
        f"error: {bad}: states.c: unreachable from a",
        f"error: {toml}: invalid TOML: Expected ']' at the end of a table declaration (at line 1, column 9)",
        f"error: {missing}: cannot read: No such file or directory",
        f"error: {tmp_path}: cannot read: Is a directory",
    ]


def test_a_spec_error_in_a_region_file_names_that_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "flip.toml").write_text(
        FLIP.replace('initial = "a"', 'initial = "z"'), encoding="utf-8"
    )
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(comp)) == (
        2,
        [],
        [f"error: {tmp_path / 'flip.toml'}: machine.initial: unknown state 'z'"],
    )


SPEND = """
[machine]
name = "budget"
initial = "open"
[counters]
tokens = 0
[states]
open = {}
closed = { final = true }
[[transition]]
event = "close"
source = "open"
dest = "closed"
[[transition]]
event = "spend"
source = "open"
dest = "open"
guard = "tokens <= 4096"
[[transition]]
event = "spend"
source = "open"
dest = "open"
guard = "tokens >= 99999999999999999999"
[[forbid]]
event = "spend"
source = "open"
guard = "tokens >= 4097 and tokens <= 99999999999999999998"
error = "OverBudget"
reason = "too many tokens"
"""


def test_big_constants_are_findings_not_tracebacks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = tmp_path / "budget.toml"
    good.write_text(SPEND, encoding="utf-8")
    gap = tmp_path / "gap.toml"
    gap.write_text(SPEND.replace("99999999999999999998", "99999999999999999997"), encoding="utf-8")
    huge = tmp_path / "huge.toml"
    huge.write_text(SPEND.replace("4096", "4" + "0" * 1000), encoding="utf-8")
    assert run(capsys, str(good), str(gap), str(huge)) == (
        2,
        [f"ok: {good} (machine budget: 2 states, 3 transitions, 1 refusals)"],
        [
            f"error: {gap}: states.open: event 'spend' is neither a transition nor a forbid when tokens=99999999999999999998 (not total)",
            f"error: {huge}: transition[1].guard: an integer has 1001 digits, more than 1000",
        ],
    )


def test_a_missing_region_file_names_the_composition_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(comp)) == (
        2,
        [],
        [
            f"error: {comp}: composition.regions.one: cannot read {tmp_path / 'flip.toml'}: No such file or directory"
        ],
    )


def test_no_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    _, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        "fsm-cache validate: error: the following arguments are required: SPEC"
    )


def test_version_is_the_installed_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``fsm-cache --version`` prints the distribution's version and exits 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"fsm-cache {version('fsm-cache')}\n"
