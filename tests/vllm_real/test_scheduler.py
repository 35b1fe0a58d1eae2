"""vLLM's scheduler-side offloading connector over our manager, completions fed by hand.

``OffloadingConnectorScheduler`` is the part of vLLM's ``OffloadingConnector``
that runs in the scheduler: it looks blocks up, builds load and store jobs,
and calls the manager as the workers report. Here it is vLLM's own code,
built from a ``CPUOffloadingSpec`` (vLLM's manager) or an
``FsmCpuOffloadingSpec`` (ours, strict mode and trail mode on), with a real
``KVCacheConfig``, real ``Request`` objects with vLLM's block hasher and real
``SchedulerOutput`` objects; no worker runs, and the job completions a worker
would report are fed by hand.

The scenario is vLLM issue #46014's: a request is preempted while its blocks
are being stored, and re-admitted before the store job reports. vLLM 0.32 to
0.34 flush the job and defer the re-admission until it reports; the store is
then acknowledged exactly once, and the request's second admission loads its
blocks back. Our manager in strict mode would refuse a second acknowledgement;
it sees none, and answers every call as vLLM's manager does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from .conftest import Vllm


BLOCK = 16
"""Tokens per block (and per offload chunk: one block a chunk)."""


class Recorder:
    """Stands between the connector and a manager, recording every call and its answer."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.calls: list[tuple[str, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.manager, name)
        if not callable(found):
            return found
        return self._recording(name, found)

    def _recording(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            answer = method(*args, **kwargs)
            if name == "take_events":
                answer = list(answer)
            self.calls.append((name, _plain(args[:1]), _plain(answer)))
            return answer

        return call


def _plain(value: Any) -> Any:
    """A comparable form of a manager argument or answer (vLLM's specs hold numpy arrays)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "block_ids"):
        return [int(i) for i in value.block_ids]
    if hasattr(value, "keys_to_store"):
        return (list(value.keys_to_store), _plain(value.store_spec), list(value.evicted_keys))
    if hasattr(value, "removed") and hasattr(value, "keys"):
        # vLLM 0.34's stored events name their request, for its KV events' payloads.
        origin = _plain(getattr(value, "req_context", None))
        return (list(value.keys), value.removed, getattr(value, "removal_expected", False), origin)
    if hasattr(value, "req_id") and not isinstance(value, str):
        return "ctx"
    return value


class Connector:
    """vLLM's scheduler-side connector over one manager, and the modules to drive it."""

    def __init__(self, vl: Vllm, ours: bool, strict: bool = True) -> None:
        def module(name: str) -> Any:
            return importlib.import_module(name)

        self.sched_mod = module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
        self.common = module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common")
        self.out = module("vllm.v1.core.sched.output")
        self.outputs = module("vllm.v1.outputs")
        self.request_mod = module("vllm.v1.request")
        self.blocks_mod = module("vllm.v1.core.kv_cache_manager")
        self.utils = module("vllm.v1.core.kv_cache_utils")
        interface = module("vllm.v1.kv_cache_interface")
        sha256 = module("vllm.utils.hashing").sha256
        self.utils.init_none_hash(sha256)
        self.hasher = self.utils.get_request_block_hasher(BLOCK, sha256)
        torch = module("torch")
        kv_cache_config = interface.KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                interface.KVCacheGroupSpec(
                    ["layer.0"],
                    interface.FullAttentionSpec(
                        BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16
                    ),
                )
            ],
        )
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(
                prefix_cache_retention_interval=None, enable_prefix_caching=True
            ),
            speculative_config=None,
            # vLLM 0.34: tokens after each block its hash covers; 0 (legacy hashes) is what
            # vLLM resolves without speculative decoding.
            num_hash_lookahead_tokens=0,
            parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
        )
        extra = {"cpu_bytes_to_use": 64 * 4096, "fsm_strict": strict, "fsm_trail": True}
        spec_class = (
            vl.fsm.FsmCpuOffloadingSpec
            if ours
            else module("vllm.v1.kv_offload.cpu.spec").CPUOffloadingSpec
        )
        self.spec = spec_class(_config(extra))
        self.sched = self.sched_mod.OffloadingConnectorScheduler(
            self.spec, vllm_config, kv_cache_config
        )
        self.manager = self.sched.manager
        self.recorder = Recorder(self.manager)
        self.sched.manager = self.recorder

    def request(self, req_id: str, tokens: int) -> Any:
        """A vLLM ``Request`` with ``tokens`` prompt tokens, its block hashes computed."""
        sampling = importlib.import_module("vllm.sampling_params").SamplingParams(max_tokens=4)
        return self.request_mod.Request(
            req_id, list(range(tokens)), sampling, None, block_hasher=self.hasher
        )

    def blocks(self, ids: list[int]) -> Any:
        """``KVCacheBlocks`` of one group holding GPU blocks ``ids``."""
        return self.blocks_mod.KVCacheBlocks(([self.utils.KVCacheBlock(block_id=i) for i in ids],))

    def new_request_data(self, req: Any, block_ids: list[int]) -> Any:
        """The ``NewRequestData`` of a request first scheduled into GPU blocks ``block_ids``.

        vLLM's scheduler passes the prompt's token ids (0.34 requires them).
        """
        tokens = list(req.all_token_ids)
        return self.out.NewRequestData.from_request(req, (block_ids,), tokens)

    def resumed(self, req: Any, block_ids: list[int], num_computed: int) -> dict[str, Any]:
        """The ``SchedulerOutput`` fields that schedule a preempted request again.

        vLLM 0.32 and 0.33 send it as a cached request marked resumed, with its
        new block table; 0.34 sends it again in full, as a new request.
        """
        if "resumed_req_ids" not in self.out.CachedRequestData.__dataclass_fields__:
            return {"scheduled_new_reqs": [self.new_request_data(req, block_ids)]}
        cached = self.out.CachedRequestData(
            req_ids=[req.request_id],
            resumed_req_ids={req.request_id},
            new_token_ids=[[]],
            all_token_ids={},
            new_block_ids=[(block_ids,)],
            num_computed_tokens=[num_computed],
            num_output_tokens=[0],
        )
        return {"scheduled_cached_reqs": cached}

    def step(self, **fields: Any) -> Any:
        """Build one step's connector metadata from a ``SchedulerOutput`` with ``fields``."""
        output = self.out.SchedulerOutput.make_empty()
        for name, value in fields.items():
            setattr(output, name, value)
        return self.sched.build_connector_meta(output)

    def report(self, *job_ids: int) -> None:
        """The worker reports ``job_ids`` finished (what the connector's worker side sends)."""
        meta = self.common.OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
        self.sched.update_connector_output(
            self.outputs.KVConnectorOutput(kv_connector_worker_meta=meta)
        )


