"""Reading the generated files that ``--check`` compares and ``--write`` refreshes."""

from __future__ import annotations

from pathlib import Path


def current_text(path: Path) -> str | None:
    """Return the text of a generated file: None when missing, ``""`` when not UTF-8.

    A file that is not UTF-8 is not what fsm_cache generated either: it reads
    as an empty text, so ``--check`` calls it stale and ``--write`` rewrites it
    instead of failing on the decode.
    """
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""
