# mypy: ignore-errors
# ruff: noqa
"""Prefill scheduling in the shape of SGLang's PrefillAdder (clean).

The request is queued before its prefix is locked: the lock on
``req.last_node`` goes with the request (store-then-pin of an owner). The
rest are shapes the audit follows without declarations: a lock's receipt,
``enumerate`` and comprehension loops, and a conditional pin.
"""


class PrefillAdder:
    def __init__(self, tree_cache, is_hybrid_swa):
        self.tree_cache = tree_cache
        self.is_hybrid_swa = is_hybrid_swa
        self.can_run_list = []
        self.new_chunked_req = None

    def add_one_req(self, req, chunked):
        if not chunked:
            self.can_run_list.append(req)
            if self.is_hybrid_swa:
                swa_uuid_for_lock = self.tree_cache.inc_lock_ref(req.last_node)
                req.swa_uuid_for_lock = swa_uuid_for_lock
            else:
                self.tree_cache.inc_lock_ref(req.last_node)
            return True
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self.tree_cache.inc_lock_ref(req.last_node)
        return True

    def _lock_node(self, last_node):
        lock = self.tree_cache.lock(last_node)
        try:
            yield None
        finally:
            self.tree_cache.unlock(lock)

    def lock_all(self, nodes):
        for node in nodes:
            self.tree_cache.inc_lock_ref(node)
        try:
            self.run(nodes)
        finally:
            for i, node in enumerate(nodes):
                self.tree_cache.dec_lock_ref(node)

    def pin_hosts(self, nodes, keep):
        for node in nodes:
            node.protect_host() if keep else None
        try:
            self.run(nodes)
        finally:
            if keep:
                [node.release_host() for node in nodes]
