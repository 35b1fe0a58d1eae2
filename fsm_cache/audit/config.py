"""Settings of the audit: the ``[tool.fsm_cache.audit]`` table and ``--pair`` options.

Example::

    [tool.fsm_cache.audit]
    pairs = ["protect_host:release_host", "inc_lock_ref:dec_lock_ref"]
    takes_ownership = ["HiRadixCache.release_aborted_request", "_track_write_through"]
    hands_off = ["HiRadixCache.prefetch_from_storage"]
    non_raising = ["record_metric"]
    ignore = ["FSM104"]
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from fsm_cache.audit.model import (
    DEFAULT_NON_RAISING,
    RULES_BY_CODE,
    AuditConfig,
    AuditError,
    Pair,
)


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_KEYS = ("pairs", "takes_ownership", "hands_off", "non_raising", "ignore")


def parse_pair(text: str) -> Pair:
    """Parse ``ACQUIRE:RELEASE`` into a :class:`Pair`."""
    acquire, sep, release = text.partition(":")
    if not sep or not acquire.isidentifier() or not release.isidentifier():
        raise AuditError(f"bad pair {text!r}: expected ACQUIRE:RELEASE, two call names")
    if acquire == release:
        raise AuditError(f"bad pair {text!r}: the acquire and release names must differ")
    return Pair(acquire, release)


def parse_pairs(texts: Sequence[str]) -> tuple[Pair, ...]:
    """Parse several pairs; a call name may belong to one pair only."""
    pairs = tuple(parse_pair(text) for text in texts)
    if not pairs:
        raise AuditError("no pairs to check: give at least one ACQUIRE:RELEASE")
    names = [name for pair in pairs for name in (pair.acquire, pair.release)]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise AuditError(f"call name {repeated[0]!r} appears in more than one pair")
    return pairs


def find_pyproject(start: Path) -> Path | None:
    """Return the nearest ``pyproject.toml`` at or above ``start``."""
    start = start.resolve()
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(path: Path | None) -> AuditConfig:
    """Read the audit table of the pyproject.toml at ``path``; defaults when absent."""
    if path is None:
        return AuditConfig()
    try:
        with path.open("rb") as stream:
            document = tomllib.load(stream)
    except tomllib.TOMLDecodeError as exc:
        raise AuditError(f"{path}: invalid TOML: {exc}") from None
    table = document.get("tool", {}).get("fsm_cache", {}).get("audit", {})
    return config_from_table(table, f"{path}: [tool.fsm_cache.audit]")


def config_from_table(table: Mapping[str, object], origin: str) -> AuditConfig:
    """Build the config from the audit table; ``origin`` prefixes error messages."""
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise AuditError(f"{origin}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    lists = {key: _strings(table.get(key, []), f"{origin}.{key}") for key in _KEYS}
    codes = sorted(set(lists["ignore"]) - RULES_BY_CODE.keys())
    if codes:
        raise AuditError(f"{origin}.ignore: unknown code {codes[0]!r}")
    config = AuditConfig(
        takes_ownership=frozenset(lists["takes_ownership"]),
        hands_off=frozenset(lists["hands_off"]),
        non_raising=DEFAULT_NON_RAISING | frozenset(lists["non_raising"]),
        ignore=frozenset(lists["ignore"]),
    )
    if "pairs" in table:
        config = replace(config, pairs=_pairs_at(lists["pairs"], f"{origin}.pairs"))
    return config


def with_pairs(config: AuditConfig, texts: Sequence[str]) -> AuditConfig:
    """Return ``config`` with its pairs replaced by the ``--pair`` options, if any."""
    return replace(config, pairs=parse_pairs(texts)) if texts else config


def _pairs_at(texts: list[str], origin: str) -> tuple[Pair, ...]:
    try:
        return parse_pairs(texts)
    except AuditError as exc:
        raise AuditError(f"{origin}: {exc}") from None


def _strings(value: object, origin: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AuditError(f"{origin}: expected a list of strings")
    return [str(item) for item in value]
