"""bf16 training-step throughput on one GPU and its MFU against the chip's measured bf16 GEMM rate, for
`bench/gpu_check.sh`.

    python -m bench.gpu_throughput_check WORK [--dry-run]

The rate: an 8192^3 bf16 matrix product (the mean of 10 after 3 warm-ups), the ceiling a training step's
GEMMs can reach on this chip. The step: `verl-mega launch local --nproc 1` of an SFT job in bf16 on a 4-layer,
hidden-2048 Qwen2 (0.27 B parameters, vocabulary 32,768, initialised at transformers' 0.02 so that bf16 stays
finite) at 32 rows x 1,024 tokens per step; the last of STEPS steps is read from metrics.jsonl (the first ones
warm up). FLOPs per token: 6 x the parameters every token multiplies (the LM head included, the embedding
lookup not) + 6 x layers x sequence x hidden for causal attention (forward QK^T and AV, backward twice that).
MFU = tokens/s x FLOPs per token / the measured rate. PASS at MFU >= MFU_GOAL, and with the run's
perf/max_memory_allocated_gb within bench.gpu_planner_check's tolerance of the memory planner's prediction.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import gpu_planner_check
from bench.gpu_ppo_check import cli
from verl_mega.data.tables import write_rows
from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "sft_demo.yaml"
GEMM_SIZE = 8192
MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=16, max_position_embeddings=2048, vocab_size=32768, tie_word_embeddings=True)
ROWS, PROMPT_CHARS, RESPONSE_CHARS = 32, 500, 500  # the tiny tokenizer has a token per character
STEPS = 4
# Megatron's local layer spec (no transformer-engine on the lent machine: unfused attention) on a small model,
# with the optimizer step and the batch's preparation in the step time; a floor, not a target.
MFU_GOAL = 0.15
OVERRIDES = [f"trainer.total_steps={STEPS}", "model.dtype=bf16", f"data.batch_size={ROWS}",
             f"actor.mini_batch_size={ROWS}", "actor.micro_batch_size=8", "data.max_prompt_length=544",
             "data.max_response_length=544", "data.truncation=error", "trainer.val_every=0",
             "trainer.tensorboard=false", "actor.optim.lr=1e-5"]


def measured_gemm_flops() -> float:
    """bf16 FLOP/s of an GEMM_SIZE^3 product on the current GPU, timed with CUDA events."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * GEMM_SIZE**3 * 10 / (start.elapsed_time(end) / 1e3)


def make_model(out: Path) -> tuple[Path, int]:
    """The HF folder of the benchmark model and the parameters each token multiplies."""
    tokenizer = build_tiny_tokenizer()
    config = AutoConfig.for_model("qwen2", pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, matmul_parameters(model)


def matmul_parameters(model) -> int:
    """Parameters of the matrices every token multiplies: the 2-D weights but the embedding table, plus the LM
    head (the embedding table again when tied)."""
    embedding = model.get_input_embeddings().weight
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embedding)
    return matrices + embedding.numel()


def make_rows(out: Path) -> Path:
    generator = torch.Generator().manual_seed(0)

    def text(chars):
        return "".join(str(int(d)) for d in torch.randint(0, 10, (chars,), generator=generator))

    rows = [{"prompt": [{"role": "user", "content": text(PROMPT_CHARS)}], "response": text(RESPONSE_CHARS)}
            for _ in range(ROWS)]
    return Path(write_rows(rows, out))


def train_command(hf: Path, rows: Path, run_dir: Path) -> list[str]:
    return ["launch", "local", "--nproc", "1", str(CONFIG),
            f"model.hf_path={hf}", f"data.train_files=[{rows}]", f"trainer.run_dir={run_dir}", *OVERRIDES]


def flops_per_token(parameters: int, sequence: float) -> float:
    return 6 * parameters + 6 * MODEL["num_hidden_layers"] * sequence * MODEL["hidden_size"]


def run(work: Path) -> list[str]:
    rate = measured_gemm_flops()
    print(f"bf16 GEMM {GEMM_SIZE}^3: {rate / 1e12:.0f} TFLOP/s on {torch.cuda.get_device_name()}")
    hf, parameters = make_model(work / "hf")
    rows, run_dir = make_rows(work / "rows.jsonl"), work / "run"
    cli(work / "children.log", *train_command(hf, rows, run_dir))
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    tokens_per_second = last["perf/tokens_per_second"]
    sequence = tokens_per_second * last["perf/step_seconds"] / ROWS
    mfu = tokens_per_second * flops_per_token(parameters, sequence) / rate
    print(f"bf16 SFT step ({parameters / 1e9:.2f} B matmul parameters, {ROWS} x {sequence:.0f} tokens): "
          f"{last['perf/step_seconds']:.3f} s, {tokens_per_second:,.0f} tokens/s, MFU {100 * mfu:.1f} % of the "
          f"measured GEMM rate (goal >= {100 * MFU_GOAL:.0f} %)")
    misses = [] if mfu >= MFU_GOAL else [f"MFU {100 * mfu:.1f} % < {100 * MFU_GOAL:.0f} %"]
    return misses + gpu_planner_check.compare(CONFIG, OVERRIDES, hf, run_dir / "metrics.jsonl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, help="an empty folder for the model, data and run")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        command = train_command(args.work / "hf", args.work / "rows.jsonl", args.work / "run")
        print(f"would measure the bf16 GEMM rate at {GEMM_SIZE}^3 and run verl-mega {' '.join(command)}")
        print(f"would report tokens/s and MFU of step {STEPS}; goal MFU >= {100 * MFU_GOAL:.0f} %")
        print(gpu_planner_check.describe(CONFIG, OVERRIDES, MODEL, args.work))
        assert CONFIG.is_file(), CONFIG
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    misses = run(args.work)
    for miss in misses:
        print(f"MISS {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
