"""vLLM with LoRA: merged weights streamed into a plain engine, against the adapters handed to vLLM's LoRA support.

    python bench/lora_rollout.py [--out DIR] [--rounds 3]      (DIR must not exist yet)

For a tiny and a mid-sized random Qwen2 (rank-4 adapters on all four linears), each mode runs in its own
one-process torchrun launch: `merged` builds vLLM's engine, then per round loads the merged weights
(`VLLMEngine.load_weights`, what a HybridEngine transition ends in) and generates; `lora` builds the engine with
`enable_lora` and per round generates under a new `LoRARequest` (a new adapter each transition, as training
moves it). Printed: the engine start and each round's seconds (load + generate: 16 prompts x 32 tokens, greedy).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench import with_repo_on_path

SIZES = {"tiny": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                      intermediate_size=128),
         "mid": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=8,
                     intermediate_size=1408)}
RANK, ALPHA = 4, 8.0
PROMPTS, NEW_TOKENS, MAX_LEN = [[5, 6, 7, 8, 9, 10, 11, 12]] * 16, 32, 128


def make_folders(root: Path, size: str) -> Path:
    """root/size/{hf, ckpt, peft, merged}: the base, its conversion, random adapters as PEFT and merged."""
    from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.converters.lora_export import Adapters, hf_adapters, merged_hf_tensors, write_peft_folder
    from verl_mega.converters.mcore_to_hf import iter_checkpoint_hf_tensors, write_hf_model
    from verl_mega.models import load_hf_model_config
    from verl_mega.models.expected_shapes import mcore_shape
    from verl_mega.models.sharding import rank_slots
    from verl_mega.models.tiny import make_tiny_hf_model

    folder = root / size
    hf = make_tiny_hf_model(folder / "hf", "qwen2", **SIZES[size])
    convert_hf_to_mcore(hf, folder / "ckpt")
    manifest, assets = Manifest.read(folder / "ckpt"), folder / "ckpt" / HF_ASSETS_DIR
    hf_config, family = load_hf_model_config(hf)
    generator, tensors = torch.Generator().manual_seed(0), {}
    for slot in rank_slots(hf_config, family):
        if slot.global_name.endswith((".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight",
                                      ".linear_fc2.weight")):
            out_features, in_features = mcore_shape(slot.rule, hf_config)
            module = slot.global_name.removesuffix("weight")
            tensors[module + "lora_a"] = torch.randn(RANK, in_features, generator=generator) / in_features ** 0.5
            tensors[module + "lora_b"] = torch.randn(out_features, RANK, generator=generator) / RANK
    adapters = Adapters(RANK, ALPHA, 0.0, tensors)
    write_peft_folder(adapters, manifest, assets, folder / "peft", base_model=str(hf), sources=(folder / "ckpt",))
    deltas = {name: (a, b) for name, a, b in hf_adapters(adapters, hf_config, family)}
    base = iter_checkpoint_hf_tensors(folder / "ckpt", manifest)
    write_hf_model(merged_hf_tensors(base, deltas, adapters.scale), manifest, assets, folder / "merged",
                   sources=(folder / "ckpt",))
    return folder


def time_mode(folder: Path, mode: str, rounds: int) -> dict:
    """In a torchrun process: the engine's start and each round's seconds."""
    from safetensors.torch import load_file

    from verl_mega.models import load_hf_model_config
    from verl_mega.parallel.state import init_parallel
    from verl_mega.rollout.engine import SamplingParams, WeightFeed
    from verl_mega.rollout.vllm_engine import VLLMEngine, import_vllm, kv_cache_bytes

    init_parallel(1, 1)
    hf = folder / "hf"
    hf_config, _ = load_hf_model_config(hf)
    start = time.perf_counter()
    if mode == "merged":
        merged = {name: tensor for file in sorted((folder / "merged").glob("*.safetensors"))
                  for name, tensor in load_file(file).items()}
        engine = VLLMEngine(hf, WeightFeed(1, 0, hf_config.vocab_size, hf_config.vocab_size), max_model_len=MAX_LEN,
                            dtype=torch.float32, max_num_seqs=len(PROMPTS))

        def one_round(index: int) -> None:
            engine.load_weights(iter(merged.items()))
            engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))
    else:
        vllm = import_vllm()
        from vllm.lora.request import LoRARequest

        llm = vllm.LLM(model=str(hf), distributed_executor_backend="external_launcher", dtype=torch.float32,
                       max_model_len=MAX_LEN, max_num_seqs=len(PROMPTS), enforce_eager=True,
                       kv_cache_memory_bytes=kv_cache_bytes(hf_config, torch.float32, len(PROMPTS) * MAX_LEN),
                       # vLLM takes max_lora_rank from a fixed set (1, 8, 16, ...): the smallest that holds RANK.
                       enable_lora=True, max_lora_rank=8, max_loras=1)
        params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

        def one_round(index: int) -> None:
            llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False,
                         lora_request=LoRARequest(f"step{index}", index + 1, str(folder / "peft")))
    started = time.perf_counter() - start
    seconds = []
    for index in range(rounds):
        begin = time.perf_counter()
        one_round(index)
        seconds.append(round(time.perf_counter() - begin, 3))
    return {"mode": mode, "engine_start_s": round(started, 2), "round_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/lora_rollout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)  # the torchrun side
    args = parser.parse_args()
    if args.time:
        print(json.dumps(time_mode(Path(args.time[0]), args.time[1], args.rounds)), flush=True)
        return
    from verl_mega.parallel.spawn import run_torchrun

    for size in SIZES:
        folder = make_folders(Path(args.out).resolve(), size)
        for mode in ("merged", "lora"):
            result = run_torchrun(1, "bench.lora_rollout", ["--time", str(folder), mode, "--rounds", str(args.rounds)],
                                  env=with_repo_on_path(), capture_output=True)
            line = next(line for line in result.stdout.splitlines() if line.startswith("{"))
            print(size, line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
