"""verl's data metrics of a trained batch (its `compute_data_metrics`, under its names): the response and prompt
lengths with the share cut at their limits, the share of empty responses, and the scores, advantages, returns
and (with a critic) values over the response tokens, with the value function's explained variance.

verl's `critic/rewards/*` (the scores after the KL penalty in the reward) are not logged: `actor/kl_coef` and
`actor/kl` say what the penalty took. The stage reads the step's batch and reward, and changes neither."""
from __future__ import annotations

import torch

from verl_mega.config import TrainConfig

from ..rollout_batch import response_tokens
from .step import Step


class BatchStats:
    def __init__(self, config: TrainConfig):
        self.config = config

    def run(self, step: Step) -> None:
        step.metrics.update(batch_stats(step.batch, step.reward.scores, self.config.data.max_prompt_length,
                                        self.config.data.max_response_length))


def batch_stats(batch: dict, scores: torch.Tensor, max_prompt_length: int, max_response_length: int
                ) -> dict[str, float]:
    """The metrics of `batch` (its attention and response masks, advantages, returns, values where it has them)
    and its sequence `scores` [B]. A response's length counts every response token (a multi-turn episode's tool
    outputs too); the means and extremes of advantages, returns and values count the tokens the losses count."""
    responses = response_tokens(batch).sum(dim=-1).float()
    prompts = (batch["attention_mask"].sum(dim=-1) - response_tokens(batch).sum(dim=-1)).float()
    metrics = {**spread("critic/score", scores.float()),
               **length_stats("response_length", responses, max_response_length),
               "response/aborted_ratio": (responses == 0).float().mean().item(),
               **length_stats("prompt_length", prompts, max_prompt_length)}
    mask = batch["response_mask"].bool()
    for name in ("advantages", "returns", "values"):
        if name in batch:
            metrics.update(spread(f"critic/{name}", torch.masked_select(batch[name], mask)))
    if "values" in batch:
        returns, values = torch.masked_select(batch["returns"], mask), torch.masked_select(batch["values"], mask)
        # verl's form: 1 - Var(returns - values) / (Var(returns) + 1e-5), with torch.var's unbiased estimate.
        metrics["critic/vf_explained_var"] = (1.0 - (returns - values).var() / (returns.var() + 1e-5)).item()
    return metrics


def spread(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """prefix/mean, /max and /min of `values` (none where there are no values)."""
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def length_stats(prefix: str, lengths: torch.Tensor, limit: int) -> dict[str, float]:
    """spread() of the lengths and the share at `limit` (cut there, or exactly that long)."""
    return {**spread(prefix, lengths), f"{prefix}/clip_ratio": (lengths == limit).float().mean().item()}
