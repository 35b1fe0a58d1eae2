"""Tensor-parallel agreement misused or after a fault: refused with a typed error, named right.

Two gloo ranks (spawned as in ``tests/test_distributed.py``) run each scenario
on a gloo group of its own and write what each call said as JSON; the tests
compare the ranks' reports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch.distributed as dist
    from torch.multiprocessing.spawn import start_processes

    from fsm_cache.bench.tp import bench_config, chat_trace, serve_request
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.distributed import collectives
    from fsm_cache.distributed.agreement import DistributedCache
    from fsm_cache.distributed.collectives import Collectives
    from fsm_cache.errors import FsmCacheError
    from fsm_cache.memory.tiers import CacheConfig
    from fsm_cache.storage import LocalFileStore

TIMEOUT = 20.0  # seconds the default group's collectives wait
DEADLINE = 240.0  # seconds the spawned ranks may run before the test kills them
Results = list[dict[str, Any]]


def said(call: Callable[[], object], caught: type[Exception] = FsmCacheError) -> str:
    """What ``call`` raised (of ``caught``), as ``Class: message``, or ``returned``."""
    try:
        call()
    except caught as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def served(timeout: float, local_sockets: bool = True, **config: object) -> DistributedCache:
    """A wrapper on a gloo group of its own that served four requests, a step after each."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    cache = HiCache(bench_config(debug=True, **config))
    shared = DistributedCache(cache, side, timeout=timeout, local_sockets=local_sockets)
    for tokens in chat_trace(4, seed=1):
        serve_request(shared.cache, tokens)
        shared.step()
    return shared


def failed_alike_then_parted(rank: int) -> str:
    """An insert fails alike on both ranks, its message naming the rank's GPU; rank 1 evicts.

    The failure, folded in by its class, is no divergence; the eviction is, and
    must be named, not the messages of the failures that agree.
    """
    shared = served(TIMEOUT, write_policy="write_through_selective")
    allocator = shared.cache.tiers.device.allocator

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError(f"CUDA out of memory on GPU {rank}")

    allocator.alloc = broken  # type: ignore[method-assign]
    try:
        shared.cache.insert(list(range(5000, 5032)))
    except RuntimeError:
        pass
    finally:
        vars(allocator).pop("alloc", None)
    if rank == 1:
        shared.cache.evict(8)
    return said(shared.step)


def closed_on_one_rank(rank: int) -> list[str]:
    """Rank 1 closes its cache, then both step twice."""
    shared = served(5.0)
    if rank == 1:
        shared.cache.close()
    return [said(shared.step), said(shared.step)]


def built_with_different_timeouts(rank: int) -> list[Any]:
    """Rank 1 is given a longer timeout: both are refused, and the cache can be wrapped again."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    cache = HiCache(bench_config(debug=True))
    refused = said(lambda: DistributedCache(cache, side, timeout=5.0 if rank == 0 else 7.5))
    untouched = not cache.transfers.acks_taken
    shared = DistributedCache(cache, side, timeout=5)  # an int: the same timeout as 5.0
    serve_request(cache, chat_trace(1, seed=1)[0])
    return [refused, untouched, said(shared.step), said(shared.verify_agreement)]


def built_with_a_cache_refused_on_one_rank(rank: int) -> list[Any]:
    """Rank 1 wraps a write_back cache: both refuse at once; then both wrap and step."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    policy = "write_back" if rank == 1 else "write_through"
    started = time.monotonic()
    refused = said(
        lambda: DistributedCache(HiCache(bench_config(write_policy=policy)), side, timeout=TIMEOUT)
    )
    at_once = time.monotonic() - started < TIMEOUT / 2  # not when the timeout ran out
    shared = DistributedCache(HiCache(bench_config()), side, timeout=TIMEOUT)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    return [refused, at_once, said(shared.step), said(shared.verify_agreement)]


def gathered_extremes(rank: int) -> list[Any]:
    """Both ranks gather 130 signed 64-bit values (more than a row) and objects of unequal sizes."""
    comm = Collectives.of(
        dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT)), TIMEOUT
    )
    values = [-(2**63), 2**63 - 1, -1, 0, *range(-63 * rank, 126 - 63 * rank)]
    values[4 + rank] = 2**62 if rank else -(2**62)
    blob = {"rank": rank, "text": "x" * (1000 * (rank + 1))}  # more than a row: two gathers
    return [
        comm.all_reduce_min(values),
        comm.all_gather_digest(values),
        comm.all_gather_object(blob),
        comm.all_reduce_min([]),  # a collective still, so that the next ones pair
        comm.all_reduce_min([rank]),
    ]


