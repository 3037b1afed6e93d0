#!/usr/bin/env bash
# Every check that needs a GPU, in one go on one GPU node (H100/H200, sm_90), in under 8 minutes; one
# PASS / FAIL / SKIP line each, and a summary. Exit status: the number of FAILs.
#
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh
#
# $PYTHON's environment holds a CUDA build of torch and requirements.txt (megatron-core, transformers, ...);
# transformer-engine and vLLM are used when installed (their checks SKIP otherwise). Nothing is installed.
# Checks: the CUDA kernels build and equal the PyTorch reference, and their speed; logit parity with
# transformers after conversion, with the transformer-engine layer spec; THD packed sequences against padded
# ones (bench/gpu_packing_check.py); PPO steps over NCCL at (1,1,1) and,
# with 2+ GPUs, TP2; vLLM rollout through the HybridEngine at rollout TP 1 (2 with 2+ GPUs), greedy tokens
# equal to transformers'. Logs go to build/gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" OMP_NUM_THREADS=4
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_ENABLE_V1_MULTIPROCESSING=0
LOGS=build/gpu-check
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$LOGS"
failures=0

# check NAME SECONDS COMMAND...: runs COMMAND with a time limit; PASS on exit 0, else FAIL with the log's tail.
check() {
    local name=$1 seconds=$2
    shift 2
    local log="$LOGS/$name.log" start=$SECONDS
    if timeout "$seconds" "$@" >"$log" 2>&1; then
        echo "PASS $name ($((SECONDS - start)) s)"
    else
        echo "FAIL $name (exit $?, $((SECONDS - start)) s; log $log):"
        tail -15 "$log" | sed 's/^/    /'
        failures=$((failures + 1))
    fi
}
skip() { echo "SKIP $1: $2"; }
has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

GPUS=$("$PYTHON" -c "import torch; assert torch.version.cuda, 'not a CUDA build of torch'; print(torch.cuda.device_count())") \
    || { echo "FAIL environment: $PYTHON has no CUDA build of torch"; exit 1; }
[ "$GPUS" -ge 1 ] || { echo "FAIL environment: no GPU visible"; exit 1; }
echo "torch with CUDA, $GPUS GPU(s): $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')"

# 1. Kernels: build for sm_90, compare with the reference (the tests run their CUDA cases on a GPU), time.
check kernels-build 170 "$PYTHON" setup.py build_ext --inplace
check kernels-vs-reference 90 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/test_ops.py tests/test_ops_vocab_parallel.py
check kernels-speed 60 "$PYTHON" bench/kernels.py --device cuda && sed 's/^/    /' "$LOGS/kernels-speed.log"

# Tiny models and their conversions at TP 1 (and 2), shared by the checks below.
"$PYTHON" - "$WORK" "$GPUS" >"$LOGS/prepare.log" 2>&1 <<'PY' || { echo "FAIL prepare (log $LOGS/prepare.log)"; exit 1; }
import sys
from pathlib import Path
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import write_rows
from verl_mega.models.tiny import make_tiny_hf_model
work, gpus = Path(sys.argv[1]), int(sys.argv[2])
for family in ("llama", "qwen2"):
    make_tiny_hf_model(work / family, family)
hf = make_tiny_hf_model(work / "hf", "qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
for tp in (1, 2) if gpus >= 2 else (1,):
    convert_hf_to_mcore(hf, work / f"ckpt_tp{tp}", tp=tp)
write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), work / "prompts.jsonl")
PY

# 2. Conversion parity with transformers, built with the transformer-engine layer spec (what GPU users train).
if has transformer_engine; then
    for family in llama qwen2; do
        check "te-parity-$family" 120 "$PYTHON" -m verl_mega.cli convert hf-to-mcore --hf "$WORK/$family" \
            --out "$WORK/te_$family" --verify
    done
    # THD packed micro-batches (actor.use_packed_sequences) against padded ones, and an update from them.
    check te-packed-sequences 120 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 bench/gpu_packing_check.py "$WORK"
else
    skip te-parity "transformer-engine is not installed"
    skip te-packed-sequences "transformer-engine is not installed"
fi

# 3. PPO steps over NCCL: GRPO on the tiny copy task, 2 steps, at (1,1,1) and TP2.
ppo() {
    "$PYTHON" -m verl_mega.cli launch local --nproc "$1" examples/grpo_demo.yaml "model.hf_path=$WORK/hf" \
        "data.train_files=[$WORK/prompts.jsonl]" "parallel.tp=$1" trainer.total_steps=2 "trainer.run_dir=$WORK/run_tp$1" \
        data.batch_size=8 actor.mini_batch_size=32 actor.micro_batch_size=8 &&
    "$PYTHON" -c "import json, math, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; assert len(rows) == 2; \
assert all(math.isfinite(r['actor/pg_loss']) for r in rows), rows" "$WORK/run_tp$1/metrics.jsonl"
}
check ppo-nccl-1gpu 150 ppo 1
if [ "$GPUS" -ge 2 ]; then check ppo-nccl-tp2 150 ppo 2; else skip ppo-nccl-tp2 "needs 2 GPUs"; fi

# 4. vLLM rollout through the HybridEngine: greedy equal to transformers', updates reach vLLM.
if has vllm; then
    check vllm-rollout-tp1 150 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 bench/gpu_rollout_check.py "$WORK" 1
    if [ "$GPUS" -ge 2 ]; then
        check vllm-rollout-tp2 150 "$PYTHON" -m torch.distributed.run --nproc-per-node 2 bench/gpu_rollout_check.py "$WORK" 2
    else
        skip vllm-rollout-tp2 "needs 2 GPUs"
    fi
else
    skip vllm-rollout "vLLM is not installed"
fi

echo "gpu_check: $failures failed"
exit "$failures"
