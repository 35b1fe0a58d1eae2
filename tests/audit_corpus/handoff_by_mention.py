# mypy: ignore-errors
# ruff: noqa
"""Values that only mention a locked node do not hand it on.

Storing, returning or yielding ``len(node.key)``, ``node.id`` or
``node.evicted`` stores an int or a bool, not the node: each function here
leaks its lock or pin. The functions at the end hand the node on whole, in
a conditional expression, a boolean operation, a ``:=``, an awaited call, a
comprehension or a dict key, and are clean.
"""


class Cache:
    def load_counted(self, node):
        self.inc_lock_ref(node)
        self.loaded_tokens += len(node.key)
        if node.evicted:
            return None
        self.dec_lock_ref(node)

    def load_logged(self, node):
        self.inc_lock_ref(node)
        self.last_id = node.id
        if node.evicted:
            return None
        self.dec_lock_ref(node)

    def host_len(self, node):
        self.inc_lock_ref(node)
        return len(node.host_value)

    def is_evicted(self, node):
        self.inc_lock_ref(node)
        return node.evicted

    def metric_before(self, node):
        self.last_len = len(node.key)
        self.inc_lock_ref(node)
        if node.evicted:
            return None
        self.dec_lock_ref(node)

    def queued_len(self, node):
        self.inc_lock_ref(node)
        self.sizes.append(len(node.key))
        if node.evicted:
            return None
        self.dec_lock_ref(node)

    def ids(self, node):
        self.inc_lock_ref(node)
        yield node.id

    def release_or_none(self, node, c):
        node.protect_host()
        return None if c else node.release_host()

    def release_and(self, node, c):
        node.protect_host()
        return c and node.release_host()

    def handed_whole(self, node, nodes, c, k):
        node.protect_host()
        if c:
            return node if c else None
        if k:
            return k and node
        self.last = (kept := node)
        return {node: k}

    async def handed_awaited(self, node):
        node.protect_host()
        return await self.store(node)

    def handed_each(self, nodes):
        for node in nodes:
            node.protect_host()
        return [n for n in nodes]
