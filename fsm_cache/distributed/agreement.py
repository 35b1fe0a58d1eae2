"""Tensor-parallel agreement: every rank applies the same finished copies in the same order.

In tensor-parallel serving each rank keeps its own radix tree and its own copy
engine, and copies finish at different times on different ranks. If each rank
applied its own acknowledgements as they came, the trees would drift apart
silently. :class:`DistributedCache` wraps a :class:`~fsm_cache.cache.hicache.HiCache`
and, on every :meth:`~DistributedCache.poll`, agrees with the other ranks of a
``torch.distributed`` process group (a MIN all-reduce, as SGLang does) on how
many finished copies, in issue order, every rank applies. Host allocation and
eviction then stay deterministic: they read only the agreed tree.

Each rank also keeps a running digest of the transitions it applied;
:meth:`~DistributedCache.verify_agreement` all-gathers the digests and raises
:class:`~fsm_cache.errors.RankDivergence` naming the first differing
transition, its node and that node's state on each rank. A lost completion
raises it too, instead of leaving every rank waiting for a copy that will
never be acknowledged: at once in :meth:`~DistributedCache.drain`, and in
:meth:`~DistributedCache.poll` once the oldest copy has been finished on some
ranks only for longer than ``timeout``. A collective that fails (a rank died,
or stopped taking part for longer than ``timeout``) raises
:class:`RankFailure` instead of hanging.

Every method here is a collective: all ranks of the group call it, in the same
order. Works with gloo (CPU) and NCCL (tensors go to the cache's CUDA device,
which is made current for each collective, so ranks need not call
``torch.cuda.set_device``).
"""

from __future__ import annotations

import time
from typing import Literal

import torch
import torch.distributed as dist

from fsm_cache.cache.hicache import HiCache
from fsm_cache.distributed.collectives import Collectives
from fsm_cache.distributed.digest import (
    AppliedTransition,
    TransitionDigest,
    copy_nodes,
    divergence_message,
    first_difference,
    involved_nodes,
    lost_message,
    stalled_message,
    waiting_message,
)
from fsm_cache.errors import ConfigError, NoProcessGroup, RankDivergence
from fsm_cache.memory.tickets import Completion


