"""The training config: a YAML file plus dotted overrides, merged onto typed defaults (OmegaConf).

A leaf of the package: the dataclasses every role and job reads, and loading them. Checking a config against
the rest of the package (registries, layouts, the model, the data files) is `verl_mega.trainer.preflight`,
run before any process group starts; every failure names the key and the fix."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from .errors import UserError
from .overrides import loose_booleans, override_layer, unknown_keys, verbatim
from .ranges import ANY, Range, above, at_least, within

# Seconds a wait may last: larger ones overflow the timeouts of threads and process groups.
LONGEST_WAIT_S = 1e9
# A seed every generator takes (numpy's are 32-bit).
SEED = within(0, 2**32 - 1)


@dataclass
class OptimConfig:
    """Adam settings and the LR schedule (constant, linear or cosine decay after a linear warmup)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "lr": at_least(0), "min_lr": at_least(0), "weight_decay": at_least(0),
        "adam_beta1": within(0, 1, high_open=True), "adam_beta2": within(0, 1, high_open=True),
        "adam_eps": at_least(0), "clip_grad": Range(note="<= 0: no clipping"), "lr_warmup_steps": at_least(0),
        "lr_decay_steps": at_least(1, note="null: the run's optimizer steps")}

    lr: float = 1e-6
    """Peak learning rate (after the warmup)."""
    min_lr: float = 0.0
    """Learning rate the linear or cosine decay ends at."""
    weight_decay: float = 0.01
    """Adam's decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam's beta1."""
    adam_beta2: float = 0.999
    """Adam's beta2."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold; <= 0: no clipping (the norm is still reported)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state sharded over the data-parallel ranks."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    lr_decay_steps: int | None = None
    """Optimizer steps the decay spans; None: the run's optimizer steps."""
    lr_decay_style: str = "constant"
    """Shape of the decay after the warmup (megatron's OptimizerParamScheduler)."""
    cpu_offload: bool = False
    """Megatron's optimizer CPU offload (optimizer_cpu_offload, the whole of it: optimizer_offload_fraction 1):
    the fp32 main parameters, gradients' copies and Adam's moments live on the host and the Adam step runs there,
    through megatron's HybridDeviceOptimizer (CUDA only; needs the distributed optimizer). verl's
    <role>.optim.override_optimizer_config.optimizer_cpu_offload; Megatron-LM's
    --optimizer-cpu-offload --optimizer-offload-fraction 1.0."""


