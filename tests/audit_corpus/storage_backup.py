# mypy: ignore-errors
# ruff: noqa
"""Storage backup (host to L3): pins handed to the backup table, drained on ack."""


class StorageBackup:
    def write_backup_storage(self, node):
        operation_id = self.cache_controller.write_storage(node.host_value, node.hash_value)
        self.ongoing_backup[operation_id] = node
        node.protect_host()

    def drain_backup(self):  # fsm-cache: takes-ownership
        for op in self.cache_controller.ack_backup_queue:
            node = self.ongoing_backup.pop(op.id, None)
            if node is None:
                continue
            node.release_host()

    def wait_backup(self, node, operation):
        node.protect_host()
        while not operation.done():
            if operation.failed():
                node.release_host()
                break
            self.cache_controller.poll()
        node.release_host()

    def force_release(self):  # fsm-cache: takes-ownership
        node = None
        for op_id in list(self.ongoing_backup):
            node = self.ongoing_backup.pop(op_id)
            node.release_host()
        if node is not None:
            node.release_host()
