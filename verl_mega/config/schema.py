"""The training config: a YAML file plus dotted overrides, merged onto typed defaults (OmegaConf).

A leaf of the package: the dataclasses every role and job reads, and loading them. Checking a config against
the rest of the package (registries, layouts, the model, the data files) is `verl_mega.trainer.validation`,
run before any process group starts; every failure names the key and the fix."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from .errors import UserError


@dataclass
class OptimConfig:
    """Adam settings and the LR schedule (constant, linear or cosine decay after a linear warmup)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # <= 0: no clipping (the norm is still reported)
    use_distributed_optimizer: bool = False
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None: the run's optimizer steps
    lr_decay_style: str = "constant"


@dataclass
class PolicyLossConfig:
    policy_loss: str = "vanilla"  # a name registered in algorithms.POLICY_LOSSES
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # a name registered in algorithms.KL_ESTIMATORS
    extra: dict = field(default_factory=dict)  # further keyword arguments of the policy loss


@dataclass
class ValueLossConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class ModelConfig:
    hf_path: str = "???"  # HF folder: config, tokenizer (and the weights when `actor_ckpt` is empty)
    actor_ckpt: str = ""  # converted megatron checkpoint; empty: converted from hf_path into the run folder
    critic_ckpt: str = ""  # converted megatron checkpoint; empty: critic_hf_path's weights, else the actor's
    critic_hf_path: str = ""  # HF causal-LM folder the critic starts from (converted like the actor's weights)
    # fp32 | bf16 | fp16: parameters and activations of actor, critic and reference (megatron mixed precision:
    # fp32 main weights, optimizer state and gradient reduction; fp16 with dynamic loss scaling).
    dtype: str = "fp32"
    family_spec: str = ""  # package.module:SPEC of a family declared outside verl_mega; empty: by model_type
    # A folder of converted checkpoints shared by runs, one per HF folder's sha256, layout and dtype; empty: the
    # HF folders are converted into the run folder. Not used for a role whose *_ckpt is given.
    conversion_cache: str = ""
    sha256: str = ""  # expected sha256 of hf_path's config and weights (RUN/provenance.json's); empty: any


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rollout_tp: int = 1


@dataclass
class DataConfig:
    # parquet or jsonl files, or folders written by HF datasets' `save_to_disk` (one split each)
    train_files: list[str] = field(default_factory=list)
    # Held-out rows scored every trainer.val_every steps and at the end (ppo: also before the first step):
    # ppo/grpo: greedy generations' reward, overall and per data_source; sft / dpo: the loss on them.
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    truncation: str = "left"  # sft / dpo: "error" refuses a too long prompt or response, naming file and row
    batch_size: int = 8  # prompts (sft: conversations; dpo: pairs or KTO rows) per step, over all DP ranks
    seed: int = 1
    # sft / dpo: rows of similar length share a batch (less padding); each group holds this many batches.
    length_group_batches: int = 8
    skip_invalid_rows: bool = False  # sft / dpo: skip (and count) bad rows instead of refusing the data file


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto | embedded | vllm
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 1
    dtype: str = "auto"  # auto (bf16 for vLLM, model.dtype for the embedded engine) | fp32 | bf16 | fp16
    # vLLM must find this share free when it starts, after actor, critic and reference are built. They then hold,
    # per bf16 parameter of a TP x PP shard, 2 B weights + 4 B fp32 gradient buffer + 4 B fp32 main weights for
    # actor and critic each and 2 B for the reference: 22 B (Adam's 8 B come with the first step and wait on the
    # host during rollouts). 0.4 leaves 60 %: on 80 GB, 2.2B parameters per GPU (a 7B model at TP 4), and vLLM's
    # 32 GB hold its weights (3.5 GB there) and a KV cache of ~27 GB.
    gpu_memory_utilization: float = 0.4  # vLLM's fraction of each GPU (weights, activations, KV cache), in (0, 1]


