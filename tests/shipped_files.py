"""The files a shipped composed spec is read from, named by hand for the tests that copy them.

Named here, not computed with :func:`fsm_cache.spec.loader.load_snapshot`, so
that the tests of what a snapshot holds compare it with a list it did not make.
"""

from __future__ import annotations


STORAGE_FILES = (
    "residency_storage.toml",
    "residency.toml",
    "host_residency.toml",
    "device_residency.toml",
    "host_storage_residency.toml",
    "storage_residency.toml",
)
"""Every file ``residency_storage.toml`` is read from: what it extends, and their regions."""
