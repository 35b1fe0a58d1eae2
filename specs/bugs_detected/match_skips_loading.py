"""NEGATIVE CONTROL (found by check): a lookup that reports every resident node on the path.

``match_prefix`` must stop at the first node that is not ``resident``: a
request reuses the device KV of the matched prefix for exactly those
tokens. This one keeps every resident node wherever it hangs (as a filter
over the path does), so a child loaded or adopted on the device under a node
still ``loading`` is handed out, its KV standing in for the tokens of the
node above it. ``fsm-cache check --ops`` loads this module: ``SPEC`` names
the spec to check and ``match_prefix`` replaces
:func:`fsm_cache.modelcheck.lookup.match_prefix`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsm_cache.modelcheck.lookup import Match
from fsm_cache.modelcheck.state import Layout, NodeEntry


SPEC = "../residency.toml"


def match_prefix(layout: Layout, path: Sequence[NodeEntry]) -> Match:
    """Report (BUG) every resident node of the path on the device, the others as a host hit."""
    device = tuple(i for i, e in enumerate(path) if layout.state(e, "device") == "resident")
    return Match(device, tuple(i for i in range(len(path)) if i not in device))