def reduced_different_widths(rank: int) -> str:
    """Rank 0 reduces one value, rank 1 seventy (two rows): both raise at the first row."""
    comm = Collectives.of(
        dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT)), TIMEOUT
    )
    return said(lambda: comm.all_reduce_min([rank] * (70 if rank else 1), "test MIN"))


def gathered_for_different_purposes(rank: int) -> str:
    """Both ranks gather an object, rank 1 for its construction: both raise at the sizes."""
    comm = Collectives.of(
        dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT)), TIMEOUT
    )
    purpose = {"what": "construction agreement"} if rank else {}
    return said(lambda: comm.all_gather_object((5.0, None), **purpose))


def built_with_a_deprecation_made_an_error(rank: int) -> list[Any]:
    """Rank 1 passes the deprecated ``verify_every`` with warnings made errors."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        started = time.monotonic()
        refused = said(
            lambda: DistributedCache(
                HiCache(bench_config()), side, timeout=TIMEOUT, verify_every=4 * rank
            ),
            Exception,  # a DeprecationWarning on rank 1, a ConfigError on rank 0
        )
    return [refused, time.monotonic() - started < TIMEOUT / 2]


def reached_different_collectives(rank: int) -> list[str]:
    """Rank 0 steps while rank 1 builds a second wrapper on the same group."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    shared = DistributedCache(HiCache(bench_config()), side, timeout=TIMEOUT)
    if rank == 0:
        return [said(shared.step), said(shared.step)]
    return [said(lambda: DistributedCache(HiCache(bench_config()), side, timeout=TIMEOUT))]


def closed_on_every_rank(rank: int) -> list[str]:
    """Both ranks close their caches, then call every agreement."""
    del rank
    shared = served(5.0)
    shared.cache.close()
    return [said(shared.step), said(shared.drain), said(shared.verify_agreement)]


def stepped_after_a_timeout(rank: int, local_sockets: bool = True) -> list[Any]:
    """Rank 1 is late to a step past the timeout; both then step again."""
    shared = served(1.0, local_sockets)
    serve_request(shared.cache, chat_trace(5, seed=1)[-1])  # leaves copies in flight
    if rank == 1:
        time.sleep(2.5)
    first = said(shared.step)
    transitions = shared.transitions
    started = time.monotonic()
    again = said(shared.step)
    quick = time.monotonic() - started < 0.5
    return [first, again, quick, shared.transitions == transitions]


def stepped_after_a_timeout_on_gloo(rank: int) -> list[Any]:
    """As :func:`stepped_after_a_timeout`, every collective on gloo."""
    return stepped_after_a_timeout(rank, local_sockets=False)


