"""Fused token log-probs (vocabulary-parallel), masked GAE, and RMSNorm (fused on the CPU).

Compiled kernels (`verl_mega._kernels`, `verl_mega._kernels_cuda`, built from csrc/) run when present; the
PyTorch fallback in `fallback.py` runs otherwise, or everywhere when VERL_MEGA_DISABLE_KERNELS=1.
"""
from .gae import gae
from .rms_norm import FusedRMSNorm, rms_norm
from .token_logprobs import token_logprobs

__all__ = ["FusedRMSNorm", "gae", "rms_norm", "token_logprobs"]
