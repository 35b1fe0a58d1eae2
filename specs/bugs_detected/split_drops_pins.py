"""NEGATIVE CONTROL (found by check): a radix split that does not carry the pins to the prefix.

The cache's split leaves client pins with the suffix but gives the prefix
the pin of a load in flight, since the same copy fills it
(:func:`fsm_cache.residency.split_prefix`); this one drops that pin too, so
a prefix being loaded is ``pinned`` with no pins. ``fsm-cache check --ops``
loads this module: ``SPEC`` names the spec to check and ``split`` replaces
:func:`fsm_cache.modelcheck.treeops.split`.
"""

from __future__ import annotations

from fsm_cache.modelcheck import treeops
from fsm_cache.modelcheck.state import Layout, Nodes


SPEC = "../residency.toml"


def split(layout: Layout, nodes: Nodes, index: int, slot: int) -> Nodes | None:
    """Split as the cache does, then (BUG) give the new prefix node no pins, not even a load's."""
    out = treeops.split(layout, nodes, index, slot)
    prefix = out[slot] if out is not None else None
    if out is None or prefix is None:
        return out
    at = 1 + len(layout.regions) + layout.counters.index("pins")
    broken = (*prefix[:at], 0, *prefix[at + 1 :])
    return (*out[:slot], broken, *out[slot + 1 :])