def _config(extra: dict[str, Any]) -> Any:
    """vLLM's ``OffloadingConfig``: one full-attention group, one block per chunk."""
    config: Any = importlib.import_module("vllm.v1.kv_offload.config")
    return config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(BLOCK, ("layer.0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id="engine-0",
        model=config.OffloadingModelConfig("tiny", "float16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def _jobs(jobs: dict[int, Any]) -> dict[int, tuple[list[int], list[int]]]:
    return {
        job_id: ([int(i) for i in job.src_spec.block_ids], [int(i) for i in job.dst_spec.block_ids])
        for job_id, job in jobs.items()
    }


def start_storing(c: Connector) -> Any:
    """Admit a request of four blocks and build the step that stores them (job 0)."""
    req = c.request("r0", 4 * BLOCK)
    c.sched.on_new_request(req)
    c.sched.get_num_new_matched_tokens(req, 0)
    c.sched.update_state_after_alloc(req, c.blocks([1, 2, 3, 4]), 0)
    new = c.new_request_data(req, [1, 2, 3, 4])
    meta = c.step(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r0": 4 * BLOCK},
        total_num_scheduled_tokens=4 * BLOCK,
    )
    assert _jobs(meta.store_jobs) == {0: ([1, 2, 3, 4], [0, 1, 2, 3])}
    req.num_computed_tokens = 4 * BLOCK
    return req


def preempt_while_storing(c: Connector) -> list[Any]:
    """Replay issue #46014's sequence; return what the connector decided at each step."""
    seen: list[Any] = []
    statuses = c.request_mod.RequestStatus
    req = c.request("r0", 4 * BLOCK)
    c.sched.on_new_request(req)
    seen.append(c.sched.get_num_new_matched_tokens(req, 0))
    c.sched.update_state_after_alloc(req, c.blocks([1, 2, 3, 4]), 0)
    new = c.new_request_data(req, [1, 2, 3, 4])
    meta = c.step(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r0": 4 * BLOCK},
        total_num_scheduled_tokens=4 * BLOCK,
    )
    seen.append(("stores", _jobs(meta.store_jobs)))
    req.num_computed_tokens = 4 * BLOCK
    # Preempted while job 0 still stores its four blocks.
    req.status, req.num_computed_tokens = statuses.PREEMPTED, 0
    meta = c.step(preempted_req_ids={"r0"})
    seen.append(("flush", sorted(meta.jobs_to_flush)))
    # Re-admitted before the store reports: deferred, not asserted on.
    seen.append(c.sched.get_num_new_matched_tokens(req, 0))
    c.step()
    c.report(0)
    hit = c.sched.get_num_new_matched_tokens(req, 0)
    seen.append(hit)
    c.sched.update_state_after_alloc(req, c.blocks([5, 6, 7, 8]), hit[0])
    req.status = statuses.RUNNING
    meta = c.step(
        **c.resumed(req, [5, 6, 7, 8], hit[0]), num_scheduled_tokens={"r0": 4 * BLOCK - hit[0]}
    )
    seen.append(("loads", _jobs(meta.load_jobs)))
    req.num_computed_tokens = 4 * BLOCK
    c.report(*meta.load_jobs)
    req.status = statuses.FINISHED_STOPPED
    seen.append(c.sched.request_finished(req))
    c.step(finished_req_ids={"r0"})
    # vLLM's KV events are msgspec structs, stood in here: compare their kinds (the
    # manager's own events, which they are made from, are compared call by call).
    seen.append(("events", [type(e).__name__ for e in c.sched.take_events()]))
    return seen


@pytest.fixture
def connectors(vl: Vllm) -> tuple[Connector, Connector]:
    return Connector(vl, ours=False), Connector(vl, ours=True)


def test_preempt_while_storing_replays_as_with_vllms_manager(
    vl: Vllm, connectors: tuple[Connector, Connector]
) -> None:
    theirs, ours = connectors
    assert type(ours.manager).__name__ == "FsmOffloadingManager"
    assert ours.manager.strict
    seen = preempt_while_storing(ours)
    assert seen == preempt_while_storing(theirs)
    assert ours.recorder.calls == theirs.recorder.calls
    # The connector deferred the re-admission while the store was in flight...
    assert seen[3] == (None, False)
    # ...acknowledged the store exactly once (strict mode refuses a second)...
    stores = [call for call in ours.recorder.calls if call[0] == "complete_store"]
    assert len(stores) == 1
    assert ours.manager.duplicate_acks == 0
    # ...and loaded all four blocks back into the new GPU blocks.
    assert seen[4][0] == 4 * BLOCK
    assert seen[5] == ("loads", {1: ([0, 1, 2, 3], [5, 6, 7, 8])})
    assert {(r.host, r.pins) for r in ours.manager.records.values()} == {("backed", 0)}
    names = [name for name, _, _ in ours.recorder.calls]
    for name in ("prepare_store", "complete_store", "lookup", "prepare_load", "complete_load"):
        assert name in names


def test_a_reset_with_a_store_in_flight_is_fenced_as_with_vllms_manager(vl: Vllm) -> None:
    """vLLM's connector fences the flushed job; its late report never reaches the manager."""
    theirs, ours = Connector(vl, ours=False), Connector(vl, ours=True, strict=False)
    for c in (theirs, ours):
        req = start_storing(c)
        c.sched.reset_cache()
        c.step()
        c.report(0)  # stale: dropped by the connector
        assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert ours.recorder.calls == theirs.recorder.calls
    assert "complete_store" not in [name for name, _, _ in ours.recorder.calls]
    assert ours.manager.records == {}


def test_strict_mode_refuses_a_reset_with_a_store_in_flight(vl: Vllm) -> None:
    from fsm_cache.errors import CopyInFlight

    c = Connector(vl, ours=True)
    c.sched.manager = c.manager  # no recorder between: the call sites are vLLM's own
    start_storing(c)
    before = {k: (r.host, r.pins, r.chunk) for k, r in c.manager.records.items()}
    with pytest.raises(CopyInFlight) as refused:
        c.sched.reset_cache()
    message = str(refused.value)
    assert (
        "evict_host refused in writing (pins=0): a device-to-host copy is still writing" in message
    )
    assert " written at scheduler.py:" in message
    assert " in _build_store_jobs; refused at scheduler.py:" in message
    # vLLM 0.33 and 0.34 reset in _reset_cache, 0.32 in reset_cache itself.
    assert message.endswith((" in _reset_cache", " in reset_cache"))
    assert {k: (r.host, r.pins, r.chunk) for k, r in c.manager.records.items()} == before
