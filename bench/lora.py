"""LoRA against full-parameter training on the ~100M model: peak memory and step time of GRPO and DPO steps.

    python -m bench.lora [--steps 4] [--rank 16] [--threads 2] [--micro 8] [--mmap-threshold 131072] [--rounds 2]

The model is bench.vs_trl's `llama100m` (~110M parameters, Llama-shaped, random weights, fp32 on the CPU),
converted once. Each (job, mode) runs in a fresh process, so that the RSS high-water mark is its own:

- GRPO: the training half of a step, at the roles: the reference's log-probs (verl's GRPO recipe keeps a KL
  loss to the reference), then one on-policy update (one epoch over one mini-batch of 8 prompts x 4 samples,
  micro-batches of --micro rows). Generation is the rollout engine's and does not depend on how the actor trains.
- DPO: the reference scores 16 chosen/rejected pairs, then one update on the sigmoid loss.

Full-parameter runs hold a second model as the reference; LoRA runs (rank --rank on linear_qkv, linear_proj,
linear_fc1, linear_fc2) score the reference with the actor's own model, adapters off. Printed per run, as the
parts of the process's RSS high-water mark:

- runtime: the process's resident size once torch, transformers and megatron-core are imported and the process
  group is up, before any model exists (what every run holds alike);
- weights, reference, grads, optimizer: the bytes of the actor's parameters, of the reference's own model (none
  with LoRA), of the DDP gradient buffers and of the optimizer state (moments; fp32 main copies for 16-bit
  models);
- activations: the most bytes autograd held at once for the backward (the tensors the forward saved,
  parameters left out, counted per storage), of which `logits` are one micro-batch's fp32 logits;
- rest: the high-water mark less all the above (the backward's temporaries, the allocator's free lists);
- build peak: the high-water mark while the roles are built (loading the checkpoint), reset before the steps
  (`/proc/self/clear_refs`), so the step peak is the steps' own;

The runs' processes start with glibc's mmap threshold fixed at --mmap-threshold bytes (MALLOC_MMAP_THRESHOLD_;
0 leaves the trainer's own settings, `verl_mega.parallel.host_heap`: no block mapped on its own, freed memory kept
in the heap). By default glibc raises the threshold to the size of each large block freed (up to
32 MiB), so that later tensors below it come from the heap, whose freed holes stay resident. The high-water mark
then counts memory of tensors freed earlier: with 8-row micro-batches 0.6 to 1.1 GiB of `rest`, more with LoRA
than without (docs/lora.md has the figures). A fixed threshold maps every tensor above it
on its own and unmaps it when freed, so the high-water mark is what the tensors need.

Then LoRA's ratios to full-parameter: of the RSS peak, of the model state (weights + reference + grads +
optimizer) and of the peak less the runtime (what the job allocates above the runtime's fixed footprint: the
CPU counterpart of a GPU's `max_memory_allocated`, which leaves out the CUDA context).

Step time is measured in other processes, with the trainer's own allocator settings: the fixed threshold maps and
unmaps every large tensor, so each step pays its page faults again (measured: 1.6x the step time of both modes).
--rounds rounds each run full-parameter and LoRA in fresh processes, in alternating order, so a change of the
machine's load falls on both; printed per round, the median step time (wall and CPU) over the steps after the
first (warm-up), and the median of the rounds' LoRA / full ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT, RESPONSE, ROWS = 64, 32, 32
JOBS = ("grpo", "dpo")


def random_batch(vocab_size: int, generator: torch.Generator) -> dict:
    """ROWS rows of PROMPT prompt and RESPONSE response tokens (no padding); DPO reads consecutive rows as
    chosen / rejected."""
    from verl_mega.trainer.rollout_batch import build_rollout_batch

    prompts = torch.randint(3, vocab_size, (ROWS, PROMPT), generator=generator).tolist()
    responses = torch.randint(3, vocab_size, (ROWS, RESPONSE), generator=generator).tolist()
    batch = build_rollout_batch(prompts, responses, RESPONSE, pad_token_id=0)
    batch["advantages"] = torch.randn(ROWS, RESPONSE, generator=generator)
    return batch


def tensor_bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def optimizer_state_bytes(optimizer) -> int:
    """Adam's moments and, for 16-bit models, the fp32 main copies of the trained parameters."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    state = [value for opt in inner for values in opt.optimizer.state.values() for value in values.values()
             if torch.is_tensor(value) and value.dim() > 0]
    mains = [param for opt in inner for group in getattr(opt, "shard_fp32_from_float16_groups", None)
             or getattr(opt, "fp32_from_float16_groups", []) for param in group]
    return tensor_bytes(state) + tensor_bytes(mains)