def built_with_different_transports(rank: int) -> list[Any]:
    """Rank 0 asks for same-host sockets, rank 1 for gloo: both refused; then both wrap alike."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    started = time.monotonic()
    refused = said(
        lambda: DistributedCache(
            HiCache(bench_config()), side, timeout=TIMEOUT, local_sockets=rank == 0
        )
    )
    at_once = time.monotonic() - started < TIMEOUT / 2
    shared = DistributedCache(HiCache(bench_config()), side, timeout=TIMEOUT)
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    return [refused, at_once, shared.comm.transport, said(shared.step)]


def fell_back_to_gloo(rank: int) -> list[Any]:
    """Rank 0 cannot connect, then rank 1 cannot listen: each time both agree over gloo, at once."""
    found = []
    for failing, part, broken in (
        (0, "_dial", lambda *args: False),  # a refused connect, say
        (1, "_listen", lambda world: None),  # out of descriptors, say
    ):
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
        started = time.monotonic()
        with pytest.MonkeyPatch.context() as patch:
            if rank == failing:
                patch.setattr(collectives, part, broken)
            shared = DistributedCache(HiCache(bench_config()), side, timeout=TIMEOUT)
        serve_request(shared.cache, chat_trace(1, seed=1)[0])
        found.append(
            [time.monotonic() - started < TIMEOUT / 2, shared.comm.transport, said(shared.step)]
        )
    return found


def set_up_beside_a_stranger(rank: int) -> list[Any]:
    """Something connects to rank 1's socket during setup and says nothing: it is dropped.

    Any process in the network namespace can reach an abstract socket's name
    (``/proc/net/unix`` lists it). Waiting on its hello made every rank raise.
    """
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    held: list[socket.socket] = []
    listen: Callable[[int], tuple[socket.socket, str] | None]
    listen = vars(collectives)["_listen"]  # what the stranger connects to

    def with_a_stranger(world: int) -> tuple[socket.socket, str] | None:
        made = listen(world)
        if made is not None:
            stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stranger.connect(made[1])
            held.append(stranger)
        return made

    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(collectives, "_listen", with_a_stranger)
        shared = DistributedCache(HiCache(bench_config()), side, timeout=4.0)
    at_once = time.monotonic() - started < 2.0
    for stranger in held:
        stranger.close()
    serve_request(shared.cache, chat_trace(1, seed=1)[0])
    return [at_once, shared.comm.transport, said(shared.step)]


def forked_after_wrapping(rank: int) -> list[Any]:
    """A forked child's exchange on its parent's sockets is refused; the parent's go on."""
    shared = served(TIMEOUT)
    sockets = shared.comm.sockets
    assert sockets is not None
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report what an exchange said, and leave at once
        try:
            sockets.exchange(b"x" * 544, 1.0)
            os.write(write, b"exchanged")
        except collectives.SocketFailure as exc:
            os.write(write, str(exc).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as reading:
        told = reading.read().decode()
    os.waitpid(child, 0)
    serve_request(shared.cache, chat_trace(2, seed=2)[1])
    return [told, said(shared.step), said(shared.verify_agreement)]


def looked_up_different_prefixes(rank: int, folder: Path) -> str:
    """Both ranks' stores hold six pages; rank 0 looks up four of them, rank 1 all six."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT))
    config = CacheConfig(
        device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
    )
    store = LocalFileStore(folder / f"store{rank}")

    def wrapped() -> DistributedCache:
        tier = StorageConfig(
            store, model="test", rank=rank, ranks=2, threads=0, io_timeout=5.0, prefetch_threshold=4
        )
        return DistributedCache(HiCache(config, storage=tier), side, timeout=TIMEOUT)

    tokens = list(range(1000, 1024))
    writer = wrapped()
    writer.cache.insert(tokens)
    writer.drain()
    writer.cache.close()
    shared = wrapped()
    return said(lambda: shared.cache.match_prefix(tokens[: 16 if rank == 0 else 24]))


def worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )
    report: dict[str, Any] = {}
    for scenario in (
        failed_alike_then_parted,
        closed_on_one_rank,
        closed_on_every_rank,
        built_with_different_timeouts,
        built_with_a_cache_refused_on_one_rank,
        gathered_extremes,
        reduced_different_widths,
        gathered_for_different_purposes,
        built_with_a_deprecation_made_an_error,
        reached_different_collectives,
        stepped_after_a_timeout,
        stepped_after_a_timeout_on_gloo,
        built_with_different_transports,
        fell_back_to_gloo,
        forked_after_wrapping,
        set_up_beside_a_stranger,
    ):
        report[scenario.__name__] = scenario(rank)
        dist.barrier()  # the default group is whole: a late rank catches up here
    report["looked_up_different_prefixes"] = looked_up_different_prefixes(rank, Path(out))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    folder = tmp_path_factory.mktemp("misuse")
    ctx = start_processes(
        worker, args=(2, str(folder / "store"), str(folder)), nprocs=2, join=False
    )  # type: ignore[no-untyped-call]
    ends = time.monotonic() + DEADLINE
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with a rank's traceback
        if time.monotonic() > ends:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"2 ranks still running after {DEADLINE:g} s")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_failure_alike_on_every_rank_is_not_named_for_its_messages(ranks: Results) -> None:
    expected = (
        "RankDivergence: rank divergence at transition 8: rank 0 applied nothing (only 8 "
        "transitions), rank 1 applied node 2 delete in evict(8); node 2 now: rank 0 "
        "unbacked/resident (pins=0, locks=0), rank 1 not in the tree"
    )
    assert [r["failed_alike_then_parted"] for r in ranks] == [expected, expected]


def test_a_step_on_a_cache_closed_on_one_rank_is_refused_and_named(ranks: Results) -> None:
    closed = "CacheClosed: step: the cache of rank 1 of 2 was closed"
    failed = (
        "rank 0 of 2: the agreement stopped before its collective, and no rank applied "
        f"anything in it: rank 1 raised {closed.replace(': ', ' in step: ', 1)}"
    )
    refused = (
        "RankFailure: rank {0} of 2: step refused: the agreement group broke at an earlier "
        "collective, and a later one could pair with another collective of the other ranks; "
        "tear the group down and rebuild it and the caches (it broke with: {1})"
    )
    assert ranks[0]["closed_on_one_rank"] == [f"RankFailure: {failed}", refused.format(0, failed)]
    # the closed rank raises its own error, then is broken as the rank it told is
    mine = failed.replace("rank 0 of 2", "rank 1 of 2", 1)
    assert ranks[1]["closed_on_one_rank"] == [closed, refused.format(1, mine)]


def test_agreements_on_caches_closed_everywhere_are_refused_alike(ranks: Results) -> None:
    for rank, report in enumerate(ranks):
        assert report["closed_on_every_rank"] == [
            f"CacheClosed: {call}: the cache of rank {rank} of 2 was closed"
            for call in ("step", "drain", "verify_agreement")
        ]


def test_ranks_given_different_timeouts_are_refused_on_every_rank(ranks: Results) -> None:
    refused = (
        "ConfigError: distributed: the ranks were given different timeouts (rank 0 5.0 s, "
        "rank 1 7.5 s): give every rank the same, or the rank that waits least gives up on a "
        "collective the others still wait in"
    )
    for report in ranks:
        assert report["built_with_different_timeouts"] == [refused, True, "returned", "returned"]


def test_a_cache_refused_on_one_rank_is_named_on_every_rank_at_once(ranks: Results) -> None:
    own = (
        "ConfigError: distributed: write_back waits for its copies inside an allocation, where "
        "the ranks cannot agree on them yet; use write_through or write_through_selective"
    )
    told = (
        "ConfigError: distributed: rank 0 of 2: the ranks must wrap their caches together, and "
        f"not every rank could: rank 1 refused with {own}"
    )
    assert [r["built_with_a_cache_refused_on_one_rank"] for r in ranks] == [
        [told, True, "returned", "returned"],
        [own, True, "returned", "returned"],
    ]


def test_gathers_reduce_and_carry_every_rank_values_exactly(ranks: Results) -> None:
    sent = []
    for rank in range(2):
        values = [-(2**63), 2**63 - 1, -1, 0, *range(-63 * rank, 126 - 63 * rank)]
        values[4 + rank] = 2**62 if rank else -(2**62)
        sent.append(values)
    least = [min(pair) for pair in zip(*sent, strict=True)]
    assert least[:8] == [-(2**63), 2**63 - 1, -1, 0, -(2**62), 1, -61, -60]
    blobs = [{"rank": rank, "text": "x" * (1000 * (rank + 1))} for rank in range(2)]
    for report in ranks:
        assert report["gathered_extremes"] == [least, sent, blobs, [], [0]]


def test_reductions_of_different_widths_are_refused_on_every_rank(ranks: Results) -> None:
    for rank, report in enumerate(ranks):
        assert report["reduced_different_widths"] == (
            f"RankFailure: rank {rank} of 2: test MIN: the ranks reached different collectives "
            "(rank 0 a MIN all-reduce of 1 word, rank 1 a MIN all-reduce of 70 words): they "
            "called the group in different orders, so its collectives no longer pair; tear the "
            "group down and rebuild it"
        )


def test_object_gathers_for_different_purposes_are_refused_on_every_rank(
    ranks: Results,
) -> None:
    for rank, report in enumerate(ranks):
        what = "construction agreement" if rank else "divergence report"
        assert report["gathered_for_different_purposes"] == (
            f"RankFailure: rank {rank} of 2: {what} (all_gather sizes): the ranks reached "
            "different collectives (rank 0 an object gather (sizes) of 1 word for a divergence "
            "report, rank 1 an object gather (sizes) of 1 word for a construction agreement): "
            "they called the group in different orders, so its collectives no longer pair; tear "
            "the group down and rebuild it"
        )


def test_a_deprecation_made_an_error_on_one_rank_is_told_to_the_others(ranks: Results) -> None:
    own = "DeprecationWarning: DistributedCache(verify_every=...) is deprecated and ignored: "
    told, mine = (r["built_with_a_deprecation_made_an_error"] for r in ranks)
    assert mine[0].startswith(own)
    assert mine[1]  # at once, as the other rank
    assert told == [
        "ConfigError: distributed: rank 0 of 2: the ranks must wrap their caches together, and "
        f"not every rank could: rank 1 refused with {mine[0]}",
        True,
    ]


def test_ranks_at_different_collectives_are_refused_not_aborted(ranks: Results) -> None:
    kinds = (
        "rank 0 a MIN all-reduce of 61 words, rank 1 an object gather (sizes) of 1 word for a "
        "construction agreement"
    )
    mismatch = (
        "RankFailure: rank {} of 2: {}: the ranks reached different collectives ({}): they "
        "called the group in different orders, so its collectives no longer pair; tear the "
        "group down and rebuild it"
    )
    step = mismatch.format(0, "step agreement (all_gather MIN)", kinds)
    assert ranks[0]["reached_different_collectives"] == [
        step,
        "RankFailure: rank 0 of 2: step refused: the agreement group broke at an earlier "
        "collective, and a later one could pair with another collective of the other ranks; "
        f"tear the group down and rebuild it and the caches (it broke with: {step[13:]})",
    ]
    assert ranks[1]["reached_different_collectives"] == [
        mismatch.format(1, "construction agreement (all_gather sizes)", kinds)
    ]


@pytest.mark.parametrize(
    ("scenario", "detail"),
    [
        ("stepped_after_a_timeout", "rank 1 did not finish the exchange within 1 s"),
        ("stepped_after_a_timeout_on_gloo", "Operation timed out!"),
    ],
)
def test_a_step_after_a_timeout_is_refused_at_once(
    ranks: Results, scenario: str, detail: str
) -> None:
    first, again, quick, unchanged = ranks[0][scenario]
    assert re.fullmatch(
        r"RankFailure: rank 0 of 2: step agreement \(all_gather MIN\) failed after \d+\.\d\d s "
        rf"\(timeout 1 s\): another rank died or stopped taking part: {re.escape(detail)}",
        first,
    ), first
    assert again == (
        "RankFailure: rank 0 of 2: step refused: the agreement group broke at an earlier "
        "collective, and a later one could pair with another collective of the other ranks; "
        f"tear the group down and rebuild it and the caches (it broke with: {first[13:]})"
    )
    assert (quick, unchanged) == (True, True)
    # the late rank may complete the step with rank 0's part (gloo keeps it, and rank 0's
    # row is in its socket), as documented; its next step, which nobody joins, fails
    assert ranks[1][scenario][1].startswith("RankFailure: rank 1 of 2: ")


def test_ranks_given_different_transports_are_refused_on_every_rank_at_once(
    ranks: Results,
) -> None:
    kinds = (
        "rank 0 an object gather (sizes) of 1 word for a same-host socket setup, rank 1 an "
        "object gather (sizes) of 1 word for a construction agreement"
    )
    mismatch = (
        "RankFailure: rank {} of 2: {} (all_gather sizes): the ranks reached different "
        f"collectives ({kinds}): they called the group in different orders, so its "
        "collectives no longer pair; tear the group down and rebuild it"
    )
    for rank, what in enumerate(("same-host socket setup", "construction agreement")):
        # wrapped again alike, the group's collectives pair again, now over the sockets
        assert ranks[rank]["built_with_different_transports"] == [
            mismatch.format(rank, what),
            True,
            "same-host sockets",
            "returned",
        ]


def test_lookups_that_ask_the_store_about_different_prefixes_name_each_rank(
    ranks: Results,
) -> None:
    expected = (
        "RankDivergence: rank divergence after transition 0: the ranks asked the storage tier "
        "about different prefixes: from [0, 4, 1, 1] to [0, 6, 1, 1] pages: rank 0 asked "
        "[0, 4, 1, 1] in match_prefix(<16 ids {}>, None), rank 1 asked [0, 6, 1, 1] in "
        "match_prefix(<24 ids {}>, None)"
    ).format(*(f"{hash(tuple(range(1000, n))) & (1 << 64) - 1:016x}" for n in (1016, 1024)))
    assert [r["looked_up_different_prefixes"] for r in ranks] == [expected, expected]


def test_a_rank_that_cannot_connect_or_listen_leaves_the_group_on_gloo_at_once(
    ranks: Results,
) -> None:
    for report in ranks:
        assert report["fell_back_to_gloo"] == [[True, "gloo", "returned"]] * 2


def test_a_forked_child_cannot_exchange_on_its_parents_sockets(ranks: Results) -> None:
    for report in ranks:
        assert report["forked_after_wrapping"] == [
            "the same-host sockets broke at an earlier exchange: inherited across a fork: a "
            "child cannot take part in its parent's agreement",
            "returned",
            "returned",
        ]


def test_a_silent_stranger_on_a_socket_holds_up_no_rank(ranks: Results) -> None:
    for report in ranks:
        assert report["set_up_beside_a_stranger"] == [True, "same-host sockets", "returned"]
