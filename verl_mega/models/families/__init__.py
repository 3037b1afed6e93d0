"""The supported model families, looked up by HF `model_type`."""
from __future__ import annotations

from pathlib import Path

from ..hf_config import HFModelConfig
from ..spec import FamilySpec
from . import llama, mistral, mixtral, phi3, qwen2, qwen3

FAMILIES: tuple[FamilySpec, ...] = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC, phi3.SPEC, mixtral.SPEC)
_BY_MODEL_TYPE = {model_type: spec for spec in FAMILIES for model_type in spec.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_MODEL_TYPE))


def family_for(config: HFModelConfig | dict) -> FamilySpec:
    """The family spec of a config; anything else (encoders, encoder-decoders, VLMs) is refused up front."""
    model_type = config.get("model_type") if isinstance(config, dict) else config.model_type
    spec = _BY_MODEL_TYPE.get(model_type)
    if spec is None:
        raise ValueError(
            f"model_type '{model_type}' is not supported; supported decoder-only families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if isinstance(config, dict):
        return spec
    if spec.moe != bool(config.num_experts):
        raise ValueError(f"model_type '{config.model_type}' config is inconsistent: num_local_experts={config.num_experts}")
    return spec


def load_hf_model_config(hf_dir) -> tuple[HFModelConfig, FamilySpec]:
    """Read `config.json`, refusing unsupported model types before looking at any other field."""
    raw = HFModelConfig.read_raw(hf_dir)
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"must hold a JSON object, not a {type(raw).__name__}")
        family_for(raw)
        config = HFModelConfig.from_dict(raw)
        return config, family_for(config)
    except ValueError as err:
        raise ValueError(f"{Path(hf_dir) / 'config.json'}: {str(err).removeprefix('config.json: ')}") from None
