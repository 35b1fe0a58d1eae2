# mypy: ignore-errors
# ruff: noqa
"""Prefetch anchors: one pin per request, released on completion, revoke or abort."""


class PrefetchAnchors:
    def prefetch_from_storage(self, req_id, last_host_node, new_input_tokens):
        if self.cache_controller.prefetch_rate_limited():
            return
        last_host_node.protect_host()
        operation = self.cache_controller.prefetch(req_id, new_input_tokens)
        self.ongoing_prefetch[req_id] = (last_host_node, new_input_tokens, operation)

    def check_prefetch_progress(self, req_id):  # fsm-cache: takes-ownership
        if req_id not in self.ongoing_prefetch:
            return True
        last_host_node, token_ids, operation = self.ongoing_prefetch[req_id]
        if not operation.is_done():
            return False
        self.cache_controller.terminate_prefetch(operation)
        if operation.host_indices is None:
            last_host_node.release_host()
        self.insert_host(last_host_node, token_ids, operation.host_indices)
        last_host_node.release_host()
        del self.ongoing_prefetch[req_id]
        return True

    def release_aborted_request(self, req_id):
        if req_id not in self.ongoing_prefetch:
            return
        last_host_node, _, operation = self.ongoing_prefetch[req_id]
        self.cache_controller.mark_terminate(operation)
        last_host_node.release_host()
        del self.ongoing_prefetch[req_id]

    def revoke_pending_prefetch(self, req_id):
        entry = self.ongoing_prefetch.pop(req_id, None)
        if entry is None:
            return
        last_host_node, _, operation = entry
        last_host_node.release_host()  # fsm-cache: takes-ownership -- popped above, once
        self.cache_controller.release_prefetch(operation)
