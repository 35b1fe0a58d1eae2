# mypy: ignore-errors
# ruff: noqa
"""Calls in a ``case`` guard run, as an ``if`` test does.

A pin taken by a guard (a ``protect_host()`` that says whether it pinned)
holds in its case's body; a release in a guard releases. A guard that
fails still ran, and the later cases see what it did.
"""


class Commands:
    def pin_leaks(self, node, cmd):
        match cmd:
            case "load" if node.protect_host():
                return 1
            case _:
                return 0

    def pin_released(self, node, cmd):
        match cmd:
            case "load" if node.protect_host():
                node.release_host()
            case _:
                pass

    def release_twice(self, node, cmd):
        node.protect_host()
        node.release_host()
        match cmd:
            case "x" if node.release_host():
                pass

    def guard_raises(self, node, cmd):
        node.protect_host()
        match cmd:
            case "x" if self.ready(cmd):
                pass
        node.release_host()
