"""The model checker: every reachable state of a small composed tree, explored and checked.

States are tuples of spec records (:mod:`~fsm_cache.modelcheck.state`), steps
go through the compiled engine, and the design's invariants are checked in
every state. ``fsm-cache check`` is :mod:`~fsm_cache.modelcheck.check`.
"""

from __future__ import annotations

from fsm_cache.modelcheck.check import check_spec
from fsm_cache.modelcheck.explore import Bounds, Explorer, Result


__all__ = ["Bounds", "Explorer", "Result", "check_spec"]
