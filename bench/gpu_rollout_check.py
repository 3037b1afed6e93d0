"""vLLM rollout through the HybridEngine on GPUs, for `bench/gpu_check.sh`:

    python -m torch.distributed.run --nproc-per-node N bench/gpu_rollout_check.py WORK ROLLOUT_TP [fp8]

The actor's megatron shards (TP = N, WORK/ckpt_tpN) stream into vLLM at ROLLOUT_TP; greedy tokens must equal
transformers' on the same HF weights (float32 on both sides, so that the comparison is exact), an update
must reach vLLM, and reloading the first weights must bring the first generations back. With fp8
(`rollout.quantization`), the stream carries block-FP8 weights and vLLM runs its FP8 layers in bf16: instead of
equal tokens, transformers' fp32 log-probs of vLLM's greedy tokens must be within FP8_MEAN_K3 (mean k3) of vLLM's.
"""
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.config.schema import OffloadConfig
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.rollout.engine import SamplingParams
from verl_mega.rollout.factory import make_rollout_engine
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.training_memory import training_memory_released

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
NEW_TOKENS = 16
FP8_MEAN_K3 = 0.05  # far above fp8 weights and activations' rounding (tests/test_fp8_rollout_seam.py: 3 % per layer)


def main(work: str, rollout_tp: int, quantization: str = "none") -> None:
    layout = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    model, _, hf_config, family = build_model_from_checkpoint(f"{work}/ckpt_tp{layout.tp}")
    # fp32 on both sides, so greedy tokens can be compared with fp32 transformers; vLLM's FP8 layers take bf16.
    dtype = torch.float32 if quantization == "none" else torch.bfloat16
    hybrid = HybridEngine(model, hf_config, family, rollout_tp=rollout_tp, dtype=dtype, measure_peak=True,
                          quantization=quantization)
    rollout = make_rollout_engine("vllm", f"{work}/hf", hf_config.raw, hybrid.feed, max_model_len=64,
                                  dtype=dtype, quantization=quantization)
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, logprobs=quantization != "none")
    original = [p.detach().clone() for p in model.parameters()]

    def transition_and_generate(label):
        rollout.sleep()
        start = time.perf_counter()
        rollout.wake_up(["weights"])
        loaded = rollout.load_weights(hybrid.stream())
        rollout.wake_up(["kv_cache"])
        seconds = time.perf_counter() - start
        with training_memory_released(model, None, OffloadConfig()):
            responses = rollout.generate(PROMPTS, params)
        if layout.rank == 0:
            print(f"{label}: {loaded} tensors in {seconds:.3f} s, peak transfer buffers {hybrid.tracker.peak} B",
                  flush=True)
        if quantization != "none":
            check_fp8_logprobs(responses, label)
        return [r.token_ids for r in responses]

    reference = AutoModelForCausalLM.from_pretrained(f"{work}/hf", dtype=torch.float32).cuda().eval()

    def check_fp8_logprobs(responses, label):
        """transformers' fp32 log-probs of vLLM's tokens, by teacher forcing, against vLLM's own (on the first
        weights only: the reference holds those)."""
        if label != "load":
            return
        k3 = []
        for prompt, response in zip(PROMPTS, responses):
            ids = torch.tensor([prompt + response.token_ids], device="cuda")
            with torch.no_grad():
                logits = reference(ids).logits[0, len(prompt) - 1:-1].float()
            train = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0].double().cpu()
            log_ratio = train - torch.tensor(response.logprobs, dtype=torch.float64)
            k3.append(log_ratio.exp() - 1 - log_ratio)
        mean_k3 = torch.cat(k3).mean().item()
        if layout.rank == 0:
            print(f"fp8 rollout: mean k3 {mean_k3:.3g} against transformers fp32 (limit {FP8_MEAN_K3})", flush=True)
        assert mean_k3 < FP8_MEAN_K3, f"fp8 rollout's log-probs are off fp32 by mean k3 {mean_k3}"

    first = transition_and_generate("load")
    if quantization == "none":
        expected = []
        for prompt in PROMPTS:
            out = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
        assert [tokens[:len(e)] for tokens, e in zip(first, expected)] == expected, \
            f"vLLM greedy {first} differs from transformers' {expected}"
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    moved = transition_and_generate("update (moved weights)")
    with torch.no_grad():
        for param, saved in zip(model.parameters(), original):
            param.copy_(saved)
    back = transition_and_generate("update (first weights again)")
    assert moved != first, "the update did not reach vLLM: generations unchanged"
    assert back == first, f"reloading the first weights did not restore the generations: {back} vs {first}"
    rollout.close()
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
