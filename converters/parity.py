"""The pass rule of logit parity (megatron-core vs transformers, both in the checkpoint's dtype).

The two implementations compute the same function with different kernels, so their logits differ by rounding
alone, and how much follows from the arithmetic:
- both round each stored activation to the dtype (unit roundoff u: 2^-24 fp32, 2^-8 bf16 (8 significant bits),
  2^-11 fp16), and both accumulate matmuls in fp32 in different orders, a random walk of sqrt(K) * 2^-24 over a
  reduction of length K (the wider of hidden and FFN size): a relative error e = u + sqrt(K) * 2^-24 per
  rounding site;
- a layer has ROUNDING_SITES places where the two may round differently (2 norms, q/k/v, attention
  probabilities and output, o_proj, gate/up, activation, down_proj, 2 residual adds), the embedding and head
  one more layer's worth; independent errors add up as a random walk, sigma = e * sqrt(S * (L + 1)), relative
  to the logits' scale (their RMS);
- the largest of N roughly Gaussian errors is about sqrt(2 ln N) sigma (N = tokens x vocabulary).
- where an fp32 GEMM runs as TF32 (transformer-engine's layers and, where allowed, torch's on a GPU), its
  inputs are rounded to 10 significant bits first: fp32 compute then has TF32's 2^-11 per rounding site.
On the tests' tiny 4-layer models the measured errors sit at 0.2-0.5 of this bound in bf16 and fp16 and at
~0.06 in fp32, where it is 2e-5 relative; at 30 layers and K = 1536 the fp32 bound is 1.7e-4 relative, far above
the ~1e-5 (5-7e-5 absolute) a correct conversion shows there, so deep models keep headroom.

That model lets each rounding error pass to the logits at unit gain. A trained model can amplify them more: the
demo's warm 4-layer model (seed 1) differs from transformers by 3.1e-5 in fp32 against a bound of 2.1e-5, and
transformers' own fp32 logits differ from its fp64 ones by 5.9e-5. So the reference's own sensitivity is measured
too: its logits again with every weight moved one unit in the last place, up or down at random, the size of the
difference that a reordered sum makes in each GEMM, passed through this model's real gain (3.0e-5 there). The
bound is the larger of the model above and NOISE_FACTOR times that sensitivity: each implementation's own fp32
error is about twice it (5.9e-5 against 3.0e-5 there), and the two errors add. A wrong tensor still fails by
orders of magnitude: one weight matrix 1.1x off moves the logits by ~1e-2 relative.

Mixture-of-experts: a token whose router scores are a near tie at the rounding level may pick another
expert in one implementation than in the other, a discrete jump that rounding arithmetic does not bound. For MoE
models the rule therefore applies to the median position (each position's max over the vocabulary, so
N = vocabulary); a wrong expert mapping moves every position and still fails.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
TF32_ROUNDOFF = 2.0**-11
ROUNDING_SITES = 11
NOISE_FACTOR = 4.0


def fp32_gemms_run_tf32(device_type: str, transformer_engine: bool) -> bool:
    """Whether fp32 GEMMs on this backend round their inputs to TF32: only on CUDA, there always with
    transformer-engine's layers (its cuBLAS GEMMs take TF32 for fp32, whatever torch's flags say), and in torch's
    own matmuls where `torch.backends.cuda.matmul.allow_tf32` is set (`torch.set_float32_matmul_precision`
    below "highest"). `torch.backends.cudnn.allow_tf32` (on by default) governs cuDNN's kernels, which these
    models reach only through transformer-engine's attention, already counted with it."""
    if device_type != "cuda":
        return False
    return transformer_engine or torch.backends.cuda.matmul.allow_tf32


