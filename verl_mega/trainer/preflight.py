"""The pre-flight check: a run's config against the package, before any process group starts.

Every problem found is listed at once, each naming its key and the fix. The allowed values come from their
owners (registries, the rollout factory, the prompt dataset, the model builder) and the layout rules from
`parallel.layout`, the same functions the converters and the trainer use, so the checks cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Callable

import torch

from verl_mega.algorithms import (
    ADV_ESTIMATORS, BYPASS_LOSS_TYPES, DISTILL_LOSSES, EXHAUSTED_POLICIES, IS_LEVELS, KL_CONTROLLERS, KL_ESTIMATORS,
    LOSS_AGG_MODES, POLICY_LOSSES, PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES, UNPAIRED_LOSSES, estimator_inputs,
    old_log_probs_from_rollout, parse_rejection,
)
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, MANIFEST_NAME, Manifest
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.config import JOBS, ConfigError, TrainConfig
from verl_mega.config.ranges import out_of_range
from verl_mega.config.schema import (
    LOG_FORMATS, NONFINITE_POLICIES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RolloutConfig,
)
from verl_mega.data.prompts import TRUNCATION_SIDES, PromptDataset, check_prompt_column
from verl_mega.data.supervised import Limits, load_preference_examples, load_sft_examples
from verl_mega.data.tables import read_rows
from verl_mega.data.tokenizer import load_tokenizer, vocabulary_difference
from verl_mega.models import HFModelConfig, load_hf_model_config
from verl_mega.models.builder import DTYPES, memory_overrides, transformer_engine_available
from verl_mega.models.external_families import import_family_spec
from verl_mega.models.families import sequence_limit
from verl_mega.models.lora import config_problems as lora_config_problems, model_problems as lora_model_problems
from verl_mega.parallel.layout import check_model_fit, check_rollout_tp, data_parallel_size, rollout_coordinates
from verl_mega.parallel.placement import placement_for, training_data_parallel_size
from verl_mega.planning.memory import Model, layout_of, plan_memory
from verl_mega.roles.megatron_step import PACKING_SETTINGS
from verl_mega.roles.reward import remote_problems
from verl_mega.rewards.registry import RewardFn, get_reward_fn
from verl_mega.rewards.sandbox_fusion import config_problems as code_sandbox_problems
from verl_mega.roles.trainable import LR_DECAY_STYLES
from verl_mega.roles.routing_replay import REPLAY_SETTINGS
from verl_mega.rollout.agent_loop import TOOL_CALL_FORMATS, check_tool_template
from verl_mega.rollout.endpoint import load_agent
from verl_mega.rollout.factory import ENGINES, engine_records_routing, resolve_engine, resolve_rollout_dtype
from verl_mega.rollout.quantization import FORMATS as QUANTIZATION_FORMATS
from verl_mega.run.mirror import parse_mirror_url, require_boto3
from verl_mega.tools import ToolSet
from verl_mega.tools.limits import limit_problems

from .plan import roles_of
from .rl.needs import check_estimator_config, teacher_alone, teacher_layout, uses_critic
from .rl.schedule import PARTIAL_POLICIES, ROLLOUT_MODES

ASYNC_KNOBS = ("max_staleness", "partial", "partial_chunk_tokens")  # rollout.* keys that only async reads
PARALLEL_NAMES = {size: f"parallel.{size}" for size in ("tp", "pp", "ep", "rollout_tp", "rollout_ranks", "cp")}


def preflight_check(config: TrainConfig, world_size: int, check_files: bool = True,
                    reward_fn: RewardFn | None = None) -> None:
    """Raise ConfigError listing every problem found (each naming its key and the fix). `reward_fn`: a callable
    handed to the job in place of `reward.function`."""
    problems: list[str] = []

    def check(run: Callable[[], object], prefix: str = "") -> object:
        try:
            return run()
        except (ValueError, OSError, ImportError, AttributeError) as err:
            problems.append(f"{prefix}{err}")
            return None

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    def known(key: str, value: str, choices) -> None:
        need(value in choices, f"{key} '{value}' is unknown; known: {', '.join(choices)}")

    p, d = config.parallel, config.data
    known("job", config.job, JOBS)
    need(config.trainer.run_dir != "", "trainer.run_dir is empty, which would write the run into the current folder: "
         "name the run folder")
    out_of_range_keys = out_of_range(config)
    problems += out_of_range_keys.values()
    # The layout arithmetic runs on sizes in range only: a zero size has its own line above.
    layout_in_range = not any(key.startswith("parallel.") for key in out_of_range_keys)
    _check_mirror(config, check)
    _check_run_identity(config, need)
    placement = check(lambda: placement_for(0, world_size, p.rollout_ranks, p.rollout_tp, p.tp, PARALLEL_NAMES)
                      ) if layout_in_range else None
    dp = placement and check(lambda: training_data_parallel_size(placement, p.tp, p.pp, p.ep, PARALLEL_NAMES, p.cp))
    _check_bridge(config, need)
    known("data.truncation", d.truncation, TRUNCATION_SIDES)
    known("model.dtype", config.model.dtype, list(DTYPES))
    known("trainer.log_format", config.trainer.log_format, LOG_FORMATS)
    _check_profiling(config, world_size, need)
    for role in lora_roles(config):
        # Its ranges are the config's, already listed: the same lines, once.
        problems += [line for line in lora_config_problems(getattr(config, role).lora, f"{role}.lora")
                     if line not in problems]
        _check_lr_schedule(getattr(config, role).optim, f"{role}.optim", need)
    for role in ("actor", "critic"):
        known(f"{role}.recompute.granularity", getattr(config, role).recompute.granularity, RECOMPUTE_GRANULARITIES)
        known(f"{role}.recompute.method", getattr(config, role).recompute.method, RECOMPUTE_METHODS)
        packing = str(getattr(config, role).use_packed_sequences).lower()
        known(f"{role}.use_packed_sequences", packing, PACKING_SETTINGS)
        need(packing != "true" or transformer_engine_available(),
             f"{role}.use_packed_sequences=true needs transformer-engine on a GPU (THD packed attention); set it "
             "to auto (packs where transformer-engine runs in bf16/fp16) or false")
    _check_sequence_parallel(config, need)
    _check_unsupported_memory_settings(config, need)
    if config.job in ("sft", "preference"):
        need(reward_fn is None, f"reward_fn: the {config.job} job learns from its data, not from a reward function")
        _check_offline(config, dp, check_files, check, need, known, layout_in_range)
    else:
        _check_ppo(config, world_size, dp, check_files, check, need, known, reward_fn, layout_in_range)
        if not problems:  # the prediction needs a valid layout and a readable model
            check(lambda: check_memory(config, world_size))
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _check_ppo(config: TrainConfig, world_size: int, dp, check_files: bool, check, need, known, reward_fn,
               layout_in_range: bool) -> None:
    p, a, c, alg = config.parallel, config.actor, config.critic, config.algorithm
    rollout_tp_fits = layout_in_range and bool(
        check(lambda: check_rollout_tp(p.tp, p.rollout_tp, PARALLEL_NAMES) or True))
    if dp is not None and rollout_tp_fits:
        _check_batch_sizes(config, p.rollout_ranks or world_size, dp, need)
    known("rollout.engine", config.rollout.engine, ENGINES)
    known("rollout.dtype", config.rollout.dtype, ["auto", *DTYPES])
    _check_quantization(config, need, known)
    known("actor.router_replay", a.router_replay, REPLAY_SETTINGS)
    if a.router_replay == "rollout" and config.rollout.engine in ENGINES:
        need(engine_records_routing(config.rollout.engine),
             f"actor.router_replay=rollout: rollout.engine={config.rollout.engine} runs vLLM here, which cannot return "
             "the experts it routed each token to; set rollout.engine=embedded or actor.router_replay=off")
    # The embedded engine generates with the very policy being trained: another dtype would only make the
    # samples drift from the log-probs the actor computes, without speeding anything up on CPU.
    need(config.rollout.engine != "embedded" or config.rollout.dtype in ("auto", config.model.dtype),
         f"rollout.dtype={config.rollout.dtype} with rollout.engine=embedded: the embedded engine runs in model.dtype "
         f"({config.model.dtype}); set rollout.dtype=auto or rollout.dtype={config.model.dtype}")
    known("algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS.names())
    if alg.adv_estimator in ADV_ESTIMATORS:
        check_estimator_config(config, need)
    known("actor.loss.policy_loss", a.loss.policy_loss, POLICY_LOSSES.names())
    known("actor.loss.bypass_loss_type", a.loss.bypass_loss_type, BYPASS_LOSS_TYPES)
    check(a.loss.knobs)
    for key, value in (("actor.loss.loss_agg_mode", a.loss.loss_agg_mode),
                       ("critic.loss.loss_agg_mode", c.loss.loss_agg_mode)):
        known(key, value, LOSS_AGG_MODES.names())
    for key, value in (("algorithm.kl_penalty", alg.kl_penalty), ("actor.loss.kl_loss_type", a.loss.kl_loss_type)):
        known(key, value, KL_ESTIMATORS.names())
    known("algorithm.kl_ctrl.type", alg.kl_ctrl.type, KL_CONTROLLERS)
    _check_rollout_correction(alg.rollout_correction, a.loss, check, need)
    for role in ("actor", "critic"):
        known(f"{role}.optim.lr_decay_style", getattr(config, role).optim.lr_decay_style, LR_DECAY_STYLES)
    known("trainer.nonfinite", config.trainer.nonfinite, NONFINITE_POLICIES)
    _check_dapo(config, need, known)
    _check_rollout_mode(config, need, known)
    if config.rollout.multi_turn.enable:
        _check_multi_turn(config, check, need, known)
    need(config.rollout.engine != "embedded" or p.rollout_tp == 1,
         f"parallel.rollout_tp={p.rollout_tp} needs rollout.engine vllm (the embedded engine runs at rollout TP 1)")
    if config.reward.remote.url:
        for problem in remote_problems(config.reward.remote, config.reward.reward_model):
            need(False, problem)
        need(reward_fn is None, "reward_fn and reward.remote.url are both set: one scores the responses")
    elif config.reward.reward_model:
        need(not check_files or Path(config.reward.reward_model, "config.json").is_file(),
             f"reward.reward_model: {config.reward.reward_model}/config.json does not exist")
    elif reward_fn is not None or config.reward.function or alg.distill.loss == "off":
        check(lambda: get_reward_fn(reward_fn or config.reward.function), "reward.function: ")
        need(reward_fn is None or callable(reward_fn), f"reward_fn: {reward_fn!r} is not callable")
    for problem in code_sandbox_problems(config.reward.code, config.reward.timeout_s):
        need(False, problem)
    _check_distill(config, world_size, check, need, known, check_files, reward_fn, layout_in_range)
    if check_files:
        _check_files(config, check, need, layout_in_range)


def check_memory(config: TrainConfig, world_size: int) -> None:
    """ValueError, in one line with the numbers, when the predicted per-rank peak exceeds trainer.gpu_memory_gb
    (colocated runs; unknown memory or trainer.skip_memory_check: no check)."""
    t = config.trainer
    if t.gpu_memory_gb is None or t.skip_memory_check or config.parallel.rollout_ranks:
        return
    found = plan_memory(Model(config), layout_of(config, world_size), roles_of(config), t.gpu_memory_gb)
    if not found.fits:
        raise ValueError(f"trainer.gpu_memory_gb={t.gpu_memory_gb:g}: predicted peak {found.max_memory_allocated_gb:.1f}"
                         f" GiB per rank ({found.peak_phase}) at {found.layout.describe()}; `verl-mega plan --memory "
                         "CONFIG --suggest` lists layouts that fit, or set trainer.skip_memory_check=true")


def _check_quantization(config: TrainConfig, need, known) -> None:
    """rollout.quantization against the engine it runs in: int8 in the embedded engine on CPU, fp8 in vLLM on a
    GPU (in bf16 or fp16, the activation dtypes of vLLM's FP8 layers)."""
    r = config.rollout
    known("rollout.quantization", r.quantization, QUANTIZATION_FORMATS)
    if r.quantization == "none" or r.engine not in ENGINES or r.dtype not in ("auto", *DTYPES):
        return
    engine, gpu = resolve_engine(r.engine, config.parallel.rollout_tp), torch.cuda.is_available()
    if r.quantization == "int8":
        need(engine == "embedded" and not gpu,
             f"rollout.quantization=int8 runs in the embedded engine on CPU (oneDNN), and this run's rollout is "
             f"{engine} on {'a GPU' if gpu else 'CPU'}: set rollout.engine=embedded, or rollout.quantization=fp8 "
             "with vLLM on a GPU")
    elif r.quantization == "fp8":
        need(engine == "vllm" and gpu,
             f"rollout.quantization=fp8 runs in vLLM's FP8 layers on a GPU, and this run's rollout is {engine} on "
             f"{'a GPU' if gpu else 'CPU (no GPU here)'}: set rollout.engine=vllm on a GPU, or "
             "rollout.quantization=int8 on CPU")
        dtype = resolve_rollout_dtype(r.engine, r.dtype, config.model.dtype)
        need(engine != "vllm" or dtype in ("bf16", "fp16"), f"rollout.quantization=fp8 with rollout.dtype={dtype}: "
             "vLLM's FP8 layers take bf16 or fp16 activations; set rollout.dtype=auto (bf16)")


def _check_rollout_correction(correction, loss, check, need) -> None:
    key = "algorithm.rollout_correction"
    need(correction.rollout_is is None or correction.rollout_is in IS_LEVELS,
         f"{key}.rollout_is '{correction.rollout_is}' is unknown; known: {', '.join(IS_LEVELS)} (null: off)")
    if correction.rollout_rs is not None:
        check(lambda: parse_rejection(correction.rollout_rs, correction.rollout_rs_threshold), f"{key}.")
    if correction.rollout_is_batch_normalize:
        need(correction.rollout_is is not None,
             f"{key}.rollout_is_batch_normalize normalises the importance weights, and {key}.rollout_is is null")
        # Bypass mode weighs by the policy being updated: its batch mean is not known before the update.
        need(not (old_log_probs_from_rollout(loss.policy_loss) and loss.bypass_loss_type == "reinforce"),
             f"{key}.rollout_is_batch_normalize with actor.loss.policy_loss={loss.policy_loss} (reinforce): the "
             "weights use the policy being updated, whose batch mean is known only after the update; turn it off")


def _check_dapo(config: TrainConfig, need, known) -> None:
    """Dynamic sampling needs groups to compare, and a partial batch it may train on must fill a mini-batch; the
    overlong buffer must fit in the response budget."""
    groups, buffer = config.algorithm.filter_groups, config.reward.overlong_buffer
    budget = config.data.max_response_length
    if groups.enable:
        need(config.rollout.n >= 2, f"algorithm.filter_groups.enable with rollout.n={config.rollout.n}: a group of "
             "one response is never dropped; set rollout.n >= 2 or disable the filter")
        need(bool(groups.metric), "algorithm.filter_groups.metric is empty: set it to score or a dict reward's field")
        known("algorithm.filter_groups.on_exhausted", groups.on_exhausted, EXHAUSTED_POLICIES)
        rows = config.data.batch_size * config.rollout.n
        need(groups.on_exhausted != "train" or config.actor.mini_batch_size < rows,
             f"algorithm.filter_groups.on_exhausted=train: a partial batch is cut to whole mini-batches, and "
             f"actor.mini_batch_size={config.actor.mini_batch_size} is the whole batch ({rows} rows), so a partial "
             "one would never train; lower actor.mini_batch_size or set on_exhausted=stop")
    if buffer.enable:
        need(1 <= buffer.len <= budget, f"reward.overlong_buffer.len={buffer.len} must be in [1, "
             f"data.max_response_length={budget}] (the penalty grows over the budget's last len tokens)")


def _check_rollout_mode(config: TrainConfig, need, known) -> None:
    """rollout.mode and its async knobs: known values in range, set only with async, and nothing the mode cannot
    keep: multi-turn episodes (not scheduled off-policy, nor resumed in chunks), routing replay (the buffer holds
    no routing), ReMax's greedy baseline with partial rollouts."""
    r = config.rollout
    known("rollout.mode", r.mode, ROLLOUT_MODES)
    known("rollout.partial", r.partial, PARTIAL_POLICIES)
    if r.mode != "async":
        for key in ASYNC_KNOBS:
            need(getattr(r, key) == getattr(RolloutConfig, key), f"rollout.{key}={getattr(r, key)} applies to "
                 f"rollout.mode=async only (this run's is {r.mode}); set rollout.mode=async or drop the key")
    if config.parallel.rollout_ranks:
        _check_rollout_ranks(config, need)
    if r.mode == "sync":
        return
    need(not r.multi_turn.enable, f"rollout.mode={r.mode} with rollout.multi_turn.enable: agent episodes are "
         "generated and trained in sync only; set rollout.mode=sync")
    need(config.actor.router_replay != "rollout", f"rollout.mode={r.mode} with actor.router_replay=rollout: the "
         "trajectory buffer holds no routing (and a partial rollout's tokens come from several weight versions); "
         "set actor.router_replay=off or rollout.mode=sync")
    estimator = config.algorithm.adv_estimator
    need(r.partial == "off" or estimator not in ADV_ESTIMATORS or "reward_baselines" not in estimator_inputs(estimator),
         f"rollout.partial={r.partial} with algorithm.adv_estimator={estimator}: its greedy baseline is generated "
         "with whole rounds only; set rollout.partial=off")


def _check_rollout_ranks(config: TrainConfig, need) -> None:
    """What the rollout ranks do not run yet: ReMax's greedy baseline, multi-turn episodes."""
    key = f"parallel.rollout_ranks={config.parallel.rollout_ranks}"
    estimator = config.algorithm.adv_estimator
    need(estimator not in ADV_ESTIMATORS or "reward_baselines" not in estimator_inputs(estimator),
         f"algorithm.adv_estimator={estimator} with {key}: its greedy baseline is generated colocated only; set "
         "parallel.rollout_ranks=0")
    need(not config.rollout.multi_turn.enable, f"rollout.multi_turn.enable with {key}: the rollout ranks run no "
         "agent loop; set parallel.rollout_ranks=0")


def _check_multi_turn(config: TrainConfig, check, need, known) -> None:
    """rollout.multi_turn: its counts, its budget within data.max_response_length and its tools (its chat template:
    `_check_files`, with the model folder's tokenizer)."""
    mt, key = config.rollout.multi_turn, "rollout.multi_turn"
    need(mt.max_tokens <= config.data.max_response_length, f"{key}.max_tokens={mt.max_tokens} must be in [0, "
         f"data.max_response_length={config.data.max_response_length}] (0: the whole response length)")
    known(f"{key}.tool_call_format", mt.tool_call_format, TOOL_CALL_FORMATS)
    need(config.actor.router_replay != "rollout", f"{key}.enable with actor.router_replay=rollout: the agent loop "
         "does not record the routing of each turn; set actor.router_replay=off")
    need(bool(mt.tools) or bool(mt.agent), f"{key}.tools is empty: name the tools the model may call "
         "(calculator, python, or module:function), or the agent that runs its own (rollout.multi_turn.agent)")
    if mt.agent:  # the agent's module is imported now, not at the first step
        check(lambda: load_agent(mt.agent), f"{key}.agent: ")
        need(config.parallel.rollout_tp == 1, f"{key}.agent with parallel.rollout_tp={config.parallel.rollout_tp}: "
             "each rank of a rollout replica would serve its own endpoint, and rounds that a slow agent splits "
             "could differ between the ranks that decode them together; set parallel.rollout_tp=1")
    if mt.tools and not mt.agent and not limit_problems(config.tools):  # bad tools.* limits have their own line
        check(lambda: ToolSet(mt.tools, config.tools).close(), f"{key}.tools: ")


def _check_offline(config: TrainConfig, dp, check_files: bool, check, need, known, layout_in_range: bool) -> None:
    """SFT and preference jobs: no rollout, reward or critic; the data rows are checked one by one."""
    if dp is not None:
        _check_offline_batch_sizes(config, dp, need)
    need(config.rollout.mode == "sync", f"rollout.mode={config.rollout.mode}: job {config.job} generates nothing; "
         "drop the key (rollout modes are the rl job's)")
    need(config.trainer.log_samples_every == 0, f"trainer.log_samples_every={config.trainer.log_samples_every}: "
         f"job {config.job} generates no samples to log; set it to 0")
    if config.job == "preference":
        _check_preference_knobs(config, known, need)
    if check_files:
        _check_offline_files(config, check, need, layout_in_range)


def _check_lr_schedule(optim, key: str, need) -> None:
    """What megatron's OptimizerParamScheduler asserts, as lines naming the keys."""
    need(optim.min_lr <= optim.lr, f"{key}.min_lr={optim.min_lr} must not exceed {key}.lr={optim.lr} (the decay ends "
         "at min_lr)")
    need(optim.lr_decay_steps is None or optim.lr_warmup_steps < optim.lr_decay_steps,
         f"{key}.lr_warmup_steps={optim.lr_warmup_steps} must be below {key}.lr_decay_steps={optim.lr_decay_steps} "
         "(the decay follows the warmup), or leave lr_decay_steps null")


def _check_profiling(config: TrainConfig, world_size: int, need) -> None:
    """Profiled steps and ranks that exist, so a typo does not silently profile nothing."""
    t = config.trainer
    steps = [step for step in t.profile_steps if not 1 <= step <= t.total_steps]
    need(not steps, f"trainer.profile_steps {steps}: steps count from 1 to trainer.total_steps={t.total_steps}")
    ranks = [rank for rank in t.profile_ranks if not 0 <= rank < world_size]
    need(not ranks, f"trainer.profile_ranks {ranks}: ranks are 0..{world_size - 1} in a world of {world_size}")


def _check_mirror(config: TrainConfig, check) -> None:
    t = config.trainer
    if t.checkpoint_mirror:
        check(lambda: parse_mirror_url(t.checkpoint_mirror), "trainer.checkpoint_mirror: ")
        check(require_boto3, "trainer.checkpoint_mirror: ")


# wandb refuses a project name holding any of these (its own message comes at the run's start, after conversion).
WANDB_FORBIDDEN = "/\\#?%:"


def _check_run_identity(config: TrainConfig, need) -> None:
    """What a run is checked against or logged under, refused now rather than once the run has started."""
    sha, project = config.model.sha256, config.trainer.wandb_project
    need(not sha or re.fullmatch("[0-9a-fA-F]{64}", sha) is not None,
         f"model.sha256={sha!r} is not a sha256 (64 hexadecimal digits, as RUN/provenance.json records it)")
    if project:
        need(importlib.util.find_spec("wandb") is not None,
             "trainer.wandb_project is set and wandb is not installed: pip install wandb, or leave it empty")
        bad = sorted(set(project) & set(WANDB_FORBIDDEN))
        need(not bad, f"trainer.wandb_project={project!r}: wandb project names may not hold {' '.join(bad)}")


def _check_bridge(config: TrainConfig, need) -> None:
    """A job that has rollout ranks to feed (the transport's limits are ranges)."""
    p = config.parallel
    need(p.rollout_ranks == 0 or config.job == "rl",
         f"parallel.rollout_ranks={p.rollout_ranks}: the {config.job} job generates nothing; set it to 0")


def _check_batch_sizes(config: TrainConfig, rollout_world: int, dp: int, need) -> None:
    """`rollout_world`: the processes that generate (all of them when colocated)."""
    d = config.data
    sequences = d.batch_size * config.rollout.n
    trained = [("actor", config.actor)] + ([("critic", config.critic)] if uses_critic(config) else [])
    for role, section in trained:  # a critic that is off is not refused for its batch sizes
        need(section.mini_batch_size % (dp * max(section.micro_batch_size, 1)) == 0,
             f"{role}.mini_batch_size={section.mini_batch_size} must be divisible by data-parallel size {dp} x "
             f"{role}.micro_batch_size={section.micro_batch_size}")
        longest = d.max_prompt_length + d.max_response_length
        need(section.max_tokens_per_micro_batch == 0 or section.max_tokens_per_micro_batch >= longest,
             f"{role}.max_tokens_per_micro_batch={section.max_tokens_per_micro_batch} must be 0 (off) or hold the "
             f"longest sequence, data.max_prompt_length + data.max_response_length = {longest}")
        need(sequences % max(section.mini_batch_size, 1) == 0,
             f"data.batch_size x rollout.n = {sequences} must be divisible by {role}.mini_batch_size="
             f"{section.mini_batch_size}")
        _check_interleavable(config.parallel, role, section, dp, need)
    replicas = rollout_coordinates(0, rollout_world, config.parallel.tp, config.parallel.rollout_tp).replicas
    generators = "parallel.rollout_ranks" if config.parallel.rollout_ranks else "processes"
    need(d.batch_size % replicas == 0,
         f"data.batch_size={d.batch_size} must be divisible by the number of rollout replicas {replicas} "
         f"({generators} / parallel.rollout_tp), so each generates the same number of prompts")


def _check_offline_batch_sizes(config: TrainConfig, dp: int, need) -> None:
    """SFT / preference: `data.batch_size` and the actor's batch sizes count examples (a pair is one)."""
    d, a = config.data, config.actor
    need(a.mini_batch_size % (dp * max(a.micro_batch_size, 1)) == 0,
         f"actor.mini_batch_size={a.mini_batch_size} must be divisible by data-parallel size {dp} x "
         f"actor.micro_batch_size={a.micro_batch_size}")
    need(d.batch_size % max(a.mini_batch_size, 1) == 0,
         f"data.batch_size={d.batch_size} must be divisible by actor.mini_batch_size={a.mini_batch_size}")
    _check_interleavable(config.parallel, "actor", a, dp, need)


def _check_interleavable(p, role: str, section, dp: int, need) -> None:
    """megatron's interleaved schedule (virtual pipeline stages) runs at least pp micro-batches per pass
    (`parallel.pipeline.interleaved_group_size`): a mini-batch must hold them on each DP rank, and a token budget,
    which may pack a pass into fewer, is refused."""
    if p.vpp == 1:
        return
    need(section.max_tokens_per_micro_batch == 0, f"{role}.max_tokens_per_micro_batch="
         f"{section.max_tokens_per_micro_batch} may pack a pass into fewer than parallel.pp={p.pp} micro-batches, "
         f"which virtual pipeline stages (parallel.vpp={p.vpp}) cannot run: set it to 0 or parallel.vpp=1")
    micro_batches = section.mini_batch_size // max(dp * max(section.micro_batch_size, 1), 1)
    need(micro_batches >= p.pp, f"{role}.mini_batch_size={section.mini_batch_size} gives each of the {dp} "
         f"data-parallel ranks {micro_batches} micro-batches of {role}.micro_batch_size={section.micro_batch_size}; "
         f"virtual pipeline stages (parallel.vpp={p.vpp}) need at least parallel.pp={p.pp}: raise the mini-batch, "
         "lower the micro-batch or set parallel.vpp=1")


def _check_preference_knobs(config: TrainConfig, known, need) -> None:
    alg = config.algorithm
    known("algorithm.loss", alg.loss, PREFERENCE_LOSSES.names())
    need(not alg.cache_reference_logprobs or alg.loss not in REFERENCE_FREE_LOSSES | UNPAIRED_LOSSES,
         f"algorithm.cache_reference_logprobs: algorithm.loss={alg.loss} "
         + ("needs no reference" if alg.loss in REFERENCE_FREE_LOSSES else
            "scores each batch's mismatched pairs with the reference for its KL baseline, which no cache holds")
         + "; unset it")


def _check_offline_files(config: TrainConfig, check, need, layout_in_range: bool) -> None:
    """Every row of the SFT / preference files is tokenized and checked now, so a bad one (no assistant turn,
    an empty response, chosen identical to rejected, too long a prompt under truncation=error) is refused
    before start-up, naming the file and the row."""
    d = config.data
    has_model = _check_model(config, check, need, layout_in_range)
    need(bool(d.train_files), "data.train_files is empty: list at least one parquet or jsonl file or datasets folder")
    if not has_model:
        return
    tokenizer = check(lambda: load_tokenizer(config.model.hf_path), "model.hf_path: ")
    if tokenizer is None:
        return
    limits = Limits(d.max_prompt_length, d.max_response_length, d.truncation)
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if not files:
            continue
        if config.job == "sft":
            loaded = check(lambda: load_sft_examples(files, tokenizer, limits, d.prompt_key, d.skip_invalid_rows),
                           f"{key}: ")
        else:
            loaded = check(lambda: load_preference_examples(
                files, tokenizer, limits, unpaired=config.algorithm.loss in UNPAIRED_LOSSES, prompt_key=d.prompt_key,
                skip_invalid=d.skip_invalid_rows), f"{key}: ")
        if key == "data.train_files" and loaded is not None:
            need(len(loaded.examples) >= d.batch_size, f"data.train_files: {len(loaded.examples)} usable rows "
                 f"cannot fill one batch of data.batch_size={d.batch_size}")


def _check_model(config: TrainConfig, check, need, layout_in_range: bool) -> bool:
    """The model folder, the given checkpoints, the sequence length and the layout against the model; whether
    the folder exists."""
    m, p = config.model, config.parallel
    has_model = Path(m.hf_path, "config.json").is_file()
    need(has_model, f"model.hf_path: {m.hf_path}/config.json does not exist; point it at an HF model folder")
    for key, ckpt in (("model.actor_ckpt", m.actor_ckpt), ("model.critic_ckpt", m.critic_ckpt)):
        need(not ckpt or Path(ckpt, MANIFEST_NAME).is_file(), f"{key}: {ckpt} is not a verl_mega checkpoint")
    need(not m.critic_hf_path or Path(m.critic_hf_path, "config.json").is_file(),
         f"model.critic_hf_path: {m.critic_hf_path}/config.json does not exist; point it at an HF model folder")
    need(not (m.critic_hf_path and m.critic_ckpt),
         "model.critic_hf_path and model.critic_ckpt both name the critic's weights; set one of them")
    spec_importable = not m.family_spec or check(lambda: import_family_spec(m.family_spec), "model.family_spec: ")
    if has_model and spec_importable:
        loaded = check(lambda: load_hf_model_config(m.hf_path, m.family_spec or None), "model.hf_path: ")
        model = loaded[0] if loaded is not None else None
        if model is not None:
            if layout_in_range:
                check(lambda: check_model_fit(model, p.tp, p.pp, p.ep, PARALLEL_NAMES))
            longest, (limit, why) = config.data.max_prompt_length + config.data.max_response_length, \
                sequence_limit(*loaded)
            need(longest <= limit, f"data.max_prompt_length + data.max_response_length = {longest} tokens exceed "
                 f"model.hf_path's {why}: lower them")
            _check_lora_fit(config, model, loaded[1], need)
            need(p.cp == 1 or not loaded[1].local_attention,
                 f"parallel.cp={p.cp}: {model.model_type}'s layers keep megatron's local attention (its soft cap), "
                 "which runs no context parallelism: set parallel.cp=1")
            need(config.actor.router_replay != "rollout" or model.num_experts is not None,
                 f"actor.router_replay=rollout replays the routing of MoE layers and model.hf_path {m.hf_path} is a "
                 f"dense {model.model_type} model: set actor.router_replay=off")
            # megatron's MoE layer refuses to train at TP > 1 without sequence parallelism.
            need(not (model.num_experts and p.tp > 1) or all(memory_overrides(getattr(config, role), p)[
                     "sequence_parallel"] for role in lora_roles(config)),
                 f"parallel.tp={p.tp}: an MoE model ({model.model_type}) trains at TP > 1 only with sequence "
                 "parallelism, which parallel.sequence_parallel=false or LoRA adapters turn off; use parallel.tp=1 "
                 "and spread it with parallel.ep and parallel.pp")
            need(p.vpp == 1 or p.pp < 1 or model.num_layers % (p.pp * p.vpp) == 0,
                 f"parallel.pp={p.pp} x parallel.vpp={p.vpp} must divide the model's {model.num_layers} layers (each "
                 "pipeline rank runs vpp chunks of equal layers)")
            if layout_in_range and p.pp >= 1 and model.num_layers % (p.pp * p.vpp) == 0:
                _check_recompute_layers(config, model.num_layers // (p.pp * p.vpp),
                                        "pipeline stage" if p.vpp == 1 else "model chunk (parallel.vpp)", need)
            if m.actor_ckpt and Path(m.actor_ckpt, MANIFEST_NAME).is_file():
                check(lambda: check_actor_checkpoint(m.actor_ckpt, model, config), "model.actor_ckpt: ")
    return has_model


def _check_sequence_parallel(config: TrainConfig, need) -> None:
    p = config.parallel
    need(p.sequence_parallel is not True or p.tp > 1, "parallel.sequence_parallel=true splits the sequence over the "
         "TP ranks and parallel.tp=1: set it to null or false, or raise parallel.tp")
    for role in lora_roles(config):
        need(not (p.sequence_parallel and getattr(config, role).lora.rank), f"{role}.lora: the adapters take no "
             "sequence-split input: set parallel.sequence_parallel to null (off for roles with adapters) or false")


def _check_unsupported_memory_settings(config: TrainConfig, need) -> None:
    """The memory settings the planner models that training does not run here (docs/memory.md says why)."""
    p = config.parallel
    need(p.cp == 1 or transformer_engine_available(), f"parallel.cp={p.cp}: context parallelism runs "
         "transformer-engine's attention (megatron-core's local attention takes context_parallel_size 1), and this "
         "machine has no transformer-engine with CUDA: set it to 1 (`verl-mega plan --memory` models it)")
    for role in ("actor", "critic"):
        need(p.cp == 1 or str(getattr(config, role).use_packed_sequences).lower() != "true",
             f"{role}.use_packed_sequences=true is not supported with parallel.cp={p.cp} (the packed row is not "
             "split over the context-parallel ranks): set it to auto or false")
    need(p.vpp == 1 or p.pp > 1, f"parallel.vpp={p.vpp} interleaves model chunks over the pipeline ranks and "
         "parallel.pp=1 has one: set parallel.vpp=1 or raise parallel.pp")
    for role in lora_roles(config):
        optim = getattr(config, role).optim
        if optim.cpu_offload:
            need(torch.cuda.is_available(), f"{role}.optim.cpu_offload=true runs megatron's HybridDeviceOptimizer, "
                 "which needs CUDA (and on a CPU-only machine the optimizer is on the host already): set it to false")
            need(optim.use_distributed_optimizer, f"{role}.optim.cpu_offload=true needs "
                 f"{role}.optim.use_distributed_optimizer=true (megatron offloads the distributed optimizer's shards)")


def _check_recompute_layers(config: TrainConfig, stage_layers: int, stage: str, need) -> None:
    """megatron's full recompute runs chunks of num_layers layers (uniform) or the first num_layers (block) of
    the `stage_layers` of each `stage` (a pipeline stage, or under virtual pipeline stages a model chunk)."""
    for role in lora_roles(config):
        recompute = getattr(config, role).recompute
        if recompute.granularity != "full":
            continue
        key = f"{role}.recompute.num_layers={recompute.num_layers}"
        if recompute.method == "uniform":
            need(stage_layers % recompute.num_layers == 0, f"{key} must divide the {stage_layers} layers of each "
                 f"{stage} (method uniform recomputes chunks of that many)")
        else:
            need(recompute.num_layers <= stage_layers, f"{key} exceeds the {stage_layers} layers of each {stage}")


def lora_roles(config: TrainConfig) -> tuple[str, ...]:
    """The roles whose `lora` the job reads: the critic exists in RL only."""
    return ("actor", "critic") if config.job == "rl" else ("actor",)


def _check_lora_fit(config: TrainConfig, model: HFModelConfig, family, need) -> None:
    for role in lora_roles(config):
        lora = getattr(config, role).lora
        for problem in lora_model_problems(lora, f"{role}.lora", model, family, config.parallel.tp):
            need(False, problem)


def check_actor_checkpoint(ckpt: str, model: HFModelConfig, config: TrainConfig) -> None:
    """Refuse a given actor checkpoint of another model than model.hf_path, or of a layout it cannot load at."""
    manifest = Manifest.read(ckpt, config.model.family_spec or None)
    stored = HFModelConfig.from_dict(manifest.hf_config)
    if stored != model:
        differ = [f"{name} {getattr(stored, name)} vs {getattr(model, name)}" for name in _ARCHITECTURE_FIELDS
                  if getattr(stored, name) != getattr(model, name)] or ["architecture details"]
        raise ValueError(f"{ckpt} is a {stored.model_type} checkpoint and model.hf_path {config.model.hf_path} is "
                         f"a {model.model_type} model; they differ in {', '.join(differ[:3])}: point "
                         "model.actor_ckpt at a conversion of model.hf_path, or leave it empty to convert it")
    p = config.parallel
    if manifest.format == "megatron_legacy" and (manifest.tp, manifest.pp, manifest.ep) != (p.tp, p.pp, p.ep):
        raise ValueError(f"{ckpt} was written for tp={manifest.tp}, pp={manifest.pp}, ep={manifest.ep} and this run "
                         f"is parallel.tp={p.tp}, pp={p.pp}, ep={p.ep}: convert again at this layout, or with "
                         "--format torch_dist, which loads at any layout")


_ARCHITECTURE_FIELDS = [field.name for field in dataclasses.fields(HFModelConfig) if field.compare]


def _check_files(config: TrainConfig, check, need, layout_in_range: bool) -> None:
    d = config.data
    has_model = _check_model(config, check, need, layout_in_range)
    need(bool(d.train_files), "data.train_files is empty: list at least one parquet or jsonl file or datasets folder")
    prompt_files = {"data.train_files": d.train_files, "data.val_files": d.val_files}
    readable = {key: files for key, files in prompt_files.items() if files and all([
        check(lambda: check_prompt_column(read_rows(file), d.prompt_key, file) or True, f"{key}: ")
        for file in files])}
    # The tokenizer the job loads first thing, loaded now: its files may be what is broken.
    tokenizer = check(lambda: load_tokenizer(config.model.hf_path), "model.hf_path: ") if has_model else None
    mt = config.rollout.multi_turn
    if tokenizer is not None and mt.enable and mt.tool_call_format in TOOL_CALL_FORMATS:
        # A chat template that renders tool messages in the tool-call format the agent loop parses.
        check(lambda: check_tool_template(tokenizer, mt.tool_call_format),
              "rollout.multi_turn with model.hf_path's tokenizer: ")
    for key, files in readable.items() if tokenizer is not None else ():
        if d.truncation == "error" and d.max_prompt_length >= 1:
            # Every prompt's length, now rather than at the step that happens to sample a long one.
            check(lambda: PromptDataset(files, tokenizer, d.max_prompt_length, d.prompt_key, d.truncation),
                  f"{key}: ")
        else:  # the chat template on a first prompt: a template that cannot render stops the run at its first step
            check(lambda: PromptDataset(files, tokenizer, d.max_prompt_length, d.prompt_key, d.truncation)[0],
                  f"{key}: ")


def _check_distill(config: TrainConfig, world_size: int, check, need, known, check_files: bool, reward_fn,
                   layout_in_range: bool) -> None:
    """algorithm.distill and its teacher: a loss with a teacher (and a teacher only with a loss), at a layout of
    the training processes, and nothing that learns from an outcome reward where the teacher is the whole reward;
    with the files, a teacher that loads, fits its layout, outside the run folder, of the student's tokenizer."""
    distill, teacher = config.algorithm.distill, config.teacher
    known("algorithm.distill.loss", distill.loss, DISTILL_LOSSES)
    given = [key for key, value in (("teacher.hf_path", teacher.hf_path), ("teacher.ckpt", teacher.ckpt),
                                    ("teacher.by_data_source", teacher.by_data_source)) if value]
    if distill.loss == "off":
        need(not given, f"{' and '.join(given)} set and algorithm.distill.loss=off: set algorithm.distill.loss "
             "(reverse_kl or gkd) to distil from it, or drop the teacher")
        return
    need(bool(teacher.hf_path or teacher.ckpt), f"algorithm.distill.loss={distill.loss} needs a teacher (of the rows "
         "of every data source teacher.by_data_source does not name): set teacher.hf_path (its HF folder) or "
         "teacher.ckpt (a converted checkpoint)")
    if teacher_alone(config, reward_fn):
        need(not config.algorithm.filter_groups.enable, "algorithm.filter_groups.enable with reward.function empty: "
             "every response scores 0 (the teacher's signal is the whole reward), so every group would be dropped; "
             "disable the filter or set reward.function")
        need(not uses_critic(config), "algorithm.adv_estimator=gae with reward.function empty: the critic would "
             "learn values of no reward; set algorithm.adv_estimator=grpo (the teacher's term is then the whole "
             "advantage) or set reward.function")
    layout_fits = layout_in_range and _check_teacher_layout(config, world_size, check, need)
    if not check_files:
        return
    default = [("teacher.ckpt", teacher.ckpt, True)] if teacher.ckpt else [("teacher.hf_path", teacher.hf_path, False)]
    for key, folder, converted in default + [(f"teacher.by_data_source.{source}", folder, False)
                                             for source, folder in teacher.by_data_source.items()]:
        if folder:
            _check_teacher_files(config, key, folder, converted, check, need, layout_fits)


def _check_teacher_layout(config: TrainConfig, world_size: int, check, need) -> bool:
    """A teacher at its own layout: teacher.tp * teacher.pp dividing the training processes (at parallel.ep), and
    the step's rows splitting evenly over the teacher's data-parallel ranks and their micro-batches. Whether the
    layout is one to split the teacher's model at (sizes out of range have their own lines; the student's layout
    has its own checks)."""
    tp, pp, ep = teacher_layout(config)
    p = config.parallel
    if (tp, pp) == (p.tp, p.pp):
        return True
    training = world_size - p.rollout_ranks
    if training < 1 or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in (tp, pp)):
        return False
    dp = check(lambda: data_parallel_size(training, tp, pp, ep, _teacher_names(config)))
    if dp is None:
        return False
    a = config.actor
    rows, micro = config.data.batch_size * config.rollout.n, 1 if a.max_tokens_per_micro_batch else a.micro_batch_size
    need(rows % (dp * max(micro, 1)) == 0, f"data.batch_size x rollout.n = {rows} must be divisible by the teacher's "
         f"data-parallel size {dp} (training processes / (teacher.tp * teacher.pp))"
         + (f" x actor.micro_batch_size={micro}" if micro > 1 else ""))
    return True


