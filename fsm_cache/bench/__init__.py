"""``fsm-cache bench``: speed figures of the engine, the copies, the cache and TP agreement.

Each benchmark measures fsm_cache side by side with a baseline in one run and
reports ratios; the synthetic workload and the serving loop live here too.
"""

from __future__ import annotations


__all__: list[str] = []