@dataclass
class PolicyLossConfig:
    """The actor's loss: the policy-gradient surrogate, its clipping, entropy bonus and KL loss.

    Every field from `clip_ratio` to `bypass_loss_type` is a knob of one or more policy losses, under verl's name; the
    actor passes them all (`knobs()`) and each loss reads its own (docs/jobs/policy-losses.md)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "clip_ratio": at_least(0), "clip_ratio_low": at_least(0), "clip_ratio_high": at_least(0),
        "clip_ratio_c": above(1, note="dual-clip"), "clip_cov_ratio": within(0, 1, low_open=True),
        "clip_cov_lb": ANY, "clip_cov_ub": ANY, "kl_cov_ratio": within(0, 1, low_open=True),
        "ppo_kl_coef": at_least(0), "tau_pos": above(0), "tau_neg": above(0), "entropy_coeff": ANY,
        "kl_loss_coef": at_least(0)}

    policy_loss: str = "vanilla"
    """The policy loss, a name registered in algorithms.POLICY_LOSSES (verl's names: vanilla, gspo, cispo,
    geo_mean, sapo, clip_cov, kl_cov, gpg)."""
    clip_ratio: float = 0.2
    """PPO's clip range: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio] (vanilla, gspo, cispo,
    clip_cov; geo_mean clips the log-ratio to [-clip_ratio, clip_ratio])."""
    clip_ratio_low: float | None = None
    """Lower clip range (DAPO's clip-higher is an asymmetric range); None: clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range; None: clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound (> 1): for negative advantages the loss is capped at clip_ratio_c * |A| (vanilla)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the fraction of a micro-batch's response tokens whose gradient is cut (at least one)."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens whose covariance of advantage and log-prob exceeds this may be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens whose covariance of advantage and log-prob is below this may be cut."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the fraction of a micro-batch's response tokens, those of largest covariance of advantage and
    log-prob, that get the KL penalty (at least one)."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of the penalty |log(pi / pi_old)| on the selected tokens."""
    tau_pos: float = 1.0
    """sapo: temperature of the soft gate for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """sapo: temperature of the soft gate for tokens with a zero or negative advantage (> tau_pos damps them
    faster)."""
    bypass_loss_type: str = "ppo_clip"
    """bypass_mode (the rollout's log-probs as the old ones, no old-log-prob pass): ppo_clip (PPO's clip on
    pi / pi_rollout, which is the correction) or reinforce (-w A log pi, w the truncated pi / pi_rollout of
    algorithm.rollout_correction's weights). verl's policy_loss.rollout_correction.loss_type."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses are averaged into the batch's loss."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus subtracted from the policy loss."""
    use_kl_loss: bool = False
    """Add a KL term against the frozen reference to the actor's loss (GRPO-style KL in loss)."""
    kl_loss_coef: float = 0.001
    """Weight of that KL loss."""
    kl_loss_type: str = "low_var_kl"
    """The KL loss's estimator, a name registered in algorithms.KL_ESTIMATORS."""
    extra: dict = field(default_factory=dict)
    """Further keyword arguments of the policy loss (for a loss registered outside verl_mega)."""

    def knobs(self) -> dict[str, Any]:
        """The keyword arguments the policy loss is called with: every knob field, and `extra`."""
        typed = {name: getattr(self, name) for name in POLICY_LOSS_KNOBS}
        repeated = sorted(typed.keys() & self.extra.keys())
        if repeated:
            raise ValueError(f"actor.loss.extra repeats {repeated}: set actor.loss.{repeated[0]} instead")
        return {**typed, **self.extra}


# PolicyLossConfig's fields that are knobs of a policy loss (verl's names).
POLICY_LOSS_KNOBS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb",
                     "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "tau_pos", "tau_neg",
                     "bypass_loss_type")


@dataclass
class ValueLossConfig:
    """The critic's clipped value loss."""

    RANGES: ClassVar[dict[str, Range]] = {"cliprange_value": at_least(0)}

    cliprange_value: float = 0.5
    """Clip range of the new values around the old ones."""
    loss_agg_mode: str = "token-mean"
    """How per-token value losses are averaged into the batch's loss."""


@dataclass
class ModelConfig:
    """The models a run starts from and the precision they train in."""

    hf_path: str = "???"
    """HF folder: config, tokenizer (and the weights when `actor_ckpt` is empty); or a Hub id org/name[@revision]
    (docs/hub.md)."""
    actor_ckpt: str = ""
    """Converted megatron checkpoint; empty: converted from hf_path into the run folder."""
    critic_ckpt: str = ""
    """Converted megatron checkpoint; empty: critic_hf_path's weights, else the actor's."""
    critic_hf_path: str = ""
    """HF causal-LM folder (or Hub id) the critic starts from (converted like the actor's weights)."""
    dtype: str = "fp32"
    """Parameters and activations of actor, critic and reference (megatron mixed precision: fp32 main weights,
    optimizer state and gradient reduction; fp16 with dynamic loss scaling)."""
    family_spec: str = ""
    """package.module:SPEC of a family declared outside verl_mega; empty: by model_type."""
    conversion_cache: str = ""
    """A folder of converted checkpoints shared by runs, one per HF folder's sha256, layout and dtype; empty: the
    HF folders are converted into the run folder. Not used for a role whose *_ckpt is given."""
    sha256: str = ""
    """Expected sha256 of hf_path's config and weights (RUN/provenance.json's); empty: any."""


@dataclass
class ParallelConfig:
    """The training layout; the data-parallel size is what the world size leaves."""

    RANGES: ClassVar[dict[str, Range]] = {
        "tp": at_least(1), "pp": at_least(1), "ep": at_least(1), "rollout_tp": at_least(1), "cp": at_least(1),
        "vpp": at_least(1),
        "rollout_ranks": at_least(0, note="0: colocated"),
        "bridge_timeout_s": within(0, LONGEST_WAIT_S, low_open=True, note="seconds"),
        "weight_push_bucket_mb": at_least(1)}

    tp: int = 1
    """Tensor-parallel size of training."""
    pp: int = 1
    """Pipeline-parallel size of training."""
    ep: int = 1
    """Expert-parallel size of training (MoE models)."""
    cp: int = 1
    """Context-parallel size (megatron's context_parallel_size): each sequence split over this many ranks, whose
    attention exchanges keys and values. It needs transformer-engine's attention on CUDA: the pre-flight check
    refuses it elsewhere; never run on a GPU yet (docs/memory.md). verl's
    actor_rollout_ref.actor.megatron.context_parallel_size."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (megatron's interleaved 1F1B schedule,
    virtual_pipeline_model_parallel_size): each rank runs this many model chunks of num_layers / (pp x vpp)
    layers, shrinking the pipeline bubble; needs pp > 1 and at least pp micro-batches per pass
    (docs/memory.md). verl's actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size."""
    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism: the activations outside attention and the MLP (norms, dropout,
    residuals) split along the sequence over the TP ranks instead of held whole by each. null: on when tp > 1
    (for a role with LoRA adapters, off), as megatron recommends; it changes no result. Micro-batches are
    left-padded to a multiple of tp tokens. verl's actor_rollout_ref.actor.megatron.sequence_parallel."""
    rollout_tp: int = 1
    """Tensor-parallel size of each rollout replica (the HybridEngine regroups the training shards into it)."""
    rollout_ranks: int = 0
    """Processes that only generate (verl's standalone rollout, slime's --rollout-num-gpus): the last this many
    global ranks, in replicas of parallel.rollout_tp; the others train and push their weights to them after each
    step. 0: every rank trains and generates (colocated, the HybridEngine)."""
    bridge_timeout_s: float = 600.0
    """Seconds a training or rollout rank waits for its peer across the bridge before the run stops naming that
    rank (disaggregated placement); keep it above the longest step."""
    weight_push_bucket_mb: int = 256
    """Size of the buckets the weights travel to the rollout ranks in (disaggregated placement): larger ones
    take fewer messages, each holds that much memory on both sides while in flight."""
    weight_push_verify: bool = False
    """Compare a checksum of every pushed tensor on both sides after each push to the rollout ranks (stopping
    the run naming the first that differs) and log how many agreed (weight_push/verified_tensors). It costs a
    host pass over the weights on each side: for tests and for debugging a new transport."""


@dataclass
class DataConfig:
    """The training and held-out data, and how prompts are cut and batched."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_prompt_length": at_least(1), "max_response_length": at_least(1), "batch_size": at_least(1),
        "seed": SEED, "length_group_batches": at_least(1)}

    train_files: list[str] = field(default_factory=list)
    """Parquet or jsonl files, folders written by HF datasets' `save_to_disk` (one split each), or Hub data
    hf://datasets/org/name[@revision]/path (a file, folder or split; docs/hub.md)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out rows scored every trainer.val_every steps and at the end (rl: also before the first step). rl:
    greedy generations' reward, overall and per data_source; sft / preference: the loss on them."""
    prompt_key: str = "prompt"
    """The data files' column holding the prompt."""
    max_prompt_length: int = 64
    """Prompt tokens kept (longer prompts are cut on the `truncation` side, or refused)."""
    max_response_length: int = 32
    """Tokens generated per response (rl); sft / preference: responses are cut on the right to this many."""
    truncation: str = "left"
    """Which side a too long prompt loses; "error" refuses it, naming file and row."""
    batch_size: int = 8
    """Prompts (sft: conversations; preference: pairs or KTO rows) per step, over all DP ranks."""
    seed: int = 1
    """Seed of the data sampler's shuffle."""
    length_group_batches: int = 8
    """sft / preference: rows of similar length share a batch (less padding); each group holds this many
    batches."""
    skip_invalid_rows: bool = False
    """sft / preference: skip (and count) bad rows instead of refusing the data file."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's multi_turn / agent loop): the model calls tools between turns."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_turns": at_least(1), "max_tokens": at_least(0, note="0: data.max_response_length"),
        "agent_timeout_s": above(0), "agent_batch_wait_s": at_least(0)}

    enable: bool = False
    """Each response is an episode: generate a turn, run its tool calls, append the results as the chat template
    renders `tool` messages, generate again (see the multi-turn page)."""
    max_turns: int = 4
    """Assistant turns per episode at most (verl's max_assistant_turns); one asking for a tool at the last turn is
    truncated."""
    max_tokens: int = 0
    """Response tokens per episode (the model's and the tool results' template tokens together); 0:
    data.max_response_length, which it may not exceed."""
    tools: list[str] = field(default_factory=list)
    """The tools the model may call: registered names (calculator, python) or `module:function` paths."""
    tool_call_format: str = "auto"
    """How the model writes a call: hermes (`<tool_call>{json}</tool_call>`: Hermes, Qwen2.5, Qwen3),
    llama3_json (Llama-3.1's bare JSON object), or auto (from the tokenizer's chat template)."""
    agent: str = ""
    """`module:function`: the user's agent drives each sample through the rollout endpoint, an OpenAI-compatible
    server of the rollout engine (docs/agent-endpoint.md), and runs its own tools (`tools` is then unused);
    empty: the in-process agent loop."""
    agent_timeout_s: float = 600.0
    """The wall clock of an agent's session: an agent not done by then loses its sample (counted)."""
    agent_batch_wait_s: float = 1.0
    """How long the endpoint's round waits for the sessions that have not asked yet once one has (the rounds
    are the in-process loop's turns, seed for seed, where every agent asks within it)."""


@dataclass
class RolloutConfig:
    """Generation: the rollout engine and its sampling."""

    RANGES: ClassVar[dict[str, Range]] = {
        "n": at_least(1), "temperature": at_least(0), "top_p": within(0, 1, low_open=True),
        "top_k": at_least(1, off=-1), "seed": SEED, "gpu_memory_utilization": within(0, 1, low_open=True),
        "max_staleness": at_least(0, note="0: fresh data only"), "partial_chunk_tokens": at_least(1)}

    engine: str = "auto"
    """The rollout engine; auto takes vLLM on GPUs where it is installed, else the embedded one."""
    n: int = 1
    """Responses sampled per prompt (the group of GRPO, RLOO, ...)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = -1
    """Keep the k most likely tokens; -1: all."""
    seed: int = 1
    """Seed of the sampling (each step and replica draws from its own offset of it)."""
    dtype: str = "auto"
    """What the rollout engine runs and the HybridEngine streams; auto: bf16 for vLLM, model.dtype for the
    embedded engine."""
    quantization: str = "none"
    """The rollout's linear weights in lower precision than training (docs/low-precision-rollouts.md): none, int8
    (per-channel weights, activations quantized per token on the fly; the embedded engine on CPU, through oneDNN)
    or fp8 (128 x 128 block-wise e4m3, DeepSeek-V3's weight_scale_inv; vLLM on a GPU). The training weights keep
    their dtype; the HybridEngine hands the engine quantized weights and scales. Turns token-level TIS on
    (algorithm.rollout_correction.rollout_is=token, cap 2: verl's decoupled_token_is) where rollout_is is null,
    unless rollout.quantization_tis is false."""
    quantization_tis: bool = True
    """With rollout.quantization: correct the quantized rollout's mismatch by token TIS when
    algorithm.rollout_correction.rollout_is is null (false: leave it off)."""
    gpu_memory_utilization: float = 0.4
    """vLLM's fraction of each GPU (weights, activations, KV cache), in (0, 1]. It must be free when vLLM starts,
    after actor, critic and reference are built: per bf16 parameter of a TP x PP shard they hold 22 B (2 B weights
    + 4 B fp32 gradient buffer + 4 B fp32 main weights for actor and critic each, 2 B for the reference; Adam's 8 B
    come with the first step and wait on the host during rollouts), so 0.4 leaves 60 %: on 80 GB, 2.2B parameters
    per GPU (a 7B model at TP 4), with vLLM's 32 GB for its weights and ~27 GB of KV cache."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    mode: str = "sync"
    """When generation happens and which weights a step's batch comes from: sync (each step generates with the
    current weights, then trains), one_step_off (each step trains on the batch generated by the weights one step
    older, while the next one is generated: verl's one-step off-policy trainer, slime's train_async.py) or async
    (generated batches wait in a buffer and a step trains on the oldest at most rollout.max_staleness versions
    old: verl's fully async trainer). See docs/async-rollout.md."""
    max_staleness: int = 1
    """async only: how many weight versions a batch may lag the weights it trains (>= 0); 0 trains on
    freshly generated data only, as sync. verl's async_training.staleness_threshold."""
    partial: str = "off"
    """async only: what happens to sequences in generation when new weights arrive: off (they finish under the
    weights they started with), finish (they continue under the new weights, each token tagged with the version
    that sampled it) or abort (they are dropped and generated again). slime's --partial-rollout."""
    partial_chunk_tokens: int = 64
    """async with rollout.partial: tokens generated between two checks for new weights (>= 1)."""


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's names of a layer's linears
LORA_INITS = ("kaiming", "gaussian")


@dataclass
class LoraConfig:
    """LoRA adapters on the role's linear layers: the base weights stay frozen in model.dtype, only the
    adapters train (gradients and optimizer state for them alone). rank 0 trains every parameter."""

    RANGES: ClassVar[dict[str, Range]] = {
        "rank": at_least(0, note="0: no adapters"), "alpha": above(0, note="null: 2 x rank"),
        "dropout": within(0, 1, high_open=True)}

    rank: int = 0
    """The adapters' rank r (0: off, full-parameter training); at most the smallest in/out width of a targeted
    layer's shard at the run's layout. verl's lora_rank (megatron: lora.rank), PEFT's r."""
    alpha: float | None = None
    """The adapters' output is scaled by alpha / rank; None: 2 x rank (scale 2, whatever the rank). PEFT's and
    verl's lora_alpha (PEFT's default, 8 with r=8, is scale 1; alpha = 2 x rank is the common choice)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0: none). Masks are drawn as megatron draws its own: the
    same on every TP rank for a replicated input (linear_qkv, linear_fc1), independent per rank for a split one
    (linear_proj, linear_fc2), so the masks follow the same law at any layout but are the same draws only at the
    same layout. PEFT's and verl's lora_dropout."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """The linear layers that get adapters, megatron's names: linear_qkv (q, k, v), linear_proj (o_proj),
    linear_fc1 (gate and up), linear_fc2 (down); in MoE layers also each expert's linear_fc1 / linear_fc2.
    verl's target_modules, PEFT's q_proj, ..., down_proj."""
    init: str = "kaiming"
    """A's initialisation (B starts at zero either way, so the first forward is the base model's): kaiming
    (uniform within 1/sqrt(in), PEFT's default) or gaussian (normal with std 1/rank, PEFT's "gaussian")."""


@dataclass
class UpdateSchedule:
    """How a role's update walks the batch: epochs, mini-batches, micro-batches."""

    RANGES: ClassVar[dict[str, Range]] = {
        "ppo_epochs": at_least(1), "mini_batch_size": at_least(1), "micro_batch_size": at_least(1),
        "max_tokens_per_micro_batch": at_least(0, note="0: off")}

    ppo_epochs: int = 1
    """Passes over each batch."""
    mini_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 2
    """Sequences per forward/backward on one rank."""
    max_tokens_per_micro_batch: int = 0
    """> 0: micro-batches of as many consecutive sequences as fit this many tokens (padding to the longest
    included) instead of micro_batch_size sequences, as verl's use_dynamic_bsz; the loss is the same."""
    use_packed_sequences: str = "auto"
    """Padding-free THD micro-batches (each row's tokens back to back, megatron's PackedSeqParams): auto (on with
    transformer-engine's layers in bf16/fp16, i.e. on a GPU with it installed), true (refused without
    transformer-engine) or false."""


RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class RecomputeConfig:
    """Activation recompute (megatron's recompute_granularity / recompute_method / recompute_num_layers): what
    the forward keeps for the backward, traded against running parts of it again."""

    RANGES: ClassVar[dict[str, Range]] = {"num_layers": at_least(1)}

    granularity: str = "none"
    """none (keep every activation), selective (recompute the attention core: its softmax and dropout, the
    activations that grow with the sequence length squared) or full (keep only each recomputed layer's input,
    run the layer again in the backward). verl's
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity (null: none)."""
    method: str = "uniform"
    """With full: uniform (the layers in chunks of num_layers, each chunk's input kept) or block (the first
    num_layers layers of each pipeline stage recomputed, the others keep everything). verl's
    ...override_transformer_config.recompute_method."""
    num_layers: int = 1
    """With full: the chunk size (uniform: it divides each pipeline stage's layers) or the recomputed layers per
    pipeline stage (block). verl's ...override_transformer_config.recompute_num_layers."""


@dataclass
class OffloadConfig:
    """What a trained role's state gives back to the accelerator across the colocated rollout window (the
    transition and the rollout), to come back bitwise before the next update (`rollout.training_memory`)."""

    params: bool = False
    """The parameters and the optimizer's fp32 main parameters wait on the host once the rollout engine has its
    copy of the weights. The actor's also keeps a reference of its own (not a LoRA actor's adapters-off base) on
    the host at all times but its log-prob pass, as verl's ref param_offload does. verl's ...megatron.param_offload
    (the reference's ...ref.megatron.param_offload follows the actor's)."""
    grads: bool = True
    """The gradient buffers are dropped (the next backward refills them). verl's ...megatron.grad_offload."""
    optimizer: bool = True
    """Adam's moments and step counters wait on the host. verl's ...megatron.optimizer_offload."""


@dataclass
class ActorConfig(UpdateSchedule):
    """The policy: its update schedule, optimizer and loss."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """The actor's, and the reference's (it follows the actor)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    router_replay: str = "off"
    """MoE models: off (each training forward routes tokens by its own router) or rollout (the old-log-prob,
    reference and update forwards send every token to the experts the rollout engine chose for it: routing replay,
    R3; embedded engine only). actor/router_mismatch reports the share of routings that differ either way.
    verl's actor_rollout_ref.actor.megatron.router_replay.mode=R3 (with rollout.enable_rollout_routing_replay);
    slime's --use-rollout-routing-replay."""


@dataclass
class CriticConfig(UpdateSchedule):
    """The value model: its update schedule, optimizer and loss."""

    enable: bool = True
    """Train a critic; GAE needs one, the outcome estimators (grpo, rloo, ...) run without."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    offload: OffloadConfig = field(default_factory=lambda: OffloadConfig(grads=False, optimizer=False))
    """What the critic gives back across the colocated rollout window, as actor.offload (its parameters, like the
    actor's, once the rollout engine has its copy); by default nothing. verl's critic.megatron.param_offload / grad_offload / optimizer_offload."""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward."""

    RANGES: ClassVar[dict[str, Range]] = {"kl_coef": at_least(0), "target_kl": above(0), "horizon": at_least(1)}

    type: str = "fixed"
    """fixed: kl_coef throughout; adaptive: adjusted towards target_kl over horizon steps."""
    kl_coef: float = 0.0
    """(Initial) coefficient of the KL penalty in the reward."""
    target_kl: float = 0.1
    """adaptive: the KL the coefficient steers towards."""
    horizon: int = 10000
    """adaptive: how many steps the coefficient's adjustment spreads over."""


@dataclass
class RolloutCorrectionConfig:
    """What the actor's update does about the gap between the rollout engine's token probabilities and the
    trainer's, under verl's keys with verl's meaning (see docs/rollout-correction.md; the rollout_corr/ metrics
    are logged either way). ρ = π_train/π_rollout per token."""

    RANGES: ClassVar[dict[str, Range]] = {"rollout_is_threshold": above(0, infinite=True, note="2 is usual")}

    rollout_is: str | None = None
    """Truncated importance weights min(weight, rollout_is_threshold) on the policy-gradient term: null (off), token
    (each token's ρ: TIS), sequence (the response's product of ρ) or geometric (their geometric mean; not in
    verl). verl's rollout_is; slime's --use-tis."""
    rollout_is_threshold: float = 2.0
    """The cap of the importance weights (> 0). verl's rollout_is_threshold; slime's --tis-clip."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the step's batch (over tokens at token level, over
    responses otherwise), so they average 1. verl's rollout_is_batch_normalize."""
    rollout_rs: str | None = None
    """Rejection: take out of the policy-gradient loss (weight 0, still counted in its mean) the tokens or whole
    responses that fail any of these comma-separated options <aggregation>_<divergence>: token, seq_sum, seq_mean
    or seq_max (not with k1) of k1 = -log ρ, k2 = (log ρ)²/2 or k3 = ρ - 1 - log ρ. null: off. verl's
    rollout_rs."""
    rollout_rs_threshold: str | None = None
    """The bounds of rollout_rs, one shared or one per option, comma-separated: a k1 option takes lower_upper
    and keeps log(lower) <= k1 <= log(upper), that is ρ (or the product, or the geometric mean) in
    [1/upper, 1/lower] (one number: the upper, lower = 1/upper); k2 and k3 take the largest divergence kept.
    verl's rollout_rs_threshold."""


# algorithm.rollout_correction's keys before it took verl's: key -> (the value it had by default, which a saved
# config.yaml holds and which is read as absent; what to write instead of any other value).
_RATIO_BAND = "rollout_rs_threshold (a band [LOW, HIGH] on the ratio is rollout_rs_threshold=<1/HIGH>_<1/LOW>)"
RETIRED_ROLLOUT_CORRECTION_KEYS = {
    "weights": ("none", "rollout_is (the same levels; null: off)"),
    "weight_cap": (2.0, "rollout_is_threshold"),
    "reject": ("none", "rollout_rs (token: token_k1, sequence: seq_sum_k1, geometric: seq_mean_k1)"),
    "reject_low": (0.5, _RATIO_BAND),
    "reject_high": (2.0, _RATIO_BAND),
}


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`): groups whose responses all score the same carry
    no group-relative signal; they are dropped and further prompt batches generated until the batch is full."""

    RANGES: ClassVar[dict[str, Range]] = {"max_num_gen_batches": at_least(0, note="0: no bound")}

    enable: bool = False
    """Dynamic sampling: drop the groups (a prompt's rollout.n responses) that all score alike and draw further
    prompt batches until data.batch_size groups are kept; needs rollout.n >= 2."""
    metric: str = "score"
    """What must differ within a group: score (the reward the advantages see, overlong penalty included) or the
    name of a numeric extra field of a dict reward (e.g. acc)."""
    max_num_gen_batches: int = 10
    """Generation rounds (data.batch_size prompts each) a step may take; 0: no bound (verl's meaning)."""
    on_exhausted: str = "stop"
    """Out of rounds before the batch is full: stop the run with a message (verl's behaviour), or train on the
    kept groups, cut to whole actor (and critic) mini-batches; a step that keeps less than one trains nothing."""


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): the frozen `teacher` scores every token the student sampled.
    With reward.function empty the teacher's signal is the whole reward; otherwise it is added to the outcome
    reward's."""

    RANGES: ClassVar[dict[str, Range]] = {"coef": at_least(0), "beta": within(0, 1), "top_k": at_least(1)}

    loss: str = "off"
    """off; reverse_kl: each sampled token's advantage gains coef * -(log p_student - log p_teacher), discount 0
    (Thinking Machines' recipe); gkd: the actor's loss gains coef * GKD's generalised JSD(beta) over the teacher's
    top_k tokens at each position (Agarwal et al. 2024)."""
    coef: float = 1.0
    """Weight of the teacher's term (beside an outcome reward's advantages, or alone)."""
    beta: float = 0.5
    """gkd: the generalised JSD's beta; 0 is the forward KL(teacher || student), 1 the reverse KL."""
    top_k: int = 20
    """gkd: the teacher's most likely tokens at each position that the divergence is taken over (renormalised)."""


@dataclass
class AlgorithmConfig:
    """Advantages and the KL penalty (rl); the preference loss and its knobs (preference)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "gamma": within(0, 1), "lam": within(0, 1), "tir_is_threshold": above(0), "beta": above(0),
        "label_smoothing": within(0, 0.5, high_open=True), "simpo_gamma": ANY, "kto_desirable_weight": above(0),
        "kto_undesirable_weight": above(0)}

    adv_estimator: str = "gae"
    """Advantage estimator, a name registered in algorithms.ADV_ESTIMATORS (gae needs the critic; the docs' Advantage
    estimators page compares them all)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE's lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo, grpo_passk: divide the group-centred rewards (pass@k: the best response's lead) by the group's
    standard deviation (false: Dr.GRPO-style)."""
    tir_is_threshold: float = 2.0
    """tir_optimal_token_baseline: the cap C of the importance weights min(pi_train / pi_rollout, C) whose squares
    scale the baseline's token weights (verl takes them from its rollout correction, cap 2 by default)."""
    use_kl_in_reward: bool = False
    """Subtract the KL to the frozen reference from the token rewards (coefficient: kl_ctrl)."""
    kl_penalty: str = "k1"
    """The estimator of that KL, a name registered in algorithms.KL_ESTIMATORS."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    normalize_rewards: bool = False
    """Scale the rewards by a running standard deviation before the advantages."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_filtering: bool = False
    """DAPO's overlong filtering (NeMo-RL's grpo.overlong_filtering): responses cut at data.max_response_length
    without an EOS are masked out of the actor's and critic's losses (they still count in their group's
    baseline)."""
    loss: str = "dpo"
    """Preference job: a name registered in algorithms.PREFERENCE_LOSSES."""
    beta: float = 0.1
    """DPO/IPO/KTO/SimPO temperature; ORPO's weight λ of the odds-ratio term."""
    label_smoothing: float = 0.0
    """cDPO / SimPO: probability that a preference label is flipped."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ."""
    kto_desirable_weight: float = 1.0
    """KTO: weight of the desirable rows' loss."""
    kto_undesirable_weight: float = 1.0
    """KTO: weight of the undesirable rows' loss."""
    cache_reference_logprobs: bool = False
    """dpo / ipo: score every train and validation row with the frozen reference once, keep the log-probs in the
    run folder (reused on resume) and build no reference model for the steps."""
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class TeacherConfig:
    """The frozen teacher of on-policy distillation (algorithm.distill.loss): it must share the student's tokenizer."""

    RANGES: ClassVar[dict[str, Range]] = {"tp": at_least(1, note="null: parallel.tp"),
                                          "pp": at_least(1, note="null: parallel.pp")}

    hf_path: str = ""
    """HF causal-LM folder of the teacher (converted like the actor's weights, into the run folder or
    model.conversion_cache)."""
    ckpt: str = ""
    """Converted megatron checkpoint of the teacher, in place of hf_path's weights."""
    tp: int | None = None
    """The teacher's tensor-parallel size, on the student's processes (teacher.tp * teacher.pp must divide them;
    the rest is the teacher's data parallelism); null: the student's (parallel.tp)."""
    pp: int | None = None
    """The teacher's pipeline-parallel size; null: the student's (parallel.pp)."""
    by_data_source: dict[str, str] = field(default_factory=dict)
    """Several teachers: data_source -> the HF folder of the teacher of that source's rows (converted like
    hf_path); rows of any other source are hf_path's (or ckpt's)."""


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`): a penalty on the score growing
    linearly over the last `len` tokens of data.max_response_length."""

    RANGES: ClassVar[dict[str, Range]] = {"len": at_least(0), "penalty_factor": at_least(0)}

    enable: bool = False
    """Soft overlong punishment: add to each score a penalty falling linearly from 0 to -penalty_factor over the
    last `len` tokens of data.max_response_length."""
    len: int = 0
    """Tokens of the buffer, 1..data.max_response_length: no penalty up to max_response_length - len tokens."""
    penalty_factor: float = 1.0
    """The penalty at the full budget (it falls linearly from 0 to -penalty_factor over the buffer)."""


REMOTE_KINDS = ("json", "judge")


@dataclass
class RemoteRewardConfig:
    """A scoring service of the team's own (docs/remote-rewards.md): its HTTP JSON scoring API, or an LLM judge
    behind an OpenAI-compatible server (`vllm serve`). `url` set replaces reward.function."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_concurrency": at_least(1), "timeout_s": within(0, LONGEST_WAIT_S, low_open=True, note="seconds"),
        "max_retries": at_least(0), "backoff_s": within(0, LONGEST_WAIT_S, note="seconds"),
        "max_consecutive_failures": at_least(1), "batch_size": at_least(1), "max_tokens": at_least(1),
        "score_scale": Range()}

    url: str = ""
    """The service; "" is off. json: the URL the rows are POSTed to; judge: the server's OpenAI base URL (ending in
    /v1; requests go to {url}/chat/completions)."""
    kind: str = "json"
    """json: the scoring API (rows in, one score per row out); judge: one chat completion per row, its answer read
    by score_pattern."""
    max_concurrency: int = 8
    """Requests in flight at once (>= 1)."""
    timeout_s: float = 60.0
    """Seconds a request may wait for the service on each socket operation (connecting, each read): past them the
    attempt failed."""
    max_retries: int = 3
    """Attempts after a request's first failed one (>= 0); after the last, the run stops naming the URL."""
    backoff_s: float = 1.0
    """Wait before the first retry, doubled before each next one (exponential backoff)."""
    max_consecutive_failures: int = 20
    """Failed attempts in a row, over every request in flight, after which the run stops naming the URL, retries
    left or not: a service that is down stops the run within one batch."""
    batch_size: int = 64
    """json: rows per request (>= 1)."""
    model: str = ""
    """judge: the model name sent to the server (vllm serve's --served-model-name, or the model path)."""
    prompt_template: str = ""
    """judge: the judge's prompt, a file path or the text itself, with {response} and optionally {prompt} and
    {ground_truth}; any other {name} is refused at pre-flight."""
    score_pattern: str = r"\[\[(-?\d+(?:\.\d+)?)\]\]"
    """judge: a regular expression whose first group is the score, searched in the answer; the last match counts.
    The default reads a final "[[7]]"."""
    score_scale: float = 1.0
    """judge: the parsed number times this is the score (0.1 maps a 0-10 grade to 0-1)."""
    max_tokens: int = 512
    """judge: most tokens of the judge's answer (the request's max_tokens; temperature is 0)."""
    api_key_env: str = ""
    """The NAME of an environment variable holding the service's key, sent as `Authorization: Bearer`; "" sends
    none. The key itself never goes in the config."""


@dataclass
class RewardCodeConfig:
    """Code-execution rewards (`code_tests`, and `default` on verl's code data sources): each test case of an
    answer runs in the python tool's sandbox, in a fresh interpreter (docs/code-rewards.md)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "test_timeout_s": within(0, LONGEST_WAIT_S, low_open=True, note="seconds"), "memory_mb": at_least(64),
        "max_tests": at_least(1), "workers": at_least(0, note="0: os.cpu_count()"),
        "max_output_chars": at_least(1), "sandbox_retries": at_least(0),
        "sandbox_backoff_s": within(0, LONGEST_WAIT_S, note="seconds")}

    test_timeout_s: float = 10.0
    """Wall-clock limit of one test case, interpreter start included, in seconds (> 0; verl's is 10): past it
    the case fails (`timeout`)."""
    memory_mb: int = 1024
    """Address space of one test case's interpreter, in MiB (RLIMIT_AS, >= 64): a larger allocation raises
    MemoryError in the answer and the case fails."""
    max_tests: int = 10
    """Test cases run per answer, the first ones of its list (>= 1): the score is the fraction of them that pass,
    as verl's continuous code score counts its first 10."""
    workers: int = 0
    """Test cases of one answer run at once, each in its own sandbox (>= 0; 0: os.cpu_count())."""
    max_output_chars: int = 4_000_000
    """Characters of a test case's output read (>= 1): a longer output fails the case (`output_limit`) as soon
    as it passes them."""
    sandbox_url: str = ""
    """A SandboxFusion service (http:// or https://, e.g. http://host:8080) that runs each test case through its
    `POST /run_code` instead of the local sandbox; "" runs them here. A service that stays down stops the run."""
    sandbox_retries: int = 3
    """Retries of a request to `sandbox_url` that fails (no connection, HTTP error, no reply in time, a reply
    SandboxFusion's format does not allow), after sandbox_backoff_s, then twice that, ... (>= 0)."""
    sandbox_backoff_s: float = 0.5
    """Seconds before the first retry of a request to `sandbox_url`, doubled at each next one (their sum must stay
    under reward.timeout_s, or a service that is down would look like slow answers)."""


@dataclass
class RewardMathConfig:
    """The math-verify rewards (`math`, `dapo`, and `default` on the data sources it scores with them)."""

    final_form: bool = False
    """Pay only answers in final form: math-verify evaluates what it reads, so "26 - 10 =" equals 16. true scores 0
    an answer that still holds an operation on written numbers (26-10, 2^{10}, 16/2; not x^2+7x, 2+\\sqrt{3},
    \\frac{1}{2}) or a response ending on an operator, before math-verify compares."""


@dataclass
class RewardConfig:
    """What scores a response (rl)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "timeout_s": within(0, LONGEST_WAIT_S, note="0: no limit"), "memory_limit_mb": at_least(0, note="0: no cap")}

    function: str = "exact_match"
    """A registered reward function's name (the rewards page lists them; `default` picks one by each row's
    data_source) or "module:function"; empty with algorithm.distill.loss set: the teacher's signal alone."""
    timeout_s: float = 5.0
    """Hard time limit per answer, in seconds: a named function other than exact_match / copy / add / number runs
    in a worker process that is killed and replaced when an answer takes longer (it scores 0, counted in
    reward/timeouts). 0: no worker, no limit."""
    memory_limit_mb: int = 4096
    """Heap cap of that worker process (RLIMIT_DATA), in MiB: an answer whose parsing allocates more scores 0
    like a late one. 0: no cap."""
    reward_model: str = ""
    """HF sequence-classification folder (or Hub id); replaces `function` when set (not with reward.remote.url)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    code: RewardCodeConfig = field(default_factory=RewardCodeConfig)
    math: RewardMathConfig = field(default_factory=RewardMathConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class PythonSandboxConfig:
    """The `python` tool's sandbox: the limits of the fresh interpreter each call runs in (docs/tools.md)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "cpu_seconds": at_least(1), "memory_mb": at_least(64), "file_size_mb": at_least(1), "folder_mb": at_least(1),
        "open_files": at_least(16), "processes": at_least(1)}

    cpu_seconds: int = 5
    """CPU seconds of the sandboxed code (RLIMIT_CPU, >= 1): past them it is killed (the call fails, `killed`)."""
    memory_mb: int = 1024
    """Address space of the sandboxed interpreter and of each process it starts, in MiB (RLIMIT_AS, >= 64): a
    larger allocation raises MemoryError in the code."""
    file_size_mb: int = 16
    """Largest file the code may write, in MiB (RLIMIT_FSIZE, >= 1)."""
    folder_mb: int = 64
    """Size of the code's folder, in MiB (>= 1): a tmpfs (memory) of this size is mounted over it in the
    sandbox's own mount namespace, so all its files together cannot pass it (without the namespaces: the
    temporary folder on disk, unbounded)."""
    open_files: int = 64
    """File descriptors the code may hold open (RLIMIT_NOFILE, >= 16)."""
    processes: int = 16
    """Processes and threads the code may run at once, itself included (RLIMIT_NPROC, >= 1): a fork bomb stops
    there."""
    allow_network: bool = False
    """Run the code even where the kernel refuses the new network (and process) namespace that cuts it off: it then
    reaches the host's network. False (the default): the python tool refuses to start there, naming this key."""


@dataclass
class ToolsConfig:
    """The tools a multi-turn rollout may call (the names are listed by the rollout's multi-turn settings): the
    limits every call runs under, and the python tool's sandbox (docs/tools.md)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "timeout_s": within(0, LONGEST_WAIT_S, low_open=True, note="seconds"), "max_output_chars": at_least(1),
        "max_argument_chars": at_least(2), "workers": at_least(1)}

    timeout_s: float = 10.0
    """Wall-clock limit of one tool call, in seconds (> 0): a later result is replaced by an error (`timeout`)
    and the python sandbox is killed."""
    max_output_chars: int = 4096
    """Characters of a tool's result the model sees (>= 1); a longer one is cut (`output_truncated`, still a
    success). The python sandbox stops reading there."""
    max_argument_chars: int = 65536
    """Largest JSON text of one call's arguments (>= 2); a longer one is refused unparsed (`arguments_too_long`)."""
    workers: int = 8
    """Tool calls run at once (a thread pool; >= 1)."""
    python: PythonSandboxConfig = field(default_factory=PythonSandboxConfig)


