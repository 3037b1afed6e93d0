"""torchrun worker for the HybridEngine tests: one launch checks one training layout for several families.

For every case and every rollout TP size t_g dividing the training TP, each rank's streamed rollout
weights must equal the HF checkpoint's tensors sliced for its rollout TP rank, bit for bit; the measured
peak must stay within the planner's figure. Then every parameter is moved (a stand-in training step) and
the next transition must carry the moved weights. With --greedy, the embedded engine loaded from the
stream must generate what transformers generates from the exported checkpoint. With --lora FAMILY, that
family's model gains LoRA adapters on its four linears: the stream must equal, bit for bit, the stream of a
model built with W + scale * B @ A written into its weights by hand, and stay within the planner's peak; then the
same for the model built in bf16 (bf16 adapters, merged in fp32 and rounded once). Quantized (rollout.quantization
int8 and fp8), each rank's stream must equal the quantizer applied to its expected slices, bit for bit, and hold
what the planner plans.

    --tp TP --pp PP --case FAMILY,HF_DIR,CKPT_DIR,EP [--case ...] [--greedy FAMILY=EXPORTED_HF_DIR ...]
        [--lora FAMILY ...] [--next --tp TP --pp PP --case ...]

`--next` starts another layout of the same world size in the same processes (each group checked in turn), so
that several layouts pay one start-up; rank 0 prints GROUP_DONE after each group.
"""
from __future__ import annotations

import argparse
import sys

import torch

from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.config import LoraConfig
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models.sharding import rank_slots, tp_part
from verl_mega.models.builder import checkpoint_tensors
from verl_mega.models.lora import apply_lora, lora_modules, lora_parameters
from verl_mega.parallel.layout import rollout_vocab_rows
from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.planner import plan
from verl_mega.rollout.quantization import quantized_stream

TRAINING_STEP_SHIFT = 0.5
PROMPTS = [[5, 6, 7, 8], [9, 10]]
LORA = LoraConfig(rank=4, alpha=8.0)


def expected_rollout_slice(reader: SafetensorsReader, cfg, family, padded_vocab: int, part: int, parts: int,
                           shift: float) -> dict[str, torch.Tensor]:
    """Ground truth: each HF tensor of the checkpoint, cut for rollout TP rank `part` of `parts`."""
    expected = {}
    for slot in rank_slots(cfg, family):
        assert slot.rule.fusion is None, "ground truth for fused HF tensors is not written"
        for name in slot.hf_names:
            full = reader.read(name)
            if slot.rule.vocab:
                rows = rollout_vocab_rows(padded_vocab, cfg.vocab_size, part, parts)
                piece = full[rows.start:rows.stop]
            else:
                piece = tp_part(full, slot.rule.tp_dim, part, parts)
            expected[name] = piece + shift if shift else piece
    return expected


def check_transition(engine: HybridEngine, reader, hf_dir: str, cfg, family, padded_vocab: int, shift: float,
                     label: str) -> None:
    layout = engine.layout
    received = {}
    for name, tensor in engine.stream():
        assert name not in received, f"{label}: '{name}' streamed twice"
        received[name] = tensor.clone()
    expected = expected_rollout_slice(reader, cfg, family, padded_vocab, engine.rollout_tp_rank, engine.rollout_tp,
                                      shift)
    assert set(received) == set(expected), (
        f"{label}: names differ: extra {sorted(set(received) - set(expected))[:4]}, "
        f"missing {sorted(set(expected) - set(received))[:4]}")
    for name, want in expected.items():
        got = received[name]
        assert got.shape == want.shape and torch.equal(got, want), (
            f"{label} rank {layout.rank}: '{name}' differs (shape {tuple(got.shape)} vs {tuple(want.shape)})")
    check_feed_describes_stream(engine, received, reader, cfg, family, label)
    figures = plan(hf_dir, layout.tp, layout.pp, layout.dp, engine.rollout_tp, ep=layout.ep).ranks[layout.rank]
    at = figures.coordinates
    coords = (at.tp_rank, at.pp_rank, at.dp_rank, at.ep_rank, figures.rollout_tp_rank)
    assert coords == (layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.ep_rank, engine.rollout_tp_rank), (
        f"{label}: planner places rank {layout.rank} at {coords}")
    held = sum(t.numel() * t.element_size() for t in received.values())
    assert held == figures.rollout_bytes, f"{label}: rollout bytes {held} != planned {figures.rollout_bytes}"
    assert engine.tracker.peak <= figures.transition_peak_bytes, (
        f"{label} rank {layout.rank}: measured peak {engine.tracker.peak} B > planned {figures.transition_peak_bytes} B")
    if layout.rank == 0:
        print(f"{label}: ok, peak {engine.tracker.peak} B <= planned {figures.transition_peak_bytes} B", flush=True)


