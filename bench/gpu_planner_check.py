"""The memory planner against `torch.cuda.max_memory_allocated`, in `bench/gpu_check.sh`'s throughput step
(`bench.gpu_throughput_check` calls it): its bf16 SFT run (one GPU, megatron's local layers, no transformer-engine)
logs `perf/max_memory_allocated_gb` each step (the CUDA allocator's peak, reset every step); the planner predicts
that step's `actor.update` phase from the same config and HF config.json (`attention="unfused"`, the local
layers' attention). PASS when the last step's measured peak is within TOLERANCE of the prediction.

What the comparison does not test: the rollout phases (no vLLM on the lent machine), flash attention, TP/PP/SP
and recompute (one GPU, the throughput run's settings). Its rows are ~1,010 tokens where the planner assumes the
full data.max_prompt_length + data.max_response_length (1,088): its activations are an upper bound by that much.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from verl_mega.config import load_config
from verl_mega.planning.memory import GIB, Model, layout_of, plan_memory
from verl_mega.trainer.plan import roles_of

TOLERANCE = 0.10  # the bound for the planner against measurement


def predicted_update_gb(config_file: Path, overrides: list[str], hf: Path) -> float:
    config = load_config(config_file, [f"model.hf_path={hf}", *overrides])
    plan = plan_memory(Model(config), layout_of(config, 1), roles_of(config), attention="unfused")
    return plan.phases["actor.update"].total_bytes / GIB


def describe(config_file: Path, overrides: list[str], model: dict, work: Path) -> str:
    """The dry run's line: the prediction (it needs only config.json) and what it would be compared with."""
    hf = work / "planner-dry-run-hf"
    AutoConfig.for_model("qwen2", **model).save_pretrained(hf)
    return (f"planner's actor.update peak for the throughput run: {predicted_update_gb(config_file, overrides, hf):.3f}"
            f" GiB; would compare with the last step's perf/max_memory_allocated_gb (PASS within "
            f"{100 * TOLERANCE:.0f} %)")


def compare(config_file: Path, overrides: list[str], hf: Path, metrics: Path) -> list[str]:
    """Print the last step's measured peak in `metrics` against the prediction; the misses."""
    measured = json.loads(metrics.read_text().splitlines()[-1])["perf/max_memory_allocated_gb"]
    predicted = predicted_update_gb(config_file, overrides, hf)
    ratio = measured / predicted
    print(f"bf16 SFT step on one GPU: torch.cuda.max_memory_allocated {measured:.3f} GiB, planner (actor.update, "
          f"unfused attention) {predicted:.3f} GiB: measured/predicted {ratio:.3f} (PASS within "
          f"{100 * TOLERANCE:.0f} %)")
    return [] if abs(ratio - 1) <= TOLERANCE else [f"planner: measured/predicted {ratio:.3f} is outside 1 +- {TOLERANCE}"]
