"""One GRPO step of the tiny and the ~100M Llama-shaped model, each stage against a limit measured in the same run.

    python -m bench.limits [--scale tiny|llama100m|both] [--threads 2] [--steps 3]

Per model: the real trainer (`verl_mega.demo.train` on examples/grpo_demo.yaml, overridden to bench/vs_trl.py's
step: 8 prompts x 4 samples, fp32, one process; plus the KL loss and two mini-batches, so the reference and the
old log-prob passes run too) for a few steps, and its last step's `timing/...` metrics. Then, in this process
and with the same thread count, the bounds:
- GEMM rate: torch matmuls of the model's own shapes (the projections, the MLP and the LM head at the step's
  token counts); update and log-prob passes are model FLOPs (2 N per token forward, twice that backward,
  causal attention, the LM head at the response positions only) over that rate;
- memory bandwidth: a large copy (bytes read + written); rollout decode is the weights plus the KV cache read
  per decoded token step, prefill its FLOPs at the GEMM rate;
- HybridEngine transition: a second launch at training TP2 (2 processes) streams the model to rollout TP 1
  and 2; the byte bound is the planner's bytes each rank receives moved by one all-gather of that size in the
  same group (the engine's collective), and the transfer buffers' measured peak against the planner's bound;
- time outside the model: the step minus its model stages (reward, data, Python between stages, metrics).
Goals (issue 31): passes >= 50 % of the GEMM rate, decode >= 50 % of the bandwidth bound at 32 sequences,
transition <= 1.25x its byte bound, outside the model <= 10 % of the step. A failing row names its limiting
term. The ratios are in-run: a shared machine slows bound and stage alike.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import with_repo_on_path
from bench.vs_trl import BUILDERS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, SCALES, SEQUENCES_PER_STEP, copy_rows

BYTES_PER_FP32 = 4
TRAIN_TP = 2  # the transition launch: 2 processes, one per core of the reference machine
ROLLOUT_TPS = (1, 2)
MODEL_STAGES = ("rollout", "transition", "old_log_prob", "ref_log_prob", "values", "update_actor", "update_critic")
GOALS = {"pass": 0.5, "decode": 0.5, "transition": 1.25, "outside": 0.10}


# --- accounting: pure functions of the model's shape and the step's token counts --------------------------

@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf_config(cls, config: dict) -> "Shape":
        return cls(config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                   config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]),
                   config["vocab_size"])


@dataclass(frozen=True)
class StepTokens:
    """The step's sequences: all the same prompt and response lengths (means; random weights generate to the
    limit, so the responses are near it)."""
    sequences: int
    prompt: float
    response: float

    @property
    def length(self) -> float:
        return self.prompt + self.response


def layer_matmul_shapes(shape: Shape) -> list[tuple[int, int]]:
    """(in, out) of each projection of one layer: fused q/k/v, o, fused gate/up, down (biases ignored)."""
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [(shape.hidden, qkv), (shape.hidden, shape.hidden), (shape.hidden, 2 * shape.ffn), (shape.ffn, shape.hidden)]


def body_params(shape: Shape) -> int:
    """N of the 2 N per token rule: the layers' projection weights (norms, embedding and LM head not in it)."""
    return shape.layers * sum(fan_in * fan_out for fan_in, fan_out in layer_matmul_shapes(shape))


def attention_flops(shape: Shape, length: float) -> float:
    """Forward FLOPs of causal attention over one sequence: q.k and p.v over the L(L+1)/2 visible pairs."""
    return shape.layers * 2 * 2 * shape.hidden * length * (length + 1) / 2


def forward_flops(shape: Shape, tokens: StepTokens) -> float:
    """One forward over the step's sequences, the LM head at the response positions only."""
    per_sequence = (2 * body_params(shape) * tokens.length + attention_flops(shape, tokens.length)
                    + 2 * shape.hidden * shape.vocab * tokens.response)
    return tokens.sequences * per_sequence


def update_flops(shape: Shape, tokens: StepTokens, epochs: int = 1) -> float:
    """Forward plus backward (twice the forward) per epoch."""
    return 3 * epochs * forward_flops(shape, tokens)


