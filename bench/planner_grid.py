"""The memory planner against measurement, per rank, over a grid of layouts (gloo, CPU, 2 and 4 ranks).

    python -m bench.planner_grid [--world 2 4] [--out planner_grid.json]

A small Qwen2-shaped model (hidden 256, 4 layers, vocabulary 1024) converted at each layout's TP and PP. For each
layout every rank builds the actor as training does (`memory_overrides` for recompute and sequence parallelism,
`TrainableModel` with megatron DDP and optimizer, one zero-gradient step so Adam's state exists) and measures
the bytes of the distinct storages it holds, compared with `planning.memory.plan_memory` of the same config:
- state: parameters, gradient buffers and optimizer state (fp32 main parameters, Adam's moments and step
  counters), against the planner's params + grads + optimizer of the largest stage (both the largest rank's);
- window: what of it stays on the device in the rollout window under `actor.offload`
  (`rollout.training_memory`, after the parameters are released), against the planner's rollout-phase resident
  bytes;
- activations: `LiveBytes`' peak over megatron's schedule (1F1B over the stages) running as many micro-batches as
  pipeline stages through forward, token log-probs (`roles.logprobs`) and backward, the gradients allocated
  before, against what the planner's actor update adds to the resident state (activations of the micro-batches
  in flight, logits, the unfused attention's scores buffer, the backward's working set; megatron's local layers,
  as on CPU);
- peak: the storage of every live tensor before that pass plus its `LiveBytes` peak, as `trainer.metrics.PeakMemory`
  counts perf/max_memory_allocated_gb on CPU, against the planner's update peak.
Prints a table, measured / predicted per quantity; `--out` keeps it as JSON. Each launch is one torchrun over
its layouts.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from bench import with_repo_on_path

SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)
VOCAB = 1024
SEQ = 256  # tokens of the measured micro-batch: data.max_prompt_length + data.max_response_length


@dataclasses.dataclass(frozen=True)
class GridLayout:
    world: int
    tp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    distributed: bool = False
    sp: bool = False
    recompute: str = "none"
    offload: tuple[bool, bool, bool] = (False, True, True)  # params, grads, optimizer
    rows: int = 1
    vpp: int = 1

    @property
    def micro_batches(self) -> int:
        """As many as pipeline stages: the first stage then holds all of them under 1F1B; with virtual stages,
        times their number, so that the interleaved schedule's warm-up runs whole groups of them."""
        return self.pp * self.vpp

    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", *[f"vpp{self.vpp}"] * (self.vpp > 1),
                 f"dp{self.world // (self.tp * self.pp)}", self.dtype]
        parts += ["distopt"] * self.distributed + ["sp"] * self.sp + [f"rc-{self.recompute}"] * (self.recompute != "none")
        offloaded = [part for part, on in zip(("params", "grads", "optim"), self.offload) if on]
        parts.append("off-" + ("+".join(offloaded) or "none"))
        return " ".join(parts + [f"b{self.rows}"])

    def overrides(self, hf: Path) -> list[str]:
        recompute = {"none": [], "selective": ["actor.recompute.granularity=selective"],
                     "full": ["actor.recompute.granularity=full", "actor.recompute.num_layers=1"]}[self.recompute]
        params, grads, optimizer = (str(on).lower() for on in self.offload)
        dp = self.world // (self.tp * self.pp)
        return [f"model.hf_path={hf}", f"model.dtype={self.dtype}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                f"parallel.vpp={self.vpp}",
                f"parallel.sequence_parallel={str(self.sp).lower()}", "rollout.engine=embedded",
                f"actor.optim.use_distributed_optimizer={str(self.distributed).lower()}", *recompute,
                f"actor.offload.params={params}", f"actor.offload.grads={grads}", f"actor.offload.optimizer={optimizer}",
                f"actor.micro_batch_size={self.rows}", f"actor.mini_batch_size={self.rows * dp * self.micro_batches}",
                f"data.batch_size={self.rows * dp * self.micro_batches}", "rollout.n=1", "critic.enable=false",
                "algorithm.adv_estimator=grpo", f"data.max_prompt_length={SEQ // 2}",
                f"data.max_response_length={SEQ // 2}"]


GRID = [
    GridLayout(2, dtype="fp32"),
    GridLayout(2, distributed=True),
    GridLayout(2, tp=2, sp=True),
    GridLayout(2, tp=2, recompute="selective", rows=2),
    GridLayout(2, pp=2, dtype="fp32", recompute="full"),
    GridLayout(2, pp=2, vpp=2, dtype="fp32"),
    GridLayout(2, offload=(True, True, True)),
    GridLayout(2, dtype="fp32", distributed=True, offload=(True, True, True)),
    GridLayout(4, distributed=True, offload=(True, False, True)),
    GridLayout(4, tp=2, distributed=True, sp=True, recompute="full"),
    GridLayout(4, tp=4, sp=True, rows=2),
    GridLayout(4, pp=2, distributed=True),
    GridLayout(4, tp=2, pp=2, offload=(True, True, True)),
    GridLayout(4, pp=4, dtype="fp32", offload=(False, False, False)),
    GridLayout(4, tp=2, pp=2, dtype="fp32", distributed=True, recompute="selective"),
]


def predicted(layout: GridLayout, hf: Path) -> dict[str, float]:
    from verl_mega.config import load_config
    from verl_mega.planning.memory import Model, Roles, layout_of, plan_memory

    config = load_config(None, layout.overrides(hf))
    plan = plan_memory(Model(config), layout_of(config, layout.world), Roles(critic=False, reference=False),
                       attention="unfused")
    update = plan.phases["actor.update"]
    return {"state": sum(plan.roles["actor"].values()), "window": plan.phases["rollout"].resident_bytes,
            "activations": update.total_bytes - update.resident_bytes, "peak": update.total_bytes}