class DistributedCache:
    """A :class:`HiCache` whose copy acknowledgements are agreed across a process group.

    Call :meth:`poll` instead of ``cache.poll()``: the cache's acknowledgements
    come from this object from now on, so its own poll applies nothing, and an
    allocation or insert that must wait for copies applies all of them in issue
    order on every rank (:meth:`collect`). Every other cache operation is
    called on ``cache`` directly, identically on every rank.

    Args:
        cache: This rank's cache; same configuration and operations on every rank.
        group: The process group; None for the default group.
        timeout: Seconds a collective may wait for the other ranks before
            :class:`RankFailure` (gloo honours it per call; NCCL uses the
            group's own timeout and watchdog); also how long the oldest copy
            may stay finished on some ranks only before :class:`RankDivergence`.
        verify_every: Run :meth:`verify_agreement` every this many polls; 0 never.
        device: Where the agreement tensors live; None: the cache's device for
            NCCL (its GPU, made current for each collective), the CPU otherwise.

    Raises:
        NoProcessGroup: ``torch.distributed`` is not initialised.
        ConfigError: ``timeout`` is not positive, ``verify_every`` is negative, or
            the cache's write policy is ``write_back``, or an NCCL group was
            given a device that is not CUDA.
    """

    def __init__(
        self,
        cache: HiCache,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float = 60.0,
        verify_every: int = 0,
        device: torch.device | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise NoProcessGroup(
                "distributed: no process group; call torch.distributed.init_process_group first"
            )
        if timeout <= 0 or verify_every < 0:
            raise ConfigError(
                "distributed: timeout must be > 0 and verify_every >= 0, "
                f"got timeout={timeout} and verify_every={verify_every}"
            )
        if cache.config.write_policy == "write_back":
            raise ConfigError(
                "distributed: write_back waits for its copies inside an allocation, where the "
                "ranks cannot agree on them yet; use write_through or write_through_selective"
            )
        self.cache = cache
        self.comm = Collectives.of(group, device, timeout, cache_device=cache.tiers.device.device)
        self.group, self.timeout, self.verify_every = group, timeout, verify_every
        self.rank, self.world_size, self.device = (
            self.comm.rank,
            self.comm.world_size,
            self.comm.device,
        )
        self.polls = 0
        self._finished: dict[int, Completion] = {}
        self._stalled_since: float | None = None
        self._digest = TransitionDigest(cache.log)
        cache.transfers.take_acks_from(self)

    # -- agreement on acknowledgements -----------------------------------------

    def collect(self, wait: bool) -> list[Completion]:
        """The acknowledgements the cache applies inside its own operations (its ack source).

        Without ``wait`` (the cache's own ``poll()``, an allocation that first
        applies what finished): none, since only :meth:`poll` applies what the
        group agreed on. With ``wait`` (an allocation or an insert that must
        wait for copies in flight): every rank reaches this point in the same
        operation, drains its copy engine and applies every copy in flight, in
        issue order, so the ranks stay identical without a collective.

        Raises:
            RankDivergence: This rank's copy engine drained without reporting a
                copy it started (a lost completion); every rank raises.
            RankFailure: The collective that makes every rank raise together failed.
        """
        if not wait:
            return []
        for completion in self.cache.tiers.copier.drain():
            self._finished[completion.ticket.id] = completion
        issued = self.cache.issued()
        ready = self.local_ready()
        (lost,) = self.comm.all_reduce_min([-(ready < len(issued))])
        if lost:
            raise RankDivergence(self._locate("lost"))
        return [self._finished.pop(ticket) for ticket in issued]

    @property
    def buffered(self) -> int:
        """Copies finished on this rank and not yet applied (waiting for the slower ranks)."""
        return len(self._finished)

    def local_ready(self) -> int:
        """Return how many copies, in issue order, have finished on this rank."""
        ready = 0
        for ticket in self.cache.issued():
            if ticket not in self._finished:
                break
            ready += 1
        return ready

    def poll(self) -> int:
        """Apply the finished copies every rank has, in issue order; return how many.

        Collects this rank's completions (never blocks on copies), agrees on
        the smallest count of finished copies at the head of the issue order
        across the group, and applies exactly that many: every rank fires the
        same ``write_done`` / ``load_done`` events in the same order.

        Raises:
            RankFailure: The agreement collective failed or timed out.
            RankDivergence: The ranks have different numbers of copies in flight
                (one lost or invented a copy); the oldest copy finished on some
                ranks and not on others for longer than ``timeout``; or a
                periodic verification found them apart.
        """
        for completion in self.cache.tiers.copier.poll():
            self._finished[completion.ticket.id] = completion
        applied = self._agree(drained=False)
        self._digest.update()  # read the log while it still holds what this poll applied
        return applied

    def drain(self) -> int:
        """Wait for every copy on this rank, then poll until no copy is in flight anywhere.

        Applying an acknowledgement may start new copies (a deferred backup of
        a child), hence the loop. Returns how many copies were applied.

        Raises:
            RankDivergence: As :meth:`poll`; also when a rank's copy engine
                drained without reporting a copy that rank started (a lost
                completion), which would otherwise leave every rank waiting.
            RankFailure: A collective failed or timed out.
        """
        applied = 0
        while True:  # agree at least once, so that every rank takes the same turns
            for completion in self.cache.tiers.copier.drain():
                self._finished[completion.ticket.id] = completion
            applied += self._agree(drained=True)
            if not self.cache.issued():
                return applied

    def _agree(self, *, drained: bool) -> int:
        """Agree on the finished head of the issue order and apply it; see :meth:`poll`.

        Args:
            drained: This rank's copy engine was just drained, so every copy it
                started has finished and must be in the buffer.
        """
        ready, issued = self.local_ready(), len(self.cache.issued())
        short = drained and ready < issued  # every copy finished, yet one never reported
        now, since = time.monotonic(), self._stalled_since
        overdue = since is not None and now - since > self.timeout
        # one collective: the MIN of each value and of its negation (the MAX), so
        # any rank's flag reaches all, and all raise or go on at the same poll
        agreed, most_ready, fewest, most, lost, late = self.comm.all_reduce_min(
            [ready, -ready, issued, -issued, -short, -overdue]
        )
        if fewest != -most:
            raise RankDivergence(self._locate())
        stalled = agreed == 0 and most_ready < 0  # the oldest copy finished on some ranks only
        if lost or (stalled and late):
            raise RankDivergence(self._locate("lost" if lost else "stalled"))
        self._stalled_since = None if not stalled else now if since is None else since
        self.cache.log.op("agreed_poll", agreed)
        chosen = [self._finished.pop(ticket) for ticket in self.cache.issued()[:agreed]]
        self.cache.apply_completions(chosen)
        self.polls += 1
        if self.verify_every and self.polls % self.verify_every == 0:
            self.verify_agreement()
        return agreed

    # -- divergence detection --------------------------------------------------

    @property
    def digest(self) -> bytes:
        """The running digest of every transition this rank's cache applied."""
        return self._digest.update()

    @property
    def transitions(self) -> int:
        """How many transitions the digest covers."""
        self._digest.update()
        return self._digest.count

    def verify_agreement(self) -> bytes:
        """Check that every rank applied the same transitions; return the agreed digest.

        Raises:
            RankDivergence: The digests differ; names the first differing
                transition, its node and that node's state on each rank
                (every rank raises the same message).
            RankFailure: A collective failed or timed out.
        """
        mine = self._digest.update()
        issued = len(self.cache.issued())
        gathered = self.comm.all_gather_digest([self._digest.count, issued, *mine])
        if all(g == gathered[0] for g in gathered):
            self._digest.agree()
            return mine
        raise RankDivergence(self._locate())

    def _locate(self, why: Literal["split", "lost", "stalled"] = "split") -> str:
        """Gather what each rank did since the agreed point and describe the first split.

        Args:
            why: ``split``: find where the transitions or the copies in flight
                part. ``lost``: a rank drained its copy engine and still lacks
                a completion. ``stalled``: the oldest copy finished on some
                ranks only, for longer than ``timeout``. A difference in the
                transitions is reported first in every case.
        """
        self._digest.update()
        start = self._digest.agreed
        tails: list[list[AppliedTransition]] = self.comm.all_gather_object(self._digest.tail())
        index = first_difference(tails)
        if index is not None:
            states = self._gather_states(involved_nodes(tails, index))
            return divergence_message(start, index, tails, states)
        applied = start + len(tails[0])
        if why != "split":
            return self._missing(applied, lost=why == "lost")
        waits: list[list[list[int]]] = self.comm.all_gather_object(self._waiting())
        if any(w != waits[0] for w in waits):
            nodes = [n for copies in waits for copy in copies for n in copy]
            return waiting_message(applied, waits, self._gather_states(nodes))
        return (
            f"rank divergence after transition {start}: the digests differ, yet every rank "
            "applied the same transitions since; the ranks last agreed at different points"
        )

    def _missing(self, applied: int, *, lost: bool) -> str:
        """Describe a completion that some ranks lack: lost in a drain, or overdue in a poll."""
        found = self.comm.all_gather_object((self.local_ready(), self._waiting()))
        ready = [r for r, _ in found]
        copies = copy_nodes([w for _, w in found])
        if lost:
            named = [n for k in ready if k < len(copies) for n in copies[k]]
            return lost_message(applied, copies, ready, self._gather_states(named))
        states = self._gather_states(copies[0])
        return stalled_message(applied, copies, ready, self.timeout, states)

    def _waiting(self) -> list[list[int]]:
        """Per copy in flight, in issue order, the nodes whose host pages it writes or reads."""
        tickets = {t.id: t for t in self.cache.tiers.copier.in_flight()}
        tickets.update((i, c.ticket) for i, c in self._finished.items())
        nodes = sorted(self.cache.tree.nodes.values(), key=lambda n: n.id)
        waits = []
        for ident in self.cache.issued():
            ticket = tickets.get(ident)
            pages = set(ticket.host_pages) if ticket else set()
            waits.append([n.id for n in nodes if pages.intersection(n.host_pages)])
        return waits

    def _gather_states(self, nodes: list[int]) -> list[dict[int, str]]:
        """Every rank's residency of ``nodes`` (the same list on every rank)."""
        tree = self.cache.tree.nodes
        here = {n: tree[n].residency() for n in dict.fromkeys(nodes) if n in tree}
        return self.comm.all_gather_object(here)
