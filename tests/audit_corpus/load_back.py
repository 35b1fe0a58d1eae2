# mypy: ignore-errors
# ruff: noqa
"""Load-back with eviction, shaped like HiRadixCache.load_back (no try/finally)."""

import torch


class HiCacheLoadBack:
    def load_back(self, node, mem_quota=None):
        last_hit_node = node
        nodes_to_load = []
        while last_hit_node.evicted:
            nodes_to_load.insert(0, last_hit_node)
            last_hit_node = last_hit_node.parent
        ancestor_node = last_hit_node

        result = self.inc_lock_ref(ancestor_node)
        host_indices = torch.cat([n.host_value for n in nodes_to_load])
        if len(host_indices) < self.load_back_threshold:
            return None
        if mem_quota is not None and len(host_indices) > mem_quota + result.delta:
            self.dec_lock_ref(ancestor_node)
            return None

        for n in nodes_to_load:
            n.protect_host()
        device_indices = self.cache_controller.load(host_indices, node_id=last_hit_node.id)
        if device_indices is None:
            self.evict(len(host_indices))
            device_indices = self.cache_controller.load(host_indices, node_id=last_hit_node.id)
        self.dec_lock_ref(ancestor_node)
        if device_indices is None:
            for n in nodes_to_load:
                n.release_host()
            return None
        for n in nodes_to_load:
            n.release_host()

        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        self.inc_lock_ref(last_hit_node)
        return device_indices

    def loading_check(self):  # fsm-cache: takes-ownership -- locks taken by load_back
        while self.cache_controller.ack_load_queue:
            ack_id = self.cache_controller.ack_load_queue.pop(0)
            end_node = self.ongoing_load_back.pop(ack_id)
            self.dec_lock_ref(end_node)