@dataclass
class TrainerConfig:
    """The run: its folder, length, checkpoints, logging and profiling."""

    RANGES: ClassVar[dict[str, Range]] = {
        "total_steps": at_least(1), "seed": SEED, "save_every": at_least(0, note="0: only at the end"),
        "keep_last": at_least(0), "checkpoint_mirror_wait_s": within(0, LONGEST_WAIT_S),
        "health_port": within(0, 65535, note="0: no endpoint"),
        "val_every": at_least(0, note="0: validate at the end only"),
        "log_samples_every": at_least(0, note="0: no samples"), "log_samples": at_least(1),
        "gpu_memory_gb": above(0, note="null: unknown, no check")}

    run_dir: str = "runs/default"
    """The run folder: config, metrics, checkpoints, final weights (see the run folder's page)."""
    total_steps: int = 10
    """Training steps of the run."""
    seed: int = 1
    """Seed of the ranks' RNGs, through megatron's model_parallel_cuda_manual_seed (init_parallel)."""
    save_every: int = 0
    """Steps between step checkpoints; 0: only at the end."""
    keep_last: int = 2
    """Step checkpoints kept (older ones are deleted)."""
    checkpoint_mirror: str = ""
    """s3://bucket/prefix: rank 0 uploads each step checkpoint there in the background (keep_last applies) and a
    run whose folder is empty or behind resumes from it; "" is off. Endpoint/credentials: boto3's (AWS_*)."""
    checkpoint_mirror_wait_s: float = 600.0
    """At the run's end, how long to wait for uploads still running."""
    tensorboard: bool = True
    """Write TensorBoard events into the run folder."""
    wandb_project: str = ""
    """Log to this wandb project; empty: no wandb."""
    health_port: int = 0
    """Port of rank 0's GET /healthz endpoint; 0: no health endpoint."""
    progress_bar: bool = True
    """A progress bar on rank 0's stderr, over the steps and through each validation (on a terminal; elsewhere a
    validation prints a line of its progress every 10 s)."""
    nonfinite: str = "error"
    """A NaN/inf reward, advantage or gradient: "error" stops the run before applying it; "skip" drops that
    batch (or optimizer step) and counts it in the metrics (trainer/nonfinite_skipped)."""
    val_every: int = 0
    """Steps between validation passes over data.val_files (0: only at the end)."""
    log_format: str = "text"
    """text: one compact console line per step; json: the step's record as one JSON line."""
    log_samples_every: int = 0
    """rl: every log_samples_every steps (0: never), log log_samples prompt / response / score rows of the
    step's rollout to RUN/generations.jsonl (and TensorBoard text, a wandb table)."""
    log_samples: int = 4
    """Rows logged each time (see log_samples_every)."""
    profile_steps: list[int] = field(default_factory=list)
    """torch.profiler traces of these steps (1-based) on profile_ranks, RUN/profile/step_NNNNNN_rankR.pt.trace.json:
    Chrome trace JSON, opened by Perfetto (ui.perfetto.dev) or TensorBoard's profiler plugin."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that record profile_steps."""
    memory_metrics: bool | None = None
    """Log each step's peak memory of rank 0 as perf/max_memory_allocated_gb and perf/max_memory_reserved_gb
    (verl's names). null: on a GPU (the CUDA allocator's statistics, reset each step, cost nothing), off on CPU,
    where they count tensor storage with a dispatch mode on every op (the step takes 1.4-2.2x as long on the tiny
    models; docs/benchmarks.md)."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU, GiB: the pre-flight check refuses a config whose predicted per-rank peak
    (`verl-mega plan --memory`, docs/memory.md) exceeds it. null: unknown, no check."""
    skip_memory_check: bool = False
    """Start even when the predicted peak exceeds trainer.gpu_memory_gb (the prediction is arithmetic, not a
    measurement)."""
    allow_config_change: bool = False
    """Resume a run folder whose saved config differs from this one in what is trained (data, algorithm, batch
    sizes, model): refused by default, naming the keys; the run's length, logging and layout may always change."""


