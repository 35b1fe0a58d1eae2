"""``fsm-cache demo``: a chat workload through HiCache, then a planted double release.

The demo serves a synthetic multi-turn chat trace (shared system prompts,
branching conversations) through a small model-shaped KV on CPU (CUDA when
present), with evictions, load-backs and storage-backup pins, checking the
design invariants one cache can check (1 to 9; 10 is across ranks) as it goes
and the KV of every cached prefix at the end. It then shows the third tier: a
cache stores its prefixes in a local file store after their host backups, and
a second cache, empty, prefetches them from it on a lookup and reads them back
bit-exact. Last, it plants the bug SGLang
users meet as ``Host reference counter is already zero.``, and shows fsm_cache
refusing it at the second release, naming the site of the refused release and
those of the pin and the first release.
"""

from __future__ import annotations

import argparse
import errno
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsm_cache.errors import BadArgument, FsmCacheError, ReleaseAtZero
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import HOST_VALID, Node, Residency


# NOTE: the cache's modules are imported where they are used, never when the CLI
# builds its parser: importing them loads the shipped specs, and a corrupt one must
# fail the demo alone (with one error line), not every other command.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from fsm_cache.bench.serving import ServeReport
    from fsm_cache.bench.workload import ChatWorkload
    from fsm_cache.cache.hicache import HiCache


CHECK_EVERY = 10
"""Requests served between two invariant checks."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="serve a chat workload through HiCache",
        description=(
            "Serve a synthetic chat workload through HiCache, checking its invariants, "
            "then show a planted double release refused."
        ),
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests to serve")
    parser.add_argument(
        "--policy",
        choices=tuple(policy.value for policy in WritePolicy),
        default=WritePolicy.WRITE_THROUGH.value,
        help="HiCache's write policy (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Serve the workload, print the summary, show the planted refusal; 0 when all is well.

    Raises:
        BadArgument: ``--requests`` is negative (the CLI prints it and exits 2).
    """
    if args.requests < 0:
        raise BadArgument(f"demo: --requests must be >= 0, got {args.requests}")
    try:
        console = _console()
    except ModuleNotFoundError as exc:
        raise FsmCacheError(
            "fsm-cache demo draws with rich, which comes with the cli extra: "
            "pip install 'fsm-cache[cli]'"
        ) from exc
    _quiet_threads()
    from fsm_cache.bench.workload import ChatWorkload
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.memory.tiers import CacheConfig

    config = CacheConfig(
        device_pages=256,
        host_pages=1024,
        page_size=16,
        layers=2,
        heads=4,
        head_dim=32,
        write_policy=args.policy,
    )
    cache = HiCache(config)
    trace = ChatWorkload(requests=args.requests, seed=args.seed)
    console.print(
        f"[bold]fsm_cache demo[/]: {trace.requests} chat requests through HiCache on "
        f"{cache.tiers.device.device} ({config.device_pages} device pages, "
        f"{config.host_pages} host pages of {config.page_size} tokens, {config.write_policy})"
    )
    started = time.perf_counter()
    report = _serve(cache, trace, console)
    checked, differing = _check_prefixes(cache, trace)
    console.print(_summary(cache, report, checked, differing, time.perf_counter() - started))
    for request in differing[:3]:
        console.print(f"[red]KV of request {request} differs from what was written[/]")
    shared = _three_tiers(console)
    planted = _planted_double_release(console)
    refused = sum(cache.stats().refused.values())
    return 0 if planted and shared and refused == 0 and not differing else 1


def _console() -> Console:
    """Return a console on stdout whose lost reader ends the demo as any command's does.

    rich's own answer to a reader that has gone (``fsm-cache demo | head -1``)
    is ``SystemExit(1)``, which reads as a failed demo; raised on as
    :class:`BrokenPipeError`, it is :func:`~fsm_cache.shell.run_command`'s
    quiet :data:`~fsm_cache.shell.OUTPUT_CLOSED`. The console turns quiet
    first, so the progress bar's clean-up writes nothing more.
    """
    from rich.console import Console

    class PipedConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return PipedConsole()