def check_quantized_transition(model, cfg, family, rollout_tp: int, reader, hf_dir: str, padded_vocab: int,
                                label: str) -> None:
    """Quantized streams: the quantizer's output on the expected slices, bit for bit, and the planned bytes."""
    layout = current_layout()
    for fmt in ("int8", "fp8"):
        engine = HybridEngine(model, cfg, family, rollout_tp, measure_peak=True, quantization=fmt)
        received = {name: tensor.clone() for name, tensor in engine.stream()}
        slices = expected_rollout_slice(reader, cfg, family, padded_vocab, engine.rollout_tp_rank, rollout_tp, 0.0)
        expected = dict(quantized_stream(slices.items(), fmt))
        assert set(received) == set(expected), f"{label} {fmt}: names differ"
        for name, want in expected.items():
            got = received[name]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                                                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want), (
                f"{label} {fmt} rank {layout.rank}: '{name}' differs")
        figures = plan(hf_dir, layout.tp, layout.pp, layout.dp, rollout_tp, ep=layout.ep,
                       quantization=fmt).ranks[layout.rank]
        held = sum(t.numel() * t.element_size() for t in received.values())
        assert held == figures.rollout_bytes, f"{label} {fmt}: rollout bytes {held} != planned {figures.rollout_bytes}"
        assert engine.tracker.peak <= figures.transition_peak_bytes, f"{label} {fmt}: peak over the plan"
    if layout.rank == 0:
        print(f"{label}: int8 and fp8 streams are the quantizer's, bytes as planned", flush=True)


def check_feed_describes_stream(engine: HybridEngine, received: dict, reader, cfg, family, label: str) -> None:
    """The rollout engine is built from `engine.feed`: it must say how the stream is laid out on this rank."""
    feed = engine.feed
    assert (feed.rollout_tp, feed.rollout_tp_rank, feed.vocab_size) == (
        engine.rollout_tp, engine.rollout_tp_rank, cfg.vocab_size), f"{label}: feed {feed}"
    assert feed.presliced == (engine.rollout_tp > 1), f"{label}: feed {feed}"
    for slot in rank_slots(cfg, family):
        for name in slot.hf_names:
            whole = reader.shape(name)
            if slot.rule.vocab:
                rows = feed.vocab_rows(feed.rollout_tp_rank)
                assert tuple(received[name].shape) == (len(rows), *whole[1:]), f"{label}: '{name}' vs feed {feed}"
            elif not feed.presliced:
                assert tuple(received[name].shape) == tuple(whole), f"{label}: '{name}' is not whole at rollout TP 1"


def check_greedy_parity(engine: HybridEngine, cfg, export_dir: str, label: str) -> None:
    from transformers import AutoModelForCausalLM

    from verl_mega.rollout.embedded import EmbeddedEngine
    from verl_mega.rollout.engine import SamplingParams

    rollout = EmbeddedEngine(cfg.raw)
    rollout.load_weights(engine.stream())
    params = SamplingParams(temperature=0, max_new_tokens=8)
    responses = rollout.generate(PROMPTS, params)
    reference = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    for prompt, response in zip(PROMPTS, responses):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=params.max_new_tokens)
        want = out[0, len(prompt):].tolist()
        assert response.token_ids == want, f"{label}: greedy {response.token_ids} != transformers {want}"
    if current_layout().rank == 0:
        print(f"{label}: greedy generation matches transformers: {responses[0].token_ids}", flush=True)


def add_trained_adapters(model) -> None:
    """`apply_lora`'s adapters, with B moved off its zero start (as training would) so that they change the weights."""
    apply_lora(model, LORA)
    generator = torch.Generator().manual_seed(current_layout().rank)
    with torch.no_grad():
        for name, param in lora_parameters(model):
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator))


