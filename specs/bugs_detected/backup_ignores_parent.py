"""NEGATIVE CONTROL (found by check): a write-through policy that backs a node up before its parent.

``fsm-cache check --ops`` loads this module: ``SPEC`` names the spec to
check, ``POLICY`` the write policy the cache follows, and ``wants_backup``
replaces :func:`fsm_cache.policy.wants_backup`.
"""

from __future__ import annotations

from fsm_cache import policy
from fsm_cache.modelcheck.state import PolicyView


SPEC = "../residency.toml"
POLICY = "write_through"


def wants_backup(
    write_policy: policy.WritePolicy, node: policy.PolicyNode, selective_threshold: int
) -> bool:
    """Decide as write-through does, but (BUG) as if the node had no parent to wait for."""
    orphan = PolicyView(node.host, node.device, node.hit_count, None)
    return policy.wants_backup(write_policy, orphan, selective_threshold)
