"""A role's model made trainable: megatron DDP, megatron's optimizer and its learning-rate schedule."""
from __future__ import annotations

import math

from verl_mega.config import OptimConfig
from verl_mega.config.errors import NonFiniteError
from verl_mega.parallel.agree import all_finite
from verl_mega.parallel.shims import accumulate_weight_gradients_in_place, use_fused_adam

from .batching import Batch, batch_size, split_rows
from .megatron_step import LossFn, forward_backward

LR_DECAY_STYLES = ("constant", "linear", "cosine")  # megatron's OptimizerParamScheduler's


def optimizer_config(optim: OptimConfig, config):
    """megatron's OptimizerConfig of `optim` for a model of TransformerConfig `config`."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        # Megatron reports the grad norm only while clipping; an infinite bound clips nothing.
        clip_grad=optim.clip_grad if optim.clip_grad > 0 else math.inf,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
        # fp16's dynamic loss scale starts where torch's GradScaler does: megatron's 2**32 overflows
        # and skips the first ~16 steps, a whole short RL run.
        initial_loss_scale=2.0**16,
        # All of the optimizer on the host (megatron's HybridDeviceOptimizer), as Megatron-LM recommends it.
        optimizer_cpu_offload=optim.cpu_offload, optimizer_offload_fraction=1.0 if optim.cpu_offload else 0.0,
    )


class TrainableModel:
    """Wraps a GPTModel for training; `model` is the DDP wrapper the pipeline schedules run.

    Gradients accumulate over a mini-batch's micro-batches in DDP's buffers; `step()` reduces, clips and
    applies them, then clears the buffers for the next mini-batch.
    """

    def __init__(self, module, optim: OptimConfig, schedule_steps: int, packed: bool = False):
        """`schedule_steps`: the optimizer steps the role takes over the run, the LR schedule's length.
        `packed`: forward the micro-batches as padding-free THD rows (see `megatron_step.stage_forward`)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if optim.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, got '{optim.lr_decay_style}'")
        config = module.config
        self.packed = packed
        self.model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=optim.use_distributed_optimizer
            ),
            module=module,
        )
        accumulate_weight_gradients_in_place(self.model)
        self.optimizer = get_megatron_optimizer(optimizer_config(optim, config), [self.model])
        use_fused_adam(self.optimizer)
        # What megatron's training loop installs: the schedules call these after the last backward. They pass the
        # model list they ran, which under virtual pipeline stages is the chunks inside the one DDP that holds all
        # of their gradients (`models.chunks.schedule_chunks`): the gradients are finalized on that DDP.
        config.finalize_model_grads_func = lambda _ran, *args, **kwargs: finalize_model_grads([self.model], *args,
                                                                                              **kwargs)
        config.grad_scale_func = self.optimizer.scale_loss
        decay_steps = optim.lr_decay_steps or max(schedule_steps, optim.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant",
        )

    def train_epochs(self, batch: Batch, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int,
                     loss_agg_mode: str, metric_names: list[str], loss_fn: LossFn, max_tokens: int = 0
                     ) -> dict[str, float]:
        """Epochs over global mini-batches of `mini_batch_size` rows (in order, unshuffled), one optimizer step
        each, `micro_batch_size` rows (or with `max_tokens`, that many tokens) per forward on each DP rank.
        Returns metrics averaged over the steps."""
        if batch_size(batch) % mini_batch_size:
            raise ValueError(f"mini_batch_size={mini_batch_size} must divide the batch of {batch_size(batch)} rows")
        self.model.train()
        steps = []
        for _ in range(ppo_epochs):
            for mini_batch in split_rows(batch, mini_batch_size, "mini_batch_size"):
                metrics = forward_backward(self.model, mini_batch, micro_batch_size, loss_agg_mode, metric_names,
                                           loss_fn, max_tokens, self.packed)
                metrics.update(self.step())
                steps.append(metrics)
        return {name: sum(step[name] for step in steps) / len(steps) for name in steps[0]}

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """Apply the accumulated gradients: {'grad_norm', 'lr', 'update_successful'}.

        Raises NonFiniteError, with the gradients cleared and nothing applied, if any rank holds a NaN/inf
        gradient in fp32/bf16, where megatron's optimizer would apply it (it checks only under fp16's scaler).
        """
        lr = self.optimizer.param_groups[0]["lr"]
        # Under fp16's loss scaler an overflow is routine: megatron skips that step and lowers the scale itself.
        if getattr(self.optimizer, "grad_scaler", None) is None:
            # Every main_grad is a view into DDP's contiguous buffers: one sum per buffer, not ~4 calls per tensor
            # (a 30-layer model has ~270), where padding between buckets is zero.
            grad_buffers = [buffer.grad_data for buffer in self.model.buffers + self.model.expert_parallel_buffers]
            if not all_finite(grad_buffers):
                self.zero_grad()
                raise NonFiniteError("gradients are NaN/inf")
        update_successful, grad_norm, _ = self.optimizer.step()
        self.zero_grad()
        if update_successful:
            self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr,
                "update_successful": float(update_successful)}