def _quiet_threads() -> None:
    import torch

    # NOTE: the demo's copies are small; torch's intra-op thread pool costs more than it
    # gains on them, and far more on a busy two-core machine.
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def _serve(cache: HiCache, trace: ChatWorkload, console: Console) -> ServeReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fsm_cache.bench.serving import serve
    from fsm_cache.bench.workload import requests

    columns = (TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("serve", total=trace.requests)
        return serve(
            cache,
            requests(trace),
            check_every=CHECK_EVERY,
            backup_every=7,
            on_request=lambda: progress.advance(task),
        )


def _check_prefixes(cache: HiCache, trace: ChatWorkload) -> tuple[int, list[str]]:
    """Compare the KV of every request's cached prefix with what was written.

    Returns:
        How many prefixes were compared, and the requests
        (``conversation/turn``) whose prefix's KV differs.
    """
    import torch

    from fsm_cache.bench.workload import requests
    from fsm_cache.memory.tiers import synthetic_kv

    checked, differing = 0, []
    for request in requests(trace):
        key = cache.tree.aligned(request.tokens)
        walk = cache.tree.walk(key)
        on_device = [n for n in walk.path if n.device == "resident"]
        if not on_device:
            continue
        pages = [p for n in on_device for p in n.device_pages]
        tokens = [t for n in on_device for t in n.key]
        expected = synthetic_kv(cache.tiers.device.layout, tokens)
        if not torch.equal(cache.tiers.read_device(pages), expected):
            differing.append(f"{request.conversation}/{request.turn}")
        checked += 1
    return checked, differing


def _summary(
    cache: HiCache, report: ServeReport, checked: int, differing: list[str], seconds: float
) -> Table:
    stats = cache.stats()
    from rich.table import Table

    table = Table(title=f"served {report.requests} requests in {seconds:.1f} s", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("hit rate, device", f"{stats.device_hit_rate:.1%}"),
        ("hit rate, host only", f"{stats.host_hit_rate:.1%}"),
        ("tokens on device / host", f"{stats.device_tokens} / {stats.host_tokens}"),
        ("bytes copied device->host", f"{stats.bytes.get('d2h', 0):,}"),
        ("bytes copied host->device", f"{stats.bytes.get('h2d', 0):,}"),
        ("load-backs", str(report.load_backs)),
        ("tokens evicted from device", f"{cache.counters.evicted_tokens['device']:,}"),
        ("storage-backup pins taken and released", str(report.backups_pinned)),
        ("transitions", ", ".join(f"{k} {v}" for k, v in sorted(stats.transitions.items()))),
        ("invariant checks passed", f"{report.invariant_checks} ({_checked()})"),
        ("cached prefixes read back bit-exact", f"{checked - len(differing)} of {checked}"),
        ("refused transitions", str(sum(stats.refused.values()))),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def _checked() -> str:
    """Say which design invariants each check covers, and which it cannot."""
    from fsm_cache.cache.invariants import CHECKED

    return (
        f"invariants {_spans(CHECKED)}, every {CHECK_EVERY} requests; "
        "10 is agreement across ranks, not checked on one cache"
    )


def _spans(numbers: Sequence[int]) -> str:
    """Render ``1, 2, 3, 5`` as ``1-3, 5``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _three_tiers(console: Console) -> bool:
    """Store prefixes from one cache into a local file store and prefetch them into another.

    Returns whether the second cache read every prefix back bit-exact.
    """
    import tempfile

    import torch

    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
    from fsm_cache.storage import LocalFileStore

    config = CacheConfig(
        device_pages=64, host_pages=128, page_size=16, layers=2, heads=4, head_dim=32, debug=True
    )
    prompts = [[p * 1000 + t for t in range(16 * (4 + p))] for p in range(3)]
    with tempfile.TemporaryDirectory(prefix="fsm-cache-demo-") as root:
        store = LocalFileStore(root)
        tier = StorageConfig(
            store, model="demo", threads=0, prefetch_threshold=16, prefetch_policy="wait"
        )
        with HiCache(config, storage=tier) as writer:
            for prompt in prompts:
                writer.insert(prompt)
            writer.poll()  # the host backups land; their stores start
            writer.poll()  # the stores land
            stored = writer.stats().storage_pages.get("stored", 0)
        console.print(
            f"\n[bold]three tiers[/]: cache A backed {len(prompts)} prompts up to the host, then "
            f"stored them in a local file store ({stored} pages, {store.capacity().used_bytes:,} bytes)"
        )
        exact = 0
        with HiCache(config, storage=tier) as reader:
            for prompt in prompts:
                found = reader.match_prefix(prompt)  # fetched from the store before it returns
                chain = reader.load_back(found.last_host_node)
                reader.poll()
                found = reader.match_prefix(prompt)
                kv = reader.tiers.read_device(list(found.device_pages))
                want = synthetic_kv(reader.tiers.device.layout, prompt)
                exact += chain is not None and torch.equal(kv, want)
            fetched = reader.stats().storage_pages.get("fetched", 0)
        console.print(
            f"cache B, empty, prefetched them on lookup ({fetched} pages) and loaded them to its "
            f"device: {exact} of {len(prompts)} prompts bit-exact"
        )
    return exact == len(prompts)


class _StorageBackup:
    """Two cleanup paths that both think they own one pin: SGLang #13483's shape."""

    def __init__(self, node: Node, machine: Residency) -> None:
        self.node, self.machine = node, machine

    def backup_to_storage(self) -> None:
        self.machine.pin(self.node)

    def drain_backup(self) -> None:
        self.machine.release(self.node)

    def release_aborted_request(self) -> None:
        self.machine.release(self.node)


def _planted_double_release(console: Console) -> bool:
    """Plant a double release in trail mode; return whether it was refused naming all three sites.

    The refusal's trail names the pin, the first release and the
    refused release itself (``...; refused at demo.py:N in release_aborted_request``).
    """
    machine = Residency(trail=True)
    node = Node(17, host="backed")
    backup = _StorageBackup(node, machine)
    backup.backup_to_storage()
    backup.drain_backup()
    console.print("\n[bold]planted bug[/]: two cleanup paths release one storage-backup pin")
    try:
        backup.release_aborted_request()
    except ReleaseAtZero as exc:
        console.print(f"[red]refused[/]: {exc}", highlight=False)
        console.print(f"node 17 is unchanged: {node.residency()}")
        released = [site.function for event, site in exc.sites if event == "release"]
        return (
            exc.site is not None
            and exc.site.function == _StorageBackup.release_aborted_request.__name__
            and released == [_StorageBackup.drain_backup.__name__]
            and node.host in HOST_VALID
        )
    return False
