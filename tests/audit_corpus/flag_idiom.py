# mypy: ignore-errors
# ruff: noqa
"""A flag set to True or False says on which paths a pin was taken (clean).

``pinned = True`` right after the pin makes ``if pinned:`` in the
``finally`` release on the paths that pinned and only on those; ``ok =
True`` after the work makes ``if not ok:`` release on the paths that
failed, while the others hand the node on.
"""


def stage(node):
    pinned = False
    try:
        node.protect_host()
        pinned = True
        work()
    finally:
        if pinned:
            node.release_host()


def publish(node):
    node.protect_host()
    ok = False
    try:
        work()
        ok = True
    finally:
        if not ok:
            node.release_host()
    return node