def storages_bytes(tensors) -> int:
    return sum({tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors if tensor.untyped_storage().nbytes()}.values())


def measure(layout: GridLayout, ckpt: Path, hf: Path) -> dict[str, float]:
    """This rank's state, window and (one stage) activation bytes."""
    from verl_mega.config import load_config
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.models.builder import memory_overrides
    from verl_mega.models.chunks import schedule_chunks
    from verl_mega.parallel.pipeline import run_schedule
    from verl_mega.roles.batching import causal_padding_mask
    from verl_mega.roles.logprobs import vocab_parallel_logprobs
    from verl_mega.roles.trainable import TrainableModel
    from verl_mega.rollout.live_bytes import LiveBytes
    from verl_mega.trainer.metrics import live_tensor_bytes
    from verl_mega.rollout.training_memory import (
        _main_parameters, _megatron_grad_buffers, _optimizer_state_tensors, training_memory_released,
    )

    config = load_config(None, layout.overrides(hf))
    module, *_ = build_model_from_checkpoint(ckpt, dtype=layout.dtype,
                                             **memory_overrides(config.actor, config.parallel))
    trainable = TrainableModel(module, config.actor.optim, schedule_steps=1)
    trainable.step()  # Adam's state is created at the first step

    def held() -> list[torch.Tensor]:
        return [*trainable.model.parameters(), *(buffer.grad_data for buffer in _megatron_grad_buffers(trainable.model)),
                *_optimizer_state_tensors(trainable.optimizer), *_main_parameters(trainable.optimizer)]

    found = {"state": storages_bytes(held())}
    with training_memory_released(trainable.model, trainable.optimizer, config.actor.offload) as release_params:
        release_params()
        found["window"] = storages_bytes(held())
    ids = torch.randint(3, VOCAB, (layout.rows, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(layout.rows, -1)
    mask = causal_padding_mask(torch.ones_like(ids))

    def forward_step(data_iterator, stage_model):
        next(data_iterator)
        logits = stage_model(ids, positions, mask)  # the last stage's [rows, SEQ, V/tp]; else its hidden states

        def loss_func(output):
            log_probs = vocab_parallel_logprobs(output[:, :-1], ids[:, 1:], vocab_size=VOCAB, return_entropy=False)
            return -log_probs.mean(), {}

        return logits, loss_func

    trainable.model.train()
    resident = live_tensor_bytes()
    with LiveBytes() as tracked:  # megatron's schedule, 1F1B over the pipeline stages (interleaved over chunks)
        run_schedule(schedule_chunks(trainable.model), [{"input_ids": ids}] * layout.micro_batches, forward_step,
                     forward_only=False)
    found["activations"] = tracked.peak
    found["peak"] = resident + tracked.peak  # as the trainer's perf/max_memory_allocated_gb counts it on CPU
    return found


def worker(hf: str, ckpts: str, out: str, world: int) -> None:
    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel

    rows = []
    for layout in (layout for layout in GRID if layout.world == world):
        init_parallel(layout.tp, layout.pp, vpp=layout.vpp)
        found = measure(layout, Path(ckpts) / f"tp{layout.tp}pp{layout.pp}", Path(hf))
        gc.collect()  # the layout's model and optimizer, in reference cycles, before the next layout counts
        gathered = [None] * world
        dist.all_gather_object(gathered, found)
        if current_layout().rank == 0:
            largest = {key: max(rank[key] for rank in gathered if key in rank) for key in found}
            rows.append({"layout": layout.name(), "measured": largest, "predicted": predicted(layout, Path(hf))})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=2))
    destroy_parallel()


def prepare(root: Path, sizes: list[tuple[int, int]] | None = None) -> tuple[Path, Path]:
    """The small model's HF folder and its checkpoints at each (TP, PP) of `sizes` (default: the grid's)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=VOCAB, tokenizer=False, **SMALL)
    for tp, pp in sizes or sorted({(layout.tp, layout.pp) for layout in GRID}):
        convert_hf_to_mcore(hf, root / "ckpt" / f"tp{tp}pp{pp}", tp=tp, pp=pp)
    return hf, root / "ckpt"


def run_grid(worlds: list[int], root: Path) -> list[dict]:
    from verl_mega.parallel.spawn import run_torchrun

    hf, ckpts = prepare(root)
    rows = []
    for world in worlds:
        out = root / f"world{world}.json"
        run_torchrun(world, "bench.planner_grid", ["--worker", str(hf), str(ckpts), str(out), str(world)],
                     env=with_repo_on_path())
        rows += json.loads(out.read_text())
    return rows


def ratios(row: dict) -> dict[str, float]:
    """measured / predicted of each quantity measured (a zero prediction measured as zero counts 1)."""
    return {key: (value / row["predicted"][key] if row["predicted"][key] else float(value == 0) or float("inf"))
            for key, value in row["measured"].items()}


QUANTITIES = ("state", "window", "activations", "peak")


def print_table(rows: list[dict]) -> None:
    kib = 1024
    print(f"{'layout':<48} " + " ".join(f"{key + ' KiB':>18}" for key in QUANTITIES) + "   (measured/predicted)")
    for row in rows:
        cells = []
        for key in QUANTITIES:
            if key in row["measured"]:
                cells.append(f"{row['measured'][key] / kib:>7.0f}/{row['predicted'][key] / kib:<7.0f} "
                             f"{ratios(row)[key]:>5.2f}")
            else:
                cells.append(f"{'-':>18}")
        print(f"{row['layout']:<48} " + " ".join(cells))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.planner_grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        hf, ckpts, out, world = args.worker
        worker(hf, ckpts, out, int(world))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_grid(args.world, Path(tmp))
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
