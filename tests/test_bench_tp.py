"""``fsm-cache bench tp``: both halves of a step do the same work, and a failed rank is typed.

The timed runs on two ranks are in tests/test_distributed.py; these run the
comparison on a group of one rank in this process.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import pytest


with warnings.catch_warnings():
    # A torch without numpy warns at import, which filterwarnings=error would turn into an error.
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch.distributed as dist
    from torch.multiprocessing.spawn import (
        ProcessContext,
        ProcessExitedException,
        ProcessRaisedException,
    )

    from fsm_cache.bench import tp as tpbench
    from fsm_cache.bench.cache import UnequalWork
    from fsm_cache.bench.tp import bench_config, chat_trace, serve_chat_trace
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.tree import Key
    from fsm_cache.errors import RankFailure


TIMEOUT = 20.0


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=TIMEOUT),
    )
    yield
    dist.destroy_process_group()


def settings(per_step: int) -> tpbench.Settings:
    return tpbench.Settings(
        per_step=per_step,
        polls=1,
        requests=0,
        small_requests=0,
        rounds=1,
        timeout=TIMEOUT,
        local_sockets=True,
    )


def transitions(step: Sequence[Key]) -> dict[str, int]:
    """The transitions of one step of ``step``'s requests on a fresh cache, its copies applied."""
    cache = HiCache(bench_config())
    serve_chat_trace(cache, step, lambda: None)
    cache.poll()  # once, as the step does
    cache.close()
    return cache.stats().transitions


@pytest.mark.usefixtures("world_of_one")
def test_the_local_and_the_agreed_half_apply_the_same_transitions() -> None:
    served = tpbench.compare_steps(bench_config, serve_chat_trace, chat_trace(16), settings(8), "t")
    assert (served.requests, served.steps) == (16, 2)
    assert min(served.local_ms, served.agreed_ms) > 0


@pytest.mark.usefixtures("world_of_one")
def test_a_step_ratio_whose_halves_did_other_work_is_refused() -> None:
    """Only the first half served (the agreed one, which goes first): no ratio of that."""
    calls = itertools.count()
    trace = chat_trace(16)

    def first_only(cache: HiCache, chunk: Sequence[Key], poll: Callable[[], object]) -> None:
        if next(calls) == 0:
            serve_chat_trace(cache, chunk, poll)

    agreed = transitions(trace)  # one step of all 16
    differs = ", ".join(f"{event} {n} agreed, 0 local" for event, n in sorted(agreed.items()))
    with pytest.raises(UnequalWork) as refused:
        tpbench.compare_steps(bench_config, first_only, trace, settings(16), "small trace")
    assert str(refused.value) == (
        f"bench tp, small trace: on rank 0 the agreed replay applied other transitions than "
        f"the local one ({differs}), so their ratio would compare different work"
    )


def test_a_rank_that_raised_an_error_of_ours_is_that_error_typed(tmp_path: Path) -> None:
    (tmp_path / "rank1.error").write_text(
        json.dumps(["RankFailure", "rank 1 of 2: step agreement failed"])
    )
    failed = ProcessRaisedException("Traceback ...", 1, 4321)
    error = tpbench.rank_error(failed, tmp_path)
    assert isinstance(error, RankFailure)
    assert str(error) == (
        "bench tp: rank 1 failed: RankFailure: rank 1 of 2: step agreement failed"
    )
    (tmp_path / "rank1.error").write_text(json.dumps(["UnequalWork", "bench tp, t: ..."]))
    error = tpbench.rank_error(failed, tmp_path)
    assert isinstance(error, UnequalWork)
    assert str(error) == "bench tp, t: ..."


def test_a_rank_that_was_killed_is_a_rank_failure(tmp_path: Path) -> None:
    killed = ProcessExitedException(
        "process 1 terminated with signal SIGKILL", 1, 4321, -9, "SIGKILL"
    )
    error = tpbench.rank_error(killed, tmp_path)
    assert isinstance(error, RankFailure)
    assert str(error) == "bench tp: rank 1 failed: process 1 terminated with signal SIGKILL"


def test_a_rank_that_raised_anything_else_keeps_its_traceback(tmp_path: Path) -> None:
    """Not an error of ours: a defect, shown with the rank's traceback."""
    failed = ProcessRaisedException("Traceback ... AttributeError: x", 0, 4321)
    assert tpbench.rank_error(failed, tmp_path) is failed


def test_the_command_prints_a_failed_rank_as_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fsm-cache bench tp``: exit 2 and the typed error, no traceback, no figure."""
    from fsm_cache.cli.main import main

    def failing(ranks: int, **sizes: object) -> tpbench.TPBench:
        raise RankFailure("bench tp: rank 1 failed: process 1 terminated with signal SIGKILL")

    monkeypatch.setattr(tpbench, "run_tp_bench", failing)
    assert main(["bench", "tp", "--quick"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: bench tp: rank 1 failed: process 1 terminated with signal SIGKILL\n",
    )


def test_an_interrupted_run_ends_its_ranks_which_ignore_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C reached every rank, and each printed a traceback under ``interrupted``.

    The ranks ignore SIGINT (a rank still importing torch printed one too);
    the interrupted run ends them, by a signal, not with a traceback's 1.
    """
    seen: list[ProcessContext] = []

    def interrupted(ranked: ProcessContext, timeout: float | None = None) -> bool:
        del timeout
        seen.append(ranked)
        for delay in (0.0, 3.0):  # while the ranks start, then once they run
            time.sleep(delay)
            for process in ranked.processes:  # as a terminal's Ctrl-C reaches its whole group
                if process.is_alive():
                    os.kill(process.pid, signal.SIGINT)
        raise KeyboardInterrupt

    monkeypatch.setattr(ProcessContext, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tpbench.run_tp_bench(2, **tpbench.QUICK)
    (ranked,) = seen
    assert [process.is_alive() for process in ranked.processes] == [False, False]
    assert {process.exitcode for process in ranked.processes} <= {-signal.SIGINT, -signal.SIGTERM}
    assert [os.path.exists(name) for name in ranked.error_files] == [False, False]


def test_a_failed_rank_leaves_no_error_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keeps the error file of the rank that failed; a failed run left it in /tmp."""
    seen: list[ProcessContext] = []
    join = ProcessContext.join

    def joined(ranked: ProcessContext, timeout: float | None = None) -> bool:
        seen.append(ranked)
        return bool(join(ranked, timeout))

    monkeypatch.setattr(ProcessContext, "join", joined)
    with pytest.raises(RankFailure):
        tpbench.run_tp_bench(2, **tpbench.QUICK, timeout=0.0001)
    ranked = seen[0]
    assert all(other is ranked for other in seen)
    assert [os.path.exists(name) for name in ranked.error_files] == [False, False]