def resident_bytes() -> tuple[int, int]:
    """(current, high-water) resident bytes of this process (VmRSS, VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024 for key in ("VmRSS", "VmHWM"))


def reset_resident_peak() -> None:
    """Start VmHWM again from the current resident size (Linux's clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class SavedActivations:
    """Within it, `peak` follows the most bytes that autograd holds at once for the backward: the storages of the
    tensors the forward saves, the model's parameters left out, each counted once while it lives."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
        self.live: dict[int, tuple] = {}
        self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.parameters:
            self.live = {ptr: entry for ptr, entry in self.live.items() if not entry[0].expired()}
            self.live.setdefault(key, (StorageWeakRef(storage), storage.nbytes()))
            self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return tensor

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def measure(job: str, rank: int, ckpt: Path, steps: int, threads: int, micro: int) -> dict:
    """One job's steps, full-parameter (rank 0) or LoRA, in this process: the parts of the RSS high-water mark
    (see the module's docstring) and step times."""
    from verl_mega.algorithms import masked_sum
    from verl_mega.config import AlgorithmConfig, LoraConfig, OptimConfig, PolicyLossConfig
    from verl_mega.parallel.state import init_parallel
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.preference import PAIR_METRICS, pair_sequence_loss
    from verl_mega.roles.reference import Reference, reference_of

    torch.set_num_threads(threads)
    init_parallel(1, 1)
    runtime, _ = resident_bytes()
    reset_resident_peak()
    loss = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=0.001)
    actor = Actor(ckpt, OptimConfig(lr=1e-5 if rank else 1e-6), loss, schedule_steps=steps,
                  lora=LoraConfig(rank=rank))
    reference = reference_of(actor, ckpt)
    dpo_loss = pair_sequence_loss(AlgorithmConfig(loss="dpo"))
    generator = torch.Generator().manual_seed(0)
    walls, cpus = [], []
    _, build_peak = resident_bytes()
    reset_resident_peak()
    activations = SavedActivations(actor.model)
    for _ in range(steps):
        batch = random_batch(actor.vocab_size, generator)
        wall, cpu = time.perf_counter(), time.process_time()
        ref = reference.compute_ref_log_prob(batch, micro)
        with activations:
            if job == "grpo":
                batch["ref_log_probs"] = ref
                actor.update_policy(batch, ppo_epochs=1, mini_batch_size=ROWS, micro_batch_size=micro)
            else:
                batch["ref_sequence_log_probs"] = masked_sum(ref.cpu(), batch["response_mask"], dim=-1)
                actor.update_on_sequences(batch, ROWS, micro, PAIR_METRICS, dpo_loss)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    ddp = actor.trainable.model
    return {
        "job": job, "rank": rank,
        "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
        "runtime_bytes": runtime,
        "weight_bytes": tensor_bytes(actor.model.parameters()),
        "reference_bytes": tensor_bytes(reference.model.parameters()) if isinstance(reference, Reference) else 0,
        "grad_bytes": tensor_bytes(buffer.grad_data for buffer in ddp.buffers + ddp.expert_parallel_buffers),
        "optimizer_bytes": optimizer_state_bytes(actor.trainable.optimizer),
        "activation_bytes": activations.peak,
        "micro": micro, "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "the trainer's own"),
        "logit_bytes": micro * (PROMPT + RESPONSE) * actor.vocab_size * 4,
        "build_peak_bytes": build_peak, "rss_peak_bytes": max(build_peak, resident_bytes()[1]),
        "step_wall_s": statistics.median(walls[1:] or walls), "step_cpu_s": statistics.median(cpus[1:] or cpus),
    }


def prepare(tmp: Path) -> Path:
    """The ~100M model, converted: its megatron checkpoint folder."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    from bench.vs_trl import build_llama100m

    hf_dir = build_llama100m(tmp / "hf")
    convert_hf_to_mcore(hf_dir, tmp / "ckpt")
    return tmp / "ckpt"


def gib(value: float) -> str:
    return f"{value / 2**30:.3f}"


PARTS = ("runtime_bytes", "weight_bytes", "reference_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
MODEL_STATE = ("weight_bytes", "reference_bytes", "grad_bytes", "optimizer_bytes")


def model_state(run: dict) -> int:
    return sum(run[key] for key in MODEL_STATE)


def report(runs: list[dict]) -> None:
    print(f"micro-batches of {runs[0]['micro']} rows, glibc's mmap threshold {runs[0]['mmap_threshold']}")
    print("| job | mode | trainable params | runtime | weights | reference | grads | optimizer | activations "
          "(logits) | rest | RSS peak | build peak |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run in runs:
        mode = f"LoRA r={run['rank']}" if run["rank"] else "full"
        rest = run["rss_peak_bytes"] - sum(run[key] for key in PARTS)
        print(f"| {run['job']} | {mode} | {run['trainable_params']:,} | "
              + " | ".join(gib(run[key]) for key in PARTS[:-1])
              + f" | {gib(run['activation_bytes'])} ({gib(run['logit_bytes'])}) | {gib(rest)} "
              f"| {gib(run['rss_peak_bytes'])} | {gib(run['build_peak_bytes'])} |")
    print("GiB; rest = RSS peak less the parts before it")
    for job in JOBS:
        full, lora = (next(run for run in runs if run["job"] == job and bool(run["rank"]) == is_lora)
                      for is_lora in (False, True))
        above_runtime = [run["rss_peak_bytes"] - run["runtime_bytes"] for run in (full, lora)]
        print(f"{job}: LoRA / full: RSS peak {lora['rss_peak_bytes'] / full['rss_peak_bytes']:.2f}, model state "
              f"{model_state(lora) / model_state(full):.2f}, RSS peak less the runtime "
              f"{above_runtime[1] / above_runtime[0]:.2f}")


def report_times(rounds: list[dict]) -> None:
    """`rounds`: per round, (job, rank) -> a timing run's result."""
    print("step time, the trainer's allocator settings: | job | round | full wall s | LoRA wall s | LoRA / full wall "
          "| full CPU s | LoRA CPU s | LoRA / full CPU |")
    ratios = {job: ([], []) for job in JOBS}
    for index, runs in enumerate(rounds):
        for job in JOBS:
            full, lora = (run for (name, rank), run in sorted(runs.items()) if name == job)
            wall, cpu = (lora[key] / full[key] for key in ("step_wall_s", "step_cpu_s"))
            ratios[job][0].append(wall)
            ratios[job][1].append(cpu)
            print(f"| {job} | {index + 1} | {full['step_wall_s']:.2f} | {lora['step_wall_s']:.2f} | {wall:.2f} "
                  f"| {full['step_cpu_s']:.2f} | {lora['step_cpu_s']:.2f} | {cpu:.2f} |")
    for job, (walls, cpus) in ratios.items():
        print(f"{job}: LoRA / full step time, median of {len(walls)} rounds: wall {statistics.median(walls):.2f}, "
              f"CPU {statistics.median(cpus):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first (warm-up) is not timed")
    parser.add_argument("--rank", type=int, default=16, help="the LoRA runs' rank")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch (the activations scale with it)")
    parser.add_argument("--mmap-threshold", type=int, default=131072,
                        help="glibc's M_MMAP_THRESHOLD in the memory runs' processes, bytes (0: the trainer's own "
                             "settings)")
    parser.add_argument("--rounds", type=int, default=2, help="step-time rounds (full and LoRA, alternating)")
    parser.add_argument("--run", nargs=3, metavar=("JOB", "RANK", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # one measurement, in the fresh process the parent started
        job, rank, ckpt = args.run
        print(json.dumps(measure(job, int(rank), Path(ckpt), args.steps, args.threads, args.micro)))
        return

    def run(job: str, rank: int, env: dict) -> dict:
        out = subprocess.run([sys.executable, "-m", "bench.lora", "--steps", str(args.steps), "--threads",
                              str(args.threads), "--micro", str(args.micro), "--run", job, str(rank), str(ckpt)],
                             check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    trainer_env = {name: value for name, value in os.environ.items() if name != "MALLOC_MMAP_THRESHOLD_"}
    memory_env = {**trainer_env,
                  **({"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {})}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = prepare(Path(tmp))
        runs = [run(job, rank, memory_env) for job in JOBS for rank in (0, args.rank)]
        rounds = []
        for index in range(args.rounds):
            order = (0, args.rank) if index % 2 == 0 else (args.rank, 0)
            rounds.append({(job, rank): run(job, rank, trainer_env) for job in JOBS for rank in order})
    report(runs)
    report_times(rounds)


if __name__ == "__main__":
    main()
