"""`make demo`: the CPU demo on a tiny model built locally.

Until the PPO trainer lands this is the convert -> verify -> export round trip: a random tiny Qwen2
(tied embeddings) becomes Megatron shards at TP2 x PP2, megatron-core's logits from the shards are
compared with transformers', and the shards are exported back to an HF folder that transformers loads.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.demo")
    parser.add_argument("--workdir", help="keep the artifacts here (default: a temp folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(args.workdir or tmp))


def run(workdir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
    from verl_mega.converters.verify import verify_checkpoints
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(workdir / "hf", "qwen2")
    print(f"[demo] tiny qwen2 (random, tied embeddings) at {hf}")
    for tp, pp in ((2, 2), (2, 1), (1, 2)):
        start = time.perf_counter()
        ckpt = workdir / f"mcore_tp{tp}_pp{pp}"
        convert_hf_to_mcore(hf, ckpt, tp=tp, pp=pp, overwrite=True)
        print(f"[demo] converted to megatron shards tp={tp} pp={pp} in {time.perf_counter() - start:.2f} s")
        (diff,) = verify_checkpoints([(hf, ckpt)])
        print(f"[demo] logit parity megatron-core vs transformers at tp={tp} pp={pp}: max |Δ logit| = {diff:.2e}")
        out = workdir / f"export_tp{tp}_pp{pp}"
        convert_mcore_to_hf(ckpt, out, overwrite=True)
        source, exported = SafetensorsReader(hf), SafetensorsReader(out)
        exact = all(torch.equal(source.read(n), exported.read(n)) for n in source.names())
        model = AutoModelForCausalLM.from_pretrained(out)
        print(f"[demo] exported back to HF: {len(exported.names())} tensors, bit-exact={exact}, "
              f"transformers loads {type(model).__name__}")
        if diff > 1e-4 or not exact:
            raise SystemExit("[demo] FAILED")
    print("[demo] OK")


if __name__ == "__main__":
    main()
