"""Generalised advantage estimation over token-level rewards, masked as verl does for multi-turn responses."""
import numbers

import torch

from ._backend import kernels_for
from ._checks import require_floating, require_same_device, require_tensor


def gae(token_rewards, values, response_mask, gamma, lam):
    """(advantages, returns) for [batch, time] rewards and values, scanning each sequence backwards.

    Tokens outside `response_mask` (padding, and tool/observation tokens inside a multi-turn response)
    get no advantage and are skipped by the recursion: the next masked-in token's value and advantage carry
    over them. advantages are 0 there; returns = advantages + values everywhere. Not whitened (that is the
    algorithms' business). Computed in float32 (float64 for float64 input) and not differentiable.
    """
    require_floating("token_rewards", token_rewards)
    require_floating("values", values)
    require_tensor("response_mask", response_mask)
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [batch, time], got shape {tuple(token_rewards.shape)}")
    for name, tensor in (("values", values), ("response_mask", response_mask)):
        if tensor.shape != token_rewards.shape:
            raise ValueError(
                f"{name} must have the shape of token_rewards {tuple(token_rewards.shape)}, got {tuple(tensor.shape)}"
            )
    require_same_device(token_rewards=token_rewards, values=values, response_mask=response_mask)
    for name, factor in (("gamma", gamma), ("lam", lam)):
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(factor).__name__}")

    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    keep = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    with torch.no_grad():
        return kernels_for(token_rewards.device).gae(
            token_rewards.to(dtype).contiguous(),
            values.to(dtype).contiguous(),
            keep.contiguous(),
            float(gamma),
            float(lam),
        )