def prefill_flops(shape: Shape, tokens: StepTokens) -> float:
    """The prompts' forward in the rollout, the LM head at the last prompt position (the first new token)."""
    per_sequence = (2 * body_params(shape) * tokens.prompt + attention_flops(shape, tokens.prompt)
                    + 2 * shape.hidden * shape.vocab)
    return tokens.sequences * per_sequence


def weight_bytes(shape: Shape, bytes_per_param: int = BYTES_PER_FP32) -> int:
    """Weights every decode step reads: the projections and the LM head (one embedding row per sequence is
    noise; norms are hidden-sized)."""
    return (body_params(shape) + shape.hidden * shape.vocab) * bytes_per_param


def kv_bytes_per_position(shape: Shape, bytes_per_param: int = BYTES_PER_FP32) -> int:
    """Keys and values of one position, all layers."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * bytes_per_param


def decode_steps(tokens: StepTokens) -> int:
    """Token steps after the prefill (which yields the first new token)."""
    return max(round(tokens.response) - 1, 0)


def decode_bytes(shape: Shape, tokens: StepTokens, bytes_per_param: int = BYTES_PER_FP32) -> float:
    """Bytes the decode must read: the weights once per token step (shared by the batch), and at step t each
    sequence's cache of its prompt + t positions (t = 1 .. steps)."""
    steps = decode_steps(tokens)
    cached_positions = tokens.sequences * (steps * tokens.prompt + steps * (steps + 1) / 2)
    return steps * weight_bytes(shape, bytes_per_param) + cached_positions * kv_bytes_per_position(shape,
                                                                                                  bytes_per_param)


def gemm_work(shape: Shape, rows: int, response_rows: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's matmuls at `rows` tokens, the LM head at `response_rows`."""
    return [(rows, fan_in, fan_out) for fan_in, fan_out in layer_matmul_shapes(shape)] + [
        (response_rows, shape.hidden, shape.vocab)]


def outside_seconds(timings: dict[str, float], step_seconds: float) -> float:
    """The step's time not in a model stage: reward, data, Python between the stages, metrics."""
    return step_seconds - sum(timings.get(stage, 0.0) for stage in MODEL_STAGES)


# --- bounds measured here ---------------------------------------------------------------------------------

def _best_seconds(run, repeats: int = 10, window: float = 0.02) -> float:
    """Best per-run seconds over `repeats` windows of at least `window` s each: on a shared machine the best
    window is the machine's rate, the others its neighbours'."""
    run()
    best = float("inf")
    for _ in range(repeats):
        runs, start = 0, time.perf_counter()
        while runs == 0 or time.perf_counter() - start < window:
            run()
            runs += 1
        best = min(best, (time.perf_counter() - start) / runs)
    return best


def gemm_rate(work: list[tuple[int, int, int]]) -> float:
    """FLOP/s of torch matmuls of these shapes, all of them, this process's threads."""
    operands = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in work]
    seconds = _best_seconds(lambda: [a @ b for a, b in operands])
    return sum(2 * m * k * n for m, k, n in work) / seconds


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of a large copy, read + written."""
    source = torch.ones(megabytes * 2 ** 20 // BYTES_PER_FP32)
    target = torch.empty_like(source)
    return 2 * source.numel() * BYTES_PER_FP32 / _best_seconds(lambda: target.copy_(source))


# --- the trainer's step -----------------------------------------------------------------------------------

def step_overrides(scale: str) -> list[str]:
    """vs_trl's step, plus the KL loss (a reference pass) and two mini-batches (an old log-prob pass)."""
    settings = SCALES[scale]
    half = SEQUENCES_PER_STEP // 2
    return [f"data.batch_size={PROMPTS_PER_STEP}", f"rollout.n={SAMPLES_PER_PROMPT}",
            f"data.max_prompt_length={settings['max_prompt_length']}",
            f"data.max_response_length={settings['max_new_tokens']}", f"actor.optim.lr={settings['lr']}",
            f"actor.optim.min_lr={settings['lr']}", "actor.optim.lr_decay_style=constant",
            "actor.loss.entropy_coeff=0.0", "actor.ppo_epochs=1",
            f"actor.mini_batch_size={half}", f"actor.micro_batch_size={half}", "actor.loss.use_kl_loss=true",
            "model.dtype=fp32"]


