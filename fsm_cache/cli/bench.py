"""``fsm-cache bench [engine|copies|cache|tp|vllm|sglang|storage]``: speed figures, measured side by side in one run.

Speed targets live here, never in timed tests: these machines are shared and
noisy, so every figure is a ratio of two things measured in the same run.
Each benchmark takes ``--quick`` and the flags :data:`TAKES` gives it; a flag
of another benchmark is refused before anything runs, never silently ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fsm_cache.errors import BadArgument
from fsm_cache.shell import one_line


TAKES: dict[str, tuple[str, ...]] = {
    "engine": (),
    "copies": (),
    "cache": ("--against",),
    "tp": (),
    "vllm": (),
    "sglang": (),
    "storage": ("--pages", "--reps"),
}
"""The flags each benchmark takes besides ``--quick`` (which all take); any other is refused."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="measure speed (ratios, side by side)",
        description="Measure what fsm_cache's checks cost, side by side with what they replace.",
    )
    parser.add_argument(
        "what",
        nargs="?",
        default="engine",
        choices=tuple(TAKES),
        help="engine (default): checked pin+release vs a bare counter and transitions; "
        "copies: machine-driven write-through vs raw gather-and-copy; "
        "cache: HiCache vs an unchecked radix tree; tp: the agreed step vs local polls on gloo ranks; "
        "vllm: the checked offloading manager vs vLLM's own (needs vLLM; make bench-vllm); "
        "sglang: SGLang's RadixCache patched vs stock (needs SGLang; make bench-sglang); "
        "storage: backup and prefetch through HiCache vs store.put/get and raw file and Redis I/O",
    )
    # The defaults of the flags in TAKES are None, so a flag given is told from one left out.
    parser.add_argument(
        "--against",
        choices=("baseline", "sglang"),
        help=f"{_only('--against')}: the in-house unchecked tree (default) or the installed "
        "SGLang's RadixCache (needs SGLang; make bench-sglang)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (for smoke tests)")
    parser.add_argument(
        "--pages",
        type=_positive,
        help=f"{_only('--pages')}: pages per backup and prefetch (default 64 pages of 2 MiB)",
    )
    parser.add_argument(
        "--reps",
        type=_positive,
        help=f"{_only('--reps')}: repetitions, the best kept (default 8)",
    )
    parser.set_defaults(handler=run)


def _only(flag: str) -> str:
    """Return which benchmarks take ``flag``, as its help and refusal say it: ``storage only``."""
    return ", ".join(what for what, flags in TAKES.items() if flag in flags) + " only"


def _refuse_foreign_flags(args: argparse.Namespace) -> None:
    """Refuse the flags given that ``args.what`` does not take (see :data:`TAKES`).

    Raises:
        BadArgument: Naming the benchmark and each such flag, with the
            benchmarks that take it; nothing has run.
    """
    flags = sorted({flag for takes in TAKES.values() for flag in takes} - set(TAKES[args.what]))
    foreign = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]
    if foreign:
        named = ", ".join(f"{flag} ({_only(flag)})" for flag in foreign)
        raise BadArgument(f"bench {args.what} does not take {named}")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark and print its table, then which of its modules ran compiled.

    Raises:
        BadArgument: A flag is given that the benchmark does not take.
    """
    _refuse_foreign_flags(args)
    status = _run(args)
    if status == 0 and args.what != "engine":  # the engine's code is generated, never compiled
        from fsm_cache import native

        print(f"fsm_cache modules compiled with mypyc: {native.summary()}")
    return status


def _run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # one thread per core is what a busy 2-core box gives
    if args.what == "engine":
        from fsm_cache.bench.engine import run_engine_bench

        print(run_engine_bench(n=20_000 if args.quick else 200_000).format())
    elif args.what == "copies":
        from fsm_cache.bench.copies import run_copy_bench

        result = run_copy_bench(quick=args.quick)
        print(result.format())
        if result.round_trip_exact is False:  # the bytes moved are wrong: no figure counts
            return 1
    elif args.what == "storage":
        from fsm_cache.bench.storage import run_storage_bench

        print(run_storage_bench(quick=args.quick, reps=args.reps, pages=args.pages).format())
    elif args.what == "cache" and args.against == "sglang":
        from fsm_cache.bench.against import QUICK_REQUESTS, run_against_sglang

        sized = {"num_requests": QUICK_REQUESTS, "rounds": 1} if args.quick else {}
        return _server_bench(lambda: run_against_sglang(**sized).format())
    elif args.what == "cache":
        from fsm_cache.bench.cache import run_cache_bench

        print(
            run_cache_bench(
                num_requests=200 if args.quick else 2000, rounds=1 if args.quick else 3
            ).format()
        )
    elif args.what == "vllm":
        from fsm_cache.bench.vllm import run_vllm_bench

        quick = {"requests": 300, "repeat": 2} if args.quick else {}
        return _server_bench(lambda: run_vllm_bench(**quick).format())
    elif args.what == "sglang":
        from fsm_cache.bench.sglang import run_sglang_bench

        small = {"requests": 200, "repeat": 1, "nodes": 500} if args.quick else {}
        return _server_bench(lambda: run_sglang_bench(**small).format())
    else:
        from fsm_cache.bench.tp import QUICK, Sizes, run_tp_bench

        sizes: Sizes = QUICK if args.quick else {}
        for ranks in (2, 4):
            print(run_tp_bench(ranks, **sizes).format())
    return 0


def _positive(text: str) -> int:
    """Parse a count of at least 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _server_bench(table: Callable[[], str]) -> int:
    """Print a benchmark that needs a server's code installed; exit 2 saying so when it is not.

    Not installed is a ``ModuleNotFoundError``; installed but not the code the
    benchmark drives (a release that moved a name) is its parent ``ImportError``.
    """
    try:
        print(table())
    except ImportError as exc:
        print(one_line(f"error: {exc}"), file=sys.stderr)
        return 2
    return 0
