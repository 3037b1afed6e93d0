"""Fused token log-probs (vocabulary-parallel) and masked GAE.

Compiled kernels (`verl_mega._kernels`, `verl_mega._kernels_cuda`, built from csrc/) run when present; the
PyTorch reference in `reference.py` runs otherwise, or everywhere when VERL_MEGA_DISABLE_KERNELS=1.
"""
from .gae import gae
from .token_logprobs import token_logprobs

__all__ = ["gae", "token_logprobs"]
