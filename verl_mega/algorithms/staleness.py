"""How old the weights that sampled a batch's tokens are: the `async/` staleness metrics.

A token sampled by weight version v and trained on at version c is c - v versions stale (0: on-policy, as in
`rollout.mode: sync`). Asynchronous rollouts bound it by `max_staleness`; these metrics show how much of that
bound a run uses.
"""
from __future__ import annotations

import torch

PREFIX = "async/"


def staleness_metrics(versions: torch.Tensor, current_version: int, mask: torch.Tensor) -> dict[str, float]:
    """`versions` [B, T]: the weight version that sampled each token (`rollout_versions`), read where `mask`
    [B, T] is 1. Returns `async/staleness_mean` and `async/staleness_max` (in versions, over the tokens),
    `async/stale_token_share` (the share sampled by older weights than `current_version`'s) and
    `async/staleness_hist/<k>` for k = 0 .. the max: the share of tokens k versions stale (they sum to 1).
    No token counted gives zeros and no histogram."""
    if versions.shape != mask.shape:
        raise ValueError(f"versions {tuple(versions.shape)} and mask {tuple(mask.shape)} differ in shape")
    counted = versions[mask.bool()].long()
    if counted.numel() == 0:
        return {f"{PREFIX}staleness_mean": 0.0, f"{PREFIX}staleness_max": 0.0, f"{PREFIX}stale_token_share": 0.0}
    if int(counted.min()) < 0 or int(counted.max()) > current_version:
        raise ValueError(f"token versions {int(counted.min())}..{int(counted.max())} fall outside 0.."
                         f"{current_version} (the current version): a masked token has no version or one "
                         "from the future")
    staleness = current_version - counted
    shares = torch.bincount(staleness).double() / staleness.numel()
    metrics = {f"{PREFIX}staleness_mean": staleness.double().mean().item(),
               f"{PREFIX}staleness_max": float(staleness.max()),
               f"{PREFIX}stale_token_share": 1.0 - shares[0].item()}
    metrics.update({f"{PREFIX}staleness_hist/{k}": share for k, share in enumerate(shares.tolist())})
    return metrics