@dataclass(frozen=True)
class Parity:
    dtype: str
    max_abs: float  # max |Δ logit| over every position and token
    scale: float  # RMS of the reference logits
    relative: float  # max_abs / scale
    top1_agreement: float  # fraction of positions where both pick the same token
    judged: float  # what the rule compares with `bound`: `relative`, or for MoE the median position's
    bound: float  # the largest `judged` the dtype's arithmetic explains
    passed: bool  # this comparison's and, with `native`, that one's
    tf32: bool = False  # whether the bound counts TF32 GEMMs (fp32 only)
    upcast_from: str | None = None  # the 16-bit dtype of the weights this fp32 comparison upcast
    native: Parity | None = None  # those weights compared in their own dtype
    sensitivity: float | None = None  # `judged` of the reference against itself with its weights one ulp moved

    def with_native(self, weights_dtype: str, native: Parity) -> Parity:
        """This fp32 comparison of `weights_dtype` weights, with their comparison in that dtype as a second line."""
        return replace(self, upcast_from=weights_dtype, native=native, passed=self.passed and native.passed)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, figures: dict) -> Parity:
        native = figures.get("native")
        return cls(**{**figures, "native": None if native is None else cls.from_dict(native)})

    def describe(self) -> str:
        """One line per comparison."""
        median = "" if self.judged == self.relative else f", median position {self.judged:.2e}"
        weights = f"{self.upcast_from} weights in " if self.upcast_from else ""
        compute = " with TF32 GEMMs" if self.tf32 else ""
        measured = ("" if self.sensitivity is None or self.bound > NOISE_FACTOR * self.sensitivity
                    else f": {NOISE_FACTOR:g}x the reference's own one-ulp sensitivity")
        line = (f"{weights}{self.dtype}{compute}: max |Δ logit| = {self.max_abs:.3e}, relative {self.relative:.2e} of the logits' RMS "
                f"{self.scale:.3g}{median} (bound {self.bound:.2e}{measured}), top-1 agreement "
                f"{self.top1_agreement:.2%}: {'OK' if self.judged <= self.bound else 'FAILED'}")
        return line if self.native is None else f"{line}\n{self.native.describe()}"


def relative_bound(dtype: str, num_layers: int, reduction_length: int, num_logits: int, tf32: bool = False) -> float:
    """The largest |Δ logit| over `num_logits` logits, relative to their RMS, that rounding explains; `tf32`:
    fp32 GEMMs round their inputs to TF32 (16-bit GEMM inputs are TF32 numbers already)."""
    storage = UNIT_ROUNDOFF[dtype]
    if tf32 and dtype == "fp32":
        storage = TF32_ROUNDOFF
    per_site = storage + math.sqrt(reduction_length) * UNIT_ROUNDOFF["fp32"]
    sigma = per_site * math.sqrt(ROUNDING_SITES * (num_layers + 1))
    return math.sqrt(2 * math.log(max(num_logits, 2))) * sigma


def logit_parity(logits: torch.Tensor, reference: torch.Tensor, dtype: str, *, num_layers: int,
                 reduction_length: int, moe: bool, tf32: bool = False,
                 perturbed: torch.Tensor | None = None) -> Parity:
    """Compare [..., V] logits with the reference's (same tokens, real vocabulary only); `tf32`: one side's
    fp32 GEMMs ran as TF32 (`fp32_gemms_run_tf32`); `perturbed`: the reference's logits with its weights one ulp
    moved (`one_ulp_moved`), whose distance from the reference widens the bound (see above)."""
    logits, reference = logits.double(), reference.double()
    scale = max(reference.pow(2).mean().sqrt().item(), torch.finfo(torch.float64).tiny)
    max_abs, judged = _judged(logits, reference, scale, moe)
    top1 = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
    num_logits = reference.shape[-1] if moe else reference.numel()
    bound = relative_bound(dtype, num_layers, reduction_length, num_logits, tf32)
    sensitivity = None
    if perturbed is not None:
        sensitivity = _judged(perturbed.double(), reference, scale, moe)[1]
        bound = max(bound, NOISE_FACTOR * sensitivity)
    tf32 = tf32 and dtype == "fp32"
    return Parity(dtype, max_abs, scale, max_abs / scale, top1, judged, bound, judged <= bound, tf32,
                  sensitivity=sensitivity)


def _judged(logits: torch.Tensor, reference: torch.Tensor, scale: float, moe: bool) -> tuple[float, float]:
    """(max |Δ logit|, what the rule judges: that relative to `scale`, or for MoE the median position's)."""
    per_position = (logits - reference).abs().amax(-1).flatten()
    max_abs = per_position.max().item()
    return max_abs, (per_position.median().item() if moe else max_abs) / scale


@torch.no_grad()
def one_ulp_moved(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every floating-point parameter of `model` one unit in the last place of its dtype, up or down at
    random (in place)."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.is_floating_point():
            up = torch.rand(param.shape, generator=generator) < 0.5
            toward = torch.where(up, math.inf, -math.inf).to(device=param.device, dtype=param.dtype)
            param.copy_(torch.nextafter(param, toward))
