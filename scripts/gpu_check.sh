#!/usr/bin/env bash
# One prepared check for a CUDA machine: install, run the gpu tests, measure the copies.
#
# Usage (from the repository root): bash scripts/gpu_check.sh
# The machine has no network: the package is installed without dependencies and
# without build isolation (torch, pytest and hatchling must already be there);
# if that install fails, the checkout is put on PYTHONPATH instead.
# With $OUT set (a folder), the whole report is also written to $OUT/gpu_check.txt
# (complete: the script waits for it to be written before it exits).
# Budget: each step has its own timeout,
# and at most 540 s in all (120 install + 150 tests + 90 + 30 + 150 benchmarks).
#
# It fails at once where CUDA is not available, and where a gpu test skips.
# The figure to read is the last section: backups (device to host) and load-backs
# (host to device) driven through the residency machines, each as a share of one
# large pinned copy_ of the same bytes in the same direction, in the same run
# (target >= 85% both ways, reported as met or MISSED, not a failure). That step
# fails if one round trip (backup, evict, load back) did not bring back the same bytes.
set -uo pipefail

cd "$(dirname "$0")/.."
tee_pid=
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    exec > >(tee "$OUT/gpu_check.txt") 2>&1
    tee_pid=$!
fi
# Exit with $1 once tee has written everything (the figures are the last lines).
finish() {
    if [ -n "$tee_pid" ]; then
        exec >&- 2>&-
        wait "$tee_pid" 2>/dev/null
    fi
    exit "$1"
}
# python3 first: on the CUDA image it is the interpreter that holds torch.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
status=0

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available())' || finish 1
# Everything below checks the CUDA path: without CUDA the gpu tests would skip and the
# benchmarks run on the CPU, and the check would pass having checked nothing.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "FAIL: CUDA is not available: this check is meant for a machine with a GPU"
    finish 1
fi

echo "== install"
if ! timeout 120 "$PY" -m pip install --quiet --no-deps --no-build-isolation -e .; then
    echo "pip install failed; using PYTHONPATH=$PWD"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# Only the modules that hold gpu tests: others import packages the image lacks (fakeredis,
# redis, transitions, mypy), and their collection errors would fail the step.
# FSM_CACHE_REQUIRE_GPU=1 (tests/conftest.py): a gpu test that skips fails here.
echo "== pytest -m gpu"
mapfile -t gpu_tests < <(grep -l 'pytest\.mark\.gpu' tests/test_*.py)
FSM_CACHE_REQUIRE_GPU=1 timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    -W ignore::pytest.PytestConfigWarning "${gpu_tests[@]}" || status=1

echo "== the copy engine alone: 4096 pages of 16 tokens, 32 layers x 8 heads x 128, fp16 (8 GiB)"
timeout 90 "$PY" -m fsm_cache.bench.memory --reps 5 || status=1

echo "== the copy engine alone: small batch, 64 pages (128 MiB)"
timeout 30 "$PY" -m fsm_cache.bench.memory --pages 64 --reps 9 || status=1

echo "== through the machines, both directions, against one large pinned copy_ (fsm-cache bench copies)"
timeout 150 "$PY" -m fsm_cache bench copies || status=1

finish "$status"
