# mypy: ignore-errors
# ruff: noqa
"""Request locks across chunked prefill, finish, abort, retraction and PD restore."""


class RequestLocks:
    def cache_unfinished_req(self, req, new_last_node):  # fsm-cache: takes-ownership
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        req.last_node = new_last_node

    def cache_finished_req(self, req):  # fsm-cache: takes-ownership
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None

    def release_req(self, req):
        self.dec_lock_ref(req.last_node)
        self.cache_finished_req(req)

    def retract_decode(self, batch):
        for req in batch.reqs_to_retract():
            self.cache_finished_req(req)
            batch.requeue(req)

    def restore_from_host(self, req, node):
        self.inc_lock_ref(node)
        try:
            try:
                self.queue_load_back(node)
            except RuntimeError:
                self.dec_lock_ref(node)
                raise
        except Exception:
            self.dec_lock_ref(node)
            req.hicache_restored_node = None
            return False
        req.last_node = node
        return True

    def abort_request(self, req):  # fsm-cache: takes-ownership
        try:
            self.send_abort(req)
        except ConnectionError:
            self.dec_lock_ref(req.last_node)
            raise
        finally:
            self.dec_lock_ref(req.last_node)
