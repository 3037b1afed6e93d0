"""HybridEngine regroup under real gloo processes: bit-exact rollout slices for every training layout and
rollout TP size, fresh weights after a training step, measured peak within the planner's figure, and greedy
generation of the embedded engine equal to transformers on the exported weights.

The layouts of one world size (and the expert-parallel case) share one torchrun launch of tests/hybrid_worker.py,
checked in turn; a failed case fails the tests of its launch with the worker's message, which names the case."""
from __future__ import annotations

import subprocess

import pytest

from verl_mega.parallel.spawn import run_torchrun

FAMILIES = ("llama", "qwen2", "mixtral")
MOE_FAMILIES = ("mixtral", "qwen2_moe")
# 8 heads over 4 query groups so that TP=4 holds whole groups and GQA is still exercised.
TEST_SIZES = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)]  # (TP, PP, DP) of the dense families
GREEDY_LAYOUT = (2, 2, 1)  # where the embedded engine's greedy generation is also compared
EP_LAYOUT = (1, 1, 2)  # (TP, PP, EP) of the MoE families: expert parallel over 2 ranks


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hybrid_models")
    return {family: make_tiny_hf_model(root / family, family, **TEST_SIZES) for family in {*FAMILIES, *MOE_FAMILIES}}


def _converted(hybrid_models, root, tp: int, pp: int, ep: int = 1, families=FAMILIES) -> list[str]:
    """The worker's --case arguments, each family converted once per (TP, PP, EP) under `root`."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    cases = []
    for family in families:
        ckpt = root / f"{family}_tp{tp}_pp{pp}_ep{ep}"
        if not ckpt.exists():
            convert_hf_to_mcore(hybrid_models[family], ckpt, tp=tp, pp=pp, ep=ep)
        cases += ["--case", f"{family},{hybrid_models[family]},{ckpt},{ep}"]
    return cases


def layout_group(hybrid_models, root, tp: int, pp: int, dp: int) -> list[str]:
    """One layout's worker arguments: the dense families, and at GREEDY_LAYOUT their exports to generate from."""
    args = ["--tp", str(tp), "--pp", str(pp), *_converted(hybrid_models, root, tp, pp)]
    if (tp, pp, dp) == GREEDY_LAYOUT:
        from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

        for family in FAMILIES:
            exported = convert_mcore_to_hf(root / f"{family}_tp{tp}_pp{pp}_ep1", root / f"{family}_export")
            args += ["--greedy", f"{family}={exported}"]
    return args


@pytest.fixture(scope="module")
def launches(hybrid_models, tmp_path_factory) -> dict[int, str]:
    """world size -> the end of its launch's output where it failed (absent where it passed); one launch per world
    size runs that size's layouts in turn (`--next` between them)."""
    root = tmp_path_factory.mktemp("hybrid")
    groups: dict[int, list[list[str]]] = {}
    for tp, pp, dp in LAYOUTS:
        groups.setdefault(tp * pp * dp, []).append(layout_group(hybrid_models, root, tp, pp, dp))
    tp, pp, ep = EP_LAYOUT
    groups.setdefault(tp * pp * ep, []).append(
        ["--tp", str(tp), "--pp", str(pp), *_converted(hybrid_models, root, tp, pp, ep=ep, families=MOE_FAMILIES)])
    failures = {}
    for world, layouts in groups.items():
        args = [arg for index, group in enumerate(layouts) for arg in [*(["--next"] if index else []), *group]]
        try:
            run_torchrun(world, "tests.hybrid_worker", args, capture_output=True)
        except subprocess.CalledProcessError as failed:
            failures[world] = f"{failed}\n{(failed.stdout or '')[-2000:]}\n{(failed.stderr or '')[-4000:]}"
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_regroup_matches_checkpoint_slices(launches, tp, pp, dp):
    assert tp * pp * dp not in launches, launches.get(tp * pp * dp)


@pytest.mark.slow
def test_regroup_gathers_experts_over_expert_parallel_ranks(launches):
    tp, pp, ep = EP_LAYOUT
    assert tp * pp * ep not in launches, launches.get(tp * pp * ep)
