"""Contracts for CrossHair: generated on compiled specs and written on the page allocators.

``fsm-cache verify`` (:mod:`~fsm_cache.contracts.verify`) runs CrossHair on
them with pinned budgets and reads its report.
"""

from __future__ import annotations

from fsm_cache.contracts.generate import Generated, generate
from fsm_cache.contracts.verify import verify_module, verify_spec


__all__ = ["Generated", "generate", "verify_module", "verify_spec"]
