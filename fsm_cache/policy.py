"""Write policies and thresholds of the hierarchical cache, as pure decisions.

The residency machines say what is legal; a policy says what the cache
chooses to do among legal steps: when to start a backup and what to do with
an unbacked device leaf under memory pressure. These functions read records
only (no torch, no pools), so the model checker can run the same decisions.

| policy | backup starts | unbacked device leaf under pressure |
| --- | --- | --- |
| ``write_through`` | at the first hit | deleted |
| ``write_through_selective`` | once hit ``selective_threshold`` times | deleted |
| ``write_back`` | only when evicted from the device | backed up, evicted after the ack |
"""

from __future__ import annotations

import enum
from typing import Protocol

from fsm_cache.residency import HOST_HELD, HOST_VALID, AnyHostState, DeviceState


class WritePolicy(str, enum.Enum):
    """When the device-to-host backup of a node starts."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PolicyNode(Protocol):
    """What policy decisions read from a node."""

    @property
    def host(self) -> AnyHostState:
        """The host residency state."""

    @property
    def device(self) -> DeviceState:
        """The device residency state."""

    @property
    def hit_count(self) -> int:
        """How often the node was matched or inserted."""

    @property
    def parent(self) -> PolicyNode | None:
        """The parent node, None at a root."""


def backup_threshold(policy: WritePolicy, selective_threshold: int) -> int | None:
    """Return the hit count that starts a backup, or None if hits never do."""
    if policy is WritePolicy.WRITE_THROUGH:
        return 1
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        return selective_threshold
    return None


def wants_backup(policy: WritePolicy, node: PolicyNode, selective_threshold: int) -> bool:
    """Return whether the policy starts a backup of ``node`` now.

    A backup starts from a device copy where the host holds no slots (none
    of :data:`~fsm_cache.residency.HOST_HELD`), whatever a spec names that
    state: ``unbacked`` and ``evicted`` in ours, free names in a user's.
    Write-through backups are prefix-closed (design invariant 3): a node is
    backed up only once its parent holds a valid host copy or is a root, so a
    child's acknowledgement can never overtake its parent's.
    """
    threshold = backup_threshold(policy, selective_threshold)
    if threshold is None or node.hit_count < threshold:
        return False
    if node.host in HOST_HELD or node.device != "resident":
        return False
    return parent_allows_backup(policy, node)


def parent_allows_backup(policy: WritePolicy, node: PolicyNode) -> bool:
    """Return whether ``node``'s parent lets its backup start under ``policy``.

    Under the write-through policies (design invariant 3) the parent must hold
    a valid host copy or be a root; write-back keeps no such order.
    """
    if policy is WritePolicy.WRITE_BACK:
        return True
    parent = node.parent
    return parent is None or parent.parent is None or parent.host in HOST_VALID


def deletes_unbacked(policy: WritePolicy) -> bool:
    """Return whether an unbacked device leaf is deleted (True) or backed up first (False)."""
    return policy is not WritePolicy.WRITE_BACK


def worth_loading(tokens: int, load_back_threshold: int) -> bool:
    """Return whether loading ``tokens`` back beats recomputing them."""
    return tokens >= load_back_threshold
