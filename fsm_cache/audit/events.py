"""What the path analysis saw, per call site, before it becomes findings.

The analysis visits the same call site on many paths; the sink keeps one
entry per site and resource, with the earliest line to cite, so the findings
and their messages do not depend on the order paths were explored in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsm_cache.audit.state import ResourceKey


# (line, col, key): one call site acting on one resource.
SiteKey = tuple[int, int, ResourceKey]


@dataclass
class Sink:
    """The events of one function.

    Attributes:
        acquires: ResourceKey -> the earliest (line, col) acquiring it.
        leaks: Acquire site -> (exit line, "returns" or "ends") of a normal path leaking it.
        raises: Acquire site -> the line whose raise leaks it.
        doubles: Release site -> the line of the earlier release on the same path.
        unmatched: Release sites reached on a path that holds and released nothing.
        matched: Release sites that released a held acquisition on some path.
        aliases: Local container element text (``staged[*]``) -> the texts put into it.
        receipts: Name bound to an acquire's return value -> the texts it acquired.
    """

    acquires: dict[ResourceKey, tuple[int, int]] = field(default_factory=dict)
    leaks: dict[SiteKey, tuple[int, str]] = field(default_factory=dict)
    raises: dict[SiteKey, int] = field(default_factory=dict)
    doubles: dict[SiteKey, int] = field(default_factory=dict)
    unmatched: set[SiteKey] = field(default_factory=set)
    matched: set[SiteKey] = field(default_factory=set)
    aliases: dict[str, set[str]] = field(default_factory=dict)
    receipts: dict[str, set[str]] = field(default_factory=dict)

    def acquired(self, key: ResourceKey, line: int, col: int) -> None:
        """Record an acquire site."""
        self.acquires[key] = min(self.acquires.get(key, (line, col)), (line, col))

    def leak(self, site: SiteKey, exit_line: int, how: str) -> None:
        """Record a normal path leaving at ``exit_line`` with ``site`` still held."""
        self.leaks[site] = min(self.leaks.get(site, (exit_line, how)), (exit_line, how))

    def raised(self, site: SiteKey, raise_line: int) -> None:
        """Record an exception at ``raise_line`` leaving with ``site`` still held.

        The line cited is the first one after the acquire; a line before it
        (a later loop pass) only when there is none.
        """
        known = self.raises.get(site, raise_line)
        self.raises[site] = min(known, raise_line, key=lambda line: (line <= site[0], line))

    def double(self, site: SiteKey, earlier: int) -> None:
        """Record a release that can follow an earlier release at ``earlier``."""
        self.doubles[site] = min(self.doubles.get(site, earlier), earlier)

    def unmatch(self, site: SiteKey) -> None:
        """Record a release on a path that holds nothing for it."""
        self.unmatched.add(site)

    def match(self, site: SiteKey) -> None:
        """Record a release on a path that held what it releases."""
        self.matched.add(site)

    def aliased(self, alias: str, texts: frozenset[str]) -> None:
        """Record that the local container elements ``alias`` stand for ``texts``."""
        self.aliases.setdefault(alias, set()).update(texts)

    def receipt(self, name: str, text: str) -> None:
        """Record that ``name`` holds the receipt of an acquire of ``text``."""
        self.receipts.setdefault(name, set()).add(text)

    def stood_for(self, texts: frozenset[str]) -> frozenset[str]:
        """Return what the receipts and container elements among ``texts`` stand for."""
        return frozenset(
            original
            for text in texts
            for original in (*self.receipts.get(text, ()), *self.aliases.get(text, ()))
        )

    def first_acquire(self, key: ResourceKey) -> tuple[int, int] | None:
        """Return the earliest acquire of ``key`` or of what its alias or receipt stands for."""
        texts = {key[1], *self.aliases.get(key[1], ()), *self.receipts.get(key[1], ())}
        sites = [
            site for (pair, text), site in self.acquires.items() if pair == key[0] and text in texts
        ]
        return min(sites, default=None)
