"""Settings of the audit: the ``[tool.fsm_cache.audit]`` table and ``--pair`` options.

The table that applies to a source file is the one in the nearest
``pyproject.toml`` at or above that file, so a project's declarations hold
wherever the audit runs from; :class:`ConfigFinder` is that one rule, shared
by the CLI and the flake8 plugin. Example::

    [tool.fsm_cache.audit]
    pairs = ["protect_host:release_host", "acquire_layout(key):release_layout(event, key)"]
    takes_ownership = ["HiRadixCache.release_aborted_request", "_track_write_through"]
    hands_off = ["HiRadixCache.prefetch_from_storage"]
    non_raising = ["record_metric"]
    ignore = ["FSM104"]
"""

from __future__ import annotations

import keyword
import stat
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from fsm_cache.audit.model import (
    DEFAULT_NON_RAISING,
    RULES_BY_CODE,
    Argument,
    AuditConfig,
    AuditError,
    Pair,
)
from fsm_cache.errors import SpecError
from fsm_cache.shell import find_pyproject

# The spec loader's reader, shared so every TOML fsm_cache reads is bounded alike:
# at most 16 MiB, and nesting or integers too large for tomllib are errors, not crashes.
from fsm_cache.spec.loader import read_toml


_TABLE = ("tool", "fsm_cache", "audit")
_KEYS = ("pairs", "takes_ownership", "hands_off", "non_raising", "ignore")


def parse_pair(text: str) -> Pair:
    """Parse ``ACQUIRE:RELEASE`` into a :class:`Pair`; both must be call names, not keywords.

    Either name may be followed by the arguments that locate its resource
    (:class:`Argument`): ``acquire_layout(key):release_layout(event, key)``,
    ``acquire(self):release``.
    """
    first, sep, second = text.partition(":")
    acquire, acquire_at = _side(first, text)
    release, release_at = _side(second, text)
    if not sep or not _is_name(acquire) or not _is_name(release):
        raise AuditError(f"bad pair {text!r}: expected ACQUIRE:RELEASE, two call names")
    if acquire == release:
        raise AuditError(f"bad pair {text!r}: the acquire and release names must differ")
    return Pair(acquire, release, acquire_at, release_at)


def _side(side: str, text: str) -> tuple[str, Argument | None]:
    """Split one side of a pair into its call name and the argument it declares, if any.

    Raises:
        AuditError: The parenthesised list is not argument names, the
            resource's last, or ``self`` alone.
    """
    name, paren, rest = side.partition("(")
    if not paren:
        return name, None
    params = tuple(param.strip() for param in rest.removesuffix(")").split(","))
    if not rest.endswith(")") or not all(_is_name(param) for param in params):
        raise AuditError(
            f"bad pair {text!r}: {name}(...) must list the argument names up to the resource, "
            f"the resource last ({name}(event, key)), or be {name}(self) for the receiver"
        )
    if "self" in params and len(params) > 1:
        raise AuditError(
            f"bad pair {text!r}: self names {name}()'s receiver and stands alone; "
            "list only the arguments a call passes"
        )
    repeated = sorted({param for param in params if params.count(param) > 1} - {"_"})
    if repeated:
        raise AuditError(f"bad pair {text!r}: {name}() names argument {repeated[0]!r} twice")
    return name, Argument(params)


def _is_name(text: str) -> bool:
    """Return whether ``text`` can be called by name: an identifier, not a keyword."""
    return text.isidentifier() and not keyword.iskeyword(text)


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


class ConfigFinder:
    """Find the config of each audited file, reading each pyproject.toml once.

    Without ``explicit``, a file gets the table of the nearest pyproject.toml at
    or above its folder (defaults when there is none), whatever the working
    directory. ``explicit`` (``--config``) applies to every file instead, and
    ``pairs`` (``--pair``) replace the pairs of every config. Both are checked
    here, before any file is read. Results are cached for the finder's lifetime:
    one run.
    """

    def __init__(self, explicit: Path | None = None, pairs: Sequence[str] = ()) -> None:
        self._pairs = parse_pairs(pairs) if pairs else None
        self._by_pyproject: dict[Path | None, AuditConfig] = {}
        self._by_folder: dict[Path, AuditConfig] = {}
        self._explicit: AuditConfig | None = None
        if explicit is not None:
            _check_config_file(explicit)
            self._explicit = self._load(explicit)

    def for_file(self, filename: str | Path) -> AuditConfig:
        """Return the config that applies to the source file ``filename``.

        A name whose folder does not exist (flake8's ``stdin``) is taken to be
        in the working directory.
        """
        if self._explicit is not None:
            return self._explicit
        folder = Path(filename).parent
        folder = (folder if folder.is_dir() else Path.cwd()).resolve()
        if folder not in self._by_folder:
            self._by_folder[folder] = self._load(find_pyproject(folder))
        return self._by_folder[folder]

    def _load(self, path: Path | None) -> AuditConfig:
        if path not in self._by_pyproject:
            config = load_config(path)
            if self._pairs is not None:
                config = replace(config, pairs=self._pairs)
            self._by_pyproject[path] = config
        return self._by_pyproject[path]


def _check_config_file(path: Path) -> None:
    """Refuse a ``--config`` that is missing, or there but no regular file (a folder, a FIFO).

    Raises:
        AuditError: Saying which, so ``--config /tmp`` is not called missing.
    """
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise AuditError(f"{path}: no such config file") from None
    except OSError as exc:
        raise AuditError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise AuditError(f"{path}: not a regular file")


def load_config(path: Path | None) -> AuditConfig:
    """Read the audit table of the pyproject.toml at ``path``; defaults when absent.

    The file is read as the spec loader reads specs, so whatever it holds (an
    integer of 5000 digits, arrays nested 5000 deep) is an :class:`AuditError`
    naming the file, never a ``ValueError`` or ``RecursionError`` traceback.

    Raises:
        AuditError: The file cannot be read, is not TOML, or its table is not usable.
    """
    if path is None:
        return AuditConfig()
    try:
        table: Mapping[str, object] = read_toml(path)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else None
        raise AuditError(f"{path}: cannot read: {why or exc}") from None
    except SpecError as exc:  # not UTF-8, not TOML, too large, too deep, too long an integer
        raise AuditError(exc.problems[0]) from None
    for depth, key in enumerate(_TABLE):
        value = table.get(key, {})
        if not isinstance(value, dict):
            where = ".".join(_TABLE[: depth + 1])
            raise AuditError(f"{path}: [{where}]: expected a table")
        table = value
    return config_from_table(table, f"{path}: [tool.fsm_cache.audit]")


def config_from_table(table: Mapping[str, object], origin: str) -> AuditConfig:
    """Build the config from the audit table; ``origin`` prefixes error messages."""
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise AuditError(f"{origin}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    lists = {key: _strings(table.get(key, []), f"{origin}.{key}") for key in _KEYS}
    for key in ("takes_ownership", "hands_off", "non_raising"):
        _check_names(lists[key], f"{origin}.{key}")
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


def _pairs_at(texts: list[str], origin: str) -> tuple[Pair, ...]:
    try:
        return parse_pairs(texts)
    except AuditError as exc:
        raise AuditError(f"{origin}: {exc}") from None


def _check_names(names: list[str], origin: str) -> None:
    """Refuse a function name that is not ``name`` or dotted names (``Class.method``)."""
    for name in names:
        if not all(_is_name(part) for part in name.split(".")):
            raise AuditError(
                f"{origin}: bad name {name!r}: expected a function name or Class.method"
            )


def _strings(value: object, origin: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AuditError(f"{origin}: expected a list of strings")
    return [str(item) for item in value]
