#!/usr/bin/env bash
# One prepared check for a CUDA machine: install, run the gpu tests, print copy bandwidth.
#
# Usage (from the repository root): bash scripts/gpu_check.sh
# The machine has no network: the package is installed without dependencies and
# without build isolation (torch, pytest and hatchling must already be there);
# if that install fails, the checkout is put on PYTHONPATH instead.
# Budget: about 5 minutes in all; each step has its own timeout.
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
status=0

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available())' || exit 1

echo "== install"
if ! timeout 120 "$PY" -m pip install --quiet --no-deps --no-build-isolation -e .; then
    echo "pip install failed; using PYTHONPATH=$PWD"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== pytest -m gpu"
timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    -W ignore::pytest.PytestConfigWarning || status=1

echo "== copy bandwidth: 4096 pages of 16 tokens, 32 layers x 8 heads x 128, fp16 (8 GiB)"
timeout 90 "$PY" -m fsm_cache.bench.memory --reps 5 || status=1

echo "== machine-driven write-through vs raw gather-and-copy vs one pinned copy_ (fsm-cache bench copies)"
timeout 120 "$PY" -m fsm_cache.cli.main bench copies || status=1

echo "== copy bandwidth: small batch, 64 pages (128 MiB)"
timeout 30 "$PY" -m fsm_cache.bench.memory --pages 64 --reps 9 || status=1

exit "$status"
