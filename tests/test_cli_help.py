"""``fsm-cache COMMAND --help``: plain text, whatever markup the docstrings it is drawn from use."""

from __future__ import annotations

import pytest

from fsm_cache.cli.main import main


COMMANDS = ["audit", "bench", "check", "demo", "diagram", "types", "validate", "verify"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_rest_markup(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """``check --help`` and ``verify --help`` opened with ````fsm-cache check````: reST's marks."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fsm-cache {command} ")
    assert "``" not in out
