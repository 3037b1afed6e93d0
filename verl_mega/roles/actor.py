"""The actor: a megatron-core policy that scores response tokens and takes PPO, supervised or preference steps.

Batches follow `roles.batching` (every rank passes the same global batch; results cover the whole batch).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.algorithms import (
    agg_loss, compute_kl, get_policy_loss_fn, is_batch_mean, old_log_probs_from_rollout, policy_loss_metric_names,
    rollout_correction, rollout_correction_from_config, topk_generalized_jsd,
)
from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.config import DistillConfig, LoraConfig, OptimConfig, PolicyLossConfig, RolloutCorrectionConfig
from verl_mega.models.lora import apply_lora
from verl_mega.parallel.state import current_layout, device

from .batching import Batch, batch_size, pad_response_columns
from .logprobs import vocab_parallel_gather_logprobs, vocab_parallel_logprobs, vocab_parallel_sum_pi_squared
from .megatron_step import MicroBatchShare, compute_per_token, resolve_sequence_packing
from .routing_replay import ROUTED_EXPERTS, attach_routing_replay, is_moe, replays, reset_mismatch, router_mismatch
from .trainable import TrainableModel


# One unit per row: every row of a sequence-level batch holds a non-empty completion.
SEQUENCE_LOSS_AGG = "seq-mean-token-sum"
# A batch column the on-policy update adds for itself: each row's index, so that the log-probs of its first
# forward can be put back in batch order (see `Actor.first_forward_log_probs`).
ROW_INDEX = "row_index"


def load_gpt_model(ckpt_dir: str | Path, **config_overrides):
    """This rank's GPTModel from a converted checkpoint, and the true (unpadded) vocabulary size.
    `dtype=` (fp32, bf16, fp16) trains in another dtype than the checkpoint's."""
    model, _, hf_config, _ = build_model_from_checkpoint(ckpt_dir, **config_overrides)
    return model, hf_config.vocab_size


def response_logprobs(logits: torch.Tensor, micro_batch: Batch, vocab_size: int, return_entropy: bool,
                      temperature: float = 1.0):
    """Log-probs (and entropy) of `responses` from a last stage's [b, R, V/tp] logits (see `stage_forward`),
    under softmax(logits / temperature): the distribution the rollout sampled from (at 1, the logits as they are,
    bitwise)."""
    responses = micro_batch["responses"].to(logits.device)
    if temperature != 1:
        logits = logits / temperature
    return vocab_parallel_logprobs(logits, responses,
                                   vocab_size=vocab_size, return_entropy=return_entropy)


def sampling_temperature(temperature: float) -> float:
    """The temperature the trainer's log-probs are taken at for responses sampled at `temperature`: the same,
    with greedy (0) counting as 1, as the rollout engines report their log-probs."""
    return temperature if temperature > 0 else 1.0


def compute_response_logprobs(model, vocab_size: int, batch: Batch, micro_batch_size: int,
                              return_entropy: bool = False, max_tokens: int = 0, packed: bool = False,
                              temperature: float = 1.0, return_sum_pi_squared: bool = False
                              ) -> dict[str, torch.Tensor]:
    """Forward-only {'log_probs'[, 'entropy'][, 'sum_pi_squared']} [B, R] of the responses at `temperature` (see
    `response_logprobs`), on every rank (actor and reference)."""
    names = ("log_probs", "entropy") if return_entropy else ("log_probs",)

    def per_token(logits, micro_batch):
        outputs = response_logprobs(logits, micro_batch, vocab_size, return_entropy, temperature)
        per_name = dict(zip(names, outputs if return_entropy else (outputs,)))
        if return_sum_pi_squared:  # of the same distribution as the log-probs
            per_name["sum_pi_squared"] = vocab_parallel_sum_pi_squared(
                logits / temperature if temperature != 1 else logits, vocab_size)
        return per_name

    model.eval()
    names += ("sum_pi_squared",) if return_sum_pi_squared else ()
    return compute_per_token(model, batch, micro_batch_size, names, per_token, max_tokens, packed)


