"""The checked core imports without torch: CrossHair and users' CI analyse it torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest


TORCH_FREE = [
    "fsm_cache",
    "fsm_cache.spec.machine",
    "fsm_cache.spec.guards",
    "fsm_cache.spec.loader",
    "fsm_cache.spec.validate",
    "fsm_cache.engine.codegen",
    "fsm_cache.engine.core",
    "fsm_cache.engine.lease",
    "fsm_cache.engine.trail",
    "fsm_cache.errors",
    "fsm_cache.residency",
    "fsm_cache.compat.sglang",
    "fsm_cache.memory.pages",
    "fsm_cache.policy",
    "fsm_cache.cache.tree",
    "fsm_cache.testing.reference",
    "fsm_cache.diagram.ir",
    "fsm_cache.audit",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    """Importing the module in a fresh interpreter leaves torch unloaded."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lazy_names_resolve() -> None:
    """The torch-backed public names resolve on first use."""
    import fsm_cache

    assert fsm_cache.HiCache.__name__ == "HiCache"
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _ = fsm_cache.Nope
