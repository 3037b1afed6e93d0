"""The reference policy: a frozen copy of the initial actor that scores responses for the KL term; for an actor
trained with LoRA adapters, the actor's own model with its adapters off (its frozen base: no second copy).

A reference of its own may wait on the host outside its pass (`offload_params`, verl's ref param_offload: on a
32B model at TP 8 its bf16 weights are 7.6 GiB per GPU, held through the actor's update otherwise)."""
from __future__ import annotations

from pathlib import Path

import contextlib

import torch

from verl_mega.models.builder import checkpoint_tensors
from verl_mega.models.host_copies import HostCopies
from verl_mega.models.lora import adapters_disabled, has_lora

from .actor import Actor, compute_response_logprobs, load_gpt_model
from .batching import Batch
from .megatron_step import resolve_sequence_packing
from .routing_replay import attach_routing_replay, replays


class Reference:
    """No DDP and no optimizer: the pipeline schedules run the bare GPTModel forward-only."""

    def __init__(self, ckpt_dir: str | Path, packed_sequences: str = "auto", temperature: float = 1.0,
                 router_replay: str = "off", offload_params: bool = False, **config_overrides):
        """`packed_sequences`: the actor's `actor.use_packed_sequences`, whose model this is. `temperature`: the
        log-probs' (see `response_logprobs`), the actor's. `router_replay`: the actor's `actor.router_replay`:
        with `rollout`, the reference routes every token as the rollout did too. `offload_params`: the weights
        wait on the host but for `compute_ref_log_prob` (the actor's `actor.offload.params`)."""
        self.model, self.vocab_size = load_gpt_model(ckpt_dir, **config_overrides)
        attach_routing_replay(self.model, replays(router_replay))
        self.temperature = temperature
        self.packed = resolve_sequence_packing(packed_sequences, self.model, "actor.use_packed_sequences")
        self.model.requires_grad_(False)
        self.model.eval()
        self.host = HostCopies() if offload_params else None
        self._to_host()

    def compute_ref_log_prob(self, batch: Batch, micro_batch_size: int, max_tokens: int = 0) -> torch.Tensor:
        """[B, R] float32 log-probs of the responses under the reference policy, on every rank."""
        with self.on_device():
            return compute_response_logprobs(self.model, self.vocab_size, batch, micro_batch_size,
                                             max_tokens=max_tokens, packed=self.packed,
                                             temperature=self.temperature)["log_probs"]

    @contextlib.contextmanager
    def on_device(self):
        """The weights on the device for the body (back on the host after, with `offload_params`)."""
        if self.host is not None:
            self.host.restore()
        try:
            yield
        finally:
            self._to_host()

    def _to_host(self) -> None:
        if self.host is not None:
            self.host.offload(checkpoint_tensors(self.model).values())
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


class AdaptersOffReference:
    """The reference of a LoRA actor: the actor's model with its adapters off is the initial policy exactly (the
    base weights never train), at the actor's sequence layout, temperature and routing replay."""

    def __init__(self, actor: Actor):
        self.actor = actor

    @property
    def model(self):
        return self.actor.model

    def compute_ref_log_prob(self, batch: Batch, micro_batch_size: int, max_tokens: int = 0) -> torch.Tensor:
        """[B, R] float32 log-probs of the responses under the base model, on every rank."""
        actor = self.actor
        with adapters_disabled(actor.model):
            return compute_response_logprobs(actor.model, actor.vocab_size, batch, micro_batch_size,
                                             max_tokens=max_tokens, packed=actor.trainable.packed,
                                             temperature=actor.temperature)["log_probs"]


def reference_of(actor: Actor, ckpt_dir: str | Path, **options) -> Reference | AdaptersOffReference:
    """The reference of `actor`, loaded from `ckpt_dir` (its initial weights) with `options` (see `Reference`),
    or with LoRA adapters on the actor its own base model."""
    return AdaptersOffReference(actor) if has_lora(actor.model) else Reference(ckpt_dir, **options)


def make_reference(ckpt_dir: str | Path, *, use_kl: bool, actor: Actor | None = None,
                   **options) -> Reference | AdaptersOffReference | None:
    """The reference when a KL term (in the reward or in the loss) needs it; None saves its memory otherwise.
    With `actor`: `reference_of(actor, ...)`."""
    if not use_kl:
        return None
    return reference_of(actor, ckpt_dir, **options) if actor is not None else Reference(ckpt_dir, **options)
