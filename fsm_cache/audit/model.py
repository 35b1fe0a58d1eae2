"""Findings, rule codes and settings of the acquire/release audit.

Everything here is plain data shared by the analysis, the reports, the CLI and
the flake8 plugin, so that all four agree on codes, wording and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsm_cache.errors import FsmCacheError


VERSION = "0.1.0"


class AuditError(FsmCacheError):
    """Bad input to the audit: an unreadable file, a syntax error, a bad option or config."""


@dataclass(frozen=True)
class Rule:
    """One finding code, as the docs, SARIF rules and ``--format json`` describe it.

    Attributes:
        code: The code, ``FSM1xx``.
        name: A short kebab-case name, used as the SARIF rule name.
        summary: One sentence saying what the code reports.
        level: The SARIF level, ``error`` or ``warning``.
    """

    code: str
    name: str
    summary: str
    level: str


RULES: tuple[Rule, ...] = (
    Rule("FSM100", "bad-marker", "A '# fsm-cache:' comment the audit cannot read.", "error"),
    Rule(
        "FSM101",
        "unreleased-acquire",
        "An acquire is neither released nor handed on along some path out of the function.",
        "error",
    ),
    Rule(
        "FSM102",
        "double-release",
        "A release can run after the same resource was already released on that path.",
        "error",
    ),
    Rule(
        "FSM103",
        "release-without-acquire",
        "A release with no acquire in reach and no documented hand-off.",
        "warning",
    ),
    Rule(
        "FSM104",
        "exception-unsafe-acquire",
        "An acquire leaks when a call after it raises; the release is not in a finally.",
        "warning",
    ),
    Rule(
        "FSM105",
        "release-on-unacquired-path",
        "A release also runs on a path that skipped the acquire.",
        "error",
    ),
    Rule(
        "FSM106",
        "not-analyzed",
        "A function past the analysis' bounds; what it acquires and releases is unchecked.",
        "error",
    ),
)
RULES_BY_CODE: dict[str, Rule] = {rule.code: rule for rule in RULES}


@dataclass(frozen=True, order=True)
class Finding:
    """One reported problem, ordered by place so reports are stable.

    Attributes:
        path: The source path as given on the command line.
        line: 1-based line of the call at fault.
        col: 1-based column of the call at fault.
        code: The rule code, ``FSM1xx``.
        message: The exact message; tests compare it verbatim.
        function: The qualified name of the enclosing function (``Class.method``).
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    function: str


@dataclass(frozen=True)
class Argument:
    """The argument a pair's call takes its resource from, as the pair declares it.

    Written after the call name: ``release_layout(event, key)`` lists the
    call's arguments up to the resource, the resource last, so its resource is
    the second positional argument or the keyword ``key``; ``acquire(self)``
    names the receiver, whatever else the call is passed.

    Attributes:
        params: The argument names, the resource's last; ``("self",)`` for the receiver.
    """

    params: tuple[str, ...]

    @property
    def receiver(self) -> bool:
        """Whether the resource is the receiver (``lock`` in ``lock.acquire(timeout=t)``)."""
        return self.params == ("self",)

    @property
    def position(self) -> int:
        """The resource's index among the positional arguments."""
        return len(self.params) - 1

    @property
    def keyword(self) -> str:
        """The keyword that passes the resource by name."""
        return self.params[-1]

    def __str__(self) -> str:
        return f"({', '.join(self.params)})"


@dataclass(frozen=True)
class Pair:
    """An acquiring call name and the call name that undoes it (``protect_host:release_host``).

    Attributes:
        acquire: The acquiring call's name.
        release: The releasing call's name.
        acquire_at: Where the acquire takes its resource, or None for the
            default rule (its first argument, else its receiver).
        release_at: The same for the release.
    """

    acquire: str
    release: str
    acquire_at: Argument | None = None
    release_at: Argument | None = None

    def __str__(self) -> str:
        acquire = f"{self.acquire}{self.acquire_at or ''}"
        return f"{acquire}:{self.release}{self.release_at or ''}"

    def argument(self, name: str) -> Argument | None:
        """Return where the call named ``name`` (this pair's acquire or release) takes its resource."""
        return self.acquire_at if name == self.acquire else self.release_at


DEFAULT_PAIRS = (Pair("protect_host", "release_host"), Pair("inc_lock_ref", "dec_lock_ref"))

# Calls that do not raise in practice: treating them as raising would report
# every acquire followed by a len() or a log line as exception-unsafe.
DEFAULT_NON_RAISING = frozenset(
    {
        *("len", "isinstance", "issubclass", "id", "repr", "str", "bool", "hasattr", "callable"),
        *("type", "range", "enumerate", "zip", "reversed", "sorted", "min", "max", "any", "all"),
        *("list", "tuple", "set", "dict", "frozenset", "super", "print"),
        *("get", "items", "keys", "values", "clear", "discard", "setdefault"),
        *("debug", "info", "warning", "error", "exception", "critical", "log"),
        *("time", "monotonic", "perf_counter"),
    }
)


@dataclass(frozen=True)
class AuditConfig:
    """What to pair and which hand-offs are deliberate.

    Attributes:
        pairs: The acquire/release call names to pair.
        takes_ownership: Functions that take over a resource passed to them: a call
            hands the resource on, and their own releases need no acquire.
        hands_off: Functions whose acquires are handed on by means the audit
            cannot see; their FSM101 and FSM104 findings are not reported.
        non_raising: Call names treated as never raising.
        ignore: Codes never reported.
    """

    pairs: tuple[Pair, ...] = DEFAULT_PAIRS
    takes_ownership: frozenset[str] = frozenset()
    hands_off: frozenset[str] = frozenset()
    non_raising: frozenset[str] = field(default=DEFAULT_NON_RAISING)
    ignore: frozenset[str] = frozenset()
