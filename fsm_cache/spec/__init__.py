"""The spec layer: machine specifications as data, loaded, validated and shipped.

Everything else derives from these objects: the engine compiles them, the
contracts and the model checker check them, the diagrams draw them. Nothing
here imports torch or any layer above.
"""

from __future__ import annotations

from fsm_cache.spec.loader import load_spec, spec_from_dict
from fsm_cache.spec.machine import (
    EventSpec,
    Forbid,
    MachineSpec,
    Spec,
    StateSpec,
    System,
    Transition,
    as_system,
)
from fsm_cache.spec.shipped import load_shipped, residency_system, shipped_spec_paths, spec_dir


__all__ = [
    "EventSpec",
    "Forbid",
    "MachineSpec",
    "Spec",
    "StateSpec",
    "System",
    "Transition",
    "as_system",
    "load_shipped",
    "load_spec",
    "residency_system",
    "shipped_spec_paths",
    "spec_dir",
    "spec_from_dict",
]
