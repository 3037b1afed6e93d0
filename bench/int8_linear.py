"""The int8 rollout's linear layers against fp32, at the ~100M model's shapes (bench/vs_trl.py's LLAMA_100M).

    python -m bench.int8_linear [--rows 32] [--rounds 20] [--threads 1]
    python -m bench.int8_linear --rollout [--rounds 3] [--threads 1]

Per projection of a decoder layer (q, k, v, o, gate, up, down) and for the whole layer's seven: the median time of
the embedded engine's fp32 `torch.nn.Linear` and of its `Int8Linear` (oneDNN s8 GEMM, per-token dynamic
activation quantization included) on the same input, `--rows` rows (32: a decode step of bench.vs_trl's 32
sequences; 2048: their prefill). fp32 and int8 calls alternate call by call within each round, so a busy
neighbour slows both alike; the ratio int8 / fp32 is the median over rounds of the per-round ratio. On a shared
machine the figures are indicative only: rerun on an idle one for the issue's record.

--rollout: the whole generation instead, the embedded engine in fp32 and in int8 on the same random ~100M
weights, bench.vs_trl's rollout (8 prompts of 64 tokens x 4 samples, 32 new tokens, no early stop), the two
engines alternating round by round; the median of the per-round ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.vs_trl import LLAMA_100M
from verl_mega.rollout.int8_linear import Int8Linear
from verl_mega.rollout.quantization import quantize_int8


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a Llama decoder layer."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}


def int8_twin(linear: torch.nn.Linear) -> Int8Linear:
    layer = Int8Linear.replacing(linear)
    q, scale = quantize_int8(linear.weight)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    return layer


def timed(layer: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls


def rollout_ratio(rounds: int) -> str:
    """bench.vs_trl's ~100M rollout in the embedded engine, fp32 and int8 alternating (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.vs_trl import PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, SCALES
    from verl_mega.rollout.embedded import EmbeddedEngine
    from verl_mega.rollout.engine import SamplingParams
    from verl_mega.rollout.quantization import quantized_stream

    # No EOS: every row decodes the full length in both engines.
    raw = {**AutoConfig.for_model("llama", **LLAMA_100M).to_dict(), "eos_token_id": None}
    weights = list(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_100M)).state_dict().items())
    engines = {"fp32": EmbeddedEngine(raw, device="cpu"), "int8": EmbeddedEngine(raw, device="cpu", quantization="int8")}
    engines["fp32"].load_weights(weights)
    engines["int8"].load_weights(quantized_stream(weights, "int8"))
    settings = SCALES["llama100m"]
    prompts = torch.randint(0, LLAMA_100M["vocab_size"], (PROMPTS_PER_STEP, settings["max_prompt_length"])).tolist()
    params = SamplingParams(max_new_tokens=settings["max_new_tokens"], n=SAMPLES_PER_PROMPT, seed=0, logprobs=True)
    seconds = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, params)
            seconds[name].append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(seconds["fp32"], seconds["int8"]))
    return (f"~100M rollout, {PROMPTS_PER_STEP} x {SAMPLES_PER_PROMPT} sequences, {settings['max_new_tokens']} new "
            f"tokens, {rounds} interleaved rounds: fp32 {statistics.median(seconds['fp32']):.2f} s, int8 "
            f"{statistics.median(seconds['int8']):.2f} s, int8/fp32 {ratio:.2f} (speed-up {1 / ratio:.2f}x)")


def main(argv=None) -> None:
    """The linears' table; with --rollout, the whole generation's ratio instead."""
    parser = argparse.ArgumentParser(prog="bench.int8_linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout", action="store_true", help="the whole ~100M rollout instead of its linears")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="calls per timing")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.rollout:
        print(rollout_ratio(args.rounds))
        return
    pairs = {}
    for name, (fan_in, fan_out) in projections(LLAMA_100M).items():
        linear = torch.nn.Linear(fan_in, fan_out, bias=False)
        pairs[name] = (linear, int8_twin(linear), torch.randn(args.rows, fan_in))
    times = {name: ([], []) for name in pairs}
    with torch.no_grad():
        for layers in pairs.values():  # warm-up: first calls allocate and JIT oneDNN primitives
            timed(layers[0], layers[2], 2), timed(layers[1], layers[2], 2)
        for _ in range(args.rounds):
            for name, (fp32, int8, x) in pairs.items():
                times[name][0].append(timed(fp32, x, args.calls))
                times[name][1].append(timed(int8, x, args.calls))
    print(f"~100M decoder layer (hidden {LLAMA_100M['hidden_size']}, ffn {LLAMA_100M['intermediate_size']}), "
          f"{args.rows} rows, {args.threads} thread(s), {args.rounds} interleaved rounds x {args.calls} calls")
    print(f"{'linear':<10} {'fp32 ms':>9} {'int8 ms':>9} {'int8/fp32':>10}")
    layer_fp32 = [sum(times[name][0][r] for name in pairs) for r in range(args.rounds)]
    layer_int8 = [sum(times[name][1][r] for name in pairs) for r in range(args.rounds)]
    for name, (fp32, int8) in [*times.items(), ("layer", (layer_fp32, layer_int8))]:
        ratio = statistics.median(b / a for a, b in zip(fp32, int8))
        print(f"{name:<10} {1e3 * statistics.median(fp32):>9.3f} {1e3 * statistics.median(int8):>9.3f} {ratio:>10.2f}")


if __name__ == "__main__":
    main()
