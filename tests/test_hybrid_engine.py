"""HybridEngine regroup under real gloo processes: bit-exact rollout slices for every training layout and
rollout TP size, fresh weights after a training step, measured peak within the planner's figure, and greedy
generation of the embedded engine equal to transformers on the exported weights.

The layouts of one world size (and the expert-parallel case) share one torchrun launch of tests/workers/hybrid_worker.py,
checked in turn; a failed case fails the tests of its launch with the worker's message, which names the case."""
from __future__ import annotations

import subprocess

import pytest

from verl_mega.parallel.spawn import run_torchrun

FAMILIES = ("llama", "qwen2", "mixtral")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# 8 heads over 4 query groups so that TP=4 holds whole groups and GQA is still exercised; multi-latent attention
# has as many key/value heads as query heads.
TEST_SIZES = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
FAMILY_SIZES = {"deepseek_v3": dict(num_key_value_heads=8)}
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)]  # (TP, PP, DP) of the dense families
GREEDY_LAYOUT = (2, 2, 1)  # where the embedded engine's greedy generation is also compared
LORA_LAYOUT = (2, 1, 1)  # where a model with LoRA adapters streams merged weights (rollout TP 1 and 2)
LORA_FAMILIES = ("llama", "qwen2")
EP_LAYOUT = (1, 1, 2)  # (TP, PP, EP) of the MoE families: expert parallel over 2 ranks


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hybrid_models")
    return {family: make_tiny_hf_model(root / family, family, **{**TEST_SIZES, **FAMILY_SIZES.get(family, {})})
            for family in {*FAMILIES, *MOE_FAMILIES}}


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
    if (tp, pp, dp) == LORA_LAYOUT:
        args += [arg for family in LORA_FAMILIES for arg in ("--lora", family)]
    return args + (_greedy_exports(root, tp, pp, 1, FAMILIES) if (tp, pp, dp) == GREEDY_LAYOUT else [])


def expert_parallel_group(hybrid_models, root) -> list[str]:
    """EP_LAYOUT's worker arguments: the MoE families, each generating greedily from the gathered experts."""
    tp, pp, ep = EP_LAYOUT
    args = ["--tp", str(tp), "--pp", str(pp), *_converted(hybrid_models, root, tp, pp, ep=ep, families=MOE_FAMILIES)]
    return args + _greedy_exports(root, tp, pp, ep, MOE_FAMILIES)


def _greedy_exports(root, tp: int, pp: int, ep: int, families) -> list[str]:
    """--greedy arguments: each family's checkpoint at (TP, PP, EP) exported to HF, for transformers' greedy."""
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

    args = []
    for family in families:
        exported = convert_mcore_to_hf(root / f"{family}_tp{tp}_pp{pp}_ep{ep}", root / f"{family}_export_ep{ep}")
        args += ["--greedy", f"{family}={exported}"]
    return args


@pytest.fixture(scope="module")
def outcomes(hybrid_models, tmp_path_factory) -> dict:
    """(TP, PP, DP) of each of LAYOUTS, and EP_LAYOUT -> None where its layout group passed, else why not: the end
    of its launch's output for the group the launch failed in (the worker's message names the case), "not run"
    for the groups after it. One launch per world size runs that size's groups in turn (`--next` between them)."""
    from tests.workers.hybrid_worker import GROUP_DONE

    root = tmp_path_factory.mktemp("hybrid")
    launches: dict[int, list[tuple]] = {}
    for tp, pp, dp in LAYOUTS:
        launches.setdefault(tp * pp * dp, []).append(((tp, pp, dp), layout_group(hybrid_models, root, tp, pp, dp)))
    tp, pp, ep = EP_LAYOUT
    launches.setdefault(tp * pp * ep, []).append((EP_LAYOUT, expert_parallel_group(hybrid_models, root)))
    outcomes = {}
    for world, groups in launches.items():
        args = [arg for index, (_, group) in enumerate(groups) for arg in [*(["--next"] if index else []), *group]]
        try:
            run_torchrun(world, "tests.workers.hybrid_worker", args, capture_output=True)
            output, failure = None, None
        except subprocess.CalledProcessError as failed:
            output = failed.stdout or ""
            failure = f"{failed}\n{output[-2000:]}\n{(failed.stderr or '')[-4000:]}"
        for index, (key, _) in enumerate(groups):
            if failure is None or GROUP_DONE.format(index=index) in output:
                outcomes[key] = None
            elif index == 0 or GROUP_DONE.format(index=index - 1) in output:
                outcomes[key] = failure  # the group its launch failed in
            else:
                outcomes[key] = "not run: its launch failed in an earlier layout group"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_regroup_matches_checkpoint_slices(outcomes, tp, pp, dp):
    """At LORA_LAYOUT the LoRA families also stream their adapters merged, equal to hand-merged weights."""
    assert outcomes[(tp, pp, dp)] is None, outcomes[(tp, pp, dp)]


@pytest.mark.slow
def test_regroup_gathers_experts_over_expert_parallel_ranks(outcomes):
    """Each MoE family then generates greedily as transformers does from its export; DeepSeek-V3's router's expert
    bias (a buffer, not a parameter) is streamed too."""
    assert outcomes[EP_LAYOUT] is None, outcomes[EP_LAYOUT]
