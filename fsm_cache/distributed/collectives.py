"""The collectives of a tensor-parallel group, on the CPU, with failures turned into RankFailure.

:class:`~fsm_cache.distributed.agreement.DistributedCache` agrees through these three
calls. They always run on CPU tensors over a gloo group, even when the model's
group is NCCL: an NCCL all-reduce is queued on the GPU behind the forward pass,
and reading its result back (``.tolist()``) waits for every kernel queued
before it, so each agreement would stall the scheduler until the compute
stream drained. SGLang keeps a CPU side group (``tp_cpu_group``) for the same
reason; :func:`cpu_group` uses a gloo group as it is and builds a gloo side
group over the ranks of any other. Their tensors are made on the CPU by name,
whatever torch's default device: a model loader's
``torch.set_default_device("cuda")`` put the divergence report's on the GPU.

The MIN all-reduce is an ``all_gather`` reduced on every rank: gloo's
``all_reduce`` passes round the ring twice (a reduce-scatter, then an all-gather),
an ``all_gather`` once, and at a few dozen integers the passes are the cost.

When every rank runs on one host (the usual tensor-parallel group: the GPUs
of one machine), the rows go over Unix sockets between the ranks instead
(:class:`SameHostRows`), set up once over gloo: a gloo collective wakes a
worker thread and a transport thread on each side, about 300 us a round
trip on a two-core host against 10 us for a socket pair, and a step's
agreement is one round trip. vLLM broadcasts its scheduler's output over
shared memory on one node for the same reason.

Each call waits at most the group's timeout (``Work.wait(timeout)``, or a
deadline on the sockets) and turns a backend error into a
:class:`~fsm_cache.errors.RankFailure` that names the rank, the collective
and how long it waited, so a dead or hung rank ends the run instead of
hanging it.
"""

from __future__ import annotations

import array
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from fsm_cache.errors import ConfigError, RankFailure


T = TypeVar("T")


CPU = torch.device("cpu")
"""Where every agreement tensor lives."""