JOBS = ("rl", "sft", "preference")
# Earlier spellings, still read (a saved config.yaml of an old run resumes): turned into the names above where
# the config is loaded, so the rest of the code sees one spelling.
JOB_ALIASES = {"ppo": "rl", "dpo": "preference"}


@dataclass
class TrainConfig:
    """A run's whole config."""

    job: str = "rl"
    """Which job runs: rl (PPO, GRPO and the other RL estimators), sft (supervised fine-tuning) or preference
    (DPO, IPO, KTO, SimPO, ORPO); `ppo` and `dpo` are read as rl and preference."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


NONFINITE_POLICIES = ("error", "skip")
LOG_FORMATS = ("text", "json")


class ConfigError(UserError):
    """A config problem; the message names the key and what to do about it."""


def load_config(path: str | Path | None, overrides: list[str] = (),
                values: dict[str, Any] | None = None) -> TrainConfig:
    """Typed defaults <- YAML file <- `key.sub=value` overrides <- `values` ({"key.sub": value}, typed already,
    as the Python API passes them). Unknown keys and wrong types are refused."""
    schema = OmegaConf.structured(TrainConfig)
    layers = [schema]
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} {'is a folder' if Path(path).is_dir() else 'does not exist'}")
        layers.append(_file_layer(Path(path)))
    for item in overrides:
        if "=" not in item or not item.partition("=")[0]:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
    try:
        layers.append(override_layer(TrainConfig, list(overrides)))
        layers.append(_dotted_layer(values or {}))
        for layer in layers[1:]:
            _drop_retired_keys(layer)
            _refuse_value_for_section(schema, OmegaConf.to_container(layer, resolve=False))
        loose = [key for layer in layers[1:] for key in loose_booleans(TrainConfig, layer)]
        if loose:
            raise ConfigError(f"{loose[0]}: a boolean key takes true or false")
        merged = OmegaConf.merge(*layers)
        config = OmegaConf.to_object(merged)
    except UserError as err:
        raise ConfigError(str(err)) from None
    except (ConfigKeyError, ValidationError) as err:
        key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    except Exception as err:  # omegaconf's MissingMandatoryValue and friends
        key = getattr(err, "full_key", "")
        raise ConfigError(f"config key '{key}' is required: set it in the YAML file or as {key}=...") from None
    config.job = JOB_ALIASES.get(config.job, config.job)
    return config


def _refuse_value_for_section(schema, given: dict, prefix: str = "") -> None:
    """A section (`actor`, `actor.optim`, ...) given a plain value, as `actor=3` gives it: named with its keys.
    omegaconf's merge error names no key."""
    for key, value in given.items():
        node = schema._get_node(key) if OmegaConf.is_dict(schema) and key in schema else None
        if node is None or not OmegaConf.is_dict(node):
            continue
        if isinstance(value, dict):
            _refuse_value_for_section(node, value, f"{prefix}{key}.")
        elif value is not None:
            keys = ", ".join(list(node.keys())[:4])
            raise ConfigError(f"config key '{prefix}{key}' is a section (keys: {keys}, ...), not a value: set one "
                              f"of its keys, e.g. {prefix}{key}.{next(iter(node.keys()), 'KEY')}=...")