@dataclass
class UpdateSchedule:
    ppo_epochs: int = 1
    mini_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 2  # sequences per forward/backward on one rank
    # > 0: micro-batches of as many consecutive sequences as fit this many tokens (padding to the longest
    # included) instead of micro_batch_size sequences, as verl's use_dynamic_bsz; the loss is the same.
    max_tokens_per_micro_batch: int = 0
    # Padding-free THD micro-batches (each row's tokens back to back, megatron's PackedSeqParams): auto (on with
    # transformer-engine's layers in bf16/fp16, i.e. on a GPU with it installed) | true (refused without
    # transformer-engine) | false.
    use_packed_sequences: str = "auto"


@dataclass
class ActorConfig(UpdateSchedule):
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)


@dataclass
class CriticConfig(UpdateSchedule):
    enable: bool = True  # needed by GAE; outcome estimators (grpo, rloo, ...) run without a critic
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.0
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    normalize_rewards: bool = False
    # Preference job (job: dpo): a name registered in algorithms.PREFERENCE_LOSSES and its knobs.
    loss: str = "dpo"
    beta: float = 0.1  # DPO/IPO/KTO/SimPO temperature; ORPO's weight λ of the odds-ratio term
    label_smoothing: float = 0.0  # cDPO / SimPO: probability that a preference label is flipped
    simpo_gamma: float = 0.5  # SimPO's target reward margin γ
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    # dpo / ipo: score every train and validation row with the frozen reference once, keep the log-probs in the
    # run folder (reused on resume) and build no reference model for the steps.
    cache_reference_logprobs: bool = False


@dataclass
class RewardConfig:
    function: str = "exact_match"  # a registered name or "module:function"
    reward_model: str = ""  # HF sequence-classification folder; replaces `function` when set


@dataclass
class TrainerConfig:
    run_dir: str = "runs/default"
    total_steps: int = 10
    seed: int = 1
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    # s3://bucket/prefix: rank 0 uploads each step checkpoint there in the background (keep_last applies) and a
    # run whose folder is empty or behind resumes from it; "" is off. Endpoint/credentials: boto3's (AWS_*).
    checkpoint_mirror: str = ""
    checkpoint_mirror_wait_s: float = 600.0  # at the run's end, how long to wait for uploads still running
    tensorboard: bool = True
    wandb_project: str = ""
    health_port: int = 0  # 0: no health endpoint
    progress_bar: bool = True
    # A NaN/inf reward, advantage or gradient: "error" stops the run before applying it; "skip" drops that
    # batch (or optimizer step) and counts it in the metrics (trainer/nonfinite_skipped).
    nonfinite: str = "error"
    val_every: int = 0  # steps between validation passes over data.val_files (0: only at the end)
    log_format: str = "text"  # text: one compact console line per step; json: the step's record as one JSON line
    # ppo: every log_samples_every steps (0: never), log_samples prompt / response / score rows of the step's
    # rollout to RUN/generations.jsonl (and TensorBoard text, a wandb table).
    log_samples_every: int = 0
    log_samples: int = 4
    # torch.profiler traces of these steps (1-based) on these ranks, RUN/profile/step_NNNNNN_rankR.pt.trace.json:
    # Chrome trace JSON, opened by Perfetto (ui.perfetto.dev) or TensorBoard's profiler plugin.
    profile_steps: list[int] = field(default_factory=list)
    profile_ranks: list[int] = field(default_factory=lambda: [0])


JOBS = ("ppo", "sft", "dpo")


@dataclass
class TrainConfig:
    job: str = "ppo"  # ppo (PPO/GRPO and friends), sft (supervised fine-tuning), dpo (preference optimisation)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
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
            raise ConfigError(f"config file {path} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        layers.append(_dotted_layer(values or {}))
        merged = OmegaConf.merge(*layers)
        config = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    except Exception as err:  # omegaconf's MissingMandatoryValue and friends
        key = getattr(err, "full_key", "")
        raise ConfigError(f"config key '{key}' is required: set it in the YAML file or as {key}=...") from None
    return config


def _dotted_layer(values: dict[str, Any]):
    layer = OmegaConf.create()
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"config key {key!r} must be a dotted name such as 'trainer.total_steps'")
        OmegaConf.update(layer, key, value, force_add=True)
    return layer


def to_yaml(config: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(config))
