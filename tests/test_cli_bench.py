"""``fsm-cache bench``: a flag that the chosen benchmark does not take is refused, not ignored."""

from __future__ import annotations

import argparse

import pytest

from fsm_cache.cli import bench
from fsm_cache.cli.main import main


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """Stand in for the benchmarks: record the arguments each run got, measure nothing."""
    runs: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        runs.append(args)
        return 0

    monkeypatch.setattr(bench, "_run", record)
    return runs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["engine", "--pages", "5"], "bench engine does not take --pages (storage only)"),
        (["--reps", "2"], "bench engine does not take --reps (storage only)"),
        (
            ["copies", "--pages", "5", "--reps", "2"],
            "bench copies does not take --pages (storage only), --reps (storage only)",
        ),
        (["cache", "--pages", "1"], "bench cache does not take --pages (storage only)"),
        (["storage", "--against", "sglang"], "bench storage does not take --against (cache only)"),
        (["tp", "--against", "baseline"], "bench tp does not take --against (cache only)"),
    ],
)
def test_a_flag_of_another_benchmark_is_refused_before_anything_runs(
    ran: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    assert main(["bench", *argv]) == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")
    assert ran == []


@pytest.mark.parametrize(
    "argv",
    [
        ["engine", "--quick"],
        ["cache", "--against", "sglang", "--quick"],
        ["storage", "--pages", "2", "--reps", "1"],
    ],
)
def test_the_flags_a_benchmark_takes_reach_it(
    ran: list[argparse.Namespace], argv: list[str]
) -> None:
    assert main(["bench", *argv]) == 0
    assert [args.what for args in ran] == [argv[0]]


def test_help_says_which_benchmarks_take_each_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--against {baseline,sglang} cache only:" in text
    assert "--pages PAGES storage only:" in text
    assert "--reps REPS storage only:" in text


@pytest.mark.parametrize("what", ["vllm", "sglang"])
def test_a_server_whose_code_moved_is_one_error_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """An installed release without a name the benchmark imports: exit 2, nothing measured."""
    from fsm_cache.bench import sglang as sglangbench
    from fsm_cache.bench import vllm as vllmbench

    def moved(**sizes: object) -> object:
        raise ImportError("cannot import name 'RadixKey' from 'sglang.srt.mem_cache.radix_key'")

    monkeypatch.setattr(sglangbench, "run_sglang_bench", moved)
    monkeypatch.setattr(vllmbench, "run_vllm_bench", moved)
    assert main(["bench", what, "--quick"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: cannot import name 'RadixKey' from 'sglang.srt.mem_cache.radix_key'\n",
    )


@pytest.mark.parametrize(
    "argv", [["sglang"], ["cache", "--against", "sglang"]], ids=["sglang", "against"]
)
def test_a_bench_of_sglang_without_sglang_says_how_to_run_it(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """It said only ``sglang is not an installed package``, where ``bench vllm`` names its make target."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here; tests/sglang_real runs the benchmarks")
    assert main(["bench", *argv, "--quick"]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: fsm-cache bench {' '.join(argv)} needs SGLang's RadixCache importable "
        "(sglang is not an installed package); in this repository run `make bench-sglang`\n",
    )
