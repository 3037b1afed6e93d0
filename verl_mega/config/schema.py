"""The training config: a YAML file plus dotted overrides, merged onto typed defaults (OmegaConf), and
validated before any process group starts. Every failure names the key and the fix."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from verl_mega.roles.actor import PolicyLossConfig
from verl_mega.roles.critic import ValueLossConfig
from verl_mega.roles.optim import OptimConfig


@dataclass
class ModelConfig:
    hf_path: str = "???"  # HF folder: config, tokenizer (and the weights when `actor_ckpt` is empty)
    actor_ckpt: str = ""  # converted megatron checkpoint; empty: converted from hf_path into the run folder
    critic_ckpt: str = ""  # empty: the critic starts from the actor's weights
    dtype: str = "fp32"


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rollout_tp: int = 1


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    truncation: str = "left"
    batch_size: int = 8  # prompts per step, over all data-parallel ranks
    seed: int = 1


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto | embedded | vllm
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 1


@dataclass
class UpdateSchedule:
    ppo_epochs: int = 1
    mini_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 2  # sequences per forward/backward on one rank


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
    tensorboard: bool = True
    wandb_project: str = ""
    health_port: int = 0  # 0: no health endpoint
    progress_bar: bool = True


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A config problem; the message names the key and what to do about it."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Typed defaults <- YAML file <- `key.sub=value` overrides. Unknown keys and wrong types are refused."""
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
        merged = OmegaConf.merge(*layers)
        config = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    except Exception as err:  # omegaconf's MissingMandatoryValue and friends
        key = getattr(err, "full_key", "")
        raise ConfigError(f"config key '{key}' is required: set it in the YAML file or as {key}=...") from None
    return config


