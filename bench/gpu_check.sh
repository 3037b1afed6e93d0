#!/usr/bin/env bash
# Every check that needs a GPU, in one go on one H100/H200 (sm_90) in under 8 minutes: one PASS / FAIL / SKIP
# line each with what it measured, and a summary. Exit status: the number of FAILs.
#
#   bash bench/gpu_kit.sh                      # here, with PyPI: the wheels the GPU machine lacks, into .whl/
#   PYTHON=python3 bash bench/gpu_check.sh     # there, from this tree (carrying .whl/)
#   bash bench/gpu_check.sh --dry-run          # anywhere (CI): every step, argument and file, nothing run
#
# $PYTHON holds a CUDA build of torch, transformers and nvcc's CUDA toolkit; nothing is fetched. Prepare:
# .whl/'s wheels (megatron-core and the pins the machine lacks) and this tree's package, its kernels built for
# sm_90 (setup.py maps converters/ and launch/ into verl_mega), install with `--target` into a temporary
# folder on PYTHONPATH; python runs with -P, so this tree's own verl_mega/ (no converters) is not imported.
# Checks, each a function of a bench/gpu_*.py module under its own timeout: the CUDA kernels built, equal to
# float64 and faster than log_softmax+gather and verl's GAE loop (gpu_kernels_check); PPO+GAE over NCCL
# against gloo on the CPU, and the embedded engine's greedy tokens against transformers' (gpu_ppo_check);
# bf16 step throughput and MFU, and that step's torch.cuda.max_memory_allocated against the memory planner's
# prediction (gpu_throughput_check, gpu_planner_check); with transformer-engine, conversion parity and THD
# packing (gpu_packing_check); with vLLM, rollout through the HybridEngine, in fp32 and in block FP8
# (gpu_rollout_check). Logs go to
# build/gpu-check/.
set -uo pipefail
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "FAIL environment: no ${PYTHON:-python3}"; exit 1; }
[[ "$PYTHON" == /* ]] || PYTHON=$PWD/$PYTHON  # the checks run from another folder
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
KIT=$REPO/.whl
LOGS=$REPO/build/gpu-check
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
KIT_SITE=$WORK/site-kit  # .whl/'s wheels
PKG_SITE=$WORK/site-pkg  # verl_mega from this tree, kernels included
export PYTHONPATH="$PKG_SITE:$KIT_SITE:$REPO" PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" OMP_NUM_THREADS=4
mkdir -p "$LOGS"
failures=0
started=$SECONDS

fail() {
    echo "FAIL $1"
    failures=$((failures + 1))
}

# run NAME SECONDS COMMAND...: COMMAND (an executable, never a shell function) under its own time limit, output
# in NAME's log; PASS with the measured lines, FAIL with the log's tail. --dry-run prints the command instead.
run() {
    local name=$1 seconds=$2
    shift 2
    local log="$LOGS/$name.log" start=$SECONDS
    if ((DRY_RUN)); then
        echo "DRY $name (limit $seconds s): $*"
        return
    fi
    if timeout "$seconds" "$@" >"$log" 2>&1; then
        echo "PASS $name ($((SECONDS - start)) s)"
        grep -v '^MISS ' "$log" | tail -12 | sed 's/^/    /'
    else
        fail "$name (exit $?, $((SECONDS - start)) s; log $log):"
        tail -15 "$log" | sed 's/^/    /'
    fi
}

# check NAME SECONDS MODULE ARGS...: python -P -m MODULE ARGS; under --dry-run the module runs with --dry-run
# (arguments parsed, files looked up, the comparisons and their bounds printed, no GPU).
check() {
    local name=$1 seconds=$2
    shift 2
    if ((DRY_RUN)); then
        echo "DRY $name (limit $seconds s): $PYTHON -P -m $*"
        "$PYTHON" -P -m "$@" --dry-run 2>&1 | sed 's/^/    /'
        ((PIPESTATUS[0] == 0)) || fail "$name: its dry run failed"
        return
    fi
    run "$name" "$seconds" "$PYTHON" -P -m "$@"
}

skip() { echo "SKIP $1: $2"; }
has() { "$PYTHON" -P -c "import $1" >/dev/null 2>&1; }

# The environment: a CUDA build of torch and a GPU (in a dry run: whatever torch is there), and whether
# setup.py's supported torch range holds it.
if ((DRY_RUN)); then
    echo "dry run: nothing is installed, built or run on a GPU; $PYTHON is $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
else
    GPUS=$("$PYTHON" -c "import torch; assert torch.version.cuda, 'not a CUDA build'; print(torch.cuda.device_count())") \
        || { echo "FAIL environment: $PYTHON has no CUDA build of torch"; exit 1; }
    ((GPUS >= 1)) || { echo "FAIL environment: no GPU visible"; exit 1; }
    echo "torch $("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name())'), $GPUS GPU(s)"
fi
TORCH_RANGE=$(grep -oE '"torch[<>=!~][^"]*"' setup.py | tr -d '"' | sed 's/^torch//')
"$PYTHON" -c "
import sys, torch
from packaging.specifiers import SpecifierSet
found = torch.__version__.split('+')[0]
if found in SpecifierSet(sys.argv[1]):
    print(f'torch {found} is inside setup.py\'s supported range torch{sys.argv[1]}')
else:
    print(f'NOTE torch {found} is outside setup.py\'s supported range torch{sys.argv[1]}, the range CI tests '
          '(requirements.txt pins its lower end): nothing has run this package on it but these checks, which '
          'use this tree without pip\'s range check, so their results hold for that torch only')
" "$TORCH_RANGE"

# Prepare 1: the kit's wheels (bench/gpu_kit.sh), installed without an index.
if ((DRY_RUN)); then
    echo "DRY kit (limit 30 s): $PYTHON -m pip install --no-index --no-deps --target $KIT_SITE .whl/*.whl; the pins:"
    bash bench/gpu_kit.sh --list | while read -r pin; do
        wheel=$(cd "$REPO" && compgen -G ".whl/$(echo "${pin%%==*}" | tr - _ | tr '[:upper:]' '[:lower:]')-${pin#*==}-*.whl" || true)
        echo "    $pin: ${wheel:-not in .whl/ here (bash bench/gpu_kit.sh downloads it)}"
    done
    ((PIPESTATUS[0] == 0)) || fail "kit: bench/gpu_kit.sh --list failed"
elif compgen -G "$KIT/*.whl" >/dev/null; then
    run kit 30 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$KIT_SITE" \
        "$KIT"/*.whl
else
    fail "kit: no wheels in .whl/: run bash bench/gpu_kit.sh where PyPI is reachable and carry .whl"
fi

# Prepare 2: this tree's package and its kernels (a missing nvcc builds no CUDA kernels: kernels-build fails).
for file in setup.py csrc/cuda_bindings.cpp csrc/token_logprobs_cuda.cu csrc/gae_cuda.cu examples/ppo_gae_demo.yaml \
    examples/sft_demo.yaml bench/gpu_reward.py; do
    [[ -f "$file" ]] || fail "prepare: $file is missing"
done
# setup.py's metadata and extensions are read in a dry run too (cheap: nothing is compiled).
((DRY_RUN)) && { "$PYTHON" setup.py -q --name >/dev/null 2>&1 || fail "package: setup.py does not load"; }
run package 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$PKG_SITE" \
    "$REPO"
run imports 20 "$PYTHON" -P -c "import verl_mega.cli, verl_mega.converters, megatron.core, transformers; \
print('verl_mega from', verl_mega.__file__, '| megatron-core', megatron.core.__version__, '| transformers', \
transformers.__version__)"

# The checks run from the work folder: a child started with `python -m` (torchrun's) puts its working folder
# first on sys.path, and this tree's verl_mega/ would shadow the built one.
cd "$WORK" || exit 1

# 1. The CUDA kernels: built, against float64, and their speed.
check kernels-build 15 bench.gpu_kernels_check build
check kernels-parity 30 bench.gpu_kernels_check parity
check kernels-speed 30 bench.gpu_kernels_check speed

# 2. PPO + GAE at (1,1,1): NCCL against gloo on the CPU, and the embedded engine against transformers.
mkdir -p "$WORK/ppo" "$WORK/throughput"
check ppo-nccl-vs-gloo 140 bench.gpu_ppo_check "$WORK/ppo"

# 3. bf16 throughput of a training step and its MFU.
check throughput-bf16 90 bench.gpu_throughput_check "$WORK/throughput"

# 4. transformer-engine and vLLM: GPU wheels far over the 64 MiB that travel to the lent machine (which has
# neither, so these SKIP there); they run where those are installed (docker/Dockerfile's image, a user's node).
if has transformer_engine || has vllm; then
    run tiny-models 60 "$PYTHON" -P -m bench.gpu_tiny_models "$WORK"
fi
if has transformer_engine; then
    for family in llama qwen2; do
        run "te-parity-$family" 120 "$PYTHON" -P -m verl_mega.cli convert hf-to-mcore --hf "$WORK/$family" \
            --out "$WORK/te_$family" --verify
    done
    run te-packed-sequences 120 "$PYTHON" -P -m torch.distributed.run --nproc-per-node 1 "$REPO/bench/gpu_packing_check.py" "$WORK"
else
    skip te-parity "transformer-engine is not installed (its wheels are far over the 64 MiB that travel)"
    skip te-packed-sequences "transformer-engine is not installed"
fi
if has vllm; then
    run vllm-rollout-tp1 150 "$PYTHON" -P -m torch.distributed.run --nproc-per-node 1 "$REPO/bench/gpu_rollout_check.py" "$WORK" 1
    run vllm-rollout-fp8 150 "$PYTHON" -P -m torch.distributed.run --nproc-per-node 1 "$REPO/bench/gpu_rollout_check.py" "$WORK" 1 fp8
else
    skip vllm-rollout "vLLM is not installed (its GPU wheels are far over the 64 MiB that travel)"
fi

echo "gpu_check: $failures failed ($((SECONDS - started)) s)"
exit "$failures"
