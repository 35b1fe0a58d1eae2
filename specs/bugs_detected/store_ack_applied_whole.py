"""NEGATIVE CONTROL (found by check): a partial store acknowledged as the whole (SGLang #39444).

A store copies a node's pages to the store and reports, per page, which
landed. The cache splits the node at the first page that did not land and
acknowledges the prefix (``store_done``) and the rest (``store_failed``)
apart. This cache (BUG) acknowledges the whole: it splits, then fires
``store_done`` on both halves, so the suffix claims pages in the store that
never landed, and the store's pin on its host pages is given back with no
failure said. ``fsm-cache check --ops`` loads this module: ``SPEC`` names
the spec to check and ``split`` replaces
:func:`fsm_cache.modelcheck.treeops.split`, which now models a partial
acknowledgement where the node being split is being stored.
"""

from __future__ import annotations

from fsm_cache.modelcheck import treeops
from fsm_cache.modelcheck.copies import H2S, failed
from fsm_cache.modelcheck.state import Layout, Nodes
from fsm_cache.modelcheck.traces import Replay


SPEC = "../residency_storage.toml"


def split(layout: Layout, nodes: Nodes, index: int, slot: int) -> Nodes | None:
    """Split as the cache does; at a node being stored, (BUG) acknowledge a partial store whole.

    The store landed the prefix's pages (``slot``) and not the suffix's
    (``index``). ``store_done`` is fired at both halves, then the suffix's
    pages in the store are what they are: what a failed copy left.
    """
    out = treeops.split(layout, nodes, index, slot)
    entry = nodes[index]
    if out is None or entry is None or layout.state(entry, "storage") != "storing":
        return out
    replay = Replay(layout, [2**31] * len(layout.counters), treeops)
    for half in (slot, index):
        out = replay.event(out, half, "store_done") if out is not None else None
    suffix = out[index] if out is not None else None
    if out is None or suffix is None:
        return out
    tier = layout.mbase + layout.memory.tiers.index("storage")
    lost = (*suffix[:tier], failed(H2S), *suffix[tier + 1 :])
    return (*out[:index], lost, *out[index + 1 :])
