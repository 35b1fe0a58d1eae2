"""``fsm-cache audit``: a static checker that pairs acquires with releases.

It parses Python sources with :mod:`ast` and follows every path of every
function, ``try``/``except``/``finally``, ``with``, early ``return``,
``raise``, loops and branches included, to report where existing cache code
can leak a pin or a lock, release one twice, release one it never took, or
lose one to an exception. See ``docs/audit.md`` for the codes and markers.
"""

from __future__ import annotations

from fsm_cache.audit.checker import check_source, check_tree
from fsm_cache.audit.command import audit_paths, main, register
from fsm_cache.audit.config import load_config, parse_pair
from fsm_cache.audit.model import RULES, Argument, AuditConfig, AuditError, Finding, Pair


__all__ = [
    "RULES",
    "Argument",
    "AuditConfig",
    "AuditError",
    "Finding",
    "Pair",
    "audit_paths",
    "check_source",
    "check_tree",
    "load_config",
    "main",
    "parse_pair",
    "register",
]