def _drop_retired_keys(layer) -> None:
    """Drop from a config layer the retired algorithm.rollout_correction keys at their old defaults (the
    config.yaml of a run folder written before verl's keys holds them, and they did nothing); refuse any other
    value of them, naming what replaces it."""
    section = OmegaConf.select(layer, "algorithm.rollout_correction", default=None)
    if not OmegaConf.is_dict(section):
        return
    for key, (default, instead) in RETIRED_ROLLOUT_CORRECTION_KEYS.items():
        if key not in section:
            continue
        value = section[key]
        if not _same_value(value, default):
            raise ConfigError(f"algorithm.rollout_correction.{key}={value} is retired (the section takes verl's "
                              f"keys with verl's meaning): set algorithm.rollout_correction.{instead}")
        del section[key]


def _same_value(value, default) -> bool:
    if isinstance(default, float):
        try:
            return float(value) == default
        except (TypeError, ValueError):
            return False
    return str(value) == default


def _file_layer(path: Path):
    """The YAML file's layer; ConfigError, in one line, for a file that is not UTF-8 YAML or names keys the
    schema lacks (all of them: a config written for verl names several)."""
    try:
        layer = OmegaConf.load(path)
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}): it is damaged or not a config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(err).split())}") from None
    except OSError as err:
        if err.errno is not None:  # a read that failed; without an errno, omegaconf's 'Invalid loaded object type'
            raise
        layer = None
    if not isinstance(layer, DictConfig):  # a list or a number: merging it raised omegaconf's traceback
        raise ConfigError(f"config file {path} must hold a mapping of sections (actor:, data:, trainer:, ...)")
    _drop_retired_keys(layer)
    unknown = unknown_keys(TrainConfig, layer)
    if unknown:
        raise ConfigError(f"config file {path}: {', '.join(unknown[:12])}{' and more' if len(unknown) > 12 else ''} "
                          f"{'is not a key' if len(unknown) == 1 else 'are not keys'} of verl_mega's config (docs/"
                          "reference/config.md lists them, with verl's names where they differ)")
    return layer


def _dotted_layer(values: dict[str, Any]):
    layer = OmegaConf.create()
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"config key {key!r} must be a dotted name such as 'trainer.total_steps'")
        OmegaConf.update(layer, key, _kept_as_given(value), force_add=True)
    return layer


def _kept_as_given(value):
    """The API's typed values, with every string kept as it is (no `${` interpolation)."""
    if isinstance(value, str):
        return verbatim(value)
    if isinstance(value, (list, tuple)):
        return [_kept_as_given(item) for item in value]
    if isinstance(value, dict):
        return {key: _kept_as_given(item) for key, item in value.items()}
    return value


def to_yaml(config: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(config))
