# mypy: ignore-errors
# ruff: noqa
"""Pins handed to callbacks, awaited copies and correlated branches (clean)."""


class CallbackCache:
    async def prefetch_async(self, node):
        node.protect_host()
        try:
            await self.storage.fetch(node.hash_value)
        finally:
            node.release_host()

    def copy_with_callback(self, node):
        node.protect_host()

        def on_done(_result):
            node.release_host()

        self.cache_controller.submit(node.host_value, callback=on_done)

    def lock_with_lambda(self, node):
        self.inc_lock_ref(node)
        self.cache_controller.submit(node.value, callback=lambda _: self.dec_lock_ref(node))

    def flush_if_storage(self, node):
        if self.enable_storage:
            node.protect_host()
        try:
            self.flush()
        finally:
            if self.enable_storage:
                node.release_host()

    def match_policy(self, node, policy):
        node.protect_host()
        match policy:
            case "write_back":
                self.staged.append(node)
            case _:
                node.release_host()

    def pinned_node(self, node):
        node.protect_host()
        return node
