"""Tensor-parallel agreement: every rank applies the same finished copies in the same order.

In tensor-parallel serving each rank keeps its own radix tree and its own copy
engine, and copies finish at different times on different ranks. If each rank
applied its own acknowledgements as they came, the trees would drift apart
silently. :class:`DistributedCache` wraps a :class:`~fsm_cache.cache.hicache.HiCache`
and, once per scheduler step (:meth:`~DistributedCache.step`), agrees with the
other ranks in one MIN all-reduce (as SGLang does) on how many finished copies,
in issue order, every rank applies, and checks in the same collective that
every rank applied the same transitions so far. Host allocation and eviction
then stay deterministic: they read only the agreed tree. Within a step the
requests are served with local bookkeeping only: no collective per request.

The all-reduce runs on CPU tensors over a gloo group, even when the model runs
on NCCL (a side group, like SGLang's ``tp_cpu_group``; see
:func:`~fsm_cache.distributed.collectives.cpu_group`), so a step never waits
for the kernels queued on the compute stream.

Each rank keeps a running digest of the transitions it applied and the
operations it served (their keys included); a step whose digests differ, like
:meth:`~DistributedCache.verify_agreement`, raises
:class:`~fsm_cache.errors.RankDivergence` naming the first differing
transition, the operation each rank applied it in, its node and that node's
state on each rank (or, where the
transitions agree, the first operation served differently). A lost completion
raises it too, instead of leaving every rank waiting for a copy that will
never be acknowledged: where an operation waited for it (on the rank that lost
it, then on every rank at the next step), at once in
:meth:`~DistributedCache.drain`, and in a step once the oldest copy has been
finished on some ranks only for longer than ``timeout``. A collective
that fails (a rank died, or stopped taking part for longer than ``timeout``)
raises :class:`RankFailure` instead of hanging.

With a storage tier (``HiCache(config, storage=...)``), each rank's store holds
its own shard and can answer differently from the others' (a page one rank's
store lost, a put that failed on one rank only). The storage tier acts on the
prefix every rank holds, as SGLang's does: the hit count of a prefetch query
is the MIN over the ranks before any rank creates and fetches the
``discovered`` node (one small all-reduce in the lookup, only for a lookup
that asks the store), and each storage copy is applied at a step with the
fewest pages any rank landed, carried by the step's one all-reduce. A query
that failed on any rank backs every rank off (the same all-reduce says so),
and the backoff ends at a step, where every rank's clock says it has passed. A
query that answered only after its budget, and a storage copy that failed on
any rank because the store raised or hung, back every rank off alike (the
first in the hit count's all-reduce, the second in the step's).

Whether a chain still loading can be read (the wrapped cache's
:meth:`~fsm_cache.cache.hicache.HiCache.wait_loaded`) is agreed too, since each
rank's copy engine knows only its own launches: every rank answers False where
any rank does, so that every rank runs the same forward pass. A copy that
this rank's copy engine refuses to start is kept in flight as a copy that
failed here (:meth:`~DistributedCache._keep_refused`), so that every rank
answers alike and fails it at the same step.

Every method here is a collective: all ranks of the group call it, in the same
order; so are a lookup that asks a storage tier about its tail and the wrapped
cache's ``wait_loaded``, and the construction itself in a group of more than
one, which refuses ranks given different timeouts or caches that differ
(:func:`cache_state`). A cache may have served before it is wrapped, each
rank applying its acknowledgements in its own order: the digest starts where
the wrap found the event log, and agreement from the caches as they are.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig, StorageTier
from fsm_cache.cache.transfers import IssuedCopies
from fsm_cache.cache.tree import TreeNode
from fsm_cache.distributed.collectives import CONSTRUCTION, CPU, Collectives
from fsm_cache.distributed.digest import (
    AppliedFailure,
    AppliedOperation,
    AppliedTransition,
    StatePart,
    TransitionDigest,
    collectives_message,
    copy_nodes,
    divergence_message,
    failure_difference,
    failure_message,
    first_difference,
    ids_text,
    involved_nodes,
    lost_message,
    namespace_text,
    operation_message,
    operation_text,
    queued_message,
    reset_message,
    stalled_message,
    state_difference,
    state_fingerprint,
    storage_waiting_message,
    waiting_message,
)
from fsm_cache.errors import (
    BadArgument,
    CacheClosed,
    ConfigError,
    CopyFailed,
    NoProcessGroup,
    RankDivergence,
    RankFailure,
)
from fsm_cache.memory.tickets import Completion, Copier, Direction, Ticket
from fsm_cache.numeric import real, whole


_P = ParamSpec("_P")
_R = TypeVar("_R")


STORAGE_SLOTS = 32
"""Storage copies a step considers: the first this many in flight, in number order.