def run_step(hf_dir: Path, work: Path, scale: str, steps: int, quantization: str = "none") -> dict:
    """The last step's metrics of a real GRPO run (the earlier steps are warm-up)."""
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    data = write_rows(copy_rows(PROMPTS_PER_STEP * steps), work / "copy.jsonl")
    train(EXAMPLES / "grpo_demo.yaml", 1, [f"model.hf_path={hf_dir}", f"data.train_files=[{data}]",
                                           f"trainer.run_dir={work / 'run'}", f"trainer.total_steps={steps}",
                                           *step_overrides(scale), f"rollout.quantization={quantization}"])
    return read_metrics(RunFolder(work / "run").metrics)[-1]


def step_tokens(record: dict) -> StepTokens:
    """Token counts from the step's metrics: all tokens (tokens/s x step) less the responses' are prompts."""
    total = record["perf/tokens_per_second"] * record["perf/step_seconds"]
    response = record["response/length_mean"]
    return StepTokens(SEQUENCES_PER_STEP, total / SEQUENCES_PER_STEP - response, response)


# --- the transition, in its own launch --------------------------------------------------------------------

def transition_worker(hf_dir: str, ckpt_dir: str, out: str) -> None:
    """Each rollout TP: the stream's time and buffers' peak, the planner's bytes and bound, and one all-gather
    of the bytes received in the same group."""
    import torch.distributed as dist

    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
    from verl_mega.rollout.hybrid_engine import HybridEngine
    from verl_mega.rollout.planner import plan

    init_parallel(TRAIN_TP, 1)
    model, _, hf_config, family = build_model_from_checkpoint(ckpt_dir)
    layout = current_layout()
    rows = []
    for rollout_tp in ROLLOUT_TPS:
        engine = HybridEngine(model, hf_config, family, rollout_tp, measure_peak=True)
        figures = plan(hf_dir, TRAIN_TP, 1, 1, rollout_tp).ranks[layout.rank]

        def stream():
            for _ in engine.stream():
                pass

        micro_dp = TRAIN_TP // rollout_tp

        def transport():
            if figures.recv_bytes and micro_dp > 1:  # each rank receives (micro_dp - 1) chunks
                chunk = torch.empty(figures.recv_bytes // BYTES_PER_FP32 // (micro_dp - 1))
                dist.all_gather_into_tensor(torch.empty(chunk.numel() * micro_dp), chunk)

        rows.append(dict(rank=layout.rank, rollout_tp=rollout_tp, recv_bytes=figures.recv_bytes,
                         seconds=_barrier_timed(stream, dist), bound_seconds=_barrier_timed(transport, dist),
                         peak=engine.tracker.peak, peak_bound=figures.transition_peak_bytes))
    gathered = [None] * layout.world_size
    dist.all_gather_object(gathered, rows)
    if layout.rank == 0:
        Path(out).write_text(json.dumps([row for rank_rows in gathered for row in rank_rows]))
    destroy_parallel()


def _barrier_timed(run, dist, repeats: int = 3) -> float:
    """Best of `repeats` runs, each between barriers (the slowest rank's time)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def run_transition(hf_dir: Path, work: Path, threads: int) -> list[dict]:
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.parallel.spawn import run_torchrun

    ckpt_dir, out = work / f"ckpt_tp{TRAIN_TP}", work / "transition.json"
    convert_hf_to_mcore(hf_dir, ckpt_dir, tp=TRAIN_TP, pp=1)
    run_torchrun(TRAIN_TP, "bench.limits", ["--transition-worker", str(hf_dir), str(ckpt_dir), str(out)],
                 env=with_repo_on_path({"OMP_NUM_THREADS": str(max(threads // TRAIN_TP, 1))}))
    return json.loads(out.read_text())


# --- the table ----------------------------------------------------------------------------------------------

def verdict(ok: bool, limit: str) -> str:
    return "PASS" if ok else f"FAIL: {limit}"


def compute_rows(shape: Shape, tokens: StepTokens, record: dict, gemm: float) -> list[tuple]:
    """(stage, work, bound, achieved, ratio, verdict) of the update and log-prob passes."""
    passes = {"update_actor": update_flops(shape, tokens), "old_log_prob": forward_flops(shape, tokens),
              "ref_log_prob": forward_flops(shape, tokens)}
    rows = []
    for stage, flops in passes.items():
        seconds = record.get(f"timing/{stage}")
        if seconds is None:
            rows.append((stage, f"{flops / 1e9:.2f} GFLOP", "", "missing from the metrics", "", ""))
            continue
        achieved = flops / seconds
        ratio = achieved / gemm
        beyond = seconds - flops / gemm
        limit = (f"{stage.replace('_', ' ')}: non-GEMM work (attention, norms, elementwise, loss, Python per op"
                 f"{' at tiny shapes' if shape.hidden < 256 else ''}), {beyond:.3f} s beyond the GEMM bound")
        rows.append((stage, f"{flops / 1e9:.2f} GFLOP", f"{gemm / 1e9:.1f} GFLOP/s", f"{achieved / 1e9:.1f} GFLOP/s",
                     f"{ratio:.0%}", verdict(ratio >= GOALS["pass"], limit)))
    return rows


def decode_step_flops(shape: Shape, sequences: int) -> float:
    """One token step's matmul FLOPs: the projections and the LM head at one position per sequence."""
    return sequences * 2 * (body_params(shape) + shape.hidden * shape.vocab)


def rollout_row(shape: Shape, tokens: StepTokens, record: dict, gemm: float, bandwidth: float,
                decode_gemm: float) -> tuple:
    """Decode against the bandwidth bound, the prefill's FLOPs at the GEMM rate taken out of the stage. A
    failing row splits the time beyond the bytes into the decode's matmuls at their own measured rate (one
    row per sequence) and the rest (Python, attention, sampling per token step)."""
    seconds, prefill = record["timing/rollout"], prefill_flops(shape, tokens)
    decode_seconds = seconds - prefill / gemm
    volume, steps = decode_bytes(shape, tokens), decode_steps(tokens)
    achieved = volume / decode_seconds
    ratio = achieved / bandwidth
    per_step = 1e3 * decode_seconds / max(steps, 1)
    matmuls = 1e3 * decode_step_flops(shape, tokens.sequences) / decode_gemm
    term = (f"{tokens.sequences}-row matmuls at their measured rate" if matmuls > per_step - matmuls
            else "Python, attention and sampling per token step")
    limit = (f"decode: {term} ({per_step:.1f} ms per step: {matmuls:.1f} ms of {tokens.sequences}-row matmuls, "
             f"{1e3 * volume / bandwidth / max(steps, 1):.1f} ms of bytes)")
    return (f"rollout ({steps} decode steps, prefill {prefill / 1e9:.2f} GFLOP)", f"{mib(volume)} read",
            f"{bandwidth / 1e9:.1f} GB/s", f"{achieved / 1e9:.2f} GB/s", f"{ratio:.0%}",
            verdict(ratio >= GOALS["decode"], limit))


def transition_rows(rows: list[dict]) -> list[tuple]:
    table = []
    for rollout_tp in ROLLOUT_TPS:
        ranks = [row for row in rows if row["rollout_tp"] == rollout_tp]
        recv = max(r["recv_bytes"] for r in ranks)
        # With nothing to receive the transport has no work: its timed call is a barrier's latency, not a bound.
        seconds, bound = max(r["seconds"] for r in ranks), max(r["bound_seconds"] for r in ranks) if recv else 0.0
        peak, peak_bound = max(r["peak"] for r in ranks), max(r["peak_bound"] for r in ranks)
        ratio = seconds / bound if bound else float("inf")
        limit = ("transition: local layout copies, no bytes to receive" if not recv else
                 f"transition: per-tensor collectives and layout copies, {seconds - bound:.3f} s beyond the bytes")
        table.append((f"transition TP{TRAIN_TP}->{rollout_tp} ({seconds:.3f} s)", f"{mib(recv)} recv/rank",
                      f"{bound:.3f} s", f"peak {mib(peak)} of {mib(peak_bound)}",
                      f"{ratio:.2f}x" if bound else "n/a",
                      verdict(ratio <= GOALS["transition"] and peak <= peak_bound, limit)))
    return table


def outside_row(record: dict) -> tuple:
    timings = {key[len("timing/"):]: value for key, value in record.items() if key.startswith("timing/")}
    step = record["perf/step_seconds"]
    outside = outside_seconds(timings, step)
    reward = timings.get("reward", 0.0)
    return ("outside the model", f"{outside:.3f} s of {step:.3f} s", "", f"reward {reward:.3f} s",
            f"{outside / step:.0%}", verdict(outside / step <= GOALS["outside"],
                                             f"Python between stages and metrics, {outside - reward:.3f} s"))


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n== {title} ==")
    header = ("stage", "work", "bound", "achieved", "ratio", "goal")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row[:5], widths)) + "  " + row[5])