def cpu_group(group: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup | None:
    """Return a gloo group over the ranks of ``group``: ``group`` itself if it is one.

    A group whose backend is not gloo (NCCL) gets a new gloo side group over
    the same ranks, in the same order (``new_group(backend="gloo")``), which
    every rank of the world must build at the same point: so only for the
    default group, or a group that spans the whole world. For a smaller NCCL
    group, build its gloo twin once on every rank of the world
    (``torch.distributed.new_group(ranks, backend="gloo")``, as SGLang builds
    ``tp_cpu_group``) and pass that.

    Args:
        group: The ranks that agree; None for the default group.
        timeout: Seconds a collective of a new side group may wait.

    Raises:
        ConfigError: ``group`` is an NCCL (or other non-gloo) group smaller than the world.
    """
    if "gloo" in str(dist.get_backend(group)):  # "gloo", or "cpu:gloo,cuda:nccl"
        return group
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ConfigError(
            f"distributed: the agreement needs a gloo group, and a {dist.get_backend(group)} "
            f"group of {dist.get_world_size(group)} of {dist.get_world_size()} ranks cannot "
            "get one here (every rank of the world would have to build it); build it on every "
            'rank with torch.distributed.new_group(ranks, backend="gloo") and pass that'
        )
    side: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return side


ROW = 68
"""Words (int64) each rank sends first in every collective of :class:`Collectives`: a row.

Every collective on the group starts with an ``all_gather`` of one row per
rank: four words of header (its kind, the kind's negation, the length of its
whole payload, and for an object gather the purpose it was called for) and
up to 64 words of payload. gloo aborts the process (``std::terminate``, which
Python cannot catch) when a message is longer than the buffer it arrives in,
so ranks that reach different collectives (one in a step, another building
its wrapper or gathering a divergence report) must still send rows of one
size; the headers then say that they differ, on every rank at once. A longer
payload sends the rest in one more ``all_gather``, once every rank's header
has said it is in the same collective with the same length.
"""

_HEADER = 4
_PAYLOAD = ROW - _HEADER

_MIN, _INTS, _SIZES, _BYTES = 1, 2, 3, 4
"""The kinds of row: an element-wise MIN, a gather of ints, an object gather's sizes, its bytes."""

_ROW_KINDS = {
    _MIN: "a MIN all-reduce",
    _INTS: "a gather of integers",
    _SIZES: "an object gather (sizes)",
    _BYTES: "an object gather (bytes)",
}

DIVERGENCE_REPORT = "divergence report"
CONSTRUCTION = "construction agreement"
SAME_HOST = "same-host socket setup"
_PURPOSES = {
    zlib.crc32(what.encode()): what for what in (DIVERGENCE_REPORT, CONSTRUCTION, SAME_HOST)
}
"""The purposes of the library's own object gathers, by the word their rows carry."""


def _reached(header: list[int]) -> str:
    """Name the collective a row's header says its rank reached."""
    kind, negated, length, purpose = header
    if kind != -negated or kind not in _ROW_KINDS:
        return "something else"
    named = f"{_ROW_KINDS[kind]} of {length} word{'' if length == 1 else 's'}"
    if kind in (_SIZES, _BYTES):
        named += f" for a {_PURPOSES.get(purpose, 'purpose of its own')}"
    return named


class _Rows:
    """The buffers of one rank's rows, kept between collectives.

    Tensors that share arrays' memory: filling and reading them stay in
    Python, where ``torch.tensor(list)`` and ``.tolist()`` took about 50 us a
    step once the step's own work had left the caches cold, and buffers made
    afresh each call cost about as much again (``fsm-cache bench tp``). A
    collective that failed may still write into its buffers later (gloo
    finishes an operation a rank stopped waiting for), so they are made anew
    after a failure (:meth:`renew`).
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.renew()

    def renew(self) -> None:
        """Make new buffers; the old ones stay with whatever collective still holds them."""
        self.mine = array.array("q", bytes(8 * ROW))
        self.sent = torch.frombuffer(self.mine, dtype=torch.int64)
        self.every = array.array("q", bytes(8 * ROW * self.world))
        rows = torch.frombuffer(self.every, dtype=torch.int64).view(self.world, ROW)
        self.received = list(rows.unbind(0))


class SocketFailure(RuntimeError):
    """An exchange over the same-host sockets failed: a peer closed its end, or time ran out.

    A RuntimeError, as gloo's errors are, so that one handler turns either into
    a :class:`~fsm_cache.errors.RankFailure`.
    """


class SameHostRows:
    """Unix sockets from this rank to every other rank of a group on one host, and their exchanges.

    Owns the sockets. Exchanges pair in order, as a gloo group's collectives
    do: an exchange that ran out of time still owes its peers the rest of its
    bytes and is owed theirs, and the next exchange sends and skips those
    first, so that a rank that arrives late still gets the row it was sent.
    A peer that closed its end or failed a send or read breaks the sockets
    for good: they are all closed, so that every other rank reads the end of
    its stream and fails at once instead of at its timeout, and every later
    exchange is refused. Dropped, it closes them too.

    Args:
        rank: This rank.
        world: Ranks in the group.
        peers: A connected socket per other rank, each rank's own.
    """

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket]) -> None:
        self.rank, self.world = rank, world
        self._peers = sorted(peers.items())
        for _, peer in self._peers:
            peer.setblocking(False)
        self._owed = dict.fromkeys(peers, b"")  # to send before the next exchange's bytes
        self._skip = dict.fromkeys(peers, 0)  # to read and drop before them
        self.failed: str | None = None
        self._close = weakref.finalize(self, _close_all, [peer for _, peer in self._peers])
        _LIVE.add(self)

    def exchange(self, data: bytes, timeout: float) -> list[bytes]:
        """Send ``data`` to every other rank; return every rank's, in rank order.

        Every rank sends as many bytes (a row, or a payload's rest whose
        length every rank's header agreed on). Sends and reads interleave, so
        a payload longer than a socket's buffer does not leave both ends
        blocked in a send.

        Args:
            data: This rank's bytes.
            timeout: Seconds to wait, in all, for the other ranks' bytes.

        Raises:
            SocketFailure: A rank closed its end or failed a send or read, the
                exchange with a rank did not finish within ``timeout``, or the
                sockets broke at an earlier exchange.
        """
        if self.failed is not None:
            raise SocketFailure(
                f"the same-host sockets broke at an earlier exchange: {self.failed}"
            )
        try:
            return self._exchange(data, timeout)
        except _Broken as exc:
            self.close(str(exc))
            raise
        except SocketFailure:  # out of time: what is owed is kept, to pair the next exchange
            raise
        except BaseException as exc:  # a KeyboardInterrupt, say: what was sent is unknown
            self.close(f"{type(exc).__name__} in an exchange")
            raise

    def close(self, reason: str = "closed on this rank") -> None:
        """Close every socket: the other ranks read the end of their streams; exchanges are refused.

        Args:
            reason: What later exchanges name as the failure (the first one given stays).
        """
        if self.failed is None:
            self.failed = reason
        self._close()

    def _exchange(self, data: bytes, timeout: float) -> list[bytes]:
        size = len(data)
        out = {rank: memoryview(self._owed[rank] + data) for rank, _ in self._peers}
        got = {rank: bytearray(self._skip[rank] + size) for rank, _ in self._peers}
        sent = dict.fromkeys(out, 0)
        read = dict.fromkeys(out, 0)
        deadline = None
        while True:
            waits = []
            for rank, peer in self._peers:
                if sent[rank] < len(out[rank]):
                    sent[rank] += _send(rank, peer, out[rank][sent[rank] :])
                if read[rank] < len(got[rank]):
                    read[rank] += _read(rank, peer, memoryview(got[rank])[read[rank] :])
                events = (select.POLLOUT if sent[rank] < len(out[rank]) else 0) | (
                    select.POLLIN if read[rank] < len(got[rank]) else 0
                )
                if events:
                    waits.append((rank, peer, events))
            if not waits:
                break
            now = time.monotonic()
            deadline = now + timeout if deadline is None else deadline
            if now >= deadline:
                for rank, _ in self._peers:  # what the late ranks will send, or wait for
                    self._owed[rank] = bytes(out[rank][sent[rank] :])
                    self._skip[rank] = len(got[rank]) - read[rank]
                late = [str(rank) for rank, _, _ in waits]
                named = ("rank " if len(late) == 1 else "ranks ") + ", ".join(late)
                raise SocketFailure(f"{named} did not finish the exchange within {timeout:g} s")
            _wait_for([(peer, events) for _, peer, events in waits], deadline - now)
        for rank in got:
            self._owed[rank], self._skip[rank] = b"", 0
        return [bytes(got[rank][-size:]) if rank in got else data for rank in range(self.world)]


_LONGEST_POLL_MS = 2**31 - 1
"""``poll()`` takes a C int of milliseconds (about 24.8 days); a longer timeout waits again."""


def _wait_for(sockets: list[tuple[socket.socket, int]], seconds: float) -> None:
    """Wait up to ``seconds`` (at least a millisecond) for any of ``sockets``' events."""
    ready = select.poll()
    for peer, events in sockets:
        ready.register(peer, events)
    ready.poll(min(_LONGEST_POLL_MS, max(1, int(1000 * seconds + 1))))


class _Broken(SocketFailure):
    """A peer closed its end, or a send or read failed: the sockets cannot pair again."""


_CLOSED = "rank {} closed its socket (it died, or its sockets broke)"


def _send(rank: int, peer: socket.socket, data: memoryview) -> int:
    """Send what ``peer`` takes now of ``data``; return how many bytes it took."""
    try:
        return peer.send(data, socket.MSG_NOSIGNAL)
    except BlockingIOError:
        return 0
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise _Broken(_CLOSED.format(rank)) from exc
    except OSError as exc:
        raise _Broken(f"the socket to rank {rank} failed a send: {exc.strerror or exc}") from exc


def _read(rank: int, peer: socket.socket, into: memoryview) -> int:
    """Read what ``peer`` has now into ``into``; return how many bytes came."""
    try:
        count = peer.recv_into(into)
    except BlockingIOError:
        return 0
    except ConnectionResetError as exc:
        raise _Broken(_CLOSED.format(rank)) from exc
    except OSError as exc:
        raise _Broken(f"the socket to rank {rank} failed a read: {exc.strerror or exc}") from exc
    if count == 0:
        raise _Broken(_CLOSED.format(rank))
    return count


def _close_all(peers: list[socket.socket]) -> None:
    for peer in peers:
        peer.close()


def same_host() -> tuple[str, str, int] | None:
    """Return what names this process's host for Unix sockets; None where they cannot be used.

    The host's name, its boot id and this process's network namespace: an
    abstract Unix socket (Linux only) is reachable from that namespace alone.
    """
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            booted = boot.read().strip()
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return socket.gethostname(), booted, namespace


def _listen(world: int) -> tuple[socket.socket, str] | None:
    """Listen on a new abstract Unix socket; return it and its name, or None if that failed."""
    name = f"\0fsm_cache-agreement-{secrets.token_hex(16)}"
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # out of descriptors, say
        return None
    try:
        listener.bind(name)
        listener.listen(world)
    except OSError:
        listener.close()
        return None
    return listener, name


_LIVE: weakref.WeakSet[SameHostRows] = weakref.WeakSet()
"""Every :class:`SameHostRows` of this process, for the fork hook."""

_BY_GROUP: weakref.WeakKeyDictionary[dist.ProcessGroup, SameHostRows] = weakref.WeakKeyDictionary()
"""Each gloo group's sockets in this process, shared by every :class:`Collectives` on it.

One ordered stream per group, as gloo has: collectives that two wrappers on
one group call in different orders then meet, and their rows' headers say so,
where streams of their own would each wait for the other until the timeout.
"""


def _after_fork_in_child() -> None:
    """Refuse, in a forked child, the sockets its parent's groups agree over, and close its copies.

    A child that exchanged on them would read and write its parent's streams.
    Closing the child's copies leaves the parent's connections as they are.
    """
    for rows in list(_LIVE):  # those of a destroyed group too, which a wrapper may still hold
        rows.close("inherited across a fork: a child cannot take part in its parent's agreement")


if hasattr(os, "register_at_fork"):  # not on Windows, where no process forks
    os.register_at_fork(after_in_child=_after_fork_in_child)


_ACCEPT_SECONDS = 10.0
"""Longest wait for the lower ranks' connections, which are queued before it starts."""

_HELLO = struct.Struct("<qq")
"""What a rank sends on a socket it connected: its rank and its nonce (from the gloo gather)."""


def _dial(
    rank: int, names: list[str], nonces: list[int], timeout: float, peers: dict[int, socket.socket]
) -> bool:
    """Connect to each higher rank and send it this rank's hello; return whether all connected.

    Each socket made goes into ``peers`` (closed by the caller if the group
    does not take them). A Unix socket's connect completes once the
    connection is in the listener's backlog, before the peer accepts it.
    """
    hello = _HELLO.pack(rank, nonces[rank])
    for other in range(rank + 1, len(names)):
        try:
            peer = peers[other] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.settimeout(timeout)
            peer.connect(names[other])
            peer.sendall(hello)
        except OSError:
            return False
    return True


def _answer(
    rank: int,
    nonces: list[int],
    listener: socket.socket,
    within: float,
    peers: dict[int, socket.socket],
) -> bool:
    """Accept each lower rank's connection and check its hello; return whether all came in ``within`` s.

    The lower ranks connected and sent their hellos before the group agreed
    that every rank had, so both wait in the listener's backlog. Anything
    else that connects (a name in the abstract namespace can be reached by
    any process in the network namespace) is dropped: every connection
    queued is accepted and read at once, without blocking, so a stranger
    that says nothing holds up no rank's hello.
    """
    ends = time.monotonic() + within
    listener.setblocking(False)
    hellos: dict[socket.socket, bytearray] = {}  # accepted, hello not read whole yet
    lower = 0
    try:
        while lower < rank:
            _accept_queued(listener, hellos)
            for peer, said in list(hellos.items()):
                if _read_hello(peer, said):
                    del hellos[peer]
                    other, nonce = _HELLO.unpack(said) if len(said) == _HELLO.size else (-1, 0)
                    if 0 <= other < rank and other not in peers and nonce == nonces[other]:
                        peers[other] = peer
                        lower += 1
                    else:
                        peer.close()
            if lower == rank:
                break
            left = ends - time.monotonic()
            if left <= 0:
                return False
            _wait_for([(waiting, select.POLLIN) for waiting in (listener, *hellos)], left)
        return True
    finally:
        _close_all(list(hellos))


def _accept_queued(listener: socket.socket, hellos: dict[socket.socket, bytearray]) -> None:
    """Accept every connection queued on ``listener`` now, to read its hello."""
    while True:
        try:
            peer, _ = listener.accept()
        except OSError:  # none queued, or out of descriptors: the rest stay queued
            return
        peer.setblocking(False)
        hellos[peer] = bytearray()


def _read_hello(peer: socket.socket, said: bytearray) -> bool:
    """Read what ``peer`` sent of its hello into ``said``; return whether it is whole or ended.

    A connection that closed or failed is ended, ``said`` emptied (no hello).
    """
    try:
        part = peer.recv(_HELLO.size - len(said))
    except BlockingIOError:
        return False
    except OSError:
        part = b""
    if not part:
        said.clear()
        return True
    said += part
    return len(said) == _HELLO.size


@dataclass(frozen=True)
class Collectives:
    """One rank's view of its CPU (gloo) agreement group.

    Attributes:
        group: The gloo group the collectives run on; None for the default group.
        rank: This rank.
        world_size: Ranks in the group.
        timeout: Seconds a collective may wait for the other ranks.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    timeout: float
    _rows: _Rows = field(init=False, compare=False, repr=False)
    _sockets: SameHostRows | None = field(init=False, compare=False, repr=False, default=None)

    def __post_init__(self) -> None:
        """Make this rank's row buffers (a frozen dataclass sets its own fields so)."""
        object.__setattr__(self, "_rows", _Rows(self.world_size))

    @classmethod
    def of(
        cls, group: dist.ProcessGroup | None, timeout: float, *, local_sockets: bool = True
    ) -> Collectives:
        """Return the collectives of ``group``'s ranks, over a gloo group (see :func:`cpu_group`).

        The first call on a group with ``local_sockets`` (the default) is a
        collective, made of up to four gloo collectives (:meth:`_join_same_host`):
        every rank of the group calls it at the same point.

        Args:
            group: The ranks that agree; None for the default group.
            timeout: Seconds a collective may wait for the other ranks.
            local_sockets: Exchange rows over Unix sockets when every rank runs
                on this host (:class:`SameHostRows`, set up at the group's first
                such call and shared by every later one); gloo otherwise, and
                wherever a rank could not connect. Every rank must pass the
                same. Where they differ at the group's first call, a rank that
                sets the sockets up gathers over gloo while the others do not,
                and the rows' headers say so (a
                :class:`~fsm_cache.errors.RankFailure` on every rank); once
                the group has its sockets, a rank on gloo and the others on
                the sockets wait for each other until the timeout.

        Raises:
            ConfigError: ``group`` is a non-gloo group smaller than the world.
            RankFailure: Setting up the sockets' gather failed or timed out.
        """
        cpu = cpu_group(group, timeout)
        made = cls(cpu, dist.get_rank(cpu), dist.get_world_size(cpu), timeout)
        key = dist.group.WORLD if cpu is None else cpu
        if local_sockets and made.world_size > 1 and key is not None:
            sockets = _BY_GROUP.get(key)
            if sockets is None:  # set up once per group, by every rank at once
                sockets = made._join_same_host()
                if sockets is not None:
                    _BY_GROUP[key] = sockets
                    # a wrapper that outlives its group must not agree over it still
                    weakref.finalize(key, sockets.close, "its process group was destroyed")
            object.__setattr__(made, "_sockets", sockets)
        return made

    @property
    def sockets(self) -> SameHostRows | None:
        """The same-host sockets the rows travel over; None where they go over gloo."""
        return self._sockets

    @property
    def transport(self) -> str:
        """How rows travel: ``"same-host sockets"`` or ``"gloo"``."""
        return "gloo" if self._sockets is None else "same-host sockets"

    def _join_same_host(self) -> SameHostRows | None:
        """Connect this rank to every other by Unix socket if every rank can.

        Gloo collectives every rank makes alike, whatever fails where: a
        gather of each rank's host, socket name and nonce; if all share a
        host and listen, a MIN of whether each connected to the ranks above
        it; if all did, a MIN of whether each accepted the ranks below it
        (queued by then, so no rank waits on one that gave up). Any rank
        that cannot, or runs on another host, leaves the whole group on
        gloo (None).
        """
        host = same_host()
        listening = _listen(self.world_size) if host is not None else None
        name, nonce = (listening[1] if listening else ""), secrets.randbits(62)
        peers: dict[int, socket.socket] = {}
        said = f"{SAME_HOST} (all_gather MIN)"
        try:
            every = self.all_gather_object((host, name, nonce), SAME_HOST)
            hosts = {theirs for theirs, _, _ in every}
            names, nonces = [n for _, n, _ in every], [k for _, _, k in every]
            if len(hosts) != 1 or None in hosts or not all(names):  # alike on every rank
                return None
            dialed = _dial(self.rank, names, nonces, self.timeout, peers)
            if not self.all_reduce_min([int(dialed)], said)[0]:
                return None
            assert listening is not None  # every rank's name is set
            within = min(self.timeout / 2, _ACCEPT_SECONDS)  # the others wait in a MIN
            answered = _answer(self.rank, nonces, listening[0], within, peers)
            if not self.all_reduce_min([int(answered)], said)[0]:
                return None
            made, peers = SameHostRows(self.rank, self.world_size, peers), {}
            return made
        finally:  # what the group did not take, on every path
            if listening is not None:
                listening[0].close()
            _close_all(list(peers.values()))

    @property
    def device(self) -> torch.device:
        """Where the collectives' tensors live: always the CPU."""
        return CPU

    def all_reduce_min(
        self, values: list[int], what: str = "step agreement (all_gather MIN)"
    ) -> list[int]:
        """Return the element-wise minimum of ``values`` over the ranks.

        An ``all_gather`` of every rank's values (a row each, :data:`ROW`),
        reduced here: gloo's ``all_reduce`` passes around the ring twice (a
        reduce-scatter, then an all-gather), an ``all_gather`` once.

        Args:
            values: This rank's values (signed 64-bit); the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.

        Raises:
            RankFailure: The collective failed or timed out, or another rank
                reached a different collective.
        """
        return [min(column) for column in zip(*self._gather(_MIN, values, what), strict=True)]

    def all_gather_digest(
        self, payload: list[int], what: str = "digest verification (all_gather)"
    ) -> list[list[int]]:
        """Return every rank's ``payload`` (signed 64-bit, equal lengths), in rank order.

        Args:
            payload: This rank's values; the same length on every rank.
            what: The collective's name in a :class:`RankFailure`.

        Raises:
            RankFailure: As :meth:`all_reduce_min`.
        """
        return self._gather(_INTS, payload, what)

    def all_gather_object(self, obj: T, what: str = DIVERGENCE_REPORT) -> list[T]:
        """Return every rank's ``obj`` (picklable), in rank order.

        Pickled and gathered as words: first the sizes (a row), then the bytes
        (a row, and the rest in one more gather), each timed, so that it waits
        at most three times ``timeout`` (``dist.all_gather_object`` would wait
        for the group's own timeout).

        Args:
            obj: This rank's object.
            what: What the gather is for: its name in a :class:`RankFailure`,
                and carried in its rows, so that ranks gathering for different
                purposes (a report on one, a construction on another) raise.

        Raises:
            RankFailure: As :meth:`all_reduce_min`.
        """
        data = pickle.dumps(obj)
        purpose = zlib.crc32(what.encode())
        said = f"{what} (all_gather sizes)"
        sizes = [size for (size,) in self._gather(_SIZES, [len(data)], said, purpose)]
        padded = data.ljust(-(-max(sizes) // 8) * 8, b"\0")
        said = f"{what} (all_gather_object)"
        words = self._gather(_BYTES, array.array("q", padded).tolist(), said, purpose)
        return [
            pickle.loads(array.array("q", each).tobytes()[:size])
            for each, size in zip(words, sizes, strict=True)
        ]

    def _gather(
        self, kind: int, payload: list[int], what: str, purpose: int = 0
    ) -> list[list[int]]:
        """Gather every rank's ``payload`` as a collective of ``kind``; return them in rank order.

        The first :data:`_PAYLOAD` words go in a row with the header (an empty
        payload too, so that every call is a collective on every rank); the
        rest, once every header agreed, in one more ``all_gather``.

        Raises:
            RankFailure: A collective failed or timed out, or another rank sent
                a row of another kind, payload length or purpose (it reached a
                different collective: every rank raises it, at the first row).
        """
        head = payload[:_PAYLOAD]
        rows = self._row([kind, -kind, len(payload), purpose], head, what)
        each = [row[_HEADER : _HEADER + len(head)] for row in rows]
        rest = payload[_PAYLOAD:]
        if rest:
            for row, theirs in zip(each, self._rest(rest, what), strict=True):
                row.extend(theirs)
        return each

    def _rest(self, rest: list[int], what: str) -> list[list[int]]:
        """Gather the words of a payload past its row (the same count on every rank)."""
        sockets = self._sockets
        if sockets is not None:
            data = array.array("q", rest).tobytes()
            got = self._collective(what, lambda: sockets.exchange(data, self.timeout))
            return [array.array("q", theirs).tolist() for theirs in got]
        mine = torch.tensor(rest, dtype=torch.int64, device=CPU)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]

        def call() -> None:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))

        self._collective(what, call)
        return [theirs.tolist() for theirs in out]

    def _row(self, header: list[int], part: list[int], what: str) -> list[list[int]]:
        """One ``all_gather`` of a row of ``header`` and ``part``; return every rank's row."""
        rows = self._rows
        rows.mine[:] = array.array("q", [*header, *part, *[0] * (_PAYLOAD - len(part))])
        sockets = self._sockets
        if sockets is not None:
            data = rows.mine.tobytes()
            got = self._collective(what, lambda: sockets.exchange(data, self.timeout))
            flat = array.array("q", b"".join(got)).tolist()
        else:
            flat = self._gloo_row(what)
        each = [flat[r * ROW : (r + 1) * ROW] for r in range(self.world_size)]
        if any(row[:_HEADER] != header for row in each):
            raise RankFailure(self._mismatch(what, [row[:_HEADER] for row in each]))
        return each

    def _gloo_row(self, what: str) -> list[int]:
        """One ``all_gather`` of this rank's row over gloo; return every rank's words, flat."""
        rows = self._rows

        def call() -> None:
            work = dist.all_gather(rows.received, rows.sent, group=self.group, async_op=True)
            self._wait(work)

        try:
            self._collective(what, call)
        except BaseException:  # gloo may still finish into these buffers
            rows.renew()
            raise
        return rows.every.tolist()

    def _mismatch(self, what: str, headers: list[list[int]]) -> str:
        """Say which collective each rank reached (its rows' headers), where they differ."""
        named = ", ".join(f"rank {rank} {_reached(header)}" for rank, header in enumerate(headers))
        return (
            f"rank {self.rank} of {self.world_size}: {what}: the ranks reached different "
            f"collectives ({named}): they called the group in different orders, so its "
            "collectives no longer pair; tear the group down and rebuild it"
        )

    def _wait(self, work: dist.Work | None) -> None:
        if work is not None:
            work.wait(timeout=timedelta(seconds=self.timeout))

    def _collective(self, what: str, call: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return call()
        except RuntimeError as exc:  # DistBackendError, gloo's errors and SocketFailure
            elapsed = time.perf_counter() - started
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RankFailure(
                f"rank {self.rank} of {self.world_size}: {what} failed after {elapsed:.2f} s "
                f"(timeout {self.timeout:g} s): another rank died or stopped taking part: {detail}"
            ) from exc
