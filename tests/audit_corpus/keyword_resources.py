# mypy: ignore-errors
# ruff: noqa
"""Pair calls that pass their resource by keyword.

The resource of a pair call is its first argument, positional or keyword:
``inc_lock_ref(node=node)`` locks ``node`` as ``inc_lock_ref(node)`` does,
so a lock taken by keyword pairs with a release passed positionally, and the
other way round. A literal keyword is a flag, as a literal positional is:
``node.protect_host(force=True)`` protects ``node``. The last function
releases another node than the one it locked by keyword.
"""


class KeywordLocks:
    def __init__(self, tree_cache):
        self.tree_cache = tree_cache

    def acquired_by_keyword(self, node):
        self.tree_cache.inc_lock_ref(node=node)
        try:
            return self.tree_cache.load(node)
        finally:
            self.tree_cache.dec_lock_ref(node)

    def released_by_keyword(self, node, swa_uuid):
        self.tree_cache.inc_lock_ref(node)
        try:
            return self.tree_cache.load(node)
        finally:
            self.tree_cache.dec_lock_ref(node=node, swa_uuid_for_lock=swa_uuid)

    def flagged_by_keyword(self, node):
        node.protect_host(force=True)
        try:
            return node.copy()
        finally:
            node.release_host()

    def releases_the_parent(self, node):
        self.tree_cache.inc_lock_ref(node=node)
        self.tree_cache.dec_lock_ref(node.parent)
