"""The CUDA kernels of verl_mega.ops on a GPU, for `bench/gpu_check.sh`: built, equal to a float64 reference,
and faster than what runs without them.

    python -m bench.gpu_kernels_check build|parity|speed [--dry-run]

build:  verl_mega._kernels_cuda imports (a build without nvcc / CUDA_HOME skips it silently, so this fails).
parity: token log-probs, entropy and their gradient at Qwen2's vocabulary (V = 152,064) from bf16 and fp32
        logits, aligned and one element into a buffer allocated on the device (no vector loads), and GAE, each
        against float64 on the same inputs, within the fp32 accumulation bound (the kernels accumulate in fp32
        whatever the input dtype; bf16 gradients add one bf16 rounding).
speed:  the log-prob forward against `log_softmax(logits.float()).gather` (what the log-prob path ran before the
        kernels) and GAE against verl's reverse Python loop, as ratios next to their goals.
Each check prints one line per comparison and exits 1 if any misses its bound or goal; --dry-run prints what it
would compare and touches no GPU.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

import torch

from bench.kernels import best_seconds, peak_extra_bytes, verl_gae_loop
from verl_mega.ops import gae, token_logprobs

CUDA_MODULE = "verl_mega._kernels_cuda"
DISABLE_ENV_VAR = "VERL_MEGA_DISABLE_KERNELS"
VOCAB = 152_064  # Qwen2 / Qwen2.5's
PARITY_TOKENS = 1024
SPEED_TOKENS = 4096
GAE_SHAPE = (256, 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
LOGIT_SCALE = 3.0
# Goals (the kernels' reason to exist): the forward reads the logits once where log_softmax writes and reads a
# second [tokens, V] tensor, and the GAE kernel is one launch where verl's loop is ~8 launches per time step.
LOGPROB_GOAL = 1.5
LOGPROB_MEMORY_GOAL = 0.10  # peak extra memory, fraction of log_softmax + gather's
GAE_GOAL = 100.0


def logprob_bound(max_abs_logit: float, vocab: int) -> float:
    """|Δ| allowed on log p and entropy: fp32 partial sums over the vocabulary (a tree of log2 V levels, each
    one rounding) plus the rounding of x - max and of exp/log, on values of magnitude max|x| + log V; 4x slack."""
    return 4 * (math.log2(vocab) + 4) * UNIT_ROUNDOFF[torch.float32] * (max_abs_logit + math.log(vocab))


def gae_bound(steps: int, magnitude: float) -> float:
    """|Δ| allowed on advantages and returns: one fp32 rounding per time step of a recursion whose terms are at
    most `magnitude`, over `steps` steps; 2x slack."""
    return 2 * steps * UNIT_ROUNDOFF[torch.float32] * magnitude


def device_logits(tokens: int, vocab: int, dtype: torch.dtype, misaligned: bool, device: str) -> torch.Tensor:
    """Random logits on `device`; `misaligned` puts them one element into a buffer allocated there (a host-side
    offset is lost by the copy to a GPU)."""
    generator = torch.Generator(device=device).manual_seed(0)
    values = (torch.randn(tokens, vocab, generator=generator, device=device) * LOGIT_SCALE).to(dtype)
    if not misaligned:
        return values
    buffer = torch.empty(tokens * vocab + 1, dtype=dtype, device=device)
    buffer[1:] = values.flatten()
    shifted = buffer[1:].view(tokens, vocab)
    assert shifted.data_ptr() % 16 != 0, "the shifted logits are still 16-byte aligned"
    return shifted


def float64_logprobs(logits: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor):
    """(log p, entropy, d(upstream · log p)/d logits) in float64 from the same logit values."""
    x = logits.double()
    log_p = torch.log_softmax(x, dim=-1)
    label_log_p = log_p.gather(-1, labels[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    grad = -log_p.exp() * upstream.double()[:, None]
    grad.scatter_add_(-1, labels[:, None], upstream.double()[:, None])
    return label_log_p, entropy, grad


def check_build(dry_run: bool, device: str) -> list[str]:
    """Misses (empty: passed): the compiled CUDA module imports and the kernels are not switched off."""
    if dry_run:
        print(f"would import {CUDA_MODULE} and require {DISABLE_ENV_VAR} unset")
        return []
    misses = []
    if os.environ.get(DISABLE_ENV_VAR, "0") not in ("", "0"):
        misses.append(f"{DISABLE_ENV_VAR}={os.environ[DISABLE_ENV_VAR]} switches the kernels off")
    try:
        module = importlib.import_module(CUDA_MODULE)
        print(f"{CUDA_MODULE}: {module.__file__}")
    except ImportError as err:
        misses.append(f"{CUDA_MODULE} is not built ({err}): is nvcc on PATH / CUDA_HOME set?")
    return misses


def random_labels(tokens: int, device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (tokens,), device=device, generator=torch.Generator(device=device).manual_seed(1))


def check_logprob_parity(dtype: torch.dtype, misaligned: bool, device: str) -> list[str]:
    logits = device_logits(PARITY_TOKENS, VOCAB, dtype, misaligned, device).requires_grad_()
    labels = random_labels(PARITY_TOKENS, device)
    upstream = torch.randn(PARITY_TOKENS, device=device, generator=torch.Generator(device=device).manual_seed(2))
    log_p, entropy = token_logprobs(logits, labels, return_entropy=True)
    log_p.backward(upstream)
    want_log_p, want_entropy, want_grad = float64_logprobs(logits.detach(), labels, upstream)
    bound = logprob_bound(logits.detach().abs().max().item(), VOCAB)
    # The gradient is rounded once to the logits' dtype; its fp32 part is bounded like log p, per unit upstream.
    grad_bound = (UNIT_ROUNDOFF[dtype] * want_grad.abs().max().item()
                  + bound * upstream.abs().max().item())
    gaps = {"log p": ((log_p.double() - want_log_p).abs().max().item(), bound),
            # entropy = log S - T / S: two terms, each bounded like log p.
            "entropy": ((entropy.double() - want_entropy).abs().max().item(), 2 * bound),
            "grad": ((logits.grad.double() - want_grad).abs().max().item(), grad_bound)}
    name = f"log-prob {PARITY_TOKENS}x{VOCAB} {dtype_name(dtype)}{' misaligned' if misaligned else ''}"
    print(f"{name}: " + ", ".join(f"{key} max|Δ| {gap:.2e} (bound {limit:.2e})" for key, (gap, limit) in gaps.items()))
    return [f"{name}: {key} {gap:.2e} > {limit:.2e}" for key, (gap, limit) in gaps.items() if not gap <= limit]


def gae_inputs(device: str):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(*GAE_SHAPE, generator=generator)
    values = torch.randn(*GAE_SHAPE, generator=generator)
    lengths = torch.randint(GAE_SHAPE[1] // 4, GAE_SHAPE[1] + 1, (GAE_SHAPE[0], 1), generator=generator)
    mask = torch.arange(GAE_SHAPE[1]) < lengths
    return rewards.to(device), values.to(device), mask.to(device)


def check_gae_parity(device: str) -> list[str]:
    rewards, values, mask = gae_inputs(device)
    advantages, returns = gae(rewards, values, mask, 1.0, 0.95)
    want_advantages, want_returns = verl_gae_loop(rewards.double(), values.double(), mask.double(), 1.0, 0.95)
    want_advantages = want_advantages * mask  # verl's loop leaves the carried value past a response's end
    want_returns = want_advantages + values.double()
    magnitude = max(want_returns.abs().max().item(), rewards.abs().max().item(), 1.0)
    bound = gae_bound(GAE_SHAPE[1], magnitude)
    gaps = {"advantages": (advantages.double() - want_advantages).abs().max().item(),
            "returns": (returns.double() - want_returns).abs().max().item()}
    print(f"GAE {GAE_SHAPE[0]}x{GAE_SHAPE[1]} fp32: " +
          ", ".join(f"{key} max|Δ| {gap:.2e}" for key, gap in gaps.items()) + f" (bound {bound:.2e})")
    return [f"GAE {key} {gap:.2e} > {bound:.2e}" for key, gap in gaps.items() if not gap <= bound]


def check_parity(dry_run: bool, device: str) -> list[str]:
    cases = [(dtype, misaligned) for dtype in DTYPES.values() for misaligned in (False, True)]
    if dry_run:
        for dtype, misaligned in cases:
            print(f"would compare log-prob/entropy/grad {PARITY_TOKENS}x{VOCAB} {dtype_name(dtype)}"
                  f"{' misaligned on the device' if misaligned else ''} with float64, bound "
                  f"{logprob_bound(6 * LOGIT_SCALE, VOCAB):.1e} at max|x| = {6 * LOGIT_SCALE}")
        print(f"would compare GAE {GAE_SHAPE} fp32 with verl's loop in float64, bound "
              f"{gae_bound(GAE_SHAPE[1], 1.0):.1e} per unit of magnitude")
        return []
    misses = []
    for dtype, misaligned in cases:
        misses += check_logprob_parity(dtype, misaligned, device)
    return misses + check_gae_parity(device)


def check_logprob_speed(dtype: torch.dtype, device: str) -> list[str]:
    logits = device_logits(SPEED_TOKENS, VOCAB, dtype, False, device)
    labels = random_labels(SPEED_TOKENS, device)
    device = logits.device

    def kernel():
        with torch.no_grad():
            return token_logprobs(logits, labels)

    def log_softmax_gather():
        with torch.no_grad():
            return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None])[:, 0]

    ours, theirs = best_seconds(kernel, device, repeats=10), best_seconds(log_softmax_gather, device, repeats=10)
    memory = peak_extra_bytes(kernel, device) / max(peak_extra_bytes(log_softmax_gather, device), 1)
    ratio = theirs / ours
    name = f"log-prob forward {SPEED_TOKENS}x{VOCAB} {dtype_name(dtype)}"
    print(f"{name}: kernel {ours * 1e3:.2f} ms vs log_softmax+gather {theirs * 1e3:.2f} ms -> {ratio:.2f}x "
          f"(goal >= {LOGPROB_GOAL}x); peak extra memory {100 * memory:.1f} % of its (goal <= "
          f"{100 * LOGPROB_MEMORY_GOAL:.0f} %)")
    misses = [f"{name}: {ratio:.2f}x < {LOGPROB_GOAL}x"] if ratio < LOGPROB_GOAL else []
    return misses + ([f"{name}: memory {100 * memory:.1f} %"] if memory > LOGPROB_MEMORY_GOAL else [])


def check_gae_speed(device: str) -> list[str]:
    rewards, values, mask = gae_inputs(device)
    device = rewards.device
    float_mask = mask.float()  # verl's masks are float
    kernel = best_seconds(lambda: gae(rewards, values, mask, 1.0, 0.95), device, repeats=20)
    verl = best_seconds(lambda: verl_gae_loop(rewards, values, float_mask, 1.0, 0.95), device, repeats=3)
    ratio = verl / kernel
    print(f"GAE {GAE_SHAPE[0]}x{GAE_SHAPE[1]}: kernel {kernel * 1e3:.3f} ms vs verl's loop {verl * 1e3:.1f} ms -> "
          f"{ratio:.0f}x (goal >= {GAE_GOAL:.0f}x)")
    return [f"GAE: {ratio:.0f}x < {GAE_GOAL:.0f}x"] if ratio < GAE_GOAL else []


def check_speed(dry_run: bool, device: str) -> list[str]:
    if dry_run:
        for dtype in DTYPES.values():
            print(f"would time the log-prob forward {SPEED_TOKENS}x{VOCAB} {dtype_name(dtype)} against "
                  f"log_softmax+gather: goals >= {LOGPROB_GOAL}x, peak extra memory <= "
                  f"{100 * LOGPROB_MEMORY_GOAL:.0f} %")
        print(f"would time GAE {GAE_SHAPE} against verl's loop: goal >= {GAE_GOAL:.0f}x")
        return []
    misses = []
    for dtype in DTYPES.values():
        misses += check_logprob_speed(dtype, device)
    return misses + check_gae_speed(device)


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


CHECKS = {"build": check_build, "parity": check_parity, "speed": check_speed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=CHECKS)
    parser.add_argument("--dry-run", action="store_true", help="print what would be compared; no GPU")
    parser.add_argument("--device", default="cuda", help="parity / speed: cpu compares the CPU kernels instead")
    args = parser.parse_args(argv)
    if not args.dry_run and args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    misses = CHECKS[args.check](args.dry_run, args.device)
    for miss in misses:
        print(f"MISS {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
