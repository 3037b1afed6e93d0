"""Benchmark the weight push over the bridge: 1 training rank (TP 1) -> 1 rollout rank, one torchrun launch.

    python -m bench.weight_push [--hidden 512 --layers 8 --ffn 1408 --vocab 32000] [--out weight_push.json]

For each bucket size (16 and 256 MiB) the training rank pushes the whole model (gloo on CPU, NCCL on GPUs) and
the rollout rank consumes the stream as `load_weights` would; also timed: the colocated HybridEngine stream
alone (what the push adds to), and a push with `verify`. Reported: seconds and MB/s of each (the slower side's
time, from a barrier over the bridge before to the push's answer after).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import with_repo_on_path

BUCKETS_MB = (16, 256)


def prepare(work: Path, hidden: int, layers: int, ffn: int, vocab: int) -> tuple[Path, Path]:
    """A random Llama of the requested size and its TP 1 shards (kept in `work` for reruns)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    tag = f"llama_h{hidden}_l{layers}_f{ffn}_v{vocab}"
    hf_dir, ckpt_dir = work / tag, work / f"{tag}_tp1"
    if not (hf_dir / "config.json").is_file():
        heads = max(hidden // 64, 2)
        make_tiny_hf_model(hf_dir, "llama", vocab_size=vocab, tokenizer=False, hidden_size=hidden,
                           num_hidden_layers=layers, intermediate_size=ffn, num_attention_heads=heads,
                           num_key_value_heads=max(heads // 2, 1))
    if not ckpt_dir.is_dir():
        convert_hf_to_mcore(hf_dir, ckpt_dir, tp=1)
    return hf_dir, ckpt_dir


def worker(ckpt_dir: str, out: str) -> None:
    import os

    import torch

    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.parallel.bridge import init_placement
    from verl_mega.parallel.placement import placement_for
    from verl_mega.parallel.state import destroy_parallel, init_parallel
    from verl_mega.rollout.hybrid_engine import HybridEngine
    from verl_mega.rollout.weight_push import push_weights, receive_weights

    placement = placement_for(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 1)
    bridge = init_placement(placement, bridge_timeout_s=1800)
    sync = torch.zeros(1)
    runs = [(bucket, False) for bucket in BUCKETS_MB] + [(BUCKETS_MB[-1], True)]
    figures = {}
    if placement.role == "train":
        init_parallel()
        model, _, cfg, family = build_model_from_checkpoint(ckpt_dir)
        hybrid = HybridEngine(model, cfg, family)
        start = time.perf_counter()
        size = sum(tensor.numel() * tensor.element_size() for _, tensor in hybrid.stream())
        figures["colocated_stream_s"] = time.perf_counter() - start
        figures["model_mb"] = size / 2**20
        for version, (bucket, verify) in enumerate(runs):
            bridge.broadcast_tensor(sync, 0, (0, 1))
            start = time.perf_counter()
            push_weights(bridge, hybrid, placement, version, bucket, verify=verify)
            figures[f"push_{bucket}mb{'_verify' if verify else ''}_s"] = time.perf_counter() - start
        bridge.send_object(figures, 1)
    else:
        for _ in runs:
            bridge.broadcast_tensor(sync, 0, (0, 1))
            _, stream = receive_weights(bridge, placement, BUCKETS_MB[-1])
            for _name, tensor in stream:
                tensor.sum()  # touch it, as a load would
        figures = bridge.recv_object(0)
        for key in [key for key in figures if key.startswith("push_") or key == "colocated_stream_s"]:
            figures[key.removesuffix("_s") + "_mb_per_s"] = figures["model_mb"] / figures[key]
        Path(out).write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures, indent=1), flush=True)
    bridge.close()
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", default="/tmp/verl_mega_bench_weight_push")
    parser.add_argument("--out", default="weight_push.json")
    parser.add_argument("--worker", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from verl_mega.parallel.spawn import run_torchrun

    _, ckpt_dir = prepare(Path(args.work), args.hidden, args.layers, args.ffn, args.vocab)
    run_torchrun(2, "bench.weight_push", ["--worker", str(ckpt_dir), str(Path(args.out).resolve())],
                 env=with_repo_on_path())


if __name__ == "__main__":
    main()
