"""Logit parity: megatron-core built from the shards vs transformers on the same random tokens, judged by
`converters.parity`'s dtype-aware rule: both sides' weights upcast exactly to fp32 (the verdict on the weights),
and for a 16-bit checkpoint also both in its dtype (like with like), a second line.

Runs under torchrun (the checkpoint's TP x PP x EP unless given); `verify_checkpoint` launches that from a
plain process. Several checkpoints of one layout share a launch. Under torchrun the figures are printed; the
launcher returns them (written as JSON by rank 0).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.checkpoint.model_io import build_model_from_checkpoint, open_hf_checkpoint
from verl_mega.models.builder import DTYPES, uses_transformer_engine
from verl_mega.models import HFModelConfig, load_hf_model_config
from verl_mega.models.families import family_for, sequence_limit
from verl_mega.parallel.spawn import in_distributed_job, run_torchrun
from verl_mega.parallel.pipeline import forward_only_outputs
from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.parallel.world import read_world

from .hf_to_mcore import check_hf_tensors
from .parity import Parity, fp32_gemms_run_tf32, logit_parity, one_ulp_moved

# Tokens a parity check runs: their logits are held in fp32 on both sides (8192 x a 152k vocabulary: 5 GB each).
LARGEST_CHECK_TOKENS = 8192


def verify_checkpoint(hf_dir: str | Path, ckpt_dir: str | Path, **kwargs) -> Parity:
    """The parity figures of one checkpoint (see `verify_checkpoints`)."""
    return verify_checkpoints([(hf_dir, ckpt_dir)], **kwargs)[0]


def verify_checkpoints(pairs: list[tuple[str | Path, str | Path]], *, tp: int | None = None, pp: int | None = None,
                       seq_len: int = 16, batch: int = 2, seed: int = 0,
                       family_spec: str | None = None) -> list[Parity]:
    """Parity per (HF folder, checkpoint) pair, all run at one layout (default: the first checkpoint's).
    Launches torchrun unless already inside a distributed job. `family_spec` replaces the family spec the
    manifests record."""
    for hf_dir, ckpt_dir in pairs:
        check_pair(hf_dir, ckpt_dir, family_spec)
    first = Manifest.read(pairs[0][1], family_spec)
    # The ranks are new processes: a spec this one accepted from the manifests (the user named it here, or a plugin
    # declares it) is named to them explicitly, since they would refuse a manifest's own say-so.
    recorded = {Manifest.read(ckpt_dir).family_spec for _, ckpt_dir in pairs} if family_spec is None else set()
    if len(recorded) == 1 and None not in recorded:
        family_spec = recorded.pop()
    tp, pp, ep = tp or first.tp, pp or first.pp, first.ep
    for name, size in (("--seq-len", seq_len), ("--batch", batch)):
        if type(size) is not int or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    # The checkpoint's own config: the HF folder may be the architecture a plugin family mirrors (check_pair).
    stored = HFModelConfig.from_dict(first.hf_config)
    family = family_for(stored, family_spec or first.family_spec, recorded=family_spec is None)
    limit, why = sequence_limit(stored, family)
    if seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {why}")
    if seq_len * batch > LARGEST_CHECK_TOKENS:  # logits of every token in fp32 on both sides
        raise ValueError(f"--batch x --seq-len = {seq_len * batch} tokens; a parity check takes at most "
                         f"{LARGEST_CHECK_TOKENS}")
    if in_distributed_job():
        return _verify_ranks(pairs, tp, pp, ep, seq_len, batch, seed, family_spec)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "parity.json"
        args = [item for hf, ckpt in pairs for item in ("--pair", str(hf), str(ckpt))]
        args += ["--tp", str(tp), "--pp", str(pp), "--seq-len", str(seq_len), "--batch", str(batch),
                 "--seed", str(seed), "--result", str(result)]
        args += ["--family-spec", family_spec] if family_spec else []
        try:
            run_torchrun(tp * pp * ep, "verl_mega.converters.verify", args, capture_output=True)
        except subprocess.CalledProcessError as err:
            errors = sorted(Path(tmp).glob(f"{result.name}.rank*.error"))
            if errors:  # a rank refused its input: its one line is the message
                raise ValueError(errors[0].read_text().strip()) from None
            tail = "\n".join((err.stdout + err.stderr).splitlines()[-30:])
            raise RuntimeError(f"the verify ranks failed (exit {err.returncode}); their output ends with:\n{tail}") from None
        return [Parity.from_dict(figures) for figures in json.loads(result.read_text())["parity"]]


def check_pair(hf_dir: str | Path, ckpt_dir: str | Path, family_spec: str | None = None) -> None:
    """Refuse, before launching anything, an HF folder and a checkpoint that are not the same model."""
    manifest = Manifest.read(ckpt_dir, family_spec)
    stored = HFModelConfig.from_dict(manifest.hf_config)
    # A family declared outside verl_mega may be checked against the HF architecture it mirrors (an
    # InternLM2-style spec against Llama, which transformers loads without remote code): the HF folder is then
    # read as its own model_type, and the two are compared by shape only.
    raw = HFModelConfig.read_raw(hf_dir) if manifest.family_spec else None
    raw_type = raw.get("model_type") if isinstance(raw, dict) else None
    mirrored = manifest.family_spec is not None and raw_type != stored.model_type
    hf_config, family = load_hf_model_config(hf_dir, None if mirrored else manifest.family_spec)
    check_hf_tensors(open_hf_checkpoint(hf_dir, hf_config, family), hf_config, family)
    if manifest.role != "actor":
        raise ValueError(f"{ckpt_dir} holds the {manifest.role}'s weights; logit parity needs an actor checkpoint")
    for field in ("model_type",) * (not mirrored) + ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "ffn_hidden_size", "vocab_size", "tie_word_embeddings"):
        if getattr(hf_config, field) != getattr(stored, field):
            raise ValueError(f"{hf_dir} and {ckpt_dir} are different models: {field} is {getattr(hf_config, field)} "
                             f"in the HF config and {getattr(stored, field)} in the checkpoint")


def _verify_ranks(pairs, tp, pp, ep, seq_len, batch, seed, family_spec=None, result_file=None) -> list[Parity]:
    results = []
    layout = init_parallel(tp, pp, ep)  # once: every pair is checked at the same layout, in eval (no RNG drawn)
    for hf_dir, ckpt_dir in pairs:
        parity, model_type = _verify_pair(hf_dir, ckpt_dir, seq_len, batch, seed, family_spec, layout.tp_rank == 0)
        results.append(parity)
        if layout.rank == 0:
            print(f"logit parity {model_type} {ckpt_dir} at tp={tp} pp={pp} ep={ep}:\n{parity.describe()}", flush=True)
    if result_file and layout.rank == 0:
        Path(result_file).write_text(json.dumps({"parity": [parity.as_dict() for parity in results]}))
    destroy_parallel()
    return results


def _verify_pair(hf_dir, ckpt_dir, seq_len, batch, seed, family_spec, judge: bool) -> tuple[Parity, str]:
    """The pair's figures on every rank, as the last stage's `judge` rank finds them (its first TP rank: every
    TP rank there holds the gathered logits, and one transformers pass is enough). Both sides' weights upcast
    exactly to fp32 and compared under the fp32 rule: what a conversion can get wrong is a weight, and 16-bit
    rounding of every activation hides a wrong tensor in a deep model. A 16-bit checkpoint is also compared in
    its own dtype, like with like (both sides round the weights the same way), the second line of its report."""
    manifest = Manifest.read(ckpt_dir, family_spec)
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, hf_config.vocab_size, (batch, seq_len), generator=generator)
    dtypes = ("fp32",) if manifest.dtype == "fp32" else ("fp32", manifest.dtype)
    outputs = {dtype: _megatron_logits(ckpt_dir, dtype, tokens, family_spec) for dtype in dtypes}
    parity = None
    if judge and outputs["fp32"][0] is not None:  # the last pipeline stage
        lines = {}
        for dtype, (logits, family, tf32) in outputs.items():
            reference, perturbed = _reference_logits(hf_dir, tokens, dtype, manifest.dtype, dtype == "fp32")
            lines[dtype] = logit_parity(logits, reference, dtype, num_layers=hf_config.num_layers, moe=family.moe,
                                        tf32=tf32, perturbed=perturbed,
                                        reduction_length=max(hf_config.hidden_size, hf_config.ffn_hidden_size))
        parity = lines["fp32"] if manifest.dtype == "fp32" else lines["fp32"].with_native(manifest.dtype,
                                                                                          lines[manifest.dtype])
    # Every rank learns the last stage's figures.
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, parity)
    return next(figures for figures in gathered if figures is not None), hf_config.model_type


def _reference_logits(hf_dir, tokens: torch.Tensor, dtype: str, weights_dtype: str, sensitivity: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' fp32 logits, computed in `dtype` from its weights rounded to `weights_dtype` (as the
    converter rounds them), and with `sensitivity`, again with those weights one fp32 ulp moved
    (`parity.one_ulp_moved`: what a reordered fp32 sum changes in each GEMM, through this model's own gain; the
    16-bit rule's rounding sites are the activations', which that does not mimic). Its buffers (RoPE
    frequencies) stay as transformers makes them."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype])
    with torch.no_grad():
        if weights_dtype != dtype:
            for param in model.parameters():
                param.copy_(param.to(DTYPES[weights_dtype]))
        reference = model(tokens).logits.float()
        if not sensitivity:
            return reference, None
        one_ulp_moved(model)
        return reference, model(tokens).logits.float()


def _megatron_logits(ckpt_dir, dtype: str, tokens: torch.Tensor, family_spec):
    """(the last stage's [b, s, V] fp32 logits, else None; the family; whether fp32 GEMMs ran as TF32) of the
    checkpoint's model built in `dtype` (weights cast on load)."""
    from megatron.core import tensor_parallel

    model, _, hf_config, family = build_model_from_checkpoint(ckpt_dir, family_spec=family_spec, dtype=dtype)
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    model_device = next(model.parameters()).device
    tf32 = fp32_gemms_run_tf32(model_device.type, uses_transformer_engine(model))

    def step(stage_model, micro_batch):
        inputs = (micro_batch["input_ids"], micro_batch["position_ids"])
        return stage_model(*(tensor.to(model_device) for tensor in inputs), None)

    def collect(output, micro_batch):
        return tensor_parallel.gather_from_tensor_model_parallel_region(output)[..., : hf_config.vocab_size].float().cpu()

    outputs = forward_only_outputs([model], [{"input_ids": tokens, "position_ids": positions}], step, collect)
    return (None if outputs is None else outputs[0]), family, tf32


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.converters.verify")
    parser.add_argument("--pair", nargs=2, action="append", required=True, metavar=("HF", "CKPT"))
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result")
    parser.add_argument("--family-spec")
    args = parser.parse_args(argv)
    try:
        ep = Manifest.read(args.pair[0][1], args.family_spec).ep
        _verify_ranks(args.pair, args.tp, args.pp, ep, args.seq_len, args.batch, args.seed, args.family_spec,
                      args.result)
    except (ValueError, OSError) as err:  # bad input: one line for the launcher to show, exit 2
        print(f"verl-mega verify: error: {err}", file=sys.stderr)
        if args.result:
            Path(f"{args.result}.rank{read_world().rank}.error").write_text(f"{err}\n")
        sys.exit(2)


if __name__ == "__main__":
    exit_process(main())
