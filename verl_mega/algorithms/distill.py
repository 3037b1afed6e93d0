"""On-policy distillation: what a frozen teacher's scores of the student's own samples teach it.

- `reverse_kl_advantage`: Thinking Machines' "On-Policy Distillation" (2025): each sampled token's advantage is
  the negative per-token reverse KL estimate, -(log p_student - log p_teacher), with discount 0 (no token's
  advantage borrows from later ones). Its expectation under the student is -KL(student || teacher) at that
  position, so the policy gradient minimises the reverse KL.
- `distill_advantages`: that advantage scaled by `coef` and added to an outcome reward's advantages (none: the
  teacher's signal alone).
- `generalized_jsd`: GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, eq. 1) between the teacher
  P and the student Q at each position, with M = beta P + (1 - beta) Q:
      JSD(beta)(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M),
  and at the ends its limits once divided by beta (resp. 1 - beta): beta = 0 is the forward KL(P || Q), beta = 1
  the reverse KL(Q || P) (the paper's interpolation between the two).
- `topk_generalized_jsd`: the same on the teacher's top-k tokens at each position, both distributions
  renormalised over those k (so with beta = 0 the forward KL on the teacher's top-k).

All functions are pure; their last dimension is the support (tokens), the others are positions.
"""
from __future__ import annotations

import math

import torch

from verl_mega.algorithms.masked import check_same_shape

# algorithm.distill.loss: off (no teacher), reverse_kl (an advantage: the actor's policy loss does the rest) or
# gkd (a loss term on the student's distribution over the teacher's top-k tokens).
DISTILL_LOSSES = ("off", "reverse_kl", "gkd")


def reverse_kl_advantage(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -(log p_student - log p_teacher) of each sampled token, zero off the mask (discount 0)."""
    check_same_shape("student_log_probs", student_log_probs, teacher_log_probs=teacher_log_probs,
                     response_mask=response_mask)
    return (teacher_log_probs - student_log_probs) * response_mask


def distill_advantages(outcome_advantages: torch.Tensor | None, student_log_probs: torch.Tensor,
                       teacher_log_probs: torch.Tensor, response_mask: torch.Tensor, *, coef: float) -> torch.Tensor:
    """outcome_advantages + coef * reverse_kl_advantage; `outcome_advantages` None: the teacher's term alone."""
    advantages = coef * reverse_kl_advantage(student_log_probs, teacher_log_probs, response_mask)
    if outcome_advantages is None:
        return advantages
    check_same_shape("outcome_advantages", outcome_advantages, response_mask=response_mask)
    return outcome_advantages * response_mask + advantages


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, from finite log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """[..., V] normalised log-probs of the student Q and the teacher P -> [...] JSD(beta)(P || Q) (see the module
    docstring): beta in [0, 1]; 0 is KL(P || Q), 1 is KL(Q || P)."""
    check_same_shape("student_log_probs", student_log_probs, teacher_log_probs=teacher_log_probs)
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0:
        return _kl(teacher_log_probs, student_log_probs)
    if beta == 1:
        return _kl(student_log_probs, teacher_log_probs)
    log_mixture = torch.logsumexp(torch.stack([teacher_log_probs + math.log(beta),
                                               student_log_probs + math.log(1 - beta)]), dim=0)
    return beta * _kl(teacher_log_probs, log_mixture) + (1 - beta) * _kl(student_log_probs, log_mixture)


def topk_generalized_jsd(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                         beta: float) -> torch.Tensor:
    """[..., k] log-probs (each over its whole vocabulary) of the teacher's top-k tokens under the student and the
    teacher -> [...] `generalized_jsd` of the two renormalised over those k tokens."""
    return generalized_jsd(torch.log_softmax(student_topk_log_probs, dim=-1),
                           torch.log_softmax(teacher_topk_log_probs, dim=-1), beta)
