# mypy: ignore-errors
# ruff: noqa
"""The same load-back with every pin and lock released in a finally (clean)."""

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
        try:
            host_indices = torch.cat([n.host_value for n in nodes_to_load])
            if len(host_indices) < self.load_back_threshold:
                return None
            if mem_quota is not None and len(host_indices) > mem_quota + result.delta:
                return None
            for n in nodes_to_load:
                n.protect_host()
            try:
                device_indices = self.cache_controller.load(host_indices)
                if device_indices is None:
                    self.evict(len(host_indices))
                    device_indices = self.cache_controller.load(host_indices)
            finally:
                for n in nodes_to_load:
                    n.release_host()
        finally:
            self.dec_lock_ref(ancestor_node)
        if device_indices is None:
            return None
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        self.inc_lock_ref(last_hit_node)
        return device_indices
