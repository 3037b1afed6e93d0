"""What partial rollouts cost: response tokens/s of `PartialRollout` at several chunk sizes against one `generate`
call of the same engine, weights, prompts and sampling.

A chunked rollout pays twice: every chunk prefills its sequences' prompt + tokens so far again (one call decodes
from its KV cache), and a step makes one call per sample slot (n calls of the prompts, where one call shares each
prompt's prefill among its n samples; see rollout/partial.py, "Seeds"). Chunk size = max_new_tokens shows the
second cost alone. A random model of the tests' family at a real-ish shape (hidden 512, 8 layers), the embedded
engine on whatever device torch sees; tokens/s counts the response tokens generated (all stop at EOS), per
second of this process's CPU time (on a shared machine wall time measures the other processes too; the wall
seconds are printed beside it).

    python -m bench.partial_chunks [--prompts 8] [--samples 4] [--new-tokens 64] [--chunks 64,32,16,8] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.engine import SamplingParams
from verl_mega.rollout.partial import PartialRollout

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512)


def timed(run, repeats: int) -> tuple[float, float, int]:
    """Median CPU and wall seconds of `run()` over `repeats` after one warm-up, and the response tokens it
    generated."""
    tokens = run()
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return statistics.median(cpu), statistics.median(wall), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunks", default="64,32,16,8")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        hf_dir = make_tiny_hf_model(Path(folder) / "model", "qwen2", **SHAPE)
        raw = HFModelConfig.read_raw(hf_dir)
        engine = EmbeddedEngine(raw, device="cpu" if not torch.cuda.is_available() else None)
        reader = SafetensorsReader(hf_dir)
        engine.load_weights((name, reader.read(name)) for name in reader.names())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 250, (16 + 4 * i,), generator=generator).tolist() for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, seed=1, logprobs=True)

    def one_call() -> int:
        return sum(len(r.token_ids) for r in engine.generate(prompts, params))

    def chunked(chunk: int) -> int:
        rollout = PartialRollout(engine, params, chunk, eos_token_ids=[raw["eos_token_id"]])
        rollout.start(prompts, version=0)
        generated = 0
        while rollout.in_flight():
            generated += sum(len(r.token_ids) for r in rollout.step())
        return generated

    print(f"{args.prompts} prompts x {args.samples} samples, up to {args.new_tokens} new tokens, "
          f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    cpu, wall, tokens = timed(one_call, args.repeats)
    print("| run | CPU seconds | wall seconds | response tokens | tokens per CPU second | vs one call |\n"
          "| --- | --- | --- | --- | --- | --- |")
    print(f"| one call | {cpu:.2f} | {wall:.2f} | {tokens} | {tokens / cpu:.0f} | 1.00x |")
    for chunk in (int(c) for c in args.chunks.split(",")):
        chunk_cpu, chunk_wall, chunk_tokens = timed(lambda: chunked(chunk), args.repeats)
        print(f"| chunks of {chunk} | {chunk_cpu:.2f} | {chunk_wall:.2f} | {chunk_tokens} | "
              f"{chunk_tokens / chunk_cpu:.0f} | {(chunk_tokens / chunk_cpu) / (tokens / cpu):.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
