# mypy: ignore-errors
# ruff: noqa
"""Locks taken on some paths and released under a None test (clean).

In the shape of SGLang 0.5.23's ``PrefillAdder._lock_node``: the lock is
taken only when asked for, its receipt or None is kept, and the release runs
under ``if lock_params is not None:``. The same holds for a receipt bound to
None first and to a lock in a branch.
"""


class PrefillAdder:
    def __init__(self, tree_cache):
        self.tree_cache = tree_cache

    def _lock_node(self, last_node, *, lock_device=False):
        lock_params = (
            self.tree_cache.inc_lock_ref(last_node).to_dec_params() if lock_device else None
        )
        try:
            yield None
        finally:
            if lock_params is not None:
                self.tree_cache.dec_lock_ref(last_node, lock_params)

    def load(self, node, pin):
        receipt = None
        if pin:
            receipt = self.tree_cache.inc_lock_ref(node)
        try:
            return self.tree_cache.load(node)
        finally:
            if receipt is not None:
                self.tree_cache.dec_lock_ref(node)
