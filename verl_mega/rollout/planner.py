"""Dry run of a HybridEngine transition: per rank, the bytes held for training, held for rollout, and
sent / received in between, from the HF model's config.json alone (no weights need to be present, so a
large run can be planned before its checkpoint is downloaded).

    verl-mega plan --hf DIR --train-tp T --train-pp P --dp D --rollout-tp t [--ep E] [--dtype bf16]
        [--lora-rank R --lora-targets linear_qkv,linear_proj,linear_fc1,linear_fc2]

The figures follow what `HybridEngine.stream` does, tensor by tensor, so its measured peak can be
checked against `RankPlan.transition_peak_bytes`. With LoRA, a targeted tensor's merged shard is one
more buffer while it is regrouped (and its fp32 merge before that). With a quantized rollout
(`rollout.quantization`), the engine holds each linear weight in 1 byte per element plus its fp32 scales
(`quantization.quantized_weight_bytes`), and quantizing one tensor holds up to three fp32 copies of it (its
float copy, the quotient, fp8's padded magnitudes) beside the transfer buffers.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from verl_mega.config.schema import LoraConfig
from verl_mega.hub import HubError, model_ref, resolve_model
from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES, padded_vocab_size
from verl_mega.models.expected_shapes import expected_hf_shapes, mcore_shard_shape
from verl_mega.models.lora import config_problems as lora_config_problems, model_problems as lora_model_problems
from verl_mega.models.sharding import rank_slots
from verl_mega.parallel.layout import (
    LARGEST_WORLD, RankCoordinates, check_model_fit, check_rollout_tp, check_sizes, data_parallel_size, rank_coordinates,
    rollout_coordinates, rollout_vocab_rows,
)

from .hybrid_engine import slice_is_gathered_shards, transfer_order
from .quantization import FORMATS as QUANTIZATION_FORMATS, is_quantized_linear_shape, quantized_weight_bytes

QUANTIZING_FP32_COPIES = 3


@dataclass(frozen=True)
class RankPlan:
    coordinates: RankCoordinates  # where the rank sits in the training grid
    rollout_tp_rank: int
    train_bytes: int  # this rank's training shards (vocabulary padded)
    rollout_bytes: int  # the rollout slice the engine ends up holding
    transition_peak_bytes: int  # most bytes of transfer buffers alive at once, during the transition
    send_bytes: int
    recv_bytes: int


@dataclass(frozen=True)
class Plan:
    train_tp: int
    train_pp: int
    dp: int
    ep: int
    rollout_tp: int
    model_bytes: int  # M: the whole model, unpadded, tied embedding once
    largest_tensor_bytes: int
    ranks: tuple[RankPlan, ...]

    def format(self) -> str:
        mib = 1024 ** 2
        lines = [
            f"training tp={self.train_tp} pp={self.train_pp} dp={self.dp} ep={self.ep} -> rollout tp={self.rollout_tp}"
            f" (micro-DP groups of {self.train_tp // self.rollout_tp}); model {self.model_bytes / mib:.2f} MiB, "
            f"largest tensor {self.largest_tensor_bytes / mib:.2f} MiB",
            f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>3} {'ep':>3} {'rtp':>3} {'train MiB':>10} {'rollout MiB':>12} "
            f"{'peak xfer MiB':>14} {'send MiB':>9} {'recv MiB':>9}",
        ]
        for r in self.ranks:
            at = r.coordinates
            lines.append(
                f"{at.rank:>4} {at.tp_rank:>3} {at.pp_rank:>3} {at.dp_rank:>3} {at.ep_rank:>3} {r.rollout_tp_rank:>3} "
                f"{r.train_bytes / mib:>10.2f} {r.rollout_bytes / mib:>12.2f} {r.transition_peak_bytes / mib:>14.2f} "
                f"{r.send_bytes / mib:>9.2f} {r.recv_bytes / mib:>9.2f}"
            )
        return "\n".join(lines)


def plan(hf_dir: str | Path, train_tp: int, train_pp: int, dp: int, rollout_tp: int, *, ep: int = 1,
         dtype: str = "fp32", make_vocab_size_divisible_by: int = 128, family_spec: str | None = None,
         lora_rank: int = 0, lora_targets: Sequence[str] = (), quantization: str = "none") -> Plan:
    """Per-rank bytes of the transition; raises ValueError naming the size that makes a layout impossible.
    `lora_rank` > 0: the actor has adapters on the linears named in `lora_targets` (megatron's names), which
    the transition streams merged. `quantization`: the rollout's format (`rollout.quantization`)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if quantization not in QUANTIZATION_FORMATS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_FORMATS)}, got '{quantization}'")
    names = {"tp": "--train-tp", "pp": "--train-pp", "ep": "--ep", "dp": "--dp", "rollout_tp": "--rollout-tp"}
    if type(lora_rank) is not int or lora_rank < 0:
        raise ValueError(f"--lora-rank must be a whole number >= 0, got {lora_rank!r}")
    check_sizes({"tp": train_tp, "pp": train_pp, "ep": ep, "dp": dp, "rollout_tp": rollout_tp}, names)
    world_size = train_tp * train_pp * dp
    if world_size > LARGEST_WORLD:  # every rank is planned and listed: 1e11 of them still ran after 300 s
        raise ValueError(f"--train-tp x --train-pp x --dp = {world_size} ranks; a plan lists each rank, up to "
                         f"{LARGEST_WORLD}")
    data_parallel_size(world_size, train_tp, train_pp, ep, names)
    check_rollout_tp(train_tp, rollout_tp, names)
    hf_config, family = load_hf_model_config(hf_dir, family_spec)
    check_model_fit(hf_config, train_tp, train_pp, ep, names)
    if lora_rank:  # the refusals training makes (a rank wider than a shard, unknown targets), planned or not
        adapters = LoraConfig(rank=lora_rank, targets=list(lora_targets))
        problems = lora_config_problems(adapters, "lora") + lora_model_problems(adapters, "lora", hf_config, family,
                                                                                train_tp)
        if problems:
            raise ValueError(problems[0])
    in_rollout = [rollout_coordinates(rank, world_size, train_tp, rollout_tp) for rank in range(world_size)]
    hf_shapes = expected_hf_shapes(hf_config, family)
    padded_vocab = padded_vocab_size(hf_config.vocab_size, train_tp, make_vocab_size_divisible_by)
    micro_dp = in_rollout[0].micro_dp

    def item(slot) -> int:  # a tensor kept in fp32 (DeepSeek-V3's expert bias) is so in any model dtype
        return slot.rule.stored_dtype(DTYPES[dtype]).itemsize

    def shard_bytes(slot) -> int:
        numel = sum(math.prod(hf_shapes[name]) for name in slot.hf_names)
        if slot.rule.vocab:
            numel = numel // hf_config.vocab_size * padded_vocab
        return numel * item(slot) // (train_tp if slot.rule.tp_dim is not None else 1)

    def merge_bytes(slot) -> int:  # the buffers of models.lora.merged_weight; 0 for a tensor without adapters
        if lora_rank == 0 or not any(slot.rule.mcore.endswith(f".{target}.weight") for target in lora_targets):
            return 0
        rows, cols = mcore_shard_shape(slot, hf_config, train_tp, padded_vocab)
        narrower = item(slot) != 4  # an fp32 weight and its factors are used as they are, without fp32 copies
        return 4 * rows * cols + narrower * (item(slot) * rows * cols + 4 * lora_rank * (rows + cols))

    def quantized_parts(slot) -> list[tuple[int, ...]]:
        """The rollout slice shapes of the slot's HF tensors the rollout receives quantized."""
        if quantization == "none":
            return []
        parts = []
        for name in slot.hf_names:
            shape = list(hf_shapes[name])
            if is_quantized_linear_shape(name, shape):
                if slot.rule.tp_dim is not None:
                    shape[slot.rule.tp_dim] //= rollout_tp
                parts.append(tuple(shape))
        return parts

    def held_bytes(slot, slice_bytes: int) -> int:
        """The rollout slice's bytes as the engine holds it: quantized parts at 1 B + scales, the rest as is."""
        parts = quantized_parts(slot)
        plain = slice_bytes - sum(math.prod(shape) for shape in parts) * item(slot)
        return plain + sum(quantized_weight_bytes(shape, quantization) for shape in parts)

    transfers = [(stage, owner_ep, slot, shard_bytes(slot))
                 for stage, owner_ep, slot in transfer_order(hf_config, family, train_pp, ep)]
    model_bytes = sum(math.prod(hf_shapes[n]) * item(slot) for _, _, slot, _ in transfers for n in slot.hf_names)
    largest = max(math.prod(hf_shapes[n]) * item(slot) for _, _, slot, _ in transfers for n in slot.hf_names)

    ranks = []
    for rank, rollout_at in enumerate(in_rollout):
        at = rank_coordinates(rank, train_tp, train_pp, dp, ep)
        pp_rank, ep_rank = at.pp_rank, at.ep_rank
        rollout_tp_rank = rollout_at.rollout_tp_rank
        # Training holds the last stage's copy of a tied embedding too, which the transition skips.
        train = sum(shard_bytes(slot) for slot in rank_slots(hf_config, family, pp_rank, train_pp, ep_rank, ep))
        rollout = peak = send = recv = largest_output = 0
        for stage, owner_ep, slot, shard in transfers:
            split = slot.rule.tp_dim is not None
            slice_bytes = shard * micro_dp if split else shard
            if slot.rule.vocab:
                rows = rollout_vocab_rows(padded_vocab, hf_config.vocab_size, rollout_tp_rank, rollout_tp)
                rollout += slice_bytes // (padded_vocab // rollout_tp) * len(rows)
            else:
                rollout += held_bytes(slot, slice_bytes)
            at_stage = pp_rank == stage
            owns = at_stage and (not slot.rule.per_expert or ep_rank == owner_ep)
            if slot.rule.per_expert and ep > 1 and at_stage:
                send += shard * (ep - 1) if owns else 0
                recv += 0 if owns else shard
            if train_pp > 1:
                send += shard * (train_pp - 1) if at_stage else 0
                recv += 0 if at_stage else shard
            if split and micro_dp > 1:
                send += shard * (micro_dp - 1)
                recv += shard * (micro_dp - 1)
            merging = merge_bytes(slot)
            # The owner's merged shard is held through the regroup like a received one.
            buffers = _transient_bytes(slot.rule, shard, slice_bytes, owns and not merging, split and micro_dp > 1)
            quantizing = QUANTIZING_FP32_COPIES * 4 * max((math.prod(s) for s in quantized_parts(slot)), default=0)
            peak = max(peak, buffers + quantizing, merging if owns else 0)
            largest_output = max(largest_output, slice_bytes)
        # The consumer still holds the previous tensor while the next one is being assembled.
        ranks.append(RankPlan(at, rollout_tp_rank, train, rollout, peak + largest_output, send, recv))
    return Plan(train_tp, train_pp, dp, ep, rollout_tp, model_bytes, largest, tuple(ranks))


def _transient_bytes(rule, shard_bytes: int, slice_bytes: int, owns: bool, gathers: bool) -> int:
    """Most bytes `HybridEngine._hf_slices` allocates at once for one tensor."""
    received = 0 if owns else shard_bytes
    if slice_is_gathered_shards(rule):
        if not gathers:
            return received  # the shard itself is the slice
        if rule.tp_dim == 0:
            return slice_bytes  # received and gathered straight into the slice
        return received + 2 * slice_bytes  # gathered, then joined along dim 1
    # split_mcore_to_hf: the gathered shards, then the layout's pieces and the joined outputs (each <= a slice)
    return received + (slice_bytes if gathers else 0) + 2 * slice_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl-mega plan", description=__doc__.split("\n\n")[0],
                                     epilog="verl-mega plan --memory CONFIG [key=value ...]: the run's predicted "
                                            "memory per rank instead (--memory --help)")
    parser.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors), or a Hub id "
                                                    "org/name[@revision] (its config.json is downloaded)")
    parser.add_argument("--train-tp", type=int, required=True)
    parser.add_argument("--train-pp", type=int, required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--rollout-tp", type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--family-spec", help="package.module:SPEC of a family declared outside verl_mega")
    parser.add_argument("--lora-rank", type=int, default=0, help="the actor's LoRA rank (0: no adapters)")
    parser.add_argument("--lora-targets", default="linear_qkv,linear_proj,linear_fc1,linear_fc2",
                        help="comma-separated megatron linears with adapters (with --lora-rank)")
    args = parser.parse_args(argv)
    try:
        hf_dir = resolve_model(model_ref(args.hf), weights=False).path if model_ref(args.hf) else args.hf
        load_hf_model_config(hf_dir, args.family_spec)  # a broken model folder is the folder's fault, not the layout's
    except (HubError, ValueError, OSError) as err:
        parser.exit(2, f"verl-mega plan: error: {err}\n")
    try:
        result = plan(hf_dir, args.train_tp, args.train_pp, args.dp, args.rollout_tp, ep=args.ep, dtype=args.dtype,
                      family_spec=args.family_spec, lora_rank=args.lora_rank,
                      lora_targets=args.lora_targets.split(","))
    except ValueError as err:
        parser.exit(2, f"verl-mega plan: impossible layout: {err}\n")
    except OSError as err:
        parser.exit(2, f"verl-mega plan: error: {err}\n")
    print(result.format())


if __name__ == "__main__":
    main()
