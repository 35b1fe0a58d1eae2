"""The checked engine: specs compiled into per-event functions over slotted records.

Also what the engine hands out and remembers: leases (an acquire that releases
exactly once), the call-site trail of recent events, and the records still
held at the end of a run. Torch-free: CrossHair analyses this layer.
"""

from __future__ import annotations

from fsm_cache.engine.core import Engine
from fsm_cache.engine.holds import Held, held_records
from fsm_cache.engine.lease import Lease, LeaseBook
from fsm_cache.engine.trail import Site, Sites, Trail


__all__ = ["Engine", "Held", "Lease", "LeaseBook", "Site", "Sites", "Trail", "held_records"]
