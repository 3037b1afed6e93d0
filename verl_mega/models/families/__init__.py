"""The supported model families, looked up by HF `model_type`; others come from outside the package."""
from __future__ import annotations

from pathlib import Path

from ..external_families import HOW_TO_DECLARE, import_family_spec, plugin_family, recorded_family_spec
from ..hf_config import HFModelConfig, check_decoder_only, check_not_quantized, context_length
from ..spec import FamilySpec
from . import deepseek_v3, gemma2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe

FAMILIES: tuple[FamilySpec, ...] = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC, phi3.SPEC, mixtral.SPEC,
                                    qwen2_moe.SPEC, gemma2.SPEC, qwen3_moe.SPEC, deepseek_v3.SPEC)
_BY_MODEL_TYPE = {model_type: spec for spec in FAMILIES for model_type in spec.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_MODEL_TYPE))


def family_for(config: HFModelConfig | dict, family_spec: str | None = None,
               data_dir: str | Path | None = None, recorded: bool = False) -> FamilySpec:
    """The family spec of a config: `family_spec` ("package.module:SPEC") when given, else the built-in family or
    an installed plugin for its model_type. `recorded`: `family_spec` comes from a checkpoint's manifest, so it is
    imported only if the user or a plugin names it too (external_families). Encoders, encoder-decoders and VLMs
    are refused up front. `data_dir` is the folder the config came from; no spec is imported from it."""
    raw = config if isinstance(config, dict) else config.raw
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"config.json: 'model_type' must name a model type (a string), got {model_type!r}")
    if family_spec is not None:
        spec = (recorded_family_spec if recorded else import_family_spec)(family_spec, data_dir)
    else:
        spec = _BY_MODEL_TYPE.get(model_type) or (plugin_family(model_type, data_dir) if isinstance(model_type, str) else None)
    if spec is None:
        raise ValueError(
            f"model_type '{model_type}' is not supported; supported decoder-only families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}; for another decoder-only family, {HOW_TO_DECLARE}"
        )
    if model_type not in spec.model_types:
        raise ValueError(f"family spec '{family_spec}' declares model types {', '.join(spec.model_types)}, but "
                         f"config.json says model_type '{model_type}'")
    check_decoder_only(raw)
    check_not_quantized(raw)
    if isinstance(config, dict):
        return spec
    if spec.moe != bool(config.num_experts):
        raise ValueError(f"model_type '{config.model_type}' config is inconsistent: num_local_experts={config.num_experts}")
    # Here, not only where config.json is read: a manifest's config (checkpoints, exports) comes through too.
    if config.rope_scaling["rope_type"] == "yarn" and not spec.mla:
        raise ValueError(f"rope type 'yarn' is not supported for {spec.name}, only for the "
                         "multi-latent attention families (deepseek_v3)")
    _check_activation(raw, spec)
    if config.attention_bias and not spec.qkv_bias:  # Qwen2's q/k/v biases are its own; transformers reads no key
        raise ValueError(f"config.json: {spec.name} 'attention_bias' must be false: in transformers it biases o_proj "
                         "as well as q/k/v, and megatron's attention output projection takes a bias only with the "
                         "MLP's")
    if spec.unmodelled_window is not None:
        spec.unmodelled_window(config)  # a window that is not a positive integer or null is refused here
    if spec.check_config is not None:
        spec.check_config(config)
    return spec


def _check_activation(raw: dict, spec: FamilySpec) -> None:
    """The MLP's activation: megatron would run the family's own whatever config.json names."""
    key = next((key for key in ("hidden_activation", "hidden_act") if raw.get(key) is not None), None)
    if key is not None and raw[key] not in spec.activations:
        raise ValueError(f"config.json: {key} {raw[key]!r} is not supported for {spec.name} (supported: "
                         f"{', '.join(spec.activations)})")


def sequence_limit(config: HFModelConfig, family: FamilySpec) -> tuple[int, str]:
    """The most tokens a sequence of this model may hold here, and what in config.json sets it: its context as vLLM
    derives it, or a sliding window narrower than that which transformers and vLLM apply and megatron here does
    not (past it the two would score different models)."""
    context = context_length(config)
    window = family.unmodelled_window(config) if family.unmodelled_window is not None else None
    if window is not None and window < context:
        return window, (f"sliding window of {window} (sliding_window in its config.json: transformers and vLLM attend "
                        f"over that many keys, this project's {family.name} model attends in full)")
    return context, (f"context of {context} (max_position_embeddings in its config.json, scaled as vLLM scales it by "
                     "rope_scaling)")


def load_hf_model_config(hf_dir, family_spec: str | None = None) -> tuple[HFModelConfig, FamilySpec]:
    """Read `config.json`, refusing unsupported model types before looking at any other field."""
    raw = HFModelConfig.read_raw(hf_dir)
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"must hold a JSON object, not a {type(raw).__name__}")
        family_for(raw, family_spec, hf_dir)
        config = HFModelConfig.from_dict(raw)
        family = family_for(config, family_spec, hf_dir)
        for rule in family.rules:  # the sizes a family's own tensors read from config.json, checked here
            if rule.shape is not None:
                rule.shape(config)
        family.moe_layer_pattern(config)  # and which layers are MoE
        return config, family
    except ValueError as err:
        raise ValueError(f"{Path(hf_dir) / 'config.json'}: {str(err).removeprefix('config.json: ')}") from None
