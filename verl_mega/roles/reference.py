"""The reference policy: a frozen copy of the initial actor that scores responses for the KL term."""
from __future__ import annotations

from pathlib import Path

import torch

from .actor import compute_response_logprobs, load_gpt_model
from .batching import Batch
from .megatron_step import resolve_sequence_packing
from .routing_replay import attach_routing_replay, replays


class Reference:
    """No DDP and no optimizer: the pipeline schedules run the bare GPTModel forward-only."""

    def __init__(self, ckpt_dir: str | Path, packed_sequences: str = "auto", temperature: float = 1.0,
                 router_replay: str = "off", **config_overrides):
        """`packed_sequences`: the actor's `actor.use_packed_sequences`, whose model this is. `temperature`: the
        log-probs' (see `response_logprobs`), the actor's. `router_replay`: the actor's `actor.router_replay`:
        with `rollout`, the reference routes every token as the rollout did too."""
        self.model, self.vocab_size = load_gpt_model(ckpt_dir, **config_overrides)
        attach_routing_replay(self.model, replays(router_replay))
        self.temperature = temperature
        self.packed = resolve_sequence_packing(packed_sequences, self.model, "actor.use_packed_sequences")
        self.model.requires_grad_(False)
        self.model.eval()

    def compute_ref_log_prob(self, batch: Batch, micro_batch_size: int, max_tokens: int = 0) -> torch.Tensor:
        """[B, R] float32 log-probs of the responses under the reference policy, on every rank."""
        return compute_response_logprobs(self.model, self.vocab_size, batch, micro_batch_size,
                                         max_tokens=max_tokens, packed=self.packed,
                                         temperature=self.temperature)["log_probs"]


def make_reference(ckpt_dir: str | Path, *, use_kl: bool, **options) -> Reference | None:
    """The reference when a KL term (in the reward or in the loss) needs it; None saves its memory otherwise."""
    return Reference(ckpt_dir, **options) if use_kl else None
