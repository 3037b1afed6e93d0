"""A normalised view of an HF `config.json`, written by transformers 4.x or 5.x.

5.x writes `rope_parameters` (theta, type, scaling fields); 4.x wrote top-level `rope_theta` and
`rope_scaling`. Checkpoints in the wild carry both forms, so every reader goes through `HFModelConfig`.
A key config.json leaves out reads as transformers' own config class has it (`transformers_defaults`): 4.x's
`save_pretrained` left out values equal to its base class's, so Gemma-2's checkpoints carry no
`tie_word_embeddings` and tie all the same.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any



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
        if not model_type or not isinstance(model_type, str):
            raise ValueError("config.json has no 'model_type' string")
        raw = _with_transformers_defaults(raw, model_type)
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
            ffn = raw["intermediate_size"]
        except KeyError as missing:
            raise ValueError(f"config.json of model_type '{model_type}' lacks the key {missing}") from None
        _check_sizes(raw)
        theta, scaling = _rope_fields(raw)
        num_experts = raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts")
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            ffn_hidden_size=ffn,
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
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None


# Keys transformers' defaults never fill: sizes a config.json must give, token ids, and RoPE's, which has two
# spellings a default must not disagree with (`_with_transformers_defaults` fills its theta alone).
_NOT_DEFAULTED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "pad_token_id",
                  "bos_token_id", "eos_token_id"}


def _with_transformers_defaults(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    defaults, theta, aliases = transformers_defaults(model_type)
    # A key given under another of its names is given (Qwen3-MoE's num_local_experts for num_experts, DeepSeek's
    # num_nextn_predict_layers for num_mtp_layers): either way round of transformers' attribute_map.
    given = set(raw) | {aliases[key] for key in raw if key in aliases} | {alias for alias, key in aliases.items()
                                                                           if key in raw}
    filled = {**{key: value for key, value in defaults.items() if key not in given}, **raw}
    params = raw.get("rope_parameters")
    if theta is not None and "rope_theta" not in raw and not (isinstance(params, dict) and "rope_theta" in params):
        filled["rope_theta"] = theta
    return filled


@functools.cache
def transformers_defaults(model_type: str) -> tuple[dict[str, Any], float | None, dict[str, str]]:
    """What transformers' config class for `model_type` gives the keys a config.json may leave out: its own declared
    scalar defaults (not its base class's; None ones are derived from other keys after reading), RoPE's theta, and
    the other names its keys answer to. Nothing for a model type transformers does not know (a plugin family's)."""
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig

        config_class = CONFIG_MAPPING[model_type]
    except (ImportError, KeyError):
        return {}, None, {}
    base = _declared_defaults(PretrainedConfig)
    defaults = {key: value for key, value in _declared_defaults(config_class).items()
                if key not in base and key not in _NOT_DEFAULTED and isinstance(value, (bool, int, float, str))}
    return defaults, _default_theta(config_class), dict(getattr(config_class, "attribute_map", {}))


def _declared_defaults(config_class) -> dict[str, Any]:
    """A config class's defaults: its dataclass fields (transformers 5), else its __init__'s keywords (4.x)."""
    if dataclasses.is_dataclass(config_class):
        return {f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}
    return {name: p.default for name, p in inspect.signature(config_class.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _default_theta(config_class) -> float | None:
    try:
        config = config_class()
    except Exception:  # noqa: BLE001 - a class that will not build from its own defaults has no default to give
        return None
    params = getattr(config, "rope_parameters", None)
    theta = params.get("rope_theta") if isinstance(params, dict) else getattr(config, "rope_theta", None)
    return float(theta) if type(theta) in (int, float) else None


# Sizes every reader divides or allocates by; a string, a bool, zero or a negative number is a broken config.
_POSITIVE_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_position_embeddings", "num_local_experts",
                      "num_experts", "n_routed_experts", "num_experts_per_tok")
_NUMBER_KEYS = ("rms_norm_eps", "partial_rotary_factor")  # rope_theta: `_check_rope`, wherever it is given
# Beyond any model's, far: a per-layer or per-expert list of a size a config names is built before any tensor is
# read (99999999999 layers: MemoryError). Other sizes only shape tensors, which the checkpoint's must then match.
_LARGEST_COUNT = 2 ** 16
_LARGEST_SIZE = 2 ** 31 - 1
_COUNT_KEYS = ("num_hidden_layers", "num_local_experts", "num_experts", "n_routed_experts")
# Null means "derive it" for the other sizes (head_dim, num_key_value_heads, ...), as in transformers; not for these.
_NEVER_NULL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
               "max_position_embeddings")


def _check_sizes(raw: dict[str, Any]) -> None:
    for key in _POSITIVE_INT_KEYS:
        value, largest = raw.get(key), _LARGEST_COUNT if key in _COUNT_KEYS else _LARGEST_SIZE
        if (key in raw and key in _NEVER_NULL or value is not None) and \
                (type(value) is not int or not 1 <= value <= largest):
            raise ValueError(f"config.json: '{key}' must be a positive integer of at most {largest}, got {value!r}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the stop set is built from them mid-run
        ids = raw.get(key)
        listed = ids if key == "eos_token_id" and isinstance(ids, list) else [ids]
        if ids is not None and not all(type(token) is int and token >= 0 for token in listed):
            either = ", a list of them" * (key == "eos_token_id")
            raise ValueError(f"config.json: '{key}' must be a token id (an integer >= 0){either} or null, got {ids!r:.80}")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != raw["num_hidden_layers"]
                                    or not all(isinstance(kind, str) for kind in layer_types)):
        raise ValueError(f"config.json: 'layer_types' must list an attention kind (a string) for each of the "
                         f"num_hidden_layers={raw['num_hidden_layers']} layers, got {layer_types!r:.80}")
    for key in _NUMBER_KEYS:
        value = raw.get(key)
        if value is not None and (type(value) not in (int, float) or not 0 < value < math.inf):
            raise ValueError(f"config.json: '{key}' must be a positive number, got {value!r}")
    for key in ("tie_word_embeddings", "attention_bias"):
        if not isinstance(raw.get(key, False), bool):
            raise ValueError(f"config.json: '{key}' must be true or false, got {raw[key]!r}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise ValueError(f"config.json: hidden_size={raw['hidden_size']} is not a multiple of "
                         f"num_attention_heads={heads} (and no head_dim is given)")
    if raw.get("num_experts_per_tok") and raw.get("num_local_experts") and \
            raw["num_experts_per_tok"] > raw["num_local_experts"]:
        raise ValueError(f"config.json: num_experts_per_tok={raw['num_experts_per_tok']} exceeds "
                         f"num_local_experts={raw['num_local_experts']}")


def _rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """RoPE's theta and scaling, read once from both spellings; where both are given they must agree."""
    readings = _rope_readings(raw)
    thetas = {where: theta for where, theta, _ in readings if theta is not None}
    scalings = {where: scaling for where, _, scaling in readings if scaling is not None}
    for values, what in ((thetas, "rope_theta"), (scalings, "RoPE scaling")):
        if any(value != first for first in list(values.values())[:1] for value in values.values()):
            said = "; ".join(f"{where} gives {value!r}" for where, value in values.items())
            raise ValueError(f"config.json: {what} is given twice and the two disagree ({said}); keep one spelling")
    theta = next(iter(thetas.values()), 10000.0)
    scaling = next(iter(scalings.values()), {"rope_type": "default"})
    _check_rope(theta, scaling)
    return float(theta), scaling


def _rope_readings(raw: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """(where, theta or None, scaling with its rope_type or None) for each spelling present: transformers 5.x's
    `rope_parameters`, and 4.x's top-level `rope_theta` / `rope_scaling` (None: no scaling given there)."""
    readings = []
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        readings.append(("rope_parameters", params.get("rope_theta"), _typed_scaling(scaling)))
    legacy = raw.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise ValueError(f"config.json: 'rope_scaling' must be an object or null, got {legacy!r}")
    if legacy is not None or "rope_theta" in raw:
        readings.append(("rope_theta/rope_scaling", raw.get("rope_theta"),
                         None if legacy is None else _typed_scaling(dict(legacy))))
    return readings


def _typed_scaling(scaling: dict[str, Any]) -> dict[str, Any]:
    """A scaling dict under one key for its type (`rope_type`; 4.x also wrote `type`), 'default' when absent."""
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    return {**scaling, "rope_type": rope_type}


# The fields each supported RoPE type reads, beyond theta.
_ROPE_FIELDS = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                # Multi-latent attention families only (families.load_hf_model_config): megatron's MLA computes it.
                "yarn": ("factor", "original_max_position_embeddings")}
ROPE_TYPES = tuple(_ROPE_FIELDS)


def _check_rope(theta, scaling: dict[str, Any]) -> None:
    """Refuse at conversion what training could not run: an unsupported RoPE type or missing scaling fields."""
    rope_type = scaling["rope_type"]
    if rope_type not in _ROPE_FIELDS:
        raise ValueError(
            f"config.json: rope type '{rope_type}' is not supported (supported: {', '.join(ROPE_TYPES)}); "
            "it needs attention scaling or sequence-length-dependent frequencies"
        )
    if type(theta) not in (int, float) or not 0 < theta < math.inf:
        raise ValueError(f"config.json: 'rope_theta' must be a positive number, got {theta!r}")
    for key in _ROPE_FIELDS[rope_type]:
        value = scaling.get(key)
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise ValueError(f"config.json: {rope_type} RoPE scaling needs a positive number '{key}', got {value!r}")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("config.json: llama3 RoPE scaling needs high_freq_factor > low_freq_factor")


def _partial_rotary_factor(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    top = raw.get("partial_rotary_factor")
    if nested is not None and top is not None and nested != top:
        raise ValueError(f"config.json: partial_rotary_factor is given twice and the two disagree (rope_parameters "
                         f"gives {nested!r}; the top level gives {top!r}); keep one spelling")
    factor = nested if nested is not None else top if top is not None else 1.0
    if type(factor) not in (int, float) or not 0 < factor <= 1:  # the rotated share of each head's dims
        raise ValueError(f"config.json: 'partial_rotary_factor' must be a number in (0, 1], got {factor!r}")
    return float(factor)


def context_length(config: HFModelConfig) -> int:
    """Tokens a sequence of this model may hold, as vLLM derives its max_model_len: max_position_embeddings,
    times the RoPE scaling factor for linear scaling, original_max_position_embeddings times it for yarn (whose
    max_position_embeddings some configs already extend and some do not); llama3's is already extended."""
    scaling = config.rope_scaling
    if scaling["rope_type"] == "linear":
        return int(config.max_position_embeddings * scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return int(max(config.max_position_embeddings, scaling["original_max_position_embeddings"] * scaling["factor"]))
    return config.max_position_embeddings


def rope_inv_freq(config: HFModelConfig):
    """The inverse frequencies HF uses for this config (default, linear and Llama-3 scaling).

    Megatron's own Llama-3 scaling hardcodes its factors, so the builder installs these instead.
    """
    import torch

    rope_type = config.rope_scaling["rope_type"]
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


# Model types that are encoders or encoder-decoders however their config.json is written.
_NOT_DECODER_ONLY_TYPES = frozenset({
    "albert", "bart", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra", "ernie", "longformer",
    "marian", "mbart", "modernbert", "mpnet", "mt5", "pegasus", "roberta", "t5", "umt5", "whisper", "xlm-roberta",
})
_NOT_DECODER_ONLY_ARCHITECTURES = ("ForMaskedLM", "ForConditionalGeneration", "ForPreTraining", "ForSeq2SeqLM",
                                   "ForImageTextToText", "ForVision2Seq", "EncoderModel")
_MULTIMODAL_KEYS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def check_decoder_only(raw: dict[str, Any]) -> None:
    """Refuse encoders, encoder-decoders and vision-language models, whatever family spec claims them."""
    model_type = raw.get("model_type")
    if not isinstance(raw.get("architectures") or [], list):
        raise ValueError(f"config.json: 'architectures' must be a list of class names, got {raw['architectures']!r}")
    architectures = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    reason = None
    if model_type in _NOT_DECODER_ONLY_TYPES:
        reason = "an encoder or encoder-decoder model type"
    elif raw.get("is_encoder_decoder"):
        reason = "an encoder-decoder (is_encoder_decoder is true)"
    elif any(isinstance(raw.get(key), dict) for key in _MULTIMODAL_KEYS):
        key = next(key for key in _MULTIMODAL_KEYS if isinstance(raw.get(key), dict))
        reason = f"a multimodal or encoder-decoder model (config.json has a '{key}' section)"
    elif any(a.endswith(suffix) for a in architectures for suffix in _NOT_DECODER_ONLY_ARCHITECTURES):
        reason = f"not a decoder-only language model (architectures: {', '.join(architectures)})"
    if reason:
        raise ValueError(f"model_type '{model_type}' is {reason}; only decoder-only language models are supported, "
                         "whatever a family spec declares")


def check_not_quantized(raw: dict[str, Any]) -> None:
    """Refuse quantized weights (FP8 with block scales, GPTQ, AWQ, ...): read as they are, their values are not the
    model's, and RL trains and rolls out the full-precision model."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(f"config.json has a quantization_config ({method or 'of unknown method'}): quantized "
                         "checkpoints are not supported; convert from the bf16 or fp32 weights (dequantize these "
                         "first)")
