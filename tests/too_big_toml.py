"""TOML that Python's parser cannot take, and what ``read_toml`` says of each (shared cases)."""

from __future__ import annotations

import pytest


TOO_MANY_DIGITS = (
    "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits;"
    " use sys.set_int_max_str_digits() to increase the limit"
)

CASES = pytest.mark.parametrize(
    ("content", "message"),
    [
        ("x = " + "9" * 5000 + "\n", TOO_MANY_DIGITS),
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ],
)
"""``content`` of a pyproject.toml and the reason ``invalid TOML: <message>`` gives."""
