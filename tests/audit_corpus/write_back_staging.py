# mypy: ignore-errors
# ruff: noqa
"""Write-back eviction: leaves are staged with a pin until their copy is flushed."""


class WriteBackEviction:
    def evict(self, num_tokens):
        staged = []
        num_evicted = 0
        for x in self.collect_leaves(num_tokens):
            if x.host_value is None:
                self.write_backup(x, write_back=True)
            x.protect_host()
            staged.append(x)
            num_evicted += len(x.value)
        self.writing_check(write_back=True)
        for x in staged:
            self.cache_controller.evict_device(x.value)
            x.release_host()
        return num_evicted

    def evict_safely(self, num_tokens):
        staged = []
        num_evicted = 0
        try:
            for x in self.collect_leaves(num_tokens):
                if x.host_value is None:
                    self.write_backup(x, write_back=True)
                x.protect_host()
                staged.append(x)
                num_evicted += len(x.value)
            self.writing_check(write_back=True)
            for x in staged:
                self.cache_controller.evict_device(x.value)
        finally:
            for x in staged:
                x.release_host()
        return num_evicted

    def stage_for_flush(self, x):
        x.protect_host()
        self.staged.append(x)
