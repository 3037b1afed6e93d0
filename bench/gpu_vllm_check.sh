#!/usr/bin/env bash
# The vLLM rollout tests on a GPU machine: the same tests as on CPU (tests/test_vllm_rollout.py), run on
# CUDA because torch sees it, with vLLM's GPU build. Those needing more GPUs than present skip and say so
# (the rollout TP 2 / 4-process ones want 2 / 4 GPUs). Fold into bench/gpu_check.sh as one step.
# Usage: bash bench/gpu_vllm_check.sh [PYTHON]   (needs `pip install vllm` with a CUDA torch; a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; print('vllm', vllm.__version__, 'on', torch.cuda.device_count(), 'GPU(s)')"
VERL_MEGA_REQUIRE_VLLM=1 OMP_NUM_THREADS=4 timeout 900 "$PY" -m pytest -q -rs tests/test_vllm_rollout.py
