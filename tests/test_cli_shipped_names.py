"""Every command that takes a SPEC takes a shipped spec by name, ``fsm_cache:NAME``.

The same rule as ``extends = "fsm_cache:NAME"`` (``spec.shipped.shipped_file``):
the name reads the installed copy, so a user's CI need not know where
site-packages is. A name no shipped spec has is argparse's error, exit 2,
listing the names there are.
"""

from __future__ import annotations

import pytest

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import shipped_names, spec_dir


NAMES = ", ".join(shipped_names())


@pytest.mark.parametrize(
    "words",
    [
        ["validate"],
        ["diagram", "--format", "md"],
        ["types"],
        ["check", "--nodes", "2"],
    ],
    ids=lambda words: words[0],
)
def test_a_shipped_name_is_the_installed_file(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(spec_dir() / "host_residency.toml")
    assert main([*words, path]) == 0
    by_path = capsys.readouterr().out
    assert main([*words, "fsm_cache:host_residency"]) == 0
    by_name = capsys.readouterr().out
    if words[0] == "check":  # the timing lines differ from run to run
        by_path, by_name = (
            "\n".join(
                line for line in out.splitlines() if not line.startswith(("  states/s:", "  time:"))
            )
            for out in (by_path, by_name)
        )
        assert by_name.startswith(f"{spec_dir() / 'host_residency.toml'}: 2 nodes")
        assert "states explored: 64 " in by_name
    assert by_name == by_path
    assert by_name


@pytest.mark.parametrize("command", ["validate", "diagram", "types", "check", "verify"])
def test_a_name_no_shipped_spec_has_is_a_usage_error(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "fsm_cache:resid"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"fsm-cache {command}: error: argument {'SPEC_OR_MODULE' if command == 'verify' else 'SPEC'}: "
        f"no shipped spec 'resid' (shipped: {NAMES})"
    )


def test_a_long_unknown_name_is_quoted_from_its_start(capsys: pytest.CaptureFixture[str]) -> None:
    """reprlib cut the middle out, so the message showed a name the user never wrote."""
    name = "bugs_detected/" + "x" * 80
    with pytest.raises(SystemExit):
        main(["validate", f"fsm_cache:{name}"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"fsm-cache validate: error: argument SPEC: no shipped spec {name[:60]!r}... "
        f"(shipped: {NAMES})"
    )
