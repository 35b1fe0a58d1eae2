"""The same-host sockets a tensor-parallel group's rows travel over, on socket pairs in one process.

Each rank of a group is a thread here with its own :class:`SameHostRows`; the
spawned-rank tests of ``tests/test_distributed*.py`` run the same class
between processes. What callers rely on: every rank gets every rank's bytes
in rank order, exchanges pair in order as gloo's collectives do (a rank that
gave up on one still owes it, and a late rank still gets its row), and a
rank that died breaks the sockets for good, at once, on every rank.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

import pytest

from fsm_cache.distributed.collectives import SameHostRows, SocketFailure, same_host


T = TypeVar("T")


def mesh(world: int) -> list[SameHostRows]:
    """One SameHostRows per rank, connected by a socket pair per pair of ranks."""
    peers: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for low, high in itertools.combinations(range(world), 2):
        peers[low][high], peers[high][low] = socket.socketpair(socket.AF_UNIX)
    return [SameHostRows(rank, world, peers[rank]) for rank in range(world)]


@pytest.fixture
def two() -> Iterator[list[SameHostRows]]:
    ranks = mesh(2)
    yield ranks
    for rank in ranks:
        rank.close()


def together(*calls: Callable[[], T]) -> list[T | BaseException]:
    """Run each call on a thread of its own; return what each returned or raised."""
    results: list[T | BaseException] = [RuntimeError("did not finish")] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_every_rank_bytes_in_rank_order(world: int) -> None:
    ranks = mesh(world)
    rows = [bytes([rank]) * 544 for rank in range(world)]
    got = together(*(partial(ranks[r].exchange, rows[r], 5.0) for r in range(world)))
    assert got == [rows] * world


def test_a_payload_longer_than_the_socket_buffers_is_not_stuck_in_a_send(
    two: list[SameHostRows],
) -> None:
    """Both send 8 MiB at once: sends and reads interleave, or both would block in a send."""
    data = [bytes([1 + rank]) * (8 << 20) for rank in range(2)]
    got = together(*(partial(two[r].exchange, data[r], 20.0) for r in range(2)))
    assert got == [data, data]


@pytest.mark.parametrize("size", [544, 4 << 20])
def test_each_rank_kth_exchange_pairs_with_the_others_kth_after_a_timeout(
    two: list[SameHostRows], size: int
) -> None:
    """As on a gloo group: an exchange given up on is still owed its bytes, both ways.

    A row always fits the socket's buffer, so a late rank gets it at once; a
    longer payload's unsent rest goes out at the giving-up rank's next exchange.
    """
    sent = [[bytes([10 * k + rank]) * size for rank in range(2)] for k in range(3)]
    started = time.monotonic()
    with pytest.raises(SocketFailure) as caught:
        two[0].exchange(sent[0][0], 0.2)
    assert str(caught.value) == "rank 1 did not finish the exchange within 0.2 s"
    assert 0.2 <= time.monotonic() - started < 2.0
    for k in (0, 1):  # rank 1's k-th exchange meets rank 0's k-th, while rank 0 is at k + 1
        late, ahead = together(
            partial(two[1].exchange, sent[k][1], 10.0),
            partial(two[0].exchange, sent[k + 1][0], 1.0),
        )
        assert late == sent[k]
        assert isinstance(ahead, SocketFailure)
        assert str(ahead) == "rank 1 did not finish the exchange within 1 s"


def test_a_rank_that_closed_breaks_the_sockets_for_good_on_the_others() -> None:
    three = mesh(3)
    three[2].close()  # rank 2 died: its ends close
    with pytest.raises(SocketFailure) as refused:
        three[2].exchange(b"x", 1.0)
    assert str(refused.value) == (
        "the same-host sockets broke at an earlier exchange: closed on this rank"
    )
    started = time.monotonic()
    got = together(lambda: three[0].exchange(b"a", 30.0), lambda: three[1].exchange(b"b", 30.0))
    assert time.monotonic() - started < 10.0  # at once, not at the timeout
    for rank, failed in enumerate(got):
        assert isinstance(failed, SocketFailure)
        assert str(failed) in (  # rank 2's end, or the other's, which closed on reading it
            "rank 2 closed its socket (it died, or its sockets broke)",
            f"rank {1 - rank} closed its socket (it died, or its sockets broke)",
        )
        assert three[rank].failed == str(failed)
        with pytest.raises(SocketFailure) as again:
            three[rank].exchange(b"a", 30.0)
        assert str(again.value) == f"the same-host sockets broke at an earlier exchange: {failed}"


def test_the_longest_timeout_waits_for_a_late_rank(two: list[SameHostRows]) -> None:
    """``poll()`` takes at most 2**31 - 1 ms: a longer timeout raised a bare OverflowError."""
    rows = [b"a" * 544, b"b" * 544]

    def late() -> list[bytes]:
        time.sleep(0.2)
        return two[1].exchange(rows[1], 1.0)

    assert together(lambda: two[0].exchange(rows[0], 4.6e9), late) == [rows, rows]


def test_an_exchange_that_raised_anything_else_breaks_the_sockets(
    two: list[SameHostRows],
) -> None:
    """What it sent is unknown, so no later exchange may pair with the other ranks'."""
    with pytest.raises(TypeError):
        two[0].exchange(None, 1.0)  # type: ignore[arg-type]
    assert two[0].failed == "TypeError in an exchange"
    with pytest.raises(SocketFailure) as caught:
        two[1].exchange(b"b", 5.0)
    assert str(caught.value) == "rank 0 closed its socket (it died, or its sockets broke)"


def test_this_host_is_named_for_unix_sockets_on_linux() -> None:
    host = same_host()
    assert host is not None
    name, boot, namespace = host
    assert name == socket.gethostname()
    assert len(boot) == 36  # a UUID
    assert namespace > 0
