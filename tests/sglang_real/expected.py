"""Where the current drop-in fails on SGLang's real code: strict xfails naming issue 14.

One entry per (scenario, mode, versions): the exception the step raises and
why. Strict: a fix that makes a scenario pass turns its xfail into a failure,
so this table has to shrink with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Failure:
    """An expected failure: the exception class name and what goes wrong."""

    error: str
    reason: str
    versions: tuple[str, ...] = ()
    """Versions it applies to; empty for all."""


ROOT_056 = (
    "RadixCache.reset gives the root host_value = [] (0.5.6): SlotsOutOfStep "
    "'host_value set while host is unbacked; fire write first'"
)
ROOT_0523 = (
    "RadixCache.reset gives the root lock_ref = 1 (0.5.23 has no host_value): "
    "ReadOnlyCounter 'lock_ref is driven by the residency machines'"
)
LOCK = (
    "RadixCache.inc_lock_ref does node.lock_ref += 1 on each node up to the root: "
    "ReadOnlyCounter; the guide maps it to node.inc_lock_ref() but SGLang's cache "
    "method also keeps evictable_size_/protected_size_"
)
SPLIT_LOCKED = (
    "_split_node copies new_node.lock_ref = child.lock_ref onto a fresh node: "
    "ReadOnlyCounter (locks 0 != 1); the message's inc_lock_ref() would count twice"
)

FAILURES: dict[tuple[str, str], Failure] = {}
for _scenario in ("root", "insert_and_match", "split", "lock", "split_locked", "lru"):
    FAILURES[(_scenario, "mixin")] = Failure("SlotsOutOfStep", ROOT_056, ("0.5.6",))
WRITE_BACKUP = (
    "HiRadixCache.write_backup sets node.host_value after cache_controller.write "
    "allocated the host slots and started the copy: SlotsOutOfStep 'fire write "
    "first'; the guide's machine.write line has to be added to SGLang's method, "
    "and a refusal there comes after memory moved"
)
for _scenario in ("hi_lifecycle", "hi_split_writing", "hi_recompute"):
    FAILURES[(_scenario, "mixin")] = Failure("SlotsOutOfStep", ROOT_056)
    FAILURES[(_scenario, "mixin+root")] = Failure("SlotsOutOfStep", WRITE_BACKUP)
FAILURES[("lock", "mixin+root")] = Failure("ReadOnlyCounter", LOCK)
FAILURES[("split_locked", "mixin+root")] = Failure("ReadOnlyCounter", SPLIT_LOCKED)


def expect_failure(request: pytest.FixtureRequest, scenario: str, mode: str, version: str) -> None:
    """Mark the running test as a strict xfail if the table expects this scenario to fail."""
    failure = FAILURES.get((scenario, mode))
    if failure is not None and failure.versions and version not in failure.versions:
        failure = None
    if failure is None and mode == "mixin" and version != "0.5.6":
        failure = Failure("ReadOnlyCounter", ROOT_0523)
    if failure is None:
        return
    from fsm_cache.compat import sglang as compat

    raises = getattr(compat, failure.error, None) or getattr(
        __import__("fsm_cache.errors", fromlist=[failure.error]), failure.error
    )
    request.applymarker(
        pytest.mark.xfail(strict=True, raises=raises, reason=f"issue 14: {failure.reason}")
    )
