#!/usr/bin/env bash
# vLLM rollout on one GPU (H200) with weights streamed from the megatron actor: an initial load and two
# weight updates, each `sleep -> wake_up(weights) -> load_weights(stream) -> wake_up(kv_cache) -> generate`.
# Checks that an update changes the generations and that reloading the first weights brings them back.
# Usage: bash bench/gpu_rollout.sh [PYTHON]   (needs vLLM and a CUDA torch; about 2-3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=4

"$PY" -c "import vllm, torch; assert torch.cuda.is_available(), 'no CUDA device'; print('vllm', vllm.__version__)"

"$PY" - "$WORK" <<'PREP'
import sys
from pathlib import Path
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
work = Path(sys.argv[1])
make_tiny_hf_model(work / "hf", "qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
convert_hf_to_mcore(work / "hf", work / "ckpt", tp=1, pp=1)
PREP

cat > "$WORK/rollout_worker.py" <<'WORKER'
import sys, time
import torch
from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.parallel.state import init_parallel, destroy_parallel
from verl_mega.rollout.engine import SamplingParams
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.training_memory import training_memory_released
from verl_mega.rollout.vllm_engine import VLLMEngine

work = sys.argv[1]
init_parallel(1, 1)
model, _, cfg, family = build_model_from_checkpoint(f"{work}/ckpt")
hybrid = HybridEngine(model, cfg, family, rollout_tp=1)
rollout = VLLMEngine(f"{work}/hf", rollout_tp=1, rollout_tp_rank=hybrid.rollout_tp_rank, dtype="bfloat16",
                     gpu_memory_utilization=0.3, max_model_len=256)
prompts = [[5, 6, 7, 8], [9, 10, 11]]
params = SamplingParams(temperature=0, max_new_tokens=16)
original = [p.detach().clone() for p in model.parameters()]


def transition_and_generate(label):
    rollout.sleep(level=1)
    start = time.perf_counter()
    rollout.wake_up(["weights"])
    loaded = rollout.load_weights(hybrid.stream())
    rollout.wake_up(["kv_cache"])
    seconds = time.perf_counter() - start
    with training_memory_released(model):
        responses = rollout.generate(prompts, params)
    print(f"{label}: {loaded} tensors in {seconds:.3f} s, peak transfer buffers {hybrid.tracker.peak} B, "
          f"first response {responses[0].token_ids}", flush=True)
    return [r.token_ids for r in responses]


first = transition_and_generate("load")
with torch.no_grad():
    for param in model.parameters():
        param.add_(torch.randn_like(param) * 0.5)
moved = transition_and_generate("update 1 (moved weights)")
with torch.no_grad():
    for param, saved in zip(model.parameters(), original):
        param.copy_(saved)
back = transition_and_generate("update 2 (first weights again)")
assert moved != first, "the update did not reach vLLM: generations unchanged"
assert back == first, f"reloading the first weights did not restore the generations: {back} vs {first}"
print("gpu rollout: OK")
destroy_parallel()
WORKER

timeout 290 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29561 \
    "$WORK/rollout_worker.py" "$WORK"
