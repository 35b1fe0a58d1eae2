"""``fsm-cache bench vllm`` runs against the installed vLLM (figures only, no speed target)."""

from __future__ import annotations

import pytest

from fsm_cache.cli.main import main


def test_bench_vllm_prints_both_managers_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "CPUOffloadingManager vs fsm_cache's" in out
    for kind in ("lookup", "prepare_store", "complete_store", "prepare_load", "complete_load"):
        assert f"\n{kind} " in out
    assert "whole trace, per call" in out
    assert "target: ours <= 1.3x vLLM's per call:" in out
