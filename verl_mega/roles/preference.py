"""Preference losses applied to the actor's sequence log-probs, one micro-batch at a time.

Paired batches interleave rows as chosen, rejected, chosen, rejected, ... so a micro-batch of an even number
of rows holds whole pairs. KTO batches hold one completion per row with the columns `desirable` [B],
`desirable_share` / `undesirable_share` [B] (1 / the global batch's count of that kind, 0 elsewhere, so the
per-kind means add up exactly over micro-batches and ranks) and `kl_baseline` [B] (z₀, the same in every row).
`ref_sequence_log_probs` [B] holds the reference model's summed log-probs where the loss needs them.
"""
from __future__ import annotations

import torch

from verl_mega.algorithms import REFERENCE_FREE_LOSSES, PairLogps, get_preference_loss_fn, pair_metrics
from verl_mega.config import AlgorithmConfig

from .batching import Batch
from .megatron_step import MicroBatchShare

PAIR_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
                "logps/rejected"]
KTO_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"]


def loss_needs_reference(loss: str) -> bool:
    """Whether preference loss `loss` compares against the frozen reference's log-probs."""
    return loss not in REFERENCE_FREE_LOSSES


def loss_knobs(algorithm: AlgorithmConfig) -> dict:
    """The config's knobs under the loss functions' keyword names (each loss takes the ones it uses)."""
    return {"beta": algorithm.beta, "label_smoothing": algorithm.label_smoothing, "gamma": algorithm.simpo_gamma,
            "desirable_weight": algorithm.kto_desirable_weight, "undesirable_weight": algorithm.kto_undesirable_weight}


def pair_sequence_loss(algorithm: AlgorithmConfig):
    """A `sequence_loss` for `Actor.update_on_sequences`: the mean pair loss weighted by the micro-batch's share."""
    loss_fn, knobs = get_preference_loss_fn(algorithm.loss), loss_knobs(algorithm)

    def sequence_loss(logps: torch.Tensor, tokens: torch.Tensor, micro_batch: Batch, share: MicroBatchShare):
        ref = micro_batch.get("ref_sequence_log_probs")
        ref = None if ref is None else ref.to(logps.device)
        pairs = PairLogps(logps[0::2], logps[1::2], None if ref is None else ref[0::2],
                          None if ref is None else ref[1::2], tokens[0::2], tokens[1::2])
        out = loss_fn(pairs, **knobs)
        metrics = pair_metrics(pairs, out)
        return out.losses.mean() * share.loss, {name: metrics[name].mean() * share.loss for name in PAIR_METRICS}

    return sequence_loss


def kto_sequence_loss(algorithm: AlgorithmConfig):
    loss_fn, knobs = get_preference_loss_fn("kto"), loss_knobs(algorithm)

    def sequence_loss(logps: torch.Tensor, tokens: torch.Tensor, micro_batch: Batch, share: MicroBatchShare):
        on = lambda key: micro_batch[key].to(logps.device)  # noqa: E731
        kl_baseline = on("kl_baseline")
        losses, rewards = loss_fn(logps, on("ref_sequence_log_probs"), on("desirable"), kl_baseline, **knobs)
        desirable, undesirable = on("desirable_share"), on("undesirable_share")
        metrics = {"loss": losses.detach().mean() * share.loss, "kl": kl_baseline.mean() * share.loss,
                   "rewards/chosen": (rewards * desirable).sum(), "rewards/rejected": (rewards * undesirable).sum(),
                   "logps/chosen": (logps.detach() * desirable).sum(),
                   "logps/rejected": (logps.detach() * undesirable).sum()}
        return losses.mean() * share.loss, metrics

    return sequence_loss


def kto_shares(desirable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(desirable_share, undesirable_share) columns of a global KTO batch."""
    desirable = desirable.bool()
    as_share = lambda rows: rows.double() / rows.sum().clamp_min(1)  # noqa: E731
    return as_share(desirable), as_share(~desirable)