def _teacher_names(config: TrainConfig) -> dict[str, str]:
    """The keys that set the teacher's sizes: teacher.tp and teacher.pp, or the student's where they are null."""
    return {**PARALLEL_NAMES, **{size: f"teacher.{size}" for size in ("tp", "pp")
                                 if getattr(config.teacher, size) is not None}}


def _check_teacher_files(config: TrainConfig, key: str, folder: str, converted: bool, check, need,
                         layout_fits: bool) -> None:
    """The teacher's folder (`converted`: a converted checkpoint, else an HF folder), outside the run folder,
    readable (config, weights or manifest), split at the teacher's layout (`layout_fits`: a valid one to try), and
    its tokenizer the student's token for token; for gkd, top-k ids the student's vocabulary holds."""
    run_dir = Path(config.trainer.run_dir).resolve()
    if Path(folder).resolve().is_relative_to(run_dir):
        need(False, f"{key}={folder} is inside trainer.run_dir={config.trainer.run_dir}, the folder this run writes: "
             "export the teacher out of it (verl-mega export) or point at another folder")
        return
    # A converted checkpoint carries its source's tokenizer files.
    tokenizer_folder = Path(folder, HF_ASSETS_DIR) if converted else folder
    if converted:
        manifest = check(lambda: Manifest.read(folder, config.model.family_spec or None), f"{key}: ")
        model = HFModelConfig.from_dict(manifest.hf_config) if manifest is not None else None
        tp, pp, ep = teacher_layout(config)
        need(manifest is None or manifest.format != "megatron_legacy" or (manifest.tp, manifest.pp, manifest.ep)
             == (tp, pp, ep), f"{key}: {folder} was written for tp={getattr(manifest, 'tp', '')}, "
             f"pp={getattr(manifest, 'pp', '')}, ep={getattr(manifest, 'ep', '')} and the teacher runs at tp={tp}, "
             f"pp={pp}, ep={ep} (teacher.tp, teacher.pp, parallel.ep): convert it again at this layout, or with "
             "--format torch_dist")
    else:
        if not Path(folder, "config.json").is_file():
            need(False, f"{key}: {folder}/config.json does not exist; point it at the teacher's HF model folder")
            return
        loaded = check(lambda: load_hf_model_config(folder, config.model.family_spec or None), f"{key}: ")
        model = loaded[0] if loaded is not None else None
        check(lambda: SafetensorsReader(folder).close(), f"{key}: ")
    if model is not None and layout_fits:
        check(lambda: check_model_fit(model, *teacher_layout(config), _teacher_names(config)), f"{key}: ")
    if model is None or not Path(config.model.hf_path, "config.json").is_file():
        return
    student_tokenizer = check(lambda: load_tokenizer(config.model.hf_path), "model.hf_path: ")
    teacher_tokenizer = check(lambda: load_tokenizer(tokenizer_folder), f"{key}: ")
    if student_tokenizer is None or teacher_tokenizer is None:
        return
    difference = vocabulary_difference(student_tokenizer, teacher_tokenizer)
    need(difference is None, f"{key}: the teacher's tokenizer is not model.hf_path's ({difference}); distillation "
         "compares the two models token by token: pick a teacher with the student's tokenizer")
    if config.algorithm.distill.loss == "gkd":
        student = check(lambda: load_hf_model_config(config.model.hf_path, config.model.family_spec or None)[0],
                        "model.hf_path: ")
        need(student is None or model.vocab_size <= student.vocab_size, f"algorithm.distill.loss=gkd: the teacher's "
             f"vocabulary ({model.vocab_size} rows) is larger than the student's ({student and student.vocab_size}), "
             "so its top-k may name tokens the student cannot score; use reverse_kl")
        need(config.algorithm.distill.top_k <= model.vocab_size, f"algorithm.distill.top_k="
             f"{config.algorithm.distill.top_k} exceeds the teacher's vocabulary of {model.vocab_size}")
