# mypy: ignore-errors
# ruff: noqa
"""Everyday Python around pins and locks that the audit once flagged (clean)."""

import contextlib


class PinnedNode:
    """A context manager class: __enter__ pins for the object, __exit__ gives it back."""

    def __init__(self, node):
        self.node = node

    def __enter__(self):
        self.node.protect_host()
        return self.node

    def __exit__(self, *exc):
        self.node.release_host()


class IdiomCache:
    def exit_stack(self, node):
        with contextlib.ExitStack() as stack:
            node.protect_host()
            stack.callback(node.release_host)
            self.publish(node)

    def deferred(self, loop, node):
        self.inc_lock_ref(node)
        loop.call_soon(self.dec_lock_ref, node)

    def walrus(self, node):
        if (params := self.inc_lock_ref(node)) is not None:
            try:
                self.publish(node)
            finally:
                self.dec_lock_ref(params)

    def strict_zip(self, nodes, ops):
        for node, op in zip(nodes, ops, strict=True):
            node.protect_host()
        try:
            self.publish(nodes)
        finally:
            for node in nodes:
                node.release_host()

    def comprehension(self, nodes):
        params = [self.inc_lock_ref(n) for n in nodes]
        try:
            self.publish(nodes)
        finally:
            for p in params:
                self.dec_lock_ref(p)

    def split_call(self, node):
        self.cache_controller.inc_lock_ref(
            node
        )  # fsm-cache: hands-off -- the ack handler releases it
