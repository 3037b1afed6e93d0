import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "gemma2", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> folder of a tiny random HF model (with the tiny tokenizer), built once per session."""
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {family: make_tiny_hf_model(root / family, family) for family in FAMILIES}
