"""Benchmark the HybridEngine transition against a naive engine, in one torchrun launch.

    python -m bench.reshard [--hidden 1024 --layers 12 --ffn 2816 --vocab 32000]   # ~0.8 GB fp32 Llama

Trains-side layout TP2 x PP2 x DP2 (8 processes); for each rollout TP size t_g in {1, 2}:
- hybrid: `HybridEngine(t_g).stream()` consumed tensor by tensor, as a rollout engine loads it;
- naive: every rank all-gathers and broadcasts the full model and holds it whole (what a rollout engine
  that takes full state dicts needs), then keeps its t_g slice.
Reported per rank: transition seconds and measured peak bytes of transfer buffers; goals: hybrid time
<= 0.5x naive, hybrid peak + M/t_g <= M/t_g + largest tensor (i.e. transient <= largest tensor).

At t_g = 1 every rank needs the whole model, so hybrid and naive run the same collectives over the same bytes
(the naive engine here is the HybridEngine at t_g = 1, holding what it streams); they differ only in the naive
side allocating and holding M per rank, so the time ratio follows the machine's memory and load (1.05 and 0.39
measured on the same code, 2 shared cores) and the hybrid's sure gain is memory. With gloo there the transfer
is bound by bytes (an all-gather 8x larger took 8.5x as long), not by the number of collectives, so bucketing
tensors would not change it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch.distributed as dist

from bench import with_repo_on_path

TP, PP, DP = 2, 2, 2
ROLLOUT_TPS = (1, 2)


def prepare(work: Path, hidden: int, layers: int, ffn: int, vocab: int) -> tuple[Path, Path]:
    """A random Llama of the requested size and its TP2 x PP2 shards (kept in `work` for reruns)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    tag = f"llama_h{hidden}_l{layers}_f{ffn}_v{vocab}"
    hf_dir, ckpt_dir = work / tag, work / f"{tag}_tp{TP}_pp{PP}"
    if not (hf_dir / "config.json").is_file():
        heads = max(hidden // 64, 2)
        make_tiny_hf_model(hf_dir, "llama", vocab_size=vocab, tokenizer=False, hidden_size=hidden,
                           num_hidden_layers=layers, intermediate_size=ffn, num_attention_heads=heads,
                           num_key_value_heads=max(heads // 2, TP))
    if not ckpt_dir.is_dir():
        convert_hf_to_mcore(hf_dir, ckpt_dir, tp=TP, pp=PP)
    return hf_dir, ckpt_dir


def _timed(run) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    result = run()
    dist.barrier()
    return time.perf_counter() - start, result


def worker(hf_dir: str, ckpt_dir: str, out: str) -> None:
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
    from verl_mega.rollout.hybrid_engine import HybridEngine
    from verl_mega.rollout.planner import plan

    init_parallel(TP, PP)
    model, _, hf_config, family = build_model_from_checkpoint(ckpt_dir)
    layout = current_layout()
    naive = HybridEngine(model, hf_config, family, rollout_tp=1, measure_peak=True)
    rows = []
    for rollout_tp in ROLLOUT_TPS:
        hybrid = HybridEngine(model, hf_config, family, rollout_tp, measure_peak=True)

        def consume_stream():
            return sum(tensor.numel() * tensor.element_size() for _, tensor in hybrid.stream())

        def hold_full_model():
            full = dict(naive.stream())
            return sum(t.numel() * t.element_size() for t in full.values())

        hybrid_s, rollout_bytes = _timed(consume_stream)
        naive_s, _ = _timed(hold_full_model)
        figures = plan(hf_dir, TP, PP, DP, rollout_tp).ranks[layout.rank]
        rows.append(dict(rank=layout.rank, rollout_tp=rollout_tp, hybrid_s=hybrid_s, naive_s=naive_s,
                         hybrid_peak=hybrid.tracker.peak, naive_peak=naive.tracker.peak,
                         planned_peak=figures.transition_peak_bytes, rollout_bytes=rollout_bytes))
    gathered = [None] * layout.world_size
    dist.all_gather_object(gathered, rows)
    if layout.rank == 0:
        summary = plan(hf_dir, TP, PP, DP, 1)
        report = dict(model_bytes=summary.model_bytes, largest_tensor_bytes=summary.largest_tensor_bytes,
                      rows=[row for rank_rows in gathered for row in rank_rows])
        Path(out).write_text(json.dumps(report, indent=2))
        print_report(report)
    destroy_parallel()


def print_report(report: dict) -> None:
    mib = 1024 ** 2
    model, largest = report["model_bytes"], report["largest_tensor_bytes"]
    print(f"model M = {model / mib:.1f} MiB, largest tensor {largest / mib:.1f} MiB; TP{TP} PP{PP} DP{DP}")
    print(f"{'t_g':>3} {'rank':>4} {'hybrid s':>9} {'naive s':>8} {'ratio':>6} {'hybrid peak':>12} "
          f"{'planned':>8} {'naive peak':>11} {'rollout':>8}  (MiB)")
    for row in sorted(report["rows"], key=lambda r: (r["rollout_tp"], r["rank"])):
        print(f"{row['rollout_tp']:>3} {row['rank']:>4} {row['hybrid_s']:>9.3f} {row['naive_s']:>8.3f} "
              f"{row['hybrid_s'] / row['naive_s']:>6.2f} {row['hybrid_peak'] / mib:>12.1f} "
              f"{row['planned_peak'] / mib:>8.1f} {row['naive_peak'] / mib:>11.1f} {row['rollout_bytes'] / mib:>8.1f}")
    for rollout_tp in ROLLOUT_TPS:
        rows = [r for r in report["rows"] if r["rollout_tp"] == rollout_tp]
        ratio = max(r["hybrid_s"] for r in rows) / max(r["naive_s"] for r in rows)
        total_peak = max(r["hybrid_peak"] + r["rollout_bytes"] for r in rows)
        bound = model / rollout_tp + largest
        print(f"t_g={rollout_tp}: slowest-rank time ratio {ratio:.2f} (goal <= 0.5); peak held "
              f"(rollout weights + transfer buffers) {total_peak / mib:.1f} MiB vs M/t_g + largest "
              f"{bound / mib:.1f} MiB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", default="/tmp/verl_mega_bench")
    parser.add_argument("--out", default="reshard.json")
    parser.add_argument("--worker", nargs=2, metavar=("HF_DIR", "CKPT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, out=args.out)
        return
    from verl_mega.parallel.spawn import run_torchrun

    hf_dir, ckpt_dir = prepare(Path(args.work), args.hidden, args.layers, args.ffn, args.vocab)
    run_torchrun(TP * PP * DP, "bench.reshard",
                 ["--worker", str(hf_dir), str(ckpt_dir), "--out", str(Path(args.out).resolve())],
                 env=with_repo_on_path())


if __name__ == "__main__":
    main()
