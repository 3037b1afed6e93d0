"""Logit parity: megatron-core built from the shards vs transformers on the same random tokens.

Runs under torchrun at the checkpoint's TP x PP (x EP); `verify_checkpoint` launches that from a plain
process. The figure is printed and written as JSON for callers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.parallel.launch import in_distributed_job, run_torchrun


def verify_checkpoint(hf_dir: str | Path, ckpt_dir: str | Path, *, seq_len: int = 16, batch: int = 2,
                      seed: int = 0, result_file: str | Path | None = None) -> float | None:
    """Max |logit difference|; launches torchrun with the checkpoint's world size when needed."""
    manifest = Manifest.read(ckpt_dir)
    args = ["--hf", str(hf_dir), "--ckpt", str(ckpt_dir), "--seq-len", str(seq_len), "--batch", str(batch),
            "--seed", str(seed)]
    if in_distributed_job():
        return _verify_rank(Path(hf_dir), Path(ckpt_dir), seq_len, batch, seed, result_file)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(result_file) if result_file else Path(tmp) / "parity.json"
        run_torchrun(manifest.tp * manifest.pp * manifest.ep, "verl_mega.converters.verify",
                     args + ["--result", str(result)])
        return json.loads(result.read_text())["max_abs_logit_diff"]


def _verify_rank(hf_dir: Path, ckpt_dir: Path, seq_len: int, batch: int, seed: int, result_file) -> float | None:
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.parallel.pipeline import forward_only_outputs
    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel

    manifest = Manifest.read(ckpt_dir)
    init_parallel(manifest.tp, manifest.pp, manifest.ep)
    model, manifest, cfg, _ = build_model_from_checkpoint(ckpt_dir)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    device = next(model.parameters()).device

    def step(stage_model, micro_batch):
        return stage_model(micro_batch["input_ids"].to(device), micro_batch["position_ids"].to(device), None)

    def collect(output, micro_batch):
        return tensor_parallel.gather_from_tensor_model_parallel_region(output)[..., : cfg.vocab_size].float().cpu()

    outputs = forward_only_outputs(model, [{"input_ids": tokens, "position_ids": positions}], step, collect)
    layout = current_layout()
    diff = None
    if outputs is not None and layout.tp_rank == 0 and layout.dp_rank == 0:
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            expected = reference(tokens).logits.float()
        diff = (outputs[0] - expected).abs().max().item()
        print(f"logit parity {cfg.model_type} tp={manifest.tp} pp={manifest.pp} ep={manifest.ep}: "
              f"max |Δ logit| = {diff:.3e}", flush=True)
        if result_file:
            Path(result_file).write_text(json.dumps({"max_abs_logit_diff": diff}))
    torch.distributed.barrier()
    destroy_parallel()
    return diff


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.converters.verify")
    parser.add_argument("--hf", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result")
    args = parser.parse_args(argv)
    verify_checkpoint(args.hf, args.ckpt, seq_len=args.seq_len, batch=args.batch, seed=args.seed,
                      result_file=args.result)


if __name__ == "__main__":
    main()