def to_yaml(config: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def save_config(config: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(to_yaml(config))


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(config))


def data_parallel_size(config: TrainConfig, world_size: int) -> int:
    p = config.parallel
    return world_size // (p.tp * p.pp)


def validate(config: TrainConfig, world_size: int, check_files: bool = True) -> None:
    """Raise ConfigError listing every problem found (each naming its key and the fix)."""
    from verl_mega.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    problems: list[str] = []
    p, d, a, c = config.parallel, config.data, config.actor, config.critic

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for key in ("tp", "pp", "ep", "rollout_tp"):
        need(getattr(p, key) >= 1, f"parallel.{key} must be >= 1")
    need(world_size % (p.tp * p.pp) == 0,
         f"parallel.tp * parallel.pp = {p.tp * p.pp} must divide the number of processes ({world_size})")
    need(p.tp % p.rollout_tp == 0 if p.rollout_tp >= 1 else False,
         f"parallel.rollout_tp={p.rollout_tp} must divide parallel.tp={p.tp}")
    dp = max(1, data_parallel_size(config, world_size))
    sequences = d.batch_size * config.rollout.n
    for role, cfg in (("actor", a), ("critic", c)):
        need(cfg.micro_batch_size >= 1, f"{role}.micro_batch_size must be >= 1")
        need(cfg.mini_batch_size % (dp * max(cfg.micro_batch_size, 1)) == 0,
             f"{role}.mini_batch_size={cfg.mini_batch_size} must be divisible by data-parallel size {dp} x "
             f"{role}.micro_batch_size={cfg.micro_batch_size}")
        need(sequences % max(cfg.mini_batch_size, 1) == 0,
             f"data.batch_size x rollout.n = {sequences} must be divisible by {role}.mini_batch_size="
             f"{cfg.mini_batch_size}")
    replicas = max(1, world_size // max(p.rollout_tp, 1))
    need(d.batch_size % replicas == 0,
         f"data.batch_size={d.batch_size} must be divisible by the number of rollout replicas {replicas} "
         f"(processes / parallel.rollout_tp), so each generates the same number of prompts")
    need(d.truncation in ("left", "right", "error"), f"data.truncation must be left, right or error, not '{d.truncation}'")
    need(config.rollout.engine in ("auto", "embedded", "vllm"),
         f"rollout.engine must be auto, embedded or vllm, not '{config.rollout.engine}'")
    need(config.model.dtype in ("fp32", "bf16"), f"model.dtype must be fp32 or bf16, not '{config.model.dtype}'")
    need(config.algorithm.adv_estimator in ADV_ESTIMATORS,
         f"algorithm.adv_estimator '{config.algorithm.adv_estimator}' is unknown; known: {', '.join(ADV_ESTIMATORS.names())}")
    need(a.loss.policy_loss in POLICY_LOSSES,
         f"actor.loss.policy_loss '{a.loss.policy_loss}' is unknown; known: {', '.join(POLICY_LOSSES.names())}")
    for key, value in (("actor.loss.loss_agg_mode", a.loss.loss_agg_mode),
                       ("critic.loss.loss_agg_mode", c.loss.loss_agg_mode)):
        need(value in LOSS_AGG_MODES, f"{key} '{value}' is unknown; known: {', '.join(LOSS_AGG_MODES.names())}")
    for key, value in (("algorithm.kl_penalty", config.algorithm.kl_penalty), ("actor.loss.kl_loss_type", a.loss.kl_loss_type)):
        need(value in KL_ESTIMATORS, f"{key} '{value}' is unknown; known: {', '.join(KL_ESTIMATORS.names())}")
    need(config.algorithm.kl_ctrl.type in ("fixed", "adaptive"),
         f"algorithm.kl_ctrl.type must be fixed or adaptive, not '{config.algorithm.kl_ctrl.type}'")
    if check_files:
        need(Path(config.model.hf_path, "config.json").is_file(),
             f"model.hf_path: {config.model.hf_path}/config.json does not exist; point it at an HF model folder")
        need(bool(d.train_files), "data.train_files is empty: list at least one parquet or jsonl file")
        for file in d.train_files:
            problems += _data_file_problems(file, d.prompt_key)
        for key, ckpt in (("model.actor_ckpt", config.model.actor_ckpt), ("model.critic_ckpt", config.model.critic_ckpt)):
            if ckpt:
                need(Path(ckpt, "verl_mega_manifest.json").is_file(), f"{key}: {ckpt} is not a verl_mega checkpoint")
    if check_files and config.reward.reward_model:
        need(Path(config.reward.reward_model, "config.json").is_file(),
             f"reward.reward_model: {config.reward.reward_model}/config.json does not exist")
    elif not config.reward.reward_model:
        problems += _reward_function_problems(config.reward.function)
    if check_files and Path(config.model.hf_path, "config.json").is_file():
        problems += _model_fit_problems(config)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _reward_function_problems(name: str) -> list[str]:
    from verl_mega.roles.reward import get_reward_fn

    try:
        get_reward_fn(name)
    except (ValueError, ImportError, AttributeError) as err:
        return [f"reward.function: {err}"]
    return []


def _data_file_problems(path: str, prompt_key: str) -> list[str]:
    from verl_mega.data.prompts import check_prompt_column
    from verl_mega.data.tables import read_rows

    try:
        check_prompt_column(read_rows(path), prompt_key, path)
    except (OSError, ValueError, ImportError) as err:
        return [f"data.train_files: {err}"]
    return []


def _model_fit_problems(config: TrainConfig) -> list[str]:
    from verl_mega.models import load_hf_model_config

    try:
        cfg, _ = load_hf_model_config(config.model.hf_path)
    except ValueError as err:
        return [f"model.hf_path: {err}"]
    p = config.parallel
    problems = []
    if cfg.num_kv_heads % p.tp:
        problems.append(f"parallel.tp={p.tp} must divide the model's query groups (num_key_value_heads={cfg.num_kv_heads})")
    if cfg.num_layers % p.pp:
        problems.append(f"parallel.pp={p.pp} must divide the model's layers (num_hidden_layers={cfg.num_layers})")
    return problems
