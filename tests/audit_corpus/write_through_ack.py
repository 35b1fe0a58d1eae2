# mypy: ignore-errors
# ruff: noqa
"""Write-through acknowledgements with the bugs the audit should find."""


class AckHandler:
    def write_backup(self, node):
        self.inc_lock_ref(node)
        host_indices = self.cache_controller.write(node.value, node_id=node.id)
        if host_indices is None:
            self.dec_lock_ref(node)
            return 0
        self.ongoing_write_through[node.id] = node
        return len(host_indices)

    def finish_ack(self, ack_id):  # fsm-cache: takes-ownership
        node = self.ongoing_write_through.pop(ack_id)
        try:
            self.publish(node)
        except Exception:
            self.dec_lock_ref(node)
            raise
        finally:
            self.dec_lock_ref(node)

    def finish_split_ack(self, ack_id):
        nodes = self.pending_publish.pop(ack_id)
        for node in nodes:
            self.dec_lock_ref(node)

    def retry_write(self, node, attempts):
        self.inc_lock_ref(node)
        for _ in range(attempts):
            if self.cache_controller.try_write(node):
                self.ongoing_write_through[node.id] = node
                return True
        return False