def micro_batch_gemms(shape: Shape, tokens: StepTokens) -> list[tuple[int, int, int]]:
    """The matmuls of one micro-batch (half the step's sequences, as `step_overrides` sets)."""
    half = tokens.sequences // 2
    return gemm_work(shape, round(half * tokens.length), round(half * tokens.response))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB" if nbytes >= 2 ** 20 else f"{nbytes / 2 ** 10:.1f} KiB"


def bench_scale(scale: str, work: Path, threads: int, steps: int, quantization: str = "none") -> None:
    hf_dir = BUILDERS[scale](work / "hf")
    shape = Shape.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    # The step's token counts are known only after it ran: the first GEMM measurement takes the configured
    # lengths (half the prompt limit, the whole response limit).
    settings = SCALES[scale]
    planned = StepTokens(SEQUENCES_PER_STEP, settings["max_prompt_length"] / 2, settings["max_new_tokens"])
    before = (gemm_rate(micro_batch_gemms(shape, planned)), copy_bandwidth())
    load_before = os.getloadavg()[0]
    record = run_step(hf_dir, work, scale, steps, quantization)
    transition = run_transition(hf_dir, work, threads)
    tokens = step_tokens(record)
    # Bounds measured before and after the step; the better of each is the machine's.
    gemm = max(before[0], gemm_rate(micro_batch_gemms(shape, tokens)))
    bandwidth = max(before[1], copy_bandwidth())
    decode_gemm = gemm_rate(gemm_work(shape, tokens.sequences, tokens.sequences))
    print_table(f"{scale}: {shape}, {tokens.sequences} sequences x ({tokens.prompt:.1f} prompt + "
                f"{tokens.response:.1f} response) tokens, step {record['perf/step_seconds']:.3f} s; load average "
                f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after",
                [*compute_rows(shape, tokens, record, gemm),
                 rollout_row(shape, tokens, record, gemm, bandwidth, decode_gemm),
                 *transition_rows(transition), outside_row(record)])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.limits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=[*SCALES, "both"], default="both")
    parser.add_argument("--threads", type=int, default=2, help="torch threads: the trainer and the bounds")
    parser.add_argument("--steps", type=int, default=3, help="trainer steps; the last is reported")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="rollout.quantization of the trainer's step (the bounds stay fp32's)")
    parser.add_argument("--transition-worker", nargs=3, metavar=("HF", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.transition_worker:
        transition_worker(*args.transition_worker)
        return
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the trainer's process inherits it
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32; a shared machine: the ratios are in-run")
    with tempfile.TemporaryDirectory() as tmp:
        for scale in SCALES if args.scale == "both" else [args.scale]:
            (Path(tmp) / scale).mkdir()
            bench_scale(scale, Path(tmp) / scale, args.threads, args.steps, args.quantization)


if __name__ == "__main__":
    main()
