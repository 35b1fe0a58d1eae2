# mypy: ignore-errors
# ruff: noqa
"""Write-through backup: the device lock is handed to the ack table (clean)."""

from contextlib import contextmanager


class WriteThroughCache:
    def __init__(self, cache_controller, root):
        self.cache_controller = cache_controller
        self.root = root
        self.ongoing_write_through = {}

    def write_backup(self, node):
        host_indices = self.cache_controller.write(node.value, node_id=node.id)
        if host_indices is None:
            return 0
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = node
        self.inc_lock_ref(node)  # stored first: the ack handler owns the lock
        return len(host_indices)

    def writing_check(self):  # fsm-cache: takes-ownership -- locks taken by write_backup
        while self.cache_controller.ack_write_queue:
            ack_id = self.cache_controller.ack_write_queue.pop(0)
            node = self.ongoing_write_through.pop(ack_id)
            self.dec_lock_ref(node)

    @contextmanager
    def locked(self, node):
        self.inc_lock_ref(node)
        try:
            yield node
        finally:
            self.dec_lock_ref(node)

    def backup_chain(self, nodes):
        for node in nodes:
            self.inc_lock_ref(node)
        try:
            self.cache_controller.write_many([n.value for n in nodes])
        finally:
            for node in reversed(nodes):
                self.dec_lock_ref(node)
