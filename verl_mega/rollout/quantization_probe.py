"""The first int8 transition's probe: is the quantized rollout the policy being trained, up to rounding?

A wrong tensor in the quantized stream (a swapped scale, a misplaced row) would not stop a run: the rollout
would sample from another policy, TIS would clip its tokens, and learning would quietly stall. So after the first
quantized load into the embedded engine, an engine in the training dtype holding the same weights unquantized is
the reference, and two things are compared:
- each int8 linear the engine holds, dequantized, against the training weight: every element must be within
  int8's rounding bound (half its row's scale), exactly, whatever the model;
- a small probe batch, sampled by the quantized engine and scored by the reference by teacher forcing: mean k3
  (ρ - 1 - log ρ per token, ρ = π_train / π_rollout) must stay below a limit far above int8's rounding.
The run stops with one line naming the tensor furthest out of its bound.

Measured mean k3 of correct int8 rollouts: 1e-5 on the tiny random test models, up to 3e-3 once their weights
are doubled (a chaotic 4-layer model), against 1e-4 - 0.2 with one swapped scale; the limit is set above the
rounding of sharp models, so the elementwise check is what catches a single wrong tensor there.
"""
from __future__ import annotations

from typing import Iterable

import torch

from verl_mega.algorithms.rollout_correction import k3_divergence
from verl_mega.config.errors import UserError

from .embedded import EmbeddedEngine
from .engine import SamplingParams
from .int8_linear import Int8Linear
from .quantization import dequantize_int8, int8_error_bound

PROBE_KL_K3_LIMIT = 0.05
PROBE_PROMPTS, PROBE_PROMPT_TOKENS, PROBE_TOKENS, PROBE_SEED = 4, 8, 16, 0
# fp32 arithmetic of the scale division and product: a few ulps of the element beyond the rounding bound.
_ROUNDING_SLACK = 1e-5


def probe_prompts(vocab_size: int) -> list[list[int]]:
    """Fixed pseudo-random prompts: the probe needs distributions to compare, not meaningful text."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (PROBE_PROMPTS, PROBE_PROMPT_TOKENS), generator=generator).tolist()


def probe_kl_k3(quantized: EmbeddedEngine, reference: EmbeddedEngine, prompts: list[list[int]]) -> float:
    """Mean k3 of the reference's log-probs against the quantized engine's, over tokens it sampled (temperature 1)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=PROBE_TOKENS, logprobs=True, seed=PROBE_SEED)
    divergences = []
    for response in quantized.generate(prompts, params):
        prompt = prompts[response.prompt_index]
        ids = torch.tensor([prompt + response.token_ids], device=reference.device)
        with torch.no_grad():
            logits = reference.model(ids).logits[0, len(prompt) - 1:-1].float()
        train = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0].double().cpu()
        divergences.append(k3_divergence(train - torch.tensor(response.logprobs, dtype=torch.float64)))
    return torch.cat(divergences).mean().item()


def furthest_tensor(quantized: EmbeddedEngine, reference: EmbeddedEngine) -> tuple[str, float]:
    """The int8 linear furthest out of its rounding bound: its name and the largest ratio of an element's error to
    its bound (<= 1 when every element is within it)."""
    linears = dict(reference.model.named_modules())
    ratios = {}
    for name, module in quantized.model.named_modules():
        if isinstance(module, Int8Linear):
            want = linears[name].weight.detach().float()
            error = (dequantize_int8(module.weight, module.weight_scale) - want).abs()
            bound = int8_error_bound(want) + want.abs() * _ROUNDING_SLACK + 1e-30
            ratios[f"{name}.weight"] = (error / bound).max().item()
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def check_quantized_rollout(quantized: EmbeddedEngine, reference: EmbeddedEngine, vocab_size: int) -> float:
    """Raise UserError (one line, naming the furthest tensor) when an int8 weight is out of its rounding bound or
    the probe's mean k3 exceeds PROBE_KL_K3_LIMIT; return the probe's mean k3 otherwise. `reference` holds the same
    weights as `quantized`, unquantized."""
    name, ratio = furthest_tensor(quantized, reference)
    kl_k3 = probe_kl_k3(quantized, reference, probe_prompts(vocab_size))
    if ratio > 1 or not kl_k3 <= PROBE_KL_K3_LIMIT:
        raise UserError(f"rollout.quantization=int8: the quantized rollout is not the trained policy up to rounding "
                        f"(probe batch mean k3 {kl_k3:.3g}, limit {PROBE_KL_K3_LIMIT:g}); the furthest tensor is "
                        f"'{name}', an element {ratio:.3g}x its rounding bound off the training weight: a wrong "
                        "tensor or scale in the quantized stream")
    return kl_k3


def probe_first_load(engine: EmbeddedEngine, raw_hf_config: dict, weights: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype) -> float:
    """`check_quantized_rollout` of `engine`, just loaded, against a reference engine in `dtype` built for the
    probe from `weights` (the same transition's stream, unquantized) and dropped after it. The global random state
    is left as it was (building the reference draws its initial weights): a resumed run, which probes again at its
    first transition, draws what the uninterrupted run drew."""
    with torch.random.fork_rng(devices=[]):
        reference = EmbeddedEngine(raw_hf_config, dtype=dtype, device=engine.device)
        reference.load_weights(weights)
        return check_quantized_rollout(engine, reference, raw_hf_config["vocab_size"])
