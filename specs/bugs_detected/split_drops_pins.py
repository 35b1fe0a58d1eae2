"""NEGATIVE CONTROL (found by check): a radix split that does not carry the pins to the prefix.

``fsm-cache check --ops`` loads this module: ``SPEC`` names the spec to check
and ``split`` replaces :func:`fsm_cache.treeops.split`.
"""

from __future__ import annotations

from fsm_cache import treeops
from fsm_cache.model import Layout, Nodes


SPEC = "../residency.toml"


def split(layout: Layout, nodes: Nodes, index: int, slot: int) -> Nodes | None:
    """Split as the cache does, then (BUG) give the new prefix node no pins."""
    out = treeops.split(layout, nodes, index, slot)
    prefix = out[slot] if out is not None else None
    if out is None or prefix is None:
        return out
    at = 1 + len(layout.regions) + layout.counters.index("pins")
    broken = (*prefix[:at], 0, *prefix[at + 1 :])
    return (*out[:slot], broken, *out[slot + 1 :])