def uses_kl_loss(loss: PolicyLossConfig) -> bool:
    """Whether the policy loss has a KL term: with a zero coefficient it adds nothing and needs no reference."""
    return loss.use_kl_loss and loss.kl_loss_coef != 0


def is_on_policy(ppo_epochs: int, mini_batch_size: int, rows: int) -> bool:
    """Whether an update's first forward sees the weights that generated the batch, for every row: one epoch
    over one mini-batch. The old log-probs are then that forward's, and a separate pass to compute them is
    redundant."""
    return ppo_epochs == 1 and mini_batch_size == rows


class Actor:
    def __init__(self, ckpt_dir: str | Path, optim: OptimConfig, loss: PolicyLossConfig | None = None, *,
                 schedule_steps: int, packed_sequences: str = "auto", temperature: float = 1.0,
                 correction: RolloutCorrectionConfig | None = None, router_replay: str = "off",
                 lora: LoraConfig | None = None, distill: DistillConfig | None = None, **config_overrides):
        """`packed_sequences`: auto | true | false, `actor.use_packed_sequences` (see `resolve_sequence_packing`).
        `temperature`: the PPO log-probs' (`sampling_temperature` of the rollout's). `correction`: what the PPO
        update does with a batch's `rollout_log_probs` (`algorithm.rollout_correction`; default: nothing).
        `router_replay`: off | rollout, `actor.router_replay` (see `roles.routing_replay`). `lora`: `actor.lora`,
        adapters trained on the frozen loaded weights (default: every parameter trains). `distill`:
        `algorithm.distill`; with loss gkd, the PPO loss gains coef * GKD's divergence from the teacher over the
        batch's `teacher_topk_ids` / `teacher_topk_log_probs` (default: no such term)."""
        module, self.vocab_size = load_gpt_model(ckpt_dir, **config_overrides)
        attach_routing_replay(module, replays(router_replay))
        apply_lora(module, lora or LoraConfig())
        packed = resolve_sequence_packing(packed_sequences, module, "actor.use_packed_sequences")
        self.trainable = TrainableModel(module, optim, schedule_steps, packed)
        self.loss = loss or PolicyLossConfig()
        self._policy_loss = get_policy_loss_fn(self.loss.policy_loss)
        self._policy_loss_knobs = self.loss.knobs()
        self._old_from_rollout = old_log_probs_from_rollout(self.loss.policy_loss)
        self.temperature = temperature
        self.distill = distill or DistillConfig()
        self.correction = correction or RolloutCorrectionConfig()
        if self._old_from_rollout and self.loss.bypass_loss_type == "ppo_clip":
            # PPO's clip in bypass mode already bounds the ratio to the rollout: only the rejection applies.
            self.correction = replace(self.correction, rollout_is=None, rollout_is_batch_normalize=False)
        # The update's rollout_is_batch_normalize divisor: the mean weight over its whole batch (None: off).
        self._is_batch_mean: torch.Tensor | None = None
        # The on-policy update's first-forward log-probs: per micro-batch (row indices, [b, r]) while it runs,
        # then [B, R] for the whole batch on every rank (None where the batch brought its old log-probs).
        self._first_forward: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.first_forward_log_probs: torch.Tensor | None = None
        # The old-log-prob pass's router mismatch, for the update's metrics (None: not measured).
        self._pass_router_mismatch: float | None = None

    @property
    def model(self):
        return self.trainable.model

    def compute_log_prob(self, batch: Batch, micro_batch_size: int, return_entropy: bool = False,
                         max_tokens: int = 0, return_sum_pi_squared: bool = False):
        """{'log_probs'[, 'entropy'][, 'sum_pi_squared']} of the response tokens, [B, R] float32 on every rank.
        With the rollout's `routed_experts` in `batch`, the router mismatch is measured too (see `update_policy`)."""
        with self._router_mismatch_measured(batch, True) as measured:
            outputs = compute_response_logprobs(self.model, self.vocab_size, batch, micro_batch_size, return_entropy,
                                                max_tokens, self.trainable.packed, self.temperature,
                                                return_sum_pi_squared)
        self._pass_router_mismatch = measured.get("router_mismatch")
        return outputs

    @contextlib.contextmanager
    def _router_mismatch_measured(self, batch: Batch, measure: bool):
        """Collective after the body: {'router_mismatch': ...} (see `routing_replay.router_mismatch`) over the
        body's forwards, when `measure` and the batch brings the rollout's routing of an MoE model; else {}."""
        measured = {}
        measures = measure and ROUTED_EXPERTS in batch and is_moe(self.model)
        if measures:
            reset_mismatch(self.model)
        yield measured
        if measures:
            mismatch = router_mismatch(self.model)
            if mismatch is not None:
                measured["router_mismatch"] = mismatch

    @property
    def uses_kl_loss(self) -> bool:
        return uses_kl_loss(self.loss)

    def update_policy(self, batch: Batch, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int,
                      max_tokens: int = 0) -> dict:
        """PPO steps (see `TrainableModel.train_epochs`); metrics averaged over the optimizer steps.

        Without 'old_log_probs' in `batch` the update is on-policy: allowed for one epoch over one mini-batch,
        where the old log-probs are by definition the first (and only) forward's, which it uses, detached; they
        are then left in `first_forward_log_probs` ([B, R] on every rank) when the batch has `rollout_log_probs`,
        for the mismatch metrics. With the rollout's `routed_experts` in `batch`, metrics include `router_mismatch`:
        the share of (token, MoE layer) pairs the router would route elsewhere than the rollout did (replayed or
        not), at the rollout's weights: the old-log-prob pass's (`compute_log_prob` before this update), else this
        on-policy update's own forward; absent where neither ran.
        """
        if self.uses_kl_loss and "ref_log_probs" not in batch:
            raise ValueError("use_kl_loss is set but the batch has no 'ref_log_probs'")
        on_policy = is_on_policy(ppo_epochs, mini_batch_size, batch_size(batch))
        if self._old_from_rollout and "rollout_log_probs" not in batch:
            raise ValueError(f"policy_loss={self.loss.policy_loss} takes the rollout's log-probs as the old ones, and "
                             "the batch has no 'rollout_log_probs'")
        if "old_log_probs" not in batch and not (on_policy or self._old_from_rollout):
            raise ValueError(f"the batch has no 'old_log_probs': they equal the update's own forward only for one "
                             f"epoch over one mini-batch, not ppo_epochs={ppo_epochs} with mini_batch_size="
                             f"{mini_batch_size} of {batch_size(batch)} rows")
        names = ["pg_loss", *policy_loss_metric_names(self.loss.policy_loss), "entropy"]
        if self.uses_kl_loss:
            names.append("kl_loss")
        if self.distill.loss == "gkd":
            if "teacher_topk_ids" not in batch:
                raise ValueError("algorithm.distill.loss=gkd and the batch has no 'teacher_topk_ids'")
            names.append("gkd_loss")
        # Only the mismatch metrics read them, and only a batch with rollout log-probs has those.
        # Off-policy (bypass mode), a later mini-batch's first forward no longer sees the rollout's weights.
        pass_log_probs = None
        if self._normalises_weights(batch):
            if "old_log_probs" not in batch:  # on-policy: the mean needs every row's weight before any step
                # On the host like the batch it joins (the pass leaves it on the device: CUDA on a GPU).
                pass_log_probs = self.compute_log_prob(batch, micro_batch_size,
                                                       max_tokens=max_tokens)["log_probs"].cpu()
                batch = {**batch, "old_log_probs": pass_log_probs}
            self._is_batch_mean = self._batch_mean_weight(batch)
        keeps_first_forward = "old_log_probs" not in batch and "rollout_log_probs" in batch and on_policy
        self.first_forward_log_probs = None
        self._first_forward = [] if keeps_first_forward else None
        if keeps_first_forward:
            batch = {**batch, ROW_INDEX: torch.arange(batch_size(batch))}
        with self._router_mismatch_measured(batch, "old_log_probs" not in batch and on_policy) as measured:
            metrics = self.trainable.train_epochs(batch, ppo_epochs, mini_batch_size, micro_batch_size,
                                                  self.loss.loss_agg_mode, names, self._micro_batch_loss, max_tokens)
        mismatch = measured.get("router_mismatch", self._pass_router_mismatch if "old_log_probs" in batch else None)
        self._pass_router_mismatch = None
        if mismatch is not None:
            metrics["router_mismatch"] = mismatch
        if keeps_first_forward:
            self.first_forward_log_probs = self._gathered_first_forward(tuple(batch["responses"].shape))
        if pass_log_probs is not None:
            self.first_forward_log_probs = pass_log_probs
        self._is_batch_mean = None
        return metrics

    def _normalises_weights(self, batch: Batch) -> bool:
        config = self.correction
        return config.rollout_is is not None and config.rollout_is_batch_normalize and "rollout_log_probs" in batch

    def _batch_mean_weight(self, batch: Batch) -> torch.Tensor:
        """The mean truncated importance weight over the whole batch, which rollout_is_batch_normalize divides
        every micro-batch's weights by (the same at every layout and micro-batch size)."""
        if self._old_from_rollout:
            raise ValueError("rollout_is_batch_normalize in bypass mode: the weights use the policy being updated, "
                             "whose batch mean is known only after the update")
        mask = batch["response_mask"]
        weights = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], mask,
                                     rollout_is=self.correction.rollout_is,
                                     rollout_is_threshold=self.correction.rollout_is_threshold).loss_weights
        return is_batch_mean(weights, mask, self.correction.rollout_is)

    def _gathered_first_forward(self, shape: tuple[int, int]) -> torch.Tensor:
        """Collective: the first forward's log-probs kept by the last pipeline stages of every DP rank, as [B, R]
        float32 on the CPU of every rank. Each row was computed on one DP rank, zeros stand for it elsewhere, so a
        sum over DP puts every row together unchanged."""
        from megatron.core import parallel_state as ps

        log_probs = torch.zeros(shape, dtype=torch.float32, device=device())
        for rows, values in self._first_forward:
            log_probs[rows.to(log_probs.device)] = pad_response_columns(values, shape[1]).to(log_probs.device)
        self._first_forward = None
        if current_layout().dp > 1:
            dist.all_reduce(log_probs, group=ps.get_data_parallel_group())
        if current_layout().pp > 1:
            dist.broadcast(log_probs, ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return log_probs.cpu()

    def update_sft(self, batch: Batch, mini_batch_size: int, micro_batch_size: int) -> dict:
        """Supervised steps: the NLL of the `response_mask` tokens (the assistant's), averaged over the global
        mini-batch's loss tokens (token-mean shares), so the update does not depend on the layout."""
        return self.trainable.train_epochs(batch, 1, mini_batch_size, micro_batch_size, "token-mean", ["loss"],
                                           self._sft_micro_batch_loss)

    def _sft_micro_batch_loss(self, logits, micro_batch: Batch, share: MicroBatchShare):
        log_prob = response_logprobs(logits, micro_batch, self.vocab_size, return_entropy=False)
        nll = agg_loss(-log_prob, micro_batch["response_mask"].to(logits.device), "token-mean")
        return nll * share.loss, {"loss": nll * share.loss}

    def update_on_sequences(self, batch: Batch, mini_batch_size: int, micro_batch_size: int,
                            metric_names: list[str], sequence_loss) -> dict:
        """Steps on a loss of whole completions: `sequence_loss(logps, tokens, micro_batch, share)` gets each row's
        summed response log-probs and token count [b] and returns what a `LossFn` returns. Every row holds one
        completion, so a micro-batch's share is its fraction of the global rows."""

        def micro_batch_loss(logits, micro_batch: Batch, share: MicroBatchShare):
            mask = micro_batch["response_mask"].to(logits.device)
            log_prob = response_logprobs(logits, micro_batch, self.vocab_size, return_entropy=False)
            return sequence_loss((log_prob * mask).sum(dim=-1), mask.sum(dim=-1), micro_batch, share)

        return self.trainable.train_epochs(batch, 1, mini_batch_size, micro_batch_size, SEQUENCE_LOSS_AGG,
                                           metric_names, micro_batch_loss)

    def _micro_batch_loss(self, logits, micro_batch: Batch, share: MicroBatchShare):
        loss_config = self.loss
        on = lambda key: micro_batch[key].to(logits.device)  # noqa: E731
        log_prob, entropy = response_logprobs(logits, micro_batch, self.vocab_size, return_entropy=True,
                                              temperature=self.temperature)
        if self._first_forward is not None:
            self._first_forward.append((micro_batch[ROW_INDEX], log_prob.detach().float().cpu()))
        if self._old_from_rollout:  # bypass mode: the rollout's ratio is the loss's own; the weights use pi_current
            old_log_prob, train_log_prob = on("rollout_log_probs"), log_prob.detach()
        else:
            old_log_prob = on("old_log_probs") if "old_log_probs" in micro_batch else log_prob.detach()
            train_log_prob = old_log_prob
        mask = on("response_mask")
        rollout_is_weights = self._rollout_is_weights(train_log_prob, micro_batch, mask)
        pg_loss, pg_metrics = self._policy_loss(old_log_prob, log_prob, on("advantages"), mask,
                                                loss_agg_mode=loss_config.loss_agg_mode,
                                                rollout_is_weights=rollout_is_weights, **self._policy_loss_knobs)
        entropy_loss = agg_loss(entropy, mask, loss_config.loss_agg_mode)
        loss = pg_loss - loss_config.entropy_coeff * entropy_loss
        # The loss's own metrics are token-level means: weighted by the micro-batch's share of the tokens.
        metrics = {"pg_loss": pg_loss * share.loss, "entropy": entropy_loss * share.loss,
                   **{name: value * share.tokens for name, value in pg_metrics.items()}}
        if self.uses_kl_loss:
            kl = compute_kl(log_prob, on("ref_log_probs"), loss_config.kl_loss_type)
            kl_loss = agg_loss(kl, mask, loss_config.loss_agg_mode)
            loss = loss + loss_config.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss * share.loss
        if self.distill.loss == "gkd":
            gkd_loss = self._gkd_loss(logits, micro_batch, mask)
            loss = loss + self.distill.coef * gkd_loss
            metrics["gkd_loss"] = gkd_loss * share.loss
        return loss * share.loss, metrics

    def _gkd_loss(self, logits, micro_batch: Batch, mask: torch.Tensor) -> torch.Tensor:
        """GKD's generalised JSD(beta) between the teacher and the student over the teacher's top-k tokens at each
        response position (both at the sampling temperature), aggregated like the policy loss."""
        ids = micro_batch["teacher_topk_ids"].to(logits.device)
        scaled = logits / self.temperature if self.temperature != 1 else logits
        student = vocab_parallel_gather_logprobs(scaled, ids, self.vocab_size)
        divergence = topk_generalized_jsd(student, micro_batch["teacher_topk_log_probs"].to(logits.device),
                                          self.distill.beta)
        return agg_loss(divergence, mask, self.loss.loss_agg_mode)

    def _rollout_is_weights(self, train_log_prob: torch.Tensor, micro_batch: Batch, mask: torch.Tensor
                            ) -> torch.Tensor | None:
        """The rollout correction's weights of each token's policy-gradient loss, from the ratio of the trainer's
        log-probs (π_train: the old ones, or the current ones in bypass mode) to the rollout's, normalised by the
        whole batch's mean weight where asked; None (no weighting) when it is off or the batch has no rollout
        log-probs."""
        config = self.correction
        if "rollout_log_probs" not in micro_batch or config.rollout_is is config.rollout_rs is None:
            return None
        rollout_log_prob = micro_batch["rollout_log_probs"].to(train_log_prob.device)
        return rollout_correction_from_config(train_log_prob, rollout_log_prob, mask, config,
                                              batch_mean=self._is_batch_mean).loss_weights
