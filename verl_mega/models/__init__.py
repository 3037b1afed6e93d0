from .families import FAMILIES, SUPPORTED_MODEL_TYPES, family_for, load_hf_model_config
from .hf_config import HFModelConfig
from .spec import FamilySpec, TensorRule

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "FamilySpec", "HFModelConfig", "TensorRule", "family_for", "load_hf_model_config"]
