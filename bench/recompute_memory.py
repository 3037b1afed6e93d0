"""Activation memory of one training forward+backward under each activation recompute setting, on CPU.

    python -m bench.recompute_memory [--tokens 2048] [--rows 1] [--threads 2]

The ~110M-parameter Llama-shaped model of bench/vs_trl.py (hidden 768, 12 layers, 12 heads, 4 KV heads), random,
converted to megatron-core and built with `actor.recompute`'s megatron settings (`memory_overrides`). Each
setting runs one forward of `--rows` rows of `--tokens` tokens, a token-mean log-prob loss and its backward,
under `rollout.live_bytes.LiveBytes`; the gradients are allocated before, so the peak is what the pass itself
keeps and allocates: the activations, the logits and the backward's temporaries. Prints each setting's peak
(MiB), its ratio to none's, and the pass's seconds (recompute runs the layers' forward twice).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.vs_trl import LLAMA_100M

SETTINGS = {
    "none": dict(granularity="none"),
    "selective": dict(granularity="selective"),
    "full uniform 1": dict(granularity="full", method="uniform", num_layers=1),
    "full block 6": dict(granularity="full", method="block", num_layers=6),
}


def build_checkpoint(root: Path, tokens: int) -> Path:
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    shape = {**LLAMA_100M, "max_position_embeddings": max(tokens, LLAMA_100M["max_position_embeddings"])}
    hf_dir = make_tiny_hf_model(root / "hf", "llama", rope_scaling=None, **shape)
    convert_hf_to_mcore(hf_dir, root / "ckpt", tp=1, pp=1, ep=1)
    return root / "ckpt"


def measure(ckpt: Path, setting: dict, rows: int, tokens: int) -> tuple[int, float, int]:
    """(peak live bytes, seconds, parameters) of one forward+backward with `setting` (a RecomputeConfig's)."""
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.config.schema import ActorConfig, ParallelConfig, RecomputeConfig
    from verl_mega.models.builder import memory_overrides
    from verl_mega.roles.batching import causal_padding_mask
    from verl_mega.rollout.live_bytes import LiveBytes

    actor = ActorConfig(recompute=RecomputeConfig(**setting))
    model, *_ = build_model_from_checkpoint(ckpt, **memory_overrides(actor, ParallelConfig()))
    model.train()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, LLAMA_100M["vocab_size"], (rows, tokens), generator=generator)
    positions = torch.arange(tokens).expand(rows, -1)
    mask = causal_padding_mask(torch.ones_like(ids))
    start = time.perf_counter()
    with LiveBytes() as tracked:
        logits = model(ids, positions, mask)  # [rows, tokens, V]
        log_probs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])
        log_probs.mean().backward()
        del logits, log_probs
    return tracked.peak, time.perf_counter() - start, sum(param.numel() for param in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    init_parallel(1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp), args.tokens)
        results = {name: measure(ckpt, setting, args.rows, args.tokens) for name, setting in SETTINGS.items()}
    destroy_parallel()
    none_peak = results["none"][0]
    params = results["none"][2]
    print(f"{params / 1e6:.1f}M parameters, {args.rows} x {args.tokens} tokens, fp32, {args.threads} threads")
    print(f"{'recompute':<16} {'peak MiB':>10} {'x none':>7} {'seconds':>8}")
    for name, (peak, seconds, _) in results.items():
        print(f"{name:<16} {peak / 2**20:>10.0f} {peak / none_peak:>7.2f} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
