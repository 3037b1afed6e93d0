#!/usr/bin/env bash
# The kernel benchmark on a GPU machine (H100/H200, sm_90), in one go and in under 5 minutes:
#   1. builds verl_mega._kernels and verl_mega._kernels_cuda in place for sm_90 (log in build/),
#   2. runs the kernel tests, which on a GPU also compare the CUDA kernels with the PyTorch reference,
#   3. runs bench/kernels.py --device cuda (GAE vs verl's loop; log-prob vs log_softmax+gather).
# Needs a CUDA build of torch in $PYTHON's environment and the CUDA toolkit that matches it (nvcc); it
# installs nothing. Set CUDA_HOME when nvcc is a wrapper (torch would guess the toolkit from its path).
#   PYTHON=.venv/bin/python CUDA_HOME=/usr/local/cuda bench/gpu_kernels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

"$PYTHON" - <<'PY'
import torch
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}")
PY

# Time limits per step, adding up to the 5 minutes.
mkdir -p build
log=build/gpu-kernels-build.log
time timeout 170 "$PYTHON" setup.py build_ext --inplace >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
"$PYTHON" -c "import verl_mega._kernels_cuda" \
    || { echo "verl_mega._kernels_cuda was not built (CUDA toolkit not found?):"; tail -40 "$log"; exit 1; }

OMP_NUM_THREADS=1 timeout 70 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/test_ops.py
timeout 60 "$PYTHON" bench/kernels.py --device cuda
