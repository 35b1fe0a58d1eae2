"""TOML that Python's parser cannot take, and what ``read_toml`` says of each (shared cases)."""

from __future__ import annotations

import pytest


def too_many_digits(digits: int) -> str:
    """Python's own words for an integer of ``digits`` digits, past its int-to-str limit.

    The TOML parser's message is quoted as it is, and Python words it differently
    by version: "Exceeds the limit (4300)" on 3.10, "(4300 digits)" on 3.11.
    """
    try:
        int("9" * digits)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"Python converted {digits} digits: no limit")


TOO_MANY_DIGITS = too_many_digits(5000)

CASES = pytest.mark.parametrize(
    ("content", "message"),
    [
        ("x = " + "9" * 5000 + "\n", TOO_MANY_DIGITS),
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ],
)
"""``content`` of a pyproject.toml and the reason ``invalid TOML: <message>`` gives."""