Each has one slot in the step's all-reduce, so the collective has the same
length on every rank whatever is in flight; copies behind them wait a step."""

_SHARED = 10
"""Values every rank must share in a step: the resets followed, copies in flight,
transitions, four digest words, storage copies in flight and the number of the
first of them, and whether anything is in flight or queued at all."""
_OWN = 7
"""Values each rank brings to a step's MIN: finished copies, its negation, a lost
completion, an overdue copy, the first finished copy that failed, whether its
clock lets the storage tier's query backoff end, and whether a storage copy
failed here as a store that is down fails one (negated)."""
_SHARED_NAMES = (
    "resets followed",
    "copies in flight",
    "transitions",
    "digests",
    "digests",
    "digests",
    "digests",
    "storage copies in flight",
    "first storage copies in flight",
    "flags of anything in flight or queued",
)
"""What each of the :data:`_SHARED` values is, as a divergence message names the ones that differ."""
_WIDTH = 2 + _OWN + 2 * _SHARED + STORAGE_SLOTS
"""Length of every agreement all-reduce (a step's, a hit count's, a verification's, a load
wait's), so ranks that reach different ones get the same shapes, and say so, instead of failing
in gloo."""
_STEP, _HITS, _VERIFY, _DRAIN, _WAIT, _RAISED = 1, 2, 3, 4, 5, 6
_KINDS = {
    _STEP: "a step",
    _HITS: "a prefetch's hit count",
    _VERIFY: "a digest verification",
    _DRAIN: "a drain",
    _WAIT: "a load wait",
    _RAISED: "the notice that a rank raised",
}
"""Each agreement collective's kind; ``_RAISED``, the highest, is the collective a rank
joins in place of a step's or a verification's when its own work before it raised. A
drain's rounds have a kind of their own, so a rank that steps where another drains is
named at once, not as different transitions at some later call."""


_RECENT = 64
"""Log entries, newest first, searched for the operation a divergence inside it names."""


Loss = tuple[int, list[list[int]], int]
"""What a rank saw when an operation waited for every copy and one never reported:
``(transitions applied, per copy in flight in issue order its nodes, copies finished
at the head of the issue order)``."""


class DistributedCache:
    """A :class:`HiCache` whose copy acknowledgements are agreed across a process group.

    Serve a scheduler step's requests on ``cache`` directly (``match_prefix``,
    ``insert``, ``lock``, ``evict``, ...: identical calls on every rank, no
    collective), then call :meth:`step` once: one all-reduce agrees on
    everything the ranks must agree on, and the agreed copies are applied. The
    cache's acknowledgements come from this object from now on, so its own
    ``poll()`` applies nothing, and an allocation or insert that must wait for
    copies applies all of them in issue order on every rank (:meth:`collect`),
    without a collective. Its ``wait_loaded`` gives the group's answer, in a
    collective of its own. The cache holds this object weakly (so that a
    dropped pair frees the cache's memory at once): keep it while the cache
    serves; once it is gone, the cache goes on as a cache of its own, no
    longer kept alike with the other ranks, until a new DistributedCache
    wraps it (on every rank at once, as any construction).

    Args:
        cache: This rank's cache; same configuration and operations on every rank.
        group: The ranks that agree; None for the default group. A gloo group
            (SGLang's ``tp_cpu_group``) is used as it is; for an NCCL group a
            gloo side group over the same ranks is built (see
            :func:`~fsm_cache.distributed.collectives.cpu_group`).
        timeout: Seconds a collective may wait for the other ranks before
            :class:`RankFailure`; also how long the oldest copy may stay
            finished on some ranks only before :class:`RankDivergence`.
        verify_every: Deprecated and ignored: every :meth:`step` compares the
            ranks' digests in its one collective.
        device: Deprecated and ignored: the agreement tensors are always CPU tensors.
        local_sockets: When every rank runs on this host, exchange the
            collectives' rows over Unix sockets set up once over the gloo
            group (:class:`~fsm_cache.distributed.collectives.SameHostRows`):
            a gloo round trip wakes two threads on each side, about 300 us
            more a step on a two-core host. Set up at a group's first
            wrapper and shared by every later one on it. False keeps every
            collective on gloo, as a group does whose ranks are on different
            hosts or could not connect. Give every rank the same: where they
            differ at a group's first wrapper, construction fails on every
            rank, naming each rank's collective; once the group has its
            sockets, a rank on gloo and the others on sockets wait for each
            other until the timeout.

    Raises:
        NoProcessGroup: ``torch.distributed`` is not initialised.
        BadArgument: ``cache`` is not a :class:`HiCache`, or ``group`` is not a
            live process group this rank belongs to.
        ConfigError: ``timeout`` is not a number of seconds from 0.001 to
            about 4.6e9 (146 years), ``local_sockets`` is not a bool,
            ``verify_every`` is not an int >= 0, the cache
            is wrapped in another DistributedCache already,
            the cache's write policy is ``write_back``, ``group`` is an
            NCCL group smaller than the world (pass its gloo twin), or the
            cache's storage tier names another rank or group size (other than
            one namespace for all, ``ranks=1``), or does not say ``ranks`` in a
            group of more than one, or its ``io_timeout`` is not
            below ``timeout``. Or another rank refused its cache or
            ``verify_every`` so (naming that rank and its error; a refused
            group or timeout is not told), or the ranks were given different
            timeouts: every rank raises it, naming each rank's (in a group of
            more than one, construction is a collective: every rank
            constructs at the same point, and a rank that refused its cache
            still takes part, so that the others do not wait out their timeout).
        RankDivergence: The ranks' caches differ (in a group of more than one):
            their trees, the nodes' states, the device pool's free pages or the
            copies in flight (:func:`cache_state`); every rank raises, naming
            the first difference. A cache that served before it is wrapped is
            accepted where the ranks' caches are alike: the digest covers
            what is logged from the wrap on.
        RankFailure: The comparison of the ranks' constructions failed or timed out.
    """

    def __init__(
        self,
        cache: HiCache,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float = 60.0,
        verify_every: int = 0,
        device: torch.device | None = None,
        local_sockets: bool = True,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise NoProcessGroup(
                "distributed: no process group; call torch.distributed.init_process_group first"
            )
        _check_group_and_timeout(group, timeout, local_sockets)
        self.comm = Collectives.of(group, timeout, local_sockets=local_sockets)
        try:
            _check_cache(cache, group, timeout, verify_every)
            _deprecated(verify_every=verify_every != 0, device=device is not None)
            assert isinstance(cache, HiCache)  # _check_cache refused anything else
            state = cache_state(cache) if self.comm.world_size > 1 else []
        except Exception as refused:  # a deprecation warning made an error too
            # the other ranks are in the construction's collective: tell them, so that
            # they raise at once instead of when their timeout runs out
            _check_construction(self.comm, refused)
            raise
        _check_construction(self.comm, None, state)  # every rank, before the cache is touched
        self.cache = cache
        self.group, self.timeout = self.comm.group, timeout
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.device = CPU
        self.steps = 0
        self._finished: dict[int, Completion] = {}
        self._stalled_since: float | None = None
        self._stalled_head: int | None = None
        self._loss: Loss | None = None
        self._resets = 0
        self._log = cache.log
        # from the log's end: before now each rank applied its own acknowledgements, in
        # its own order; the construction checked that the ranks' caches agree now
        self._digest = TransitionDigest(cache.log, cache.log.recorded)
        # starts the copy engine refused, kept in flight as failed copies under ids -1, -2, ...:
        # a wrapper dropped before this one may have left some in flight
        self._refused = -min([0, *cache.issued()])
        self._broken: str | None = None  # the RankFailure that broke the group, if one did
        # held weakly by the cache (_Alone): strong both ways, a dropped pair kept the
        # cache's memory until Python's cyclic collector ran
        alone = _Alone(self, cache.tiers.copier, cache.transfers, cache.storage)
        weakref.finalize(self, alone.adopt, self._finished)  # what it held, handed over
        before = cache.transfers.ack_source
        if isinstance(before, _Alone):  # a dropped DistributedCache's: what it was handed
            self._finished.update(before.hand_over())
        cache.transfers.take_acks_from(
            alone,
            _weakly(self._agree_wait, alone.wait_here),
            _weakly(self._failed_here, alone.failed_here),
            replacing=before,
        )
        starts = _AgreedStarts(cache.tiers.copier, _weakly(self._keep_refused, _refused_alone))
        cache.transfers.start_copies_with(starts)
        if cache.storage is not None:
            cache.storage.agree_by(_weakly(self._agree_hits, _hits_alone))

    # -- agreement on acknowledgements -----------------------------------------

    def collect(self, wait: bool) -> list[Completion]:
        """The acknowledgements the cache applies inside its own operations (its ack source).

        Without ``wait`` (the cache's own ``poll()``, an allocation that first
        applies what finished): none, since only :meth:`step` applies what the
        group agreed on. With ``wait`` (an allocation or an insert that must
        wait for copies in flight): every rank reaches this point in the same
        operation, drains its copy engine and applies every copy in flight, in
        issue order, so the ranks stay identical without a collective. That
        applies the copy a stalled step waits on, so the stall clock stops (on
        every rank: each reaches this point).

        Raises:
            RankDivergence: This rank's copy engine drained without reporting a
                copy it started (a lost completion): this rank raises at once,
                and the next :meth:`step` makes every rank raise together,
                naming the copy.
        """
        if not wait:
            return []
        self._follow_reset()
        for completion in self.cache.tiers.copier.drain():
            self._finished[completion.ticket.id] = completion
        issued = self.cache.issued()
        ready = self._ready(issued)
        if ready < len(issued):
            batches = self.cache.transfers.in_flight()
            copies = [[n.id for n in batches[ticket].nodes] for ticket in issued]
            self._loss = self._loss or (self.transitions, copies, ready)
            raise RankDivergence(
                f"rank {self.rank} of {self.world_size}: a completion was lost: this rank "
                f"drained its copy engine without the completion of copy {ready + 1} of "
                f"{len(issued)} in flight (nodes {copies[ready]}); every rank raises at the "
                "next step"
            )
        self._stalled_since = self._stalled_head = None
        return [self._finished.pop(ticket) for ticket in issued]

    def _follow_reset(self) -> None:
        """Start over after the cache's ``reset()``: a new event log, no copy in flight.

        Every rank resets its cache in the same place, so every rank starts
        over alike. Each reset followed is counted, and the count is one of
        the values every rank must share: a rank that reset alone makes every
        rank raise the same :class:`RankDivergence` at the next step or
        verification, naming it (its transitions, counted from the reset,
        would only say that the ranks last agreed at different points).
        """
        if self.cache.log is self._log:
            return
        self._log = self.cache.log
        self._digest = TransitionDigest(self._log)
        self._resets += 1
        self._finished.clear()
        self._stalled_since = self._stalled_head = None
        self._loss = None

    def _keep_refused(
        self, direction: Direction, src: Sequence[int], dst: Sequence[int], refusal: CopyFailed
    ) -> Ticket:
        """Keep a start this rank's copy engine refused in flight, as a copy that failed.

        Refused at once, it would fail its nodes on this rank alone (a ``load_back``
        that answers None here and a chain elsewhere, a node ``unbacked`` here and
        ``writing`` elsewhere), and the ranks would part at the call. Kept in
        flight under a ticket of its own (a negative id, which no copy engine
        hands out) with its failure already buffered, it takes a copy number as
        on every other rank, a load wait answers False for it on every rank
        (:meth:`_failed_here`), and the step that reaches it applies it as
        failed on every rank, as a copy that failed in flight here only. An
        operation that waits for the copies before that step (:meth:`collect`
        with ``wait``: an insert through the loading chain, an allocation under
        pressure) applies each rank's own outcome instead: failed here, done
        elsewhere, so the ranks part and the next step names them, as for any
        copy that failed on one rank inside a wait. Only this rank knows the
        start was refused, so a wait could not apply it alike without a
        collective.

        Args:
            direction: The copy's direction.
            src: The pages it would have read.
            dst: The pages it would have written.
            refusal: What the copy engine refused it with.
        """
        self._follow_reset()  # a reset before this start must not drop its failure later
        self._refused += 1
        ticket = Ticket(-self._refused, direction, tuple(src), tuple(dst))
        error = CopyFailed(
            f"rank {self.rank} of {self.world_size}: the copy engine refused to start the "
            f"copy: {refusal}"
        )
        self._finished[ticket.id] = Completion(ticket, error)
        return ticket

    @property
    def buffered(self) -> int:
        """Copies finished on this rank and not yet applied (waiting for the slower ranks)."""
        self._follow_reset()
        return len(self._finished)

    def local_ready(self) -> int:
        """Return how many copies, in issue order, have finished on this rank."""
        return self._ready(self.cache.issued())

    def _ready(self, issued: Sequence[int]) -> int:
        """Return how many of ``issued`` (in issue order) have finished on this rank."""
        ready = 0
        for ticket in issued:
            if ticket not in self._finished:
                break
            ready += 1
        return ready

    def step(self) -> int:
        """End a scheduler step: agree with the other ranks in one collective, apply; return how many.

        Call it once per step, after the step's requests, on every rank.
        Collects this rank's completions (never blocks on copies), then one
        all-reduce agrees on the smallest count of finished copies at the
        head of the issue order and checks that every rank applied the same
        transitions and has the same copies in flight; exactly the agreed
        copies are applied: every rank fires the same ``write_done`` /
        ``load_done`` events in the same order. With a storage tier the same
        all-reduce agrees on the storage copies every rank finished (of the
        first :data:`STORAGE_SLOTS` in flight), each with the fewest pages any
        rank landed; they are applied after the host copies
        (:meth:`~fsm_cache.cache.hicache.HiCache.poll`), so a page one rank
        read and another did not fails, or splits its node, on every rank;
        and it ends the tier's query backoff where every rank's clock says
        its wait has passed (:meth:`~fsm_cache.cache.storage_tier.StorageTier.resume_queries`),
        then backs every rank off where a storage copy failed on any rank as
        a store that is down fails one
        (:meth:`~fsm_cache.cache.storage_tier.StorageTier.back_off_for_copies`).
        The all-reduce runs on CPU tensors over a gloo group, so it never
        waits for the GPU. Returns how many copies (host and storage) were applied.

        Raises:
            RankFailure: The agreement collective failed or timed out, or an
                earlier call raised RankFailure, or raised before a collective that
                another rank reached without raising (refused at once: the group is broken).
            CacheClosed: The cache was closed (raised before the collective: where
                another rank's cache is open, it raises RankFailure naming this rank).
            RankDivergence: The ranks applied different transitions or served
                different operations, or have different numbers of copies in
                flight (one lost or invented a copy); a rank's cache was reset
                alone; an operation waited for a copy whose completion a rank
                lost; the oldest copy finished on some ranks and not on
                others for longer than ``timeout``; or some ranks called
                another method (:meth:`verify_agreement`, say) instead.
            CopyFailed: A storage fetch's pages could not be written to this
                rank's host: the group failed the fetch on every rank, and
                this rank alone raises it, once the step is done
                (:meth:`~fsm_cache.cache.storage_tier.StorageTier.raise_unwritten`).
        """
        with self._in_group("step"):
            with self._announcing("step"):
                self._check_open("step")
                self._follow_reset()
                for completion in self.cache.tiers.copier.poll():
                    self._finished[completion.ticket.id] = completion
            applied = self._agree(drained=False)[0]
        if self.cache.storage is not None:  # after the step, on this rank alone: see the tier's
            self.cache.storage.raise_unwritten()
        return applied

    def poll(self) -> int:
        """Deprecated: :meth:`step`, which is meant once per scheduler step, not per request."""
        warnings.warn(
            "DistributedCache.poll() is deprecated: call step() once per scheduler step",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.step()

    def drain(self) -> int:
        """Wait for every copy on this rank, then agree until no copy is in flight anywhere.

        Applying an acknowledgement may start new copies (a deferred backup of
        a child, the store of a node backed up), hence the loop. The ranks
        leave it together: after a round that found nothing in flight or
        queued on any rank (agreed in the round's collective), or after as
        many rounds as the tree has nodes, plus two (a load under a lock whose
        copy fails every time is copied again every round; it stays
        ``loading``, its copy in flight or queued, as after
        :meth:`~fsm_cache.cache.hicache.HiCache.close`). Each storage copy is
        waited for at most until its ``io_timeout``. Returns how many copies
        were applied.

        Raises:
            RankDivergence: As :meth:`step`; also when a rank's copy engine
                drained without reporting a copy that rank started (a lost
                completion), which would otherwise leave every rank waiting.
            RankFailure: A collective failed or timed out, or an earlier call
                raised RankFailure, or raised before a collective that another rank
                reached without raising (refused at once: the group is broken).
            CacheClosed: The cache was closed (raised before the collective: where
                another rank's cache is open, it raises RankFailure naming this rank).
            CopyFailed: As :meth:`step`, once the last round is done.
        """
        with self._in_group("drain"):
            with self._announcing("drain"):
                self._check_open("drain")
                self._follow_reset()
            applied, rounds, limit = 0, 0, None
            while True:  # agree at least once, so that every rank takes the same turns
                with self._announcing("drain"):
                    for completion in self.cache.tiers.copier.drain():
                        self._finished[completion.ticket.id] = completion
                count, quiet = self._agree(drained=True)
                applied, rounds = applied + count, rounds + 1
                if limit is None:  # the first round checked that the trees agree, so this does
                    limit = len(self.cache.tree.nodes) + 2
                if quiet or rounds >= limit:
                    break
        if self.cache.storage is not None:  # after the last round: the others' rounds go on
            self.cache.storage.raise_unwritten()
        return applied

    def _agree(self, *, drained: bool) -> tuple[int, bool]:
        """Agree on the finished head of the issue order and apply it; see :meth:`step`.

        A copy that failed on any rank is applied as failed on every rank: the
        head applied in one step ends at the first such copy.

        Args:
            drained: This rank's copy engine was just drained, so every copy it
                started has finished and must be in the buffer.

        Returns:
            How many copies were applied, and whether no rank had anything in
            flight or queued before they were (so every rank still has none).
        """
        with self._announcing("drain" if drained else "step"):
            digest = self._digest.update()
            issued = self.cache.issued()
            ready = self._ready(issued)
            failed = next(
                (i for i, ticket in enumerate(issued[:ready]) if not self._finished[ticket].ok),
                ready,
            )
            # a wait lost a completion, or every copy finished and one never reported
            short = self._loss is not None or (drained and ready < len(issued))
            # the stall clock runs for one head copy: a new head (the old one applied by a
            # wait) starts it over, at the same step on every rank
            head = issued[0] if issued else None
            now = time.monotonic()
            since = self._stalled_since if head == self._stalled_head else None
            overdue = since is not None and now - since > self.timeout
            tier = self.cache.storage
            slots = (
                [-1] * STORAGE_SLOTS if tier is None else tier.report(STORAGE_SLOTS, wait=drained)
            )
            stores = {} if tier is None else tier.in_flight()
            busy = not self.cache.transfers.idle() or (tier is not None and not tier.idle())
            resume = tier is None or tier.queries_may_resume()
            down = tier is not None and tier.copies_failed_here()
        # one collective: the MIN of each value and of its negation (the MAX), so any rank's
        # flag reaches all, all ranks raise or go on at the same step, and the values every
        # rank must share (copies in flight, transitions, digest words) are equal iff MIN == MAX;
        # then per storage copy the fewest pages any rank landed (see StorageTier.report)
        same = [*self._shared(digest, len(issued)), len(stores), next(iter(stores), 0), busy]
        reduced = self._reduce(
            _DRAIN if drained else _STEP,
            [
                *(ready, -ready, -short, -overdue, failed, resume, -down),
                *same,
                *(-v for v in same),
                *slots,
            ],
            "step agreement (all_gather MIN)",
        )
        agreed, most_ready, lost, late, first_failed, resumed, down_somewhere = reduced[:_OWN]
        lows = reduced[_OWN : _OWN + _SHARED]
        highs = reduced[_OWN + _SHARED : _OWN + 2 * _SHARED]
        finished = reduced[_OWN + 2 * _SHARED : _OWN + 2 * _SHARED + STORAGE_SLOTS]
        if lows[0] != -highs[0]:  # first: a rank that reset alone differs in everything else
            raise RankDivergence(self._reset_message())
        if lost:  # then: a wait that lost a completion also parts the transitions
            raise RankDivergence(self._locate("lost"))
        if lows != [-high for high in highs]:
            raise RankDivergence(self._locate(apart=shared_values_apart(lows, highs)))
        stalled = agreed == 0 and most_ready < 0  # the oldest copy finished on some ranks only
        if stalled and late:
            raise RankDivergence(self._locate("stalled"))
        self._digest.agree()
        self._stalled_since = None if not stalled else now if since is None else since
        self._stalled_head = head if stalled else None
        agreed = min(agreed, first_failed + 1)
        self.cache.log.op("agreed_poll", agreed)
        accepted = 0
        if tier is not None:
            accepted = tier.accept(finished)
            tier.resume_queries(bool(resumed))  # only where every rank's clock says so
            tier.back_off_for_copies(bool(down_somewhere))  # a store down on any rank: on all
        chosen = [self._finished.pop(ticket) for ticket in issued[:agreed]]
        if first_failed < agreed and chosen[first_failed].ok:
            chosen[first_failed] = Completion(
                chosen[first_failed].ticket,
                CopyFailed(
                    f"rank {self.rank} of {self.world_size}: the copy failed on another rank"
                ),
            )
        self.cache.apply_completions(chosen)
        if accepted:
            self.cache.poll()  # the tier's collect() returns exactly the accepted copies
        self.steps += 1
        return agreed + accepted, not lows[-1]

    def _reduce(
        self, kind: int, values: list[int], what: str, raised: str | None = None
    ) -> list[int]:
        """All-reduce ``values`` (MIN) as a collective of ``kind``; return the reduced values.

        Every agreement collective has the same length and starts with its
        kind and its negation, so ranks that reach different collectives (one
        in a step, another in a lookup's hit count) all raise
        :class:`RankDivergence` instead of gloo failing on mismatched shapes
        (SGLang #39267), naming the collective each rank reached. Where some ranks sent the :data:`_RAISED` notice
        (``raised`` says what this rank raised), every rank gathers what each
        raised, and raises :class:`RankFailure` naming them.
        """
        padded = [kind, -kind, *values, *[0] * (_WIDTH - 2 - len(values))]
        reduced = self.comm.all_reduce_min(padded, what)
        low, high = reduced[0], -reduced[1]
        if high == _RAISED and low != high:
            raise RankFailure(self._raised_message(raised))
        if low != high:  # every rank found it so, and gathers which rank reached which
            reached: list[tuple[int, int]] = self.comm.all_gather_object(
                (kind, self._digest.agreed)
            )
            kinds = [k for k, _ in reached]
            why = (
                "a lookup asked the storage tier on some ranks only"
                if _HITS in kinds
                else "the ranks called different DistributedCache methods"
            )
            start = min(agreed for _, agreed in reached)
            raise RankDivergence(collectives_message(start, [_KINDS[k] for k in kinds], why))
        return reduced[2:]

    @contextlib.contextmanager
    def _in_group(self, where: str) -> Iterator[None]:
        """Run one of this rank's agreement calls; refuse it once the group has broken.

        A :class:`RankFailure` means the group is broken: a rank that timed out
        of a collective has sent its part, and a rank that reaches it later
        completes it with that part and applies the step alone. This rank's
        next collective would then pair with another rank's next one (a
        different step, or another kind), so every later call is refused
        here, before it touches the group or the cache, naming the failure.

        Raises:
            RankFailure: The group broke at an earlier call of this wrapper.
        """
        if self._broken is not None:
            raise RankFailure(
                f"rank {self.rank} of {self.world_size}: {where} refused: the agreement group "
                "broke at an earlier collective, and a later one could pair with another "
                "collective of the other ranks; tear the group down and rebuild it and the "
                f"caches (it broke with: {self._broken})"
            )
        try:
            yield
        except RankFailure as failure:
            self._break(failure)
            raise

    def _break(self, failure: RankFailure) -> None:
        """Note that the group broke with ``failure`` (the first one kept); see :meth:`_in_group`."""
        self._broken = self._broken or str(failure)

    def _check_open(self, where: str) -> None:
        """Refuse an agreement on a closed cache, before its collective.

        ``close()`` applied what was left as it finished on this rank alone,
        so there is nothing left to agree on; raised inside
        :meth:`_announcing`, the other ranks learn it at once.

        Raises:
            CacheClosed: The cache was closed.
        """
        if self.cache.closed:
            raise CacheClosed(
                f"{where}: the cache of rank {self.rank} of {self.world_size} was closed"
            )

    @contextlib.contextmanager
    def _announcing(self, where: str) -> Iterator[None]:
        """Run this rank's work before a collective; if it raises, tell the others first.

        The others are waiting in the collective by then. This rank joins it
        as a :data:`_RAISED` notice, then its part of a gather of what each
        rank raised, and raises its own error; the others raise
        :class:`RankFailure` naming it at once, instead of after ``timeout``.
        Where some rank did not raise (it was told, or is gone), this rank is
        broken as the told ranks are: the ranks no longer did the same, so
        every later agreement call is refused here too (:meth:`_in_group`),
        with the :class:`RankFailure` the notice raised, which gives way to
        the error that caused it. Where every rank raised, the notices paired
        and the group goes on.
        """
        try:
            yield
        except Exception as exc:
            text = f"{type(exc).__name__} in {where}: {exc}"
            try:
                self._reduce(_RAISED, [], f"notice that {where} raised (all_gather MIN)", text)
            except RankFailure as failure:  # the only error a notice raises
                self._break(failure)
            raise

    def _raised_message(self, mine: str | None) -> str:
        """Gather what each rank raised before the collective (None: nothing) and name them."""
        raised = self.comm.all_gather_object(mine)
        named = "; ".join(f"rank {r} raised {text}" for r, text in enumerate(raised) if text)
        return (
            f"rank {self.rank} of {self.world_size}: the agreement stopped before its "
            f"collective, and no rank applied anything in it: {named}"
        )

    def _agree_hits(self, found: Sequence[int], asked: Sequence[int]) -> list[int]:
        """Agree on a prefetch query's hit counts: the MIN over the ranks (the tier's hook).

        Every rank's lookup asks its own store about the same pages (``asked``,
        checked equal); each takes the fewest stored pages any rank found, so
        every rank discovers and fetches the same prefix, or none below the
        threshold (SGLang's storage hit count, all-reduced with MIN). The last
        two counts are whether the store answered and whether it answered
        within its ``query_budget``: where any rank's raised or was slow,
        every rank backs off alike (:class:`~fsm_cache.cache.storage_tier.QueryBackoff`);
        each rank's clock says only whether its own store was slow.

        Raises:
            RankDivergence: The ranks asked about different numbers of pages (each
                rank named, with what it asked and the lookup it asked in).
            RankFailure: The collective failed or timed out, or an earlier call
                raised RankFailure, or raised before a collective that another rank
                reached without raising (refused at once: the group is broken).
        """
        n, m = len(found), len(asked)
        with self._in_group("a prefetch's hit count"):
            reduced = self._reduce(
                _HITS,
                [*found, *asked, *(-a for a in asked)],
                "prefetch hit count (all_gather MIN)",
            )
            lows, highs = reduced[n : n + m], [-h for h in reduced[n + m : n + 2 * m]]
            if lows != highs:  # every rank found it so: each says what it asked, and in what
                said = self.comm.all_gather_object((list(asked), self._operation_running()))
                each = ", ".join(
                    f"rank {rank} asked {pages} in {operation}"
                    for rank, (pages, operation) in enumerate(said)
                )
                raise RankDivergence(
                    f"rank divergence after transition {self._digest.agreed}: the ranks asked "
                    f"the storage tier about different prefixes: from {lows} to {highs} pages: "
                    f"{each}"
                )
        agreed = reduced[:n]
        self.cache.log.op("agreed_hits", tuple(found), tuple(agreed))
        return agreed

    def _operation_running(self) -> str:
        """The operation this rank's cache logged last, as every rank renders it.

        A storage query runs inside a lookup, logged when it began, and
        logs nothing of its own before the hit count is agreed, so the
        lookup is among the last few entries.
        """
        for kind, name, args in itertools.islice(reversed(self.cache.log.entries), _RECENT):
            if kind == "op":
                return operation_text(name, args) or name
        return "an operation"

    # -- divergence detection --------------------------------------------------

    @property
    def digest(self) -> bytes:
        """The running digest of the transitions this cache applied since the wrap or its reset."""
        self._follow_reset()
        return self._digest.update()

    @property
    def transitions(self) -> int:
        """How many transitions the digest covers (since the wrap, or the cache's last reset)."""
        self._follow_reset()
        self._digest.update()
        return self._digest.count

    def verify_agreement(self) -> bytes:
        """Check that every rank applied the same transitions; return the agreed digest.

        One all-reduce of the same shape as a step's, with a kind of its own,
        compares the resets followed, the transitions, the copies in flight
        and the digest (which covers the operations served, with their keys).

        Raises:
            RankDivergence: The digests differ; names the first differing
                transition, the operation each rank applied it in, its node and
                that node's state on each rank, or
                else the first operation the ranks served differently, or the
                ranks whose cache was reset alone (every rank raises the same
                message). Or some ranks called :meth:`step` (or :meth:`drain`)
                where the others called this: every rank raises at once.
            RankFailure: A collective failed or timed out, or an earlier call
                raised RankFailure, or raised before a collective that another rank
                reached without raising (refused at once: the group is broken).
            CacheClosed: The cache was closed (raised before the collective: where
                another rank's cache is open, it raises RankFailure naming this rank).
        """
        with self._in_group("verify_agreement"):
            with self._announcing("verify_agreement"):
                self._check_open("verify_agreement")
                self._follow_reset()
                mine = self._digest.update()
            same = self._shared(mine, len(self.cache.issued()))
            reduced = self._reduce(
                _VERIFY, [*same, *(-v for v in same)], "digest verification (all_gather MIN)"
            )
            self._check_shared(reduced[: len(same)], reduced[len(same) : 2 * len(same)])
            return mine

    def _agree_wait(self, local: Callable[[], bool]) -> bool:
        """Agree on whether a load can be read (the cache's ``wait_loaded``): the MIN over the ranks.

        Each rank computes its own answer (``local``: its copy engine knows
        only its own launches), and every rank returns False when any rank
        did, so that every rank runs the same forward pass: the failed load
        is then applied as failed on every rank at the next step, unless an
        operation that waits for copies applies it first, each rank its own
        outcome (:meth:`collect`), which parts the ranks as any copy that
        failed on one rank only does there. One
        all-reduce of the same shape as a step's, with a kind of its own, that
        also compares what :meth:`verify_agreement` compares: ranks that
        pair this collective with another rank's wait for another request
        (one rank's ``load_back`` gave up where another's did not) part there.

        Raises:
            RankDivergence: As :meth:`verify_agreement`, or some ranks reached
                another collective (every rank raises).
            RankFailure: The collective failed or timed out, or an earlier call
                raised RankFailure, or raised before a collective that another rank
                reached without raising (refused at once: the group is broken).
        """
        with self._in_group("wait_loaded"):
            with self._announcing("wait_loaded"):
                self._follow_reset()
                ready = int(local())
                mine = self._digest.update()
            same = self._shared(mine, len(self.cache.issued()))
            reduced = self._reduce(
                _WAIT, [ready, *same, *(-v for v in same)], "load wait agreement (all_gather MIN)"
            )
            lows, highs = reduced[1 : 1 + len(same)], reduced[1 + len(same) : 1 + 2 * len(same)]
            self._check_shared(lows, highs)
            return reduced[0] == 1

    def _failed_here(self, tickets: Sequence[int]) -> bool:
        """Whether a copy of ``tickets`` finished failed on this rank, held back until agreed.

        The copy engine reported it at a :meth:`step` and forgot it, or
        refused to start it (:meth:`_keep_refused`) and never knew it; the
        slower ranks had not finished theirs, so it waits here unapplied, its
        node still loading. A load wait must then say False on this rank, and
        so on every rank: the copy never wrote the pages the forward pass
        would read. (Only :meth:`_agree_wait` gets here, after following a reset.)
        """
        finished = self._finished
        return any(ticket in finished and not finished[ticket].ok for ticket in tickets)

    def _shared(self, digest: bytes, in_flight: int) -> list[int]:
        """The values every rank must share at any agreement: the first of :data:`_SHARED`.

        Args:
            digest: This rank's digest, just updated.
            in_flight: The copies in flight here (``len(cache.issued())``).
        """
        return [self._resets, in_flight, self._digest.count, *struct.unpack("<4I", digest)]

    def _check_shared(self, lows: Sequence[int], highs: Sequence[int]) -> None:
        """Raise unless every rank shares the :meth:`_shared` values; then the point is agreed.

        Args:
            lows: The values' MIN over the ranks.
            highs: The MIN of their negations.

        Raises:
            RankDivergence: A rank's cache was reset alone, or the values differ.
        """
        if lows[0] != -highs[0]:
            raise RankDivergence(self._reset_message())
        if lows != [-high for high in highs]:
            raise RankDivergence(self._locate(apart=shared_values_apart(lows, highs)))
        self._digest.agree()

    def _reset_message(self) -> str:
        """Gather the resets each rank followed and name the ranks that reset alone."""
        return reset_message(self.comm.all_gather_object(self._resets))

    def _locate(
        self, why: Literal["split", "lost", "stalled"] = "split", apart: Sequence[str] = ()
    ) -> str:
        """Gather what each rank did since the agreed point and describe the first split.

        Args:
            why: ``split``: find where the transitions, the operations
                served or the copies in flight part. ``lost``: a rank drained its copy engine and still lacks
                a completion. ``stalled``: the oldest copy finished on some
                ranks only, for longer than ``timeout``. A completion lost in
                an operation that waited for it is reported first (the
                transitions part because of it); for a split, an operation
                that failed from outside the cache on some ranks only (the
                cause, whatever it left apart); then a difference in the
                transitions, in every case.
            apart: The shared values the ranks differ in (:data:`_SHARED_NAMES`),
                named when nothing else is found to differ.
        """
        if why == "lost":
            losses: list[Loss | None] = self.comm.all_gather_object(self._loss)
            if any(loss is not None for loss in losses):
                return self._lost_in_wait(losses)
        self._digest.update()
        start = self._digest.agreed
        if why == "split":
            failed: list[list[AppliedFailure]] = self.comm.all_gather_object(
                self._digest.failures()
            )
            index = failure_difference(failed)
            if index is not None:
                return failure_message(index, failed)
        tails: list[list[AppliedTransition]] = self.comm.all_gather_object(self._digest.tail())
        index = first_difference(tails)
        if index is not None:
            states = self._gather_states(involved_nodes(tails, index))
            operations = self.comm.all_gather_object(self._digest.operation_of(index))
            return divergence_message(start, index, tails, states, operations)
        applied = start + len(tails[0])
        if why != "split":
            return self._missing(applied, lost=why == "lost")
        served: list[list[AppliedOperation]] = self.comm.all_gather_object(
            self._digest.operations()
        )
        index = first_difference(served)
        if index is not None:
            return operation_message(index, served)
        return self._copies_apart(start, applied, apart)

    def _copies_apart(self, start: int, applied: int, apart: Sequence[str]) -> str:
        """Describe ranks that did the same since the agreed point but wait on different copies.

        In flight to or from the host, in flight to or from a storage tier,
        or waiting to start (queued, or failed and to run again); where all
        of those agree, name the shared values that differ.

        Args:
            start: Transitions every rank had agreed on.
            applied: Transitions every rank has applied now.
            apart: The shared values the ranks differ in.
        """
        waits: list[list[list[int]]] = self.comm.all_gather_object(self._waiting())
        if any(w != waits[0] for w in waits):
            nodes = [n for copies in waits for copy in copies for n in copy]
            return waiting_message(applied, waits, self._gather_states(nodes))
        tier = self.cache.storage
        mine = (
            []
            if tier is None
            else [(c.kind, [n.id for n in c.nodes]) for c in tier.in_flight().values()]
        )
        stores = self.comm.all_gather_object(mine)
        if any(w != stores[0] for w in stores):
            return storage_waiting_message(applied, stores)
        queued = self.comm.all_gather_object(self.cache.transfers.queued_nodes())
        if any(q != queued[0] for q in queued):
            nodes = [n for copies in queued for _, ids in copies for n in ids]
            return queued_message(applied, queued, self._gather_states(nodes))
        return (
            f"rank divergence after transition {start}: the ranks' {', '.join(apart)} differ, "
            "yet every rank applied the same transitions and served the same operations since, "
            "and waits on the same copies; the ranks last agreed at different points"
        )

    def _lost_in_wait(self, losses: list[Loss | None]) -> str:
        """Describe the completions lost in an operation that waited, as the short ranks saw it.

        Args:
            losses: Per rank, what it saw when its wait came up short; None where nothing was lost.
        """
        applied, copies, _ = next(loss for loss in losses if loss is not None)
        ready = [len(copies) if loss is None else loss[2] for loss in losses]
        named = [n for k in ready if k < len(copies) for n in copies[k]]
        return lost_message(applied, copies, ready, self._gather_states(named))

    def _missing(self, applied: int, *, lost: bool) -> str:
        """Describe a completion that some ranks lack: lost in a drain, or overdue in a step."""
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
        """Every rank's state of ``nodes`` (the same list on every rank): see :func:`node_state`."""
        tree, storage = self.cache.tree.nodes, self.cache.storage is not None
        here = {n: node_state(tree[n], storage) for n in dict.fromkeys(nodes) if n in tree}
        return self.comm.all_gather_object(here)


def _orphaned(source: object) -> bool:
    """Whether ``source`` is the acknowledgements of a DistributedCache that is gone."""
    return isinstance(source, _Alone) and source.orphaned


def _weakly(method: Callable[_P, _R], alone: Callable[_P, _R]) -> Callable[_P, _R]:
    """Return a bound ``method`` of a DistributedCache, held weakly; ``alone`` once it is gone.

    The cache holds what a DistributedCache gives it (its load waits, its
    refused starts, its storage hits; :class:`_Alone` its acknowledgements),
    and the DistributedCache holds the cache. Held strongly, the two made a
    reference cycle, and a dropped pair kept the cache's pools until
    Python's cyclic collector ran. Once the DistributedCache is gone (dropped
    while its cache serves on), the cache answers alone.
    """
    held = weakref.WeakMethod(method)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        live = held()
        return alone(*args, **kwargs) if live is None else live(*args, **kwargs)

    return call


def _refused_alone(
    _direction: Direction, _src: Sequence[int], _dst: Sequence[int], refusal: CopyFailed
) -> Ticket:
    """A start the copy engine refused, with no group to hold it for: refused, as on a plain cache."""
    raise refusal


def _hits_alone(found: Sequence[int], _asked: Sequence[int]) -> list[int]:
    """A prefetch query's hit counts with no group to agree with: this rank's own."""
    return list(found)


class _Alone:
    """A DistributedCache's acknowledgements as its cache reads them, the DistributedCache held weakly.

    While the DistributedCache lives, :meth:`collect` is its
    :meth:`~DistributedCache.collect`. Once it is gone (dropped while its
    cache serves on), the cache goes on as a cache of its own: what its copy
    engine reports, with the completions the DistributedCache had buffered
    (handed over by :meth:`adopt` as it went), applied in issue order; its
    load waits are its own answer. The ranks are no longer kept alike: no
    step will run again.

    Args:
        shared: The DistributedCache.
        copier: This rank's copy engine.
        copies: The cache's copies in flight.
        storage: The cache's storage tier, if it has one: it decides alone
            again once the DistributedCache is gone.
    """

    def __init__(
        self,
        shared: DistributedCache,
        copier: Copier,
        copies: IssuedCopies,
        storage: StorageTier | None,
    ) -> None:
        self._shared = weakref.ref(shared)
        self._copier, self._copies = copier, copies
        self._storage = storage
        self._left: dict[int, Completion] = {}

    @property
    def orphaned(self) -> bool:
        """Whether its DistributedCache is gone, so that another may wrap the cache."""
        return self._shared() is None

    def hand_over(self) -> dict[int, Completion]:
        """Give the completions it holds to the DistributedCache that wraps the cache next."""
        left, self._left = self._left, {}
        return left

    def adopt(self, finished: dict[int, Completion]) -> None:
        """Take over the completions the DistributedCache held, as it goes; free its storage tier."""
        self._left = finished
        if self._storage is not None:
            self._storage.decide_alone()

    def collect(self, wait: bool) -> list[Completion]:
        """Return what the DistributedCache gives, or, once it is gone, what is said above."""
        shared = self._shared()
        if shared is not None:
            return shared.collect(wait)
        left = self._left
        reported = self._copier.drain() if wait else self._copier.poll()
        left.update((completion.ticket.id, completion) for completion in reported)
        out = [left.pop(ticket) for ticket in self._copies.issued() if ticket in left]
        left.clear()  # of copies no longer in flight (the cache was reset)
        return out

    def wait_here(self, local: Callable[[], bool]) -> bool:
        """A load wait with no group to agree with: this rank's own answer."""
        return local()

    def failed_here(self, tickets: Sequence[int]) -> bool:
        """Whether a copy of ``tickets`` failed and waits here, among what was handed over."""
        left = self._left
        return any(ticket in left and not left[ticket].ok for ticket in tickets)


class _AgreedStarts:
    """The copy engine's starts, with a start it refuses kept in flight as a failed copy.

    A copy engine refuses a start with :class:`~fsm_cache.errors.CopyFailed`
    on one rank only (a destination still busy there, an engine closed
    there); :class:`~fsm_cache.cache.transfers.Transfers` would fail the copy
    at once, on that rank alone. Anything else the engine raises (a broken
    engine) is left to :class:`~fsm_cache.cache.transfers.Transfers`, which
    fails the copy and raises it to the caller.

    Args:
        copier: This rank's copy engine.
        keep: Makes the ticket a refused start is kept in flight under
            (:meth:`DistributedCache._keep_refused`).
    """

    def __init__(
        self,
        copier: Copier,
        keep: Callable[[Direction, Sequence[int], Sequence[int], CopyFailed], Ticket],
    ) -> None:
        self._copier = copier
        self._keep = keep

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Start a device-to-host copy; a refused one is kept in flight, failed."""
        try:
            return self._copier.start_write(device_pages, host_pages)
        except CopyFailed as refusal:
            return self._keep(Direction.D2H, device_pages, host_pages, refusal)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Start a host-to-device copy; a refused one is kept in flight, failed."""
        try:
            return self._copier.start_load(host_pages, device_pages)
        except CopyFailed as refusal:
            return self._keep(Direction.H2D, host_pages, device_pages, refusal)


_SHORTEST_TIMEOUT = 0.001
"""The shortest wait a collective can be given: torch.distributed waits whole milliseconds,
and reads 0 ms as no limit at all (a shorter timeout waited for the group's own, 30 minutes
by default)."""
_LONGEST_TIMEOUT = 2**62 / 10**9
"""The longest (about 146 years): torch.distributed adds a timeout to its clock in 64-bit
nanoseconds, and past about 9.2e9 s less the clock a wait overflowed (it failed at once with
"Operation timed out!", or never returned); half the range is left to the clock."""


def shared_values_apart(lows: Sequence[int], highs: Sequence[int]) -> list[str]:
    """Name the values every rank must share whose MIN and MAX over the ranks differ, each once.

    Args:
        lows: The values' MIN over the ranks, in the order of a step's
            (:data:`_SHARED_NAMES`), or the first of them.
        highs: The MIN of their negations: the negated MAX.

    Returns:
        What differs, for a divergence message: ``["digests", "flags of
        anything in flight or queued"]``; empty when every rank agrees.
    """
    return list(
        dict.fromkeys(
            _SHARED_NAMES[i]
            for i, (low, high) in enumerate(zip(lows, highs, strict=True))
            if low != -high
        )
    )


def _check_group_and_timeout(group: object, timeout: object, local_sockets: object) -> None:
    """Refuse a group, a timeout or a transport no agreement can run on (before anything is changed).

    Raises:
        BadArgument: ``group`` is not a live process group this rank belongs to.
        ConfigError: ``timeout`` is not a number of seconds from a
            millisecond to :data:`_LONGEST_TIMEOUT`, or ``local_sockets`` is not a bool.
    """
    if group is not None:
        _check_group(group)
    if type(local_sockets) is not bool:
        raise ConfigError(
            f"distributed: local_sockets must be True or False, got {local_sockets!r}"
        )
    if not real(timeout) or not (_SHORTEST_TIMEOUT <= timeout <= _LONGEST_TIMEOUT):
        raise ConfigError(
            f"distributed: timeout must be a number of seconds from {_SHORTEST_TIMEOUT:g} to "
            f"{_LONGEST_TIMEOUT:g} (torch.distributed waits whole milliseconds, 0 meaning no "
            f"limit, and adds them to its clock in 64-bit nanoseconds), got {timeout!r}"
        )


def _check_cache(
    cache: object, group: dist.ProcessGroup | None, timeout: float, verify_every: object
) -> None:
    """Refuse a cache this rank cannot agree over, or ``verify_every`` (before anything is changed).

    Raises:
        BadArgument: ``cache`` is not a :class:`HiCache`.
        ConfigError: ``verify_every`` is not an int >= 0, the cache is wrapped in
            a DistributedCache already, its write policy is ``write_back``, or
            its storage tier does not fit the group (:func:`_check_storage`).
    """
    if not isinstance(cache, HiCache):
        raise BadArgument(f"distributed: cache must be a HiCache, got {type(cache).__name__}")
    if cache.transfers.acks_taken and not _orphaned(cache.transfers.ack_source):
        raise ConfigError(
            "distributed: this cache's acknowledgements come from another DistributedCache"
            " already: wrap a cache once (two would each buffer completions the other waits for)"
        )
    if not whole(verify_every):
        raise ConfigError(f"distributed: verify_every must be an int >= 0, got {verify_every!r}")
    if cache.config.write_policy == "write_back":
        raise ConfigError(
            "distributed: write_back waits for its copies inside an allocation, where the "
            "ranks cannot agree on them yet; use write_through or write_through_selective"
        )
    if cache.storage is not None:
        _check_storage(cache.storage.config, group, timeout)


def _check_construction(
    comm: Collectives, refused: Exception | None, state: Sequence[StatePart] = ()
) -> None:
    """Refuse a construction that some rank refused, with different timeouts or caches, everywhere.

    Every rank constructs at the same point, so a rank that refused its own
    arguments still takes part, saying so: the others raise at once, naming
    it, instead of waiting out their timeout for it. A rank with a shorter
    timeout gives up on a collective that the others still wait in, and a
    copy finished on some ranks only is overdue by its clock first: every
    rank must wait alike. The caches must be alike too (:func:`cache_state`):
    a cache may have served before it is wrapped, each rank applying its own
    acknowledgements as they came, and agreement starts from where the caches
    are. One all-gather (of each rank's timeout, its exact bits, its refusal
    and a hash of its cache's state), and where the hashes differ one more, of
    the states, to name the first difference; skipped in a group of one.
    ``verify_every`` and ``device`` are ignored, so they need not agree.

    Args:
        comm: The group's collectives.
        refused: What this rank refused its arguments with; None if it did not.
        state: This rank's cache's state (:func:`cache_state`); none where it refused.

    Raises:
        ConfigError: Another rank refused its arguments (this rank's own
            refusal is its caller's to raise), or the timeouts differ.
        RankDivergence: The caches' states differ: the first difference is named.
        RankFailure: An all-gather failed or timed out (each rank waits its own timeout).
    """
    if comm.world_size == 1:
        return
    mine = None if refused is None else f"{type(refused).__name__}: {refused}"
    each: list[tuple[float, str | None, bytes]] = comm.all_gather_object(
        (float(comm.timeout), mine, state_fingerprint(state)), CONSTRUCTION
    )
    if refused is not None:
        return
    others = [(rank, text) for rank, (_, text, _) in enumerate(each) if text is not None]
    if others:
        named = "; ".join(f"rank {rank} refused with {text}" for rank, text in others)
        raise ConfigError(
            f"distributed: rank {comm.rank} of {comm.world_size}: the ranks must wrap their "
            f"caches together, and not every rank could: {named}"
        )
    timeouts = [timeout for timeout, _, _ in each]
    if any(t != timeouts[0] for t in timeouts):
        named = ", ".join(f"rank {rank} {t!r} s" for rank, t in enumerate(timeouts))
        raise ConfigError(
            f"distributed: the ranks were given different timeouts ({named}): give every "
            "rank the same, or the rank that waits least gives up on a collective the "
            "others still wait in"
        )
    if any(fingerprint != each[0][2] for _, _, fingerprint in each):
        states: list[list[StatePart]] = comm.all_gather_object(list(state), CONSTRUCTION)
        apart = state_difference(states) or "their states hash differently"
        raise RankDivergence(
            f"distributed: rank {comm.rank} of {comm.world_size}: the ranks' caches differ, so "
            f"they cannot start to agree: {apart}; wrap caches that served the same operations, "
            "once every copy is applied on every rank (poll each until none is in flight), or "
            "new ones"
        )


def node_state(node: TreeNode, storage: bool) -> str:
    """A node's state as a divergence message shows it: ``backed/resident (pins=0, locks=0)``.

    With a storage tier (``storage``) its storage state follows the device's:
    ``backed/resident/stored (pins=0, locks=0)``, since ranks may part there
    alone (one rank's store dropped the pages, another's did not).
    """
    shown = node.residency()
    if not storage:
        return shown
    regions, counts = shown.split(" ", 1)
    return f"{regions}/{node.storage} {counts}"


def cache_state(cache: HiCache) -> list[StatePart]:
    """The state a cache must share with the other ranks' when it is wrapped, as text.

    Its nodes by id: each node's parent, key, namespace, state
    (:func:`node_state`), device pages, last access and hits (what later
    lookups, evictions and selective backups read), and each namespace root's
    state (its locks); the last node id made; the device pool's free pages in
    the order they are handed out (a later allocation's slots are folded into
    the digest); and the copies in flight, waiting to start, or to and from a
    storage tier. Host page numbers are left out: which host pages a copy took
    depends on the order the copies before it were acknowledged in, and
    nothing the ranks must share reads them.

    Args:
        cache: This rank's cache.
    """
    storage = cache.storage is not None
    tree = cache.tree
    parts: list[StatePart] = []
    namespaces: dict[int, str] = {}
    for namespace, root in tree.roots.items():
        name = namespace_text(namespace)
        parts.append((f"the root of namespace {name}", (("state", node_state(root, storage)),)))
        below = list(root.children.values())
        while below:
            node = below.pop()
            namespaces[node.id] = name
            below.extend(node.children.values())
    for ident in sorted(tree.nodes):
        node = tree.nodes[ident]
        parent = node.parent
        fields = (
            ("parent", "a root" if parent is None or parent.is_root else f"node {parent.id}"),
            ("namespace", namespaces.get(ident, "none")),
            ("key", ids_text(tuple(node.key))),
            ("state", node_state(node, storage)),
            ("device pages", ids_text(tuple(node.device_pages))),
            ("last access", str(node.last_access)),
            ("hits", str(node.hit_count)),
        )
        parts.append((f"node {ident}", fields))
    parts.append(("the tree", (("last node id", str(tree.last_id)),)))
    free = cache.tiers.device.allocator.free_list
    parts.append(("the device pool", (("free pages", ids_text(free)),)))
    batches = cache.transfers.in_flight()
    copies = (batches[ticket] for ticket in cache.issued())
    tier = cache.storage
    stores = () if tier is None else tier.in_flight().values()
    waits = (
        ("copies in flight", _copies((b.ticket.direction.value, b.nodes) for b in copies)),
        ("storage copies in flight", _copies((c.kind, c.nodes) for c in stores)),
        ("waiting to start", _copies(cache.transfers.queued_nodes())),
    )
    parts.append(("the copies", waits))
    return parts


def _copies(copies: Iterable[tuple[str, Sequence[TreeNode | int]]]) -> str:
    """``d2h of nodes [1, 2] then h2d of nodes [4]`` (nodes or their ids), or ``none``."""
    named = (
        f"{kind} of nodes {[n if isinstance(n, int) else n.id for n in nodes]}"
        for kind, nodes in copies
    )
    return " then ".join(named) or "none"


def _check_group(group: object) -> None:
    """Refuse a ``group`` this rank cannot agree over (before anything is changed).

    Raises:
        BadArgument: ``group`` is the placeholder ``new_group()`` gives the
            ranks outside a group, not a process group, or one that
            ``torch.distributed`` no longer knows (destroyed).
    """
    outside = dist.GroupMember.NON_GROUP_MEMBER
    if group is outside or (type(group) is type(outside) and group == outside):
        raise BadArgument(
            "distributed: this rank is not a member of the group it passed (new_group() gives "
            "the ranks outside a group a placeholder); pass the group of this rank's own ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise BadArgument(
            f"distributed: group must be a torch.distributed ProcessGroup or None, "
            f"got {type(group).__name__}"
        )
    try:
        rank = dist.get_rank(group)
    except ValueError:  # torch's words: "Group ... is not registered"
        rank = -1
    if rank < 0:
        raise BadArgument(
            "distributed: group is not a process group of this rank: it was destroyed, or "
            "this rank is not one of its members"
        )


def _check_storage(config: StorageConfig, group: dist.ProcessGroup | None, timeout: float) -> None:
    """Refuse a storage tier that does not fit the group (before anything is changed).

    Raises:
        ConfigError: It names a rank or group size other than the group's
            (ranks with shards of their own would read one another's; one
            namespace for the whole group, ``rank=0, ranks=1``, is fine where
            every rank holds the same KV, as an MLA latent), leaves ``ranks``
            unsaid in a group of more than one (which of the two it means
            cannot be told from the cache), or its
            ``io_timeout`` is not below ``timeout`` (a rank waiting for a copy
            would miss the others' next collective).
    """
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    if config.ranks is None and ranks > 1:
        raise ConfigError(
            f"distributed: the storage tier does not say its ranks, in a group of {ranks}: pass "
            f"StorageConfig(rank={rank}, ranks={ranks}) where each rank holds its own KV heads, or "
            "ranks=1 where every rank holds the same KV (an MLA latent); unsaid, every rank "
            "would key its shard under one namespace and read the others'"
        )
    if config.shards != 1 and (config.rank, config.shards) != (rank, ranks):
        raise ConfigError(
            f"distributed: the storage tier is rank {config.rank} of {config.ranks}, the group's "
            f"rank is {rank} of {ranks}: pass StorageConfig(rank=, ranks=) of the group, so "
            "each rank keys its own shard (or ranks=1 where every rank holds the same KV)"
        )
    if not config.io_timeout < timeout:
        raise ConfigError(
            f"distributed: the storage tier's io_timeout ({config.io_timeout:g} s) must be below "
            f"the agreement timeout ({timeout:g} s): a rank waiting for a storage copy must "
            "reach the next collective in time"
        )


def _deprecated(**given: bool) -> None:
    """Warn about each deprecated argument of :class:`DistributedCache` that was given."""
    why = {
        "verify_every": "every step() compares the ranks' digests in its one collective",
        "device": "the agreement always runs on CPU tensors over a gloo group",
    }
    for name, was_given in given.items():
        if was_given:
            warnings.warn(
                f"DistributedCache({name}=...) is deprecated and ignored: {why[name]}",
                DeprecationWarning,
                stacklevel=3,
            )
