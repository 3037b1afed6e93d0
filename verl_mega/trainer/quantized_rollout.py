"""The recommended correction of a quantized rollout (`rollout.quantization`): token-level TIS.

A quantized rollout samples from a policy a little different from the one trained; truncated importance sampling
reweighs each token by min(π_train / π_rollout, cap). Where the run does not choose its own correction
(`algorithm.rollout_correction.rollout_is` null) and `rollout.quantization_tis` is on, the run gets verl's
`RolloutCorrectionConfig.decoupled_token_is()`: rollout_is=token, rollout_is_threshold=2.0 (verl's
algorithm.py; its default cap, which `rollout_is_threshold` already holds here).
"""
from __future__ import annotations

import copy

from verl_mega.config import TrainConfig

TIS_LEVEL = "token"  # verl's decoupled_token_is


def adds_tis(config: TrainConfig) -> bool:
    """Whether the run's quantized rollout turns token TIS on (see the module docstring)."""
    return (config.rollout.quantization != "none" and config.rollout.quantization_tis
            and config.algorithm.rollout_correction.rollout_is is None)


def tis_note(config: TrainConfig) -> str | None:
    """The pre-flight's note line where `adds_tis`, else None."""
    if not adds_tis(config):
        return None
    cap = config.algorithm.rollout_correction.rollout_is_threshold
    return (f"note: rollout.quantization={config.rollout.quantization} turns on token TIS "
            f"(algorithm.rollout_correction.rollout_is={TIS_LEVEL}, rollout_is_threshold={cap}: verl's "
            "decoupled_token_is) to correct the quantized rollout's mismatch; rollout.quantization_tis=false or "
            "an explicit rollout_is overrides it")


def with_quantization_tis(config: TrainConfig) -> TrainConfig:
    """A copy of `config`, with token TIS on where `adds_tis`."""
    config = copy.deepcopy(config)
    if adds_tis(config):
        config.algorithm.rollout_correction.rollout_is = TIS_LEVEL
    return config
