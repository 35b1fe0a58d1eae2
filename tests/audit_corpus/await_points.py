# mypy: ignore-errors
# ruff: noqa
"""An ``await`` of a future or task can raise: its exception, or CancelledError.

Awaiting a future held in a name or a table, not a call, is still a point
where the coroutine can be cancelled, so a pin taken before it and released
after it leaks. Released in a ``finally``, it does not.
"""


class Loader:
    async def wait_for_load(self, node, fut):
        node.protect_host()
        await fut
        node.release_host()

    async def wait_for_pending(self, node):
        node.protect_host()
        await self.pending[node.id]
        node.release_host()

    async def wait_safely(self, node, fut):
        node.protect_host()
        try:
            await fut
        finally:
            node.release_host()
