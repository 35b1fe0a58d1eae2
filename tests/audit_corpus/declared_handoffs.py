# mypy: ignore-errors
# ruff: noqa
"""Deliberate cross-function pairs, declared with markers so they are not reported."""


class DeclaredHandOffs:
    def pin_for_reader(self, node):  # fsm-cache: hands-off -- the reader thread releases it
        node.protect_host()
        self.signal_reader(node.id)

    def lock_for_batch(self, node):
        self.inc_lock_ref(node)  # fsm-cache: hands-off -- the scheduler unlocks at batch end
        self.scheduler.note(node.id)

    def unlock_batch(self, nodes):  # fsm-cache: takes-ownership
        for node in nodes:
            self.dec_lock_ref(node)

    def track_backup(self, node):  # fsm-cache: takes-ownership
        self.pending_backups.add(node.id)

    def backup(self, node):
        node.protect_host()
        self.track_backup(node)

    def known_safe_flush(self, node):
        node.protect_host()  # fsm-cache: ignore[FSM104] -- flush() cannot raise here
        self.flush()
        node.release_host()

    def misspelled(self, node):
        node.protect_host()  # fsm-cache: hand-off
        self.queue.put(node)
