"""The critic: the policy's backbone with a scalar value head, trained with the clipped value loss.

Batches follow `roles.batching` (every rank passes the same global batch; results cover the whole batch).
"""
from __future__ import annotations

from pathlib import Path

import torch

from verl_mega.algorithms import compute_value_loss, masked_mean
from verl_mega.config import LoraConfig, OptimConfig, ValueLossConfig
from verl_mega.models.chunks import model_chunks
from verl_mega.models.lora import apply_lora
from verl_mega.models.value_head import attach_value_head

from .actor import load_gpt_model
from .batching import Batch
from .megatron_step import MicroBatchShare, compute_per_token, resolve_sequence_packing
from .trainable import TrainableModel


class Critic:
    def __init__(self, ckpt_dir: str | Path, optim: OptimConfig, loss: ValueLossConfig | None = None, *,
                 schedule_steps: int, packed_sequences: str = "auto", lora: LoraConfig | None = None,
                 **config_overrides):
        """`packed_sequences`: auto | true | false, `critic.use_packed_sequences`. `lora`: `critic.lora`, adapters
        on the frozen backbone; the value head trains in full either way."""
        module, _ = load_gpt_model(ckpt_dir, **config_overrides)
        attach_value_head(module)
        apply_lora(module, lora or LoraConfig())
        head = model_chunks(module)[-1]
        if head.post_process:  # the head is new (zero-initialised): the backbone's adapters alone cannot fit it
            head.output_layer.requires_grad_(True)
        packed = resolve_sequence_packing(packed_sequences, module, "critic.use_packed_sequences")
        self.trainable = TrainableModel(module, optim, schedule_steps, packed)
        self.loss = loss or ValueLossConfig()

    @property
    def model(self):
        return self.trainable.model

    def compute_values(self, batch: Batch, micro_batch_size: int, max_tokens: int = 0) -> torch.Tensor:
        """[B, R] float32 values of the states before each response token, on every rank."""
        self.model.eval()
        return compute_per_token(self.model, batch, micro_batch_size, ("values",),
                                 lambda output, micro_batch: {"values": _response_values(output)},
                                 max_tokens, self.trainable.packed)["values"]

    def update_critic(self, batch: Batch, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int,
                      max_tokens: int = 0) -> dict:
        """Clipped value-loss steps over global mini-batches (as `Actor.update_policy`); needs 'values' (the
        predictions at rollout time) and 'returns'. Returns metrics averaged over steps."""
        return self.trainable.train_epochs(batch, ppo_epochs, mini_batch_size, micro_batch_size,
                                        self.loss.loss_agg_mode, ["vf_loss", "vf_clipfrac", "vpred_mean"],
                                        self._micro_batch_loss, max_tokens)

    def _micro_batch_loss(self, output, micro_batch: Batch, share: MicroBatchShare):
        on = lambda key: micro_batch[key].to(output.device)  # noqa: E731
        mask = on("response_mask")
        vpreds = _response_values(output)
        vf_loss, vf_clipfrac = compute_value_loss(vpreds, on("values"), on("returns"), mask,
                                                  cliprange_value=self.loss.cliprange_value,
                                                  loss_agg_mode=self.loss.loss_agg_mode)
        metrics = {"vf_loss": vf_loss * share.loss, "vf_clipfrac": vf_clipfrac * share.tokens,
                   "vpred_mean": masked_mean(vpreds.detach(), mask) * share.tokens}
        return vf_loss * share.loss, metrics


def _response_values(output: torch.Tensor) -> torch.Tensor:
    """[b, R] values from the value head's [b, R, 1] output at the response positions (see `stage_forward`)."""
    return output[..., 0].float()
