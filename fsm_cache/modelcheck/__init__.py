"""The model checker: every reachable state of a small composed tree, explored and checked.

States are tuples of spec records (:mod:`~fsm_cache.modelcheck.state`) with
the model's own account of their pages and copies in flight
(:mod:`~fsm_cache.modelcheck.copies`), steps go through the compiled engine,
the design's invariants and what lookups tell callers
(:mod:`~fsm_cache.modelcheck.lookup`) are checked in every state, and every
state must be able to settle (:mod:`~fsm_cache.modelcheck.liveness`).
``fsm-cache check`` is :mod:`~fsm_cache.modelcheck.check`.
"""

from __future__ import annotations

from fsm_cache.modelcheck.check import check_spec
from fsm_cache.modelcheck.explore import Bounds, Explorer, Result


__all__ = ["Bounds", "Explorer", "Result", "check_spec"]
