"""A normalised view of an HF `config.json`, written by transformers 4.x or 5.x.

5.x writes `rope_parameters` (theta, type, scaling fields); 4.x wrote top-level `rope_theta` and
`rope_scaling`. Checkpoints in the wild carry both forms, so every reader goes through `HFModelConfig`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class HFModelConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]
    rotary_percent: float
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int | None
    moe_top_k: int | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "HFModelConfig":
        model_type = raw.get("model_type")
        if not model_type:
            raise ValueError("config.json has no 'model_type'")
        text = raw.get("text_config")
        if isinstance(text, dict) and "num_hidden_layers" not in raw:
            raise ValueError(
                f"model_type '{model_type}' is a multimodal model (config.json has a text_config); "
                "only decoder-only language models are supported"
            )
        try:
            num_heads = raw["num_attention_heads"]
            hidden = raw["hidden_size"]
            num_layers = raw["num_hidden_layers"]
            vocab = raw["vocab_size"]
        except KeyError as missing:
            raise ValueError(f"config.json of model_type '{model_type}' lacks the key {missing}") from None
        theta, scaling = _rope_fields(raw)
        num_experts = raw.get("num_local_experts") or raw.get("num_experts")
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            ffn_hidden_size=raw["intermediate_size"],
            vocab_size=vocab,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_percent=_partial_rotary_factor(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=num_experts,
            moe_top_k=raw.get("num_experts_per_tok") if num_experts else None,
            raw=raw,
        )

    @staticmethod
    def read_raw(hf_dir: str | Path) -> dict[str, Any]:
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --hf must point at a HuggingFace model folder")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None


def _rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5.x
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:  # transformers 4.x
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(raw.get("partial_rotary_factor", 1.0))


def rope_inv_freq(config: HFModelConfig):
    """The inverse frequencies HF uses for this config (default, linear and Llama-3 scaling).

    Megatron's own Llama-3 scaling hardcodes its factors, so the builder installs these instead.
    """
    import torch

    rope_type = config.rope_scaling["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope type '{rope_type}' is not supported (supported: {', '.join(ROPE_TYPES)}); "
            "it needs attention scaling or sequence-length-dependent frequencies"
        )
    dim = int(config.head_dim * config.rotary_percent)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        return inv_freq / config.rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq, scaling: dict[str, Any]):
    import torch

    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