def check_merged_stream(model, ckpt_dir: str, hf_dir: str, cfg, family, label: str, dtype: str = "fp32") -> None:
    """The stream of a model in `dtype` with adapters == the stream of a model built with W + scale * B @ A (fp32
    math, rounded to `dtype`) as its weights."""
    layout = current_layout()
    add_trained_adapters(model)
    rollout_tps = [t for t in range(1, layout.tp + 1) if layout.tp % t == 0]
    merged_streams, peaks = {}, []
    for rollout_tp in rollout_tps:
        engine = HybridEngine(model, cfg, family, rollout_tp, measure_peak=True)
        merged_streams[rollout_tp] = {name: tensor.clone() for name, tensor in engine.stream()}
        figures = plan(hf_dir, layout.tp, layout.pp, layout.dp, rollout_tp, ep=layout.ep, dtype=dtype,
                       lora_rank=LORA.rank, lora_targets=LORA.targets).ranks[layout.rank]
        assert engine.tracker.peak <= figures.transition_peak_bytes, (
            f"{label} -> t_g={rollout_tp} rank {layout.rank}: measured peak {engine.tracker.peak} B > planned "
            f"{figures.transition_peak_bytes} B with adapters")
        peaks.append(f"t_g={rollout_tp} peak {engine.tracker.peak} B <= planned {figures.transition_peak_bytes} B")
    by_hand, _, _, _ = build_model_from_checkpoint(ckpt_dir, dtype=dtype)
    trained = checkpoint_tensors(model)
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(by_hand).items():  # the model's weights as trained so far
            tensor.copy_(trained[name])
        for info in lora_modules(model):
            adapted, plain = model.get_submodule(info.name), by_hand.get_submodule(info.name)
            delta = adapted.lora_b.float() @ adapted.lora_a.float()
            plain.weight.copy_((adapted.weight.float() + info.scale * delta).to(adapted.weight.dtype))
    for rollout_tp in rollout_tps:
        plain = dict(HybridEngine(by_hand, cfg, family, rollout_tp).stream())
        streamed = merged_streams[rollout_tp]
        assert set(plain) == set(streamed), f"{label} -> t_g={rollout_tp}: the merged stream's names differ"
        for name, want in plain.items():
            assert torch.equal(streamed[name], want), (
                f"{label} -> t_g={rollout_tp} rank {layout.rank}: merged '{name}' differs from the hand-merged model's")
    if layout.rank == 0:
        print(f"{label}: merged stream equals the hand-merged model's; {', '.join(peaks)}", flush=True)


def run_case(family_name: str, hf_dir: str, ckpt_dir: str, ep: int, tp: int, pp: int, greedy_export: str | None,
             lora: bool = False) -> None:
    init_parallel(tp, pp, ep)
    model, manifest, cfg, family = build_model_from_checkpoint(ckpt_dir)
    reader = SafetensorsReader(hf_dir)
    layout = current_layout()
    engines = [HybridEngine(model, cfg, family, rollout_tp, measure_peak=True)
               for rollout_tp in range(1, tp + 1) if tp % rollout_tp == 0]
    for engine in engines:
        label = f"{family_name} tp={tp} pp={pp} dp={layout.dp} ep={ep} -> t_g={engine.rollout_tp}"
        check_transition(engine, reader, hf_dir, cfg, family, manifest.padded_vocab_size, 0.0, label)
        check_quantized_transition(model, cfg, family, engine.rollout_tp, reader, hf_dir, manifest.padded_vocab_size,
                                   label)
    if greedy_export:
        check_greedy_parity(engines[0], cfg, greedy_export, f"{family_name} tp={tp} pp={pp}")
    with torch.no_grad():  # a step moves the parameters and (DeepSeek-V3) the router's expert bias
        for tensor in checkpoint_tensors(model).values():
            tensor.add_(TRAINING_STEP_SHIFT)
    for engine in engines:
        label = f"{family_name} tp={tp} pp={pp} dp={layout.dp} ep={ep} -> t_g={engine.rollout_tp} after a step"
        check_transition(engine, reader, hf_dir, cfg, family, manifest.padded_vocab_size, TRAINING_STEP_SHIFT, label)
    if lora:
        label = f"{family_name} tp={tp} pp={pp} dp={layout.dp} with LoRA"
        check_merged_stream(model, ckpt_dir, hf_dir, cfg, family, label)
        bf16_model, _, _, _ = build_model_from_checkpoint(ckpt_dir, dtype="bf16")
        check_merged_stream(bf16_model, ckpt_dir, hf_dir, cfg, family, f"{label} in bf16", "bf16")


def layout_groups(argv: list[str]) -> list[list[str]]:
    """The arguments of each layout group: `argv` split at `--next`."""
    groups = [[]]
    for arg in argv:
        if arg == "--next":
            groups.append([])
        else:
            groups[-1].append(arg)
    return groups


def run_group(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--greedy", action="append", default=[], help="FAMILY=EXPORTED_HF_DIR")
    parser.add_argument("--lora", action="append", default=[], help="FAMILY whose merged LoRA stream is checked")
    args = parser.parse_args(argv)
    greedy = dict(item.split("=", 1) for item in args.greedy)
    for case in args.case:
        family_name, hf_dir, ckpt_dir, ep = case.split(",")
        run_case(family_name, hf_dir, ckpt_dir, int(ep), args.tp, args.pp, greedy.get(family_name),
                 family_name in args.lora)


GROUP_DONE = "hybrid_worker: layout group {index} passed"  # printed by rank 0 once every rank is through it


def main(argv=None) -> None:
    import torch.distributed as dist

    for index, group in enumerate(layout_groups(sys.argv[1:] if argv is None else argv)):
        run_group(group)
        dist.barrier()
        if current_layout().rank == 0:
            print(GROUP_DONE.format(index=index), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main())
