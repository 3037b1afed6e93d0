"""HybridEngine regroup under real gloo processes: bit-exact rollout slices for every training layout and
rollout TP size, fresh weights after a training step, measured peak within the planner's figure, and greedy
generation of the embedded engine equal to transformers on the exported weights."""
from __future__ import annotations

import pytest

from verl_mega.parallel.spawn import run_torchrun

FAMILIES = ("llama", "qwen2", "mixtral")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
# 8 heads over 4 query groups so that TP=4 holds whole groups and GQA is still exercised; multi-latent attention
# has as many key/value heads as query heads.
TEST_SIZES = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
FAMILY_SIZES = {"deepseek_v3": dict(num_key_value_heads=8)}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hybrid_models")
    return {family: make_tiny_hf_model(root / family, family, **{**TEST_SIZES, **FAMILY_SIZES.get(family, {})})
            for family in {*FAMILIES, *MOE_FAMILIES}}


def _converted(hybrid_models, tmp_path, tp: int, pp: int, ep: int = 1, families=FAMILIES) -> list[str]:
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    cases = []
    for family in families:
        ckpt = tmp_path / f"{family}_tp{tp}_pp{pp}_ep{ep}"
        convert_hf_to_mcore(hybrid_models[family], ckpt, tp=tp, pp=pp, ep=ep)
        cases += ["--case", f"{family},{hybrid_models[family]},{ckpt},{ep}"]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)])
def test_regroup_matches_checkpoint_slices(hybrid_models, tmp_path, tp, pp, dp):
    args = ["--tp", str(tp), "--pp", str(pp), *_converted(hybrid_models, tmp_path, tp, pp)]
    if (tp, pp, dp) == (2, 2, 1):
        from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

        for family in FAMILIES:
            exported = convert_mcore_to_hf(tmp_path / f"{family}_tp{tp}_pp{pp}_ep1", tmp_path / f"{family}_export")
            args += ["--greedy", f"{family}={exported}"]
    run_torchrun(tp * pp * dp, "tests.hybrid_worker", args)


@pytest.mark.slow
def test_regroup_gathers_experts_over_expert_parallel_ranks(hybrid_models, tmp_path):
    """DeepSeek-V3 also generates greedily as transformers does from the export: its router's expert bias (a
    buffer, not a parameter) is streamed too."""
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

    args = ["--tp", "1", "--pp", "1", *_converted(hybrid_models, tmp_path, 1, 1, ep=2, families=MOE_FAMILIES)]
    exported = convert_mcore_to_hf(tmp_path / "deepseek_v3_tp1_pp1_ep2", tmp_path / "deepseek_v3_export")
    run_torchrun(2, "tests.hybrid_worker", [*args, "--greedy", f"deepseek_v3={exported}"])
