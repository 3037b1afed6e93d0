"""LoRA adapters (verl_mega.models.lora): the layers against y = W x + (alpha/r) B A x, forward and backward, in
both TP splits; the first forward is the base model's; adapters off is the base model bitwise; the base weights
get no gradient buffers and no optimizer state; bad configs fail in one line."""
from __future__ import annotations

import math
import re

import pytest
import torch

from verl_mega.config import LoraConfig
from verl_mega.models.lora import (
    COLUMN, ROW, adapters_disabled, apply_lora, config_problems, initial_a, lora_modules, lora_parameters, lora_scale,
    merged_weight,
)

from tests.workers.lora_worker import ALPHA, DROPOUT, HIDDEN, JOB_STEPS, QKV, RANK, TwoLinears, full_tensors
from test_layout_invariance import LAYOUTS, LOGPROB_ATOL, REL_TOL, assert_within_bf16_rounding, rel_diff


@pytest.fixture(scope="module")
def one_rank():
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def lora(rank=4, **fields) -> LoraConfig:
    return LoraConfig(rank=rank, **fields)


def with_random_b(model) -> None:
    """B is zero at first: a random B makes the adapters' term visible."""
    generator = torch.Generator().manual_seed(7)
    for name, param in lora_parameters(model):
        if name.endswith("lora_b"):
            param.data.copy_(torch.randn(param.shape, generator=generator))


def reference_linear(x, weight, a, b, scale, mask=None):
    """y = W x + scale * B A (mask x): `mask` the adapters' dropout (scaled by 1 / (1 - p)), None for none."""
    dropped = x if mask is None else x * mask
    return x @ weight.t() + scale * (dropped @ a.t()) @ b.t()


@pytest.mark.parametrize("target", ["linear_qkv", "linear_proj"])
def test_layer_matches_the_reference_forward_and_backward(one_rank, target):
    torch.manual_seed(0)
    model = TwoLinears()
    apply_lora(model, lora(targets=[target], alpha=6.0))
    with_random_b(model)
    module = getattr(model, target)
    x = torch.randn(3, 2, module.weight.shape[1], requires_grad=True)
    out, _ = module(input_=x) if target == "linear_qkv" else module(x)  # by keyword too, as a caller may
    a, b = (p.detach().clone().requires_grad_() for p in (module.lora_a, module.lora_b))
    x_ref = x.detach().clone().requires_grad_()
    expected = reference_linear(x_ref, module.weight.detach(), a, b, 6.0 / 4)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(module.lora_a.grad, a.grad)
    torch.testing.assert_close(module.lora_b.grad, b.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert module.weight.grad is None and not module.weight.requires_grad


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_first_forward_is_the_base_models(one_rank, init):
    torch.manual_seed(0)
    model = TwoLinears()
    x = torch.randn(3, 2, 12)
    base = model(x)
    apply_lora(model, lora(init=init))
    assert torch.equal(model(x), base)
    assert all(not param.any() for name, param in lora_parameters(model) if name.endswith("lora_b"))
    assert all(param.abs().sum() > 0 for name, param in lora_parameters(model) if name.endswith("lora_a"))


class NormFusedLinear(torch.nn.Module):
    """Stands in for transformer-engine's TELayerNormColumnParallelLinear (the GPU spec's linear_qkv / linear_fc1):
    the layer's input norm inside the linear, its output (y, bias) as megatron's wrapper returns it."""

    def __init__(self, normalization: str, zero_centered_gamma: bool):
        super().__init__()
        generator = torch.Generator().manual_seed(11)
        self.weight = torch.nn.Parameter(torch.randn(20, 12, generator=generator))
        self.layer_norm_weight = torch.nn.Parameter(torch.rand(12, generator=generator) + 0.5)
        bias = torch.randn(12, generator=generator)
        self.layer_norm_bias = torch.nn.Parameter(bias) if normalization == "LayerNorm" else None
        self.normalization, self.zero_centered_gamma, self.eps = normalization, zero_centered_gamma, 1e-5

    def normed(self, x):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return torch.nn.functional.rms_norm(x, (12,), gamma, self.eps)
        return torch.nn.functional.layer_norm(x, (12,), gamma, self.layer_norm_bias, self.eps)

    def forward(self, x):
        return self.normed(x) @ self.weight.t(), None


NormFusedLinear.__name__ = "TELayerNormColumnParallelLinear"
NormFusedLinear.__module__ = "megatron.core.extensions.transformer_engine"


@pytest.mark.parametrize("normalization, zero_centered", [("RMSNorm", False), ("LayerNorm", True)])
def test_transformer_engines_norm_fused_linear_adapts_the_normalised_input(one_rank, normalization, zero_centered):
    model = torch.nn.Module()
    model.linear_qkv = NormFusedLinear(normalization, zero_centered)
    apply_lora(model, lora(targets=["linear_qkv"]))
    with_random_b(model)
    layer = model.linear_qkv
    assert [(info.name, info.kind) for info in lora_modules(model)] == [("linear_qkv", COLUMN)]
    x = torch.randn(3, 2, 12)
    normed = layer.normed(x).detach()
    expected = reference_linear(normed, layer.weight.detach(), layer.lora_a.detach(), layer.lora_b.detach(), 2.0)
    torch.testing.assert_close(layer(x)[0], expected)


class RowParallelLinearOfTE(torch.nn.Module):
    """Stands in for transformer-engine's row-parallel linear (its class name and module) on a CPU."""


RowParallelLinearOfTE.__name__ = "TERowParallelLinear"
RowParallelLinearOfTE.__module__ = "megatron.core.extensions.transformer_engine"


def test_a_post_normed_transformer_engine_linear_is_row_parallel():
    """Gemma-2's TE spec subclasses TE's row-parallel linear (`gemma2_layers.PostNormed`): its o_proj and
    down_proj take adapters as the local spec's do, where the exact class name was refused on a GPU."""
    from verl_mega.models.gemma2_layers import PostNormed
    from verl_mega.models.lora import parallel_kind

    post_normed = PostNormed(RowParallelLinearOfTE)
    assert parallel_kind(post_normed.__new__(post_normed)) == ROW


def test_gemma2_post_normed_linears_adapt_before_their_norm(one_rank, tmp_path):
    """Gemma-2's o_proj and down_proj normalise their output (sandwich norms): the adapters add to the linear's
    own output, so the adapted layer computes what its merged weight does (the rollout's and the export's)."""
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "gemma2", num_hidden_layers=1)
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    model, *_ = build_model_from_checkpoint(tmp_path / "ckpt", implementation="local")
    apply_lora(model, lora(targets=["linear_proj", "linear_fc2"]))
    with_random_b(model)
    infos = lora_modules(model)
    assert len(infos) == 2
    with torch.no_grad():
        for info in infos:
            layer = model.get_submodule(info.name)
            x = torch.randn(3, 1, layer.weight.shape[1])
            merged = merged_weight(layer.weight, layer.lora_a, layer.lora_b, info.scale)
            torch.testing.assert_close(layer(x)[0], layer.post_layernorm(x @ merged.t()))


def test_initialisation_follows_peft(one_rank):
    kaiming = initial_a(lora(rank=8), 400, "a")
    assert kaiming.abs().max() <= 1 / math.sqrt(400) and kaiming.abs().max() > 0.9 / math.sqrt(400)
    gaussian = initial_a(lora(rank=8, init="gaussian"), 4000, "a")
    assert abs(gaussian.std().item() - 1 / 8) < 0.005
    assert torch.equal(initial_a(lora(), 10, "layer.3"), initial_a(lora(), 10, "layer.3"))
    assert not torch.equal(initial_a(lora(), 10, "layer.3"), initial_a(lora(), 10, "layer.4"))


def test_adapters_disabled_is_the_base_model_bitwise(one_rank):
    torch.manual_seed(0)
    model = TwoLinears()
    x = torch.randn(3, 2, 12)
    base = model(x)
    apply_lora(model, lora())
    with_random_b(model)
    adapted = model(x)
    assert not torch.allclose(adapted, base)
    with adapters_disabled(model):
        assert torch.equal(model(x), base)
    assert torch.equal(model(x), adapted)


def test_merged_weight_gives_the_adapted_forward(one_rank):
    torch.manual_seed(0)
    model = TwoLinears(dtype=torch.bfloat16)
    apply_lora(model, lora(alpha=2.0))
    with_random_b(model)
    for info in lora_modules(model):
        module = getattr(model, info.name)
        merged = merged_weight(module.weight, module.lora_a, module.lora_b, info.scale)
        assert merged.dtype == torch.bfloat16
        expected = module.weight.float() + info.scale * module.lora_b.float() @ module.lora_a.float()
        assert torch.equal(merged, expected.to(torch.bfloat16))
    assert [(i.name, i.kind, i.scale) for i in lora_modules(model)] == [("linear_qkv", COLUMN, 0.5),
                                                                       ("linear_proj", ROW, 0.5)]


def test_scale_defaults_to_two():
    assert lora_scale(lora(rank=16)) == 2.0
    assert lora_scale(lora(rank=16, alpha=8.0)) == 0.5


@pytest.mark.parametrize("fields, message", [
    ({"rank": -1}, "lora.rank must be >= 0 (0: no adapters), got -1"),
    ({"targets": ["q_proj"]}, "lora.targets: q_proj unknown; known: linear_qkv"),
    ({"targets": []}, "lora.targets is empty"),
    ({"init": "xavier"}, "lora.init 'xavier' is unknown; known: kaiming, gaussian"),
    ({"dropout": 1.0}, "lora.dropout must be in [0, 1), got 1.0"),
    ({"alpha": 0.0}, "lora.alpha must be > 0 (null: 2 x rank), got 0.0"),
])
def test_bad_configs_fail_in_one_line(one_rank, fields, message):
    config = lora(**{"rank": 4, **fields})
    assert config_problems(config, "lora")[0].startswith(message)
    with pytest.raises(ValueError, match="^" + re.escape(message)) as error:
        apply_lora(TwoLinears(), config)
    assert "\n" not in str(error.value)


def test_a_rank_that_does_not_fit_and_a_missing_target_are_refused(one_rank):
    model = TwoLinears()
    with pytest.raises(ValueError, match=r"^lora.rank=13 does not fit linear_qkv \(20 x 12 on each of 1 TP ranks\): "
                                         "use a rank of at most 12$"):
        apply_lora(model, lora(rank=13))
    assert all(param.requires_grad for param in model.parameters()) and not any(True for _ in lora_parameters(model))
    with pytest.raises(ValueError, match="^lora.targets: the model has none of linear_fc1$"):
        apply_lora(TwoLinears(), lora(targets=["linear_fc1"]))


# --- the roles: a LoRA actor trains its adapters alone; its reference is its own base ---------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora_roles")
    hf_dir = make_tiny_hf_model(root / "hf", "qwen2", num_hidden_layers=2)
    convert_hf_to_mcore(hf_dir, root / "ckpt")
    return root / "ckpt"


def tiny_batch(vocab_size: int = 300) -> dict:
    from tests.workers.roles_worker import fixed_batch

    batch = fixed_batch(vocab_size, pad_id=0)
    generator = torch.Generator().manual_seed(3)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=generator)
    return batch


def lora_actor(ckpt, rank=4):
    from verl_mega.config import OptimConfig
    from verl_mega.roles.actor import Actor

    return Actor(ckpt, OptimConfig(lr=1e-2), schedule_steps=2, lora=lora(rank=rank))


def optimizer_state_numel(optimizer) -> int:
    """Elements of every tensor of Adam's state (moments; fp32 main copies where the model is 16-bit)."""
    return sum(value.numel() for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               for state in inner.optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.dim() > 0)


def test_only_the_adapters_get_gradient_buffers_and_optimizer_state(one_rank, tiny_ckpt):
    actor = lora_actor(tiny_ckpt)
    adapters = sum(param.numel() for _, param in lora_parameters(actor.model))
    everything = sum(param.numel() for param in actor.model.parameters())
    # 2 layers x 4 targets, rank 4: qkv (4 x 64 + 128 x 4), proj (4 x 64 + 64 x 4), fc1 (4 x 64 + 256 x 4),
    # fc2 (4 x 128 + 64 x 4)
    assert adapters == 2 * (768 + 512 + 1280 + 768)
    assert [name for name, param in actor.model.named_parameters() if param.requires_grad] == [
        f"module.{name}" for name, _ in lora_parameters(actor.model)]
    buffered = sum(param.numel() for buffer in actor.trainable.model.buffers for param in buffer.params)
    assert buffered == adapters
    actor.update_policy(tiny_batch(), ppo_epochs=1, mini_batch_size=8, micro_batch_size=4)
    assert optimizer_state_numel(actor.trainable.optimizer) == 2 * adapters  # Adam's two moments
    assert adapters < everything / 10
    # The base stayed as loaded, the adapters moved.
    assert all(param.grad is None for name, param in actor.model.named_parameters() if not param.requires_grad)
    assert all(param.any() for name, param in lora_parameters(actor.model) if name.endswith("lora_b"))


def test_the_reference_of_a_lora_actor_is_its_base_with_no_second_copy(one_rank, tiny_ckpt):
    from verl_mega.roles.reference import AdaptersOffReference, Reference, reference_of

    batch = tiny_batch()
    full = Reference(tiny_ckpt).compute_ref_log_prob(batch, 4)
    actor = lora_actor(tiny_ckpt)
    reference = reference_of(actor, tiny_ckpt)
    assert isinstance(reference, AdaptersOffReference)
    actor_storage = {param.data_ptr() for param in actor.model.parameters()}
    assert {param.data_ptr() for param in reference.model.parameters()} == actor_storage
    assert torch.equal(reference.compute_ref_log_prob(batch, 4), full)
    actor.update_policy(batch, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4)
    assert not torch.equal(actor.compute_log_prob(batch, 4)["log_probs"], full)
    assert torch.equal(reference.compute_ref_log_prob(batch, 4), full)


def test_a_full_parameter_actor_keeps_a_reference_of_its_own(one_rank, tiny_ckpt):
    from verl_mega.config import OptimConfig
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.reference import Reference, reference_of

    actor = Actor(tiny_ckpt, OptimConfig(), schedule_steps=1)
    assert isinstance(reference_of(actor, tiny_ckpt), Reference)
    assert all(param.requires_grad for param in actor.model.parameters())


def test_a_lora_critic_trains_its_adapters_and_its_whole_value_head(one_rank, tiny_ckpt):
    from verl_mega.config import OptimConfig
    from verl_mega.roles.critic import Critic

    critic = Critic(tiny_ckpt, OptimConfig(), schedule_steps=1, lora=lora())
    trained = [name for name, param in critic.model.named_parameters() if param.requires_grad]
    adapters = [f"module.{name}" for name, _ in lora_parameters(critic.model)]
    assert sorted(trained) == sorted(adapters + ["module.output_layer.weight", "module.output_layer.bias"])


def test_experts_as_one_grouped_gemm_are_refused_in_one_line(one_rank):
    model = TwoLinears()
    model.experts = type("GroupedMLP", (torch.nn.Module,), {})()
    with pytest.raises(ValueError, match=r"^lora.targets: experts computes its experts as one grouped GEMM "
                                         r"\(moe_grouped_gemm\), which takes no adapters; drop linear_fc1, linear_fc2"):
        apply_lora(model, lora())
    assert not any(True for _ in lora_parameters(model))  # nothing half-applied


# --- the pre-flight check -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def preflight_inputs(tmp_path_factory):
    import json

    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora_preflight")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"copy: {i}"}) for i in range(8)))
    return {"prompts": prompts, **{family: make_tiny_hf_model(root / family, family, num_hidden_layers=2)
                                   for family in ("qwen2", "deepseek_v3")}}


def preflight_lines(inputs, family: str, *overrides: str) -> list[str]:
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={inputs[family]}", f"data.train_files=[{inputs['prompts']}]",
                                "parallel.tp=2", "data.batch_size=4", "actor.mini_batch_size=4",
                                "critic.mini_batch_size=4", *overrides])
    try:
        preflight_check(config, world_size=2)
    except ConfigError as error:
        return [line.removeprefix("  - ") for line in str(error).splitlines()[1:]]
    return []


@pytest.mark.parametrize("overrides, expected", [
    (["actor.lora.rank=33"], "actor.lora.rank=33 does not fit decoder.layers.{layer}.self_attention.linear_proj.weight "
                             "(64 x 32 on each of parallel.tp=2 ranks): use a rank of at most 32"),
    (["critic.lora.rank=4", "critic.lora.init=xavier"],
     "critic.lora.init 'xavier' is unknown; known: kaiming, gaussian"),
    (["actor.lora.rank=4", "actor.lora.targets=[linear_qkv,o_proj]"],
     "actor.lora.targets: o_proj unknown; known: linear_qkv, linear_proj, linear_fc1, linear_fc2"),
    (["actor.lora.rank=-2"], "actor.lora.rank must be >= 0 (0: no adapters), got -2"),
])
def test_the_preflight_check_names_each_bad_lora_key(preflight_inputs, overrides, expected):
    assert preflight_lines(preflight_inputs, "qwen2", *overrides) == [expected]


def test_the_preflight_check_takes_the_widest_rank_that_fits(preflight_inputs):
    assert preflight_lines(preflight_inputs, "qwen2", "actor.lora.rank=32", "critic.lora.rank=32") == []


def test_the_preflight_check_refuses_a_target_the_family_lacks(preflight_inputs):
    assert preflight_lines(preflight_inputs, "deepseek_v3", "parallel.tp=1", "actor.lora.rank=4") == [
        "actor.lora.targets: linear_qkv: the deepseek_v3 family has no such layer; drop it from the targets"]


# --- at TP 2 and at every layout (the layout grids' launches, tests/workers/lora_worker.py) ---------------------------

def tp2_layers(grid, name: str) -> list[dict]:
    return [torch.load(grid / "lora" / f"layers_tp{rank}.pt")[name] for rank in range(2)]


def assert_tp2_layer_is_the_tp1_one(ranks: list[dict], name: str, mask=None) -> None:
    """The two TP ranks' outputs and gradients of layer `name` (qkv: column-, proj: row-parallel), put together,
    against y = W x + (alpha/r) B A (mask x) on the whole tensors."""
    full = full_tensors()
    column = name == "qkv"
    a = ranks[0]["a"] if column else torch.cat([rank["a"] for rank in ranks], dim=1)
    target = "linear_qkv" if column else "linear_proj"
    assert torch.equal(a, initial_a(lora(rank=RANK), a.shape[1], target))  # sliced from the one draw
    x = full[f"{name}.x"].clone().requires_grad_()
    a, b = a.clone().requires_grad_(), full[f"{name}.b"].clone().requires_grad_()
    expected = reference_linear(x, full[f"{name}.weight"], a, b, ALPHA / RANK, mask)
    expected.backward(full[f"{name}.grad"])
    if column:  # the output and B split by rows; A and x whole on each rank
        torch.testing.assert_close(torch.cat([rank["out"] for rank in ranks], dim=-1), expected.detach())
        torch.testing.assert_close(torch.cat([rank["b_grad"] for rank in ranks], dim=0), b.grad)
        for rank in ranks:
            torch.testing.assert_close(rank["a_grad"], a.grad)
            torch.testing.assert_close(rank["x_grad"], x.grad)
    else:  # A and x split by input columns; the output and B whole on each rank
        torch.testing.assert_close(torch.cat([rank["a_grad"] for rank in ranks], dim=-1), a.grad)
        torch.testing.assert_close(torch.cat([rank["x_grad"] for rank in ranks], dim=-1), x.grad)
        for rank in ranks:
            torch.testing.assert_close(rank["out"], expected.detach())
            torch.testing.assert_close(rank["b_grad"], b.grad)
    assert x.shape[-1] == (HIDDEN if column else QKV)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qkv", "proj"])
def test_layers_at_tp2_match_the_reference_forward_and_backward(layout_grid, name):
    """Column (qkv: B and the output split) and row (proj: A and the input split) parallel, put together."""
    assert_tp2_layer_is_the_tp1_one(tp2_layers(layout_grid, name), name)


def dropout_mask(rng_state: torch.Tensor, shape) -> torch.Tensor:
    """The mask (kept elements scaled by 1 / (1 - p)) that dropout draws for a tensor of `shape` from a generator
    in `rng_state`."""
    generator = torch.Generator().set_state(rng_state)
    return torch.empty(shape).bernoulli_(1 - DROPOUT, generator=generator) / (1 - DROPOUT)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qkv", "proj"])
def test_dropout_at_tp2_is_one_tp1_mask_drawn_as_megatron_draws_its_own(layout_grid, name):
    """Column-parallel (replicated input): both TP ranks draw the same mask, from the generator they share.
    Row-parallel (split input): each rank draws its slice's mask from the model-parallel RNG tracker, seeded per
    rank, so the slices' masks are independent. Either way the layer at TP 2 computes the TP 1 layer with the
    mask the ranks' masks make (the same drawn twice, or the slices side by side)."""
    ranks = tp2_layers(layout_grid, f"dropout_{name}")
    x = full_tensors()[f"{name}.x"]
    if name == "qkv":
        masks = [dropout_mask(rank["rng"], x.shape) for rank in ranks]
        assert torch.equal(masks[0], masks[1])
        mask = masks[0]
    else:
        masks = [dropout_mask(rank["tracker_rng"], (*x.shape[:-1], x.shape[-1] // 2)) for rank in ranks]
        assert not torch.equal(masks[0], masks[1])
        mask = torch.cat(masks, dim=-1)
    assert 0 < (mask == 0).sum() < mask.numel()
    assert_tp2_layer_is_the_tp1_one(ranks, name, mask)


def lora_results(grid, model: str, layouts) -> dict:
    """(tp, pp, dp) -> the last stage's results of lora_worker's update of `model` at `layouts` ((tp, pp, dp, ep)),
    weights merged over the stages."""
    merged = {}
    for tp, pp, dp, ep in layouts:
        stages = [torch.load(grid / "lora" / f"{model}_tp{tp}pp{pp}ep{ep}dp{dp}_stage{stage}.pt")
                  for stage in range(pp)]
        stages[-1]["weights"] = {name: tensor for stage in stages for name, tensor in stage["weights"].items()}
        merged[(tp, pp, dp)] = stages[-1]
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("model, layouts", [
    ("qwen2", [(*layout, 1) for layout in LAYOUTS]), ("mixtral", [(1, 1, 1, 1), (1, 1, 2, 2)]),
], ids=["dense", "moe_ep2"])
def test_one_lora_update_is_layout_invariant(layout_grid, model, layouts):
    """The dense model at every layout of the role grid; the MoE model's experts (their adapters too) split over
    two expert-parallel ranks."""
    results = lora_results(layout_grid, model, layouts)
    reference = results[(1, 1, 1)]
    mask = reference["response_mask"].bool()
    for layout, result in results.items():
        # The adapters-off reference is the base model, before and after the update, bitwise.
        assert torch.equal(result["reference_after"], result["reference"]), layout
        torch.testing.assert_close(result["reference"][mask], reference["reference"][mask], rtol=0,
                                   atol=LOGPROB_ATOL)
        for name in ("pg_loss", "entropy", "kl_loss", "grad_norm"):
            assert rel_diff(result["metrics"][name], reference["metrics"][name]) <= REL_TOL, (layout, name)
        assert abs(result["metrics"]["ppo_kl"] - reference["metrics"]["ppo_kl"]) <= 2 * LOGPROB_ATOL
        assert result["weights"].keys() == reference["weights"].keys()
        worst = max(rel_diff(result["weights"][name], tensor) for name, tensor in reference["weights"].items())
        print(f"{layout}: max rel diff of the effective weights W + sBA {worst:.2e}")
        assert worst <= REL_TOL
        for before, after in zip(reference["critic_metrics"], result["critic_metrics"]):
            assert rel_diff(after["vf_loss"], before["vf_loss"]) <= REL_TOL, layout
    # The update moved the adapted layers' effective weights, and nothing else.
    from safetensors.torch import load_file

    hf_dir = layout_grid / "roles" / "hf" if model == "qwen2" else layout_grid / "offline" / "hf" / model
    base = load_file(hf_dir / "model.safetensors")
    adapted = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
               "up_proj.weight", "down_proj.weight", "w1.weight", "w2.weight", "w3.weight")
    for name, tensor in reference["weights"].items():
        assert torch.equal(tensor, base[name].float()) != name.endswith(adapted), name


@pytest.mark.slow
def test_one_bf16_lora_update_is_layout_invariant_within_bf16_rounding(layout_grid):
    """In bf16 the adapters are bf16 parameters, like the base weights whose GEMMs they join, and the optimizer
    steps fp32 main copies of them (megatron's mixed-precision optimizer, as Megatron-Bridge and NeMo have it):
    TP 2 agrees with TP 1 within the role grid's bf16 rules, and the adapters-off reference is the bf16 base,
    bitwise, before and after the update."""
    results = lora_results(layout_grid, "qwen2_bf16", [(1, 1, 1, 1), (2, 1, 1, 1)])
    reference, result = results[(1, 1, 1)], results[(2, 1, 1)]
    for outcome in results.values():
        assert outcome["dtypes"] == {"adapters": {torch.bfloat16}, "optimizer": {torch.float32}}
        assert torch.equal(outcome["reference_after"], outcome["reference"])
    assert_within_bf16_rounding(result, reference, "metrics", "bf16 LoRA at TP 2")


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_the_offline_jobs_train_lora_adapters_on_two_ranks(layout_grid, job):
    """The SFT job at TP 2 and the DPO job at DP 2 (distributed optimizer), built as the trainer builds them, in the
    layout grid's 2-process launch (lora_worker.run_jobs): the loss falls, every adapter moves and nothing else
    trains, the base stays bitwise as loaded, and DPO's reference is the actor's own model with its adapters off:
    its first step, where the adapters are still the base's, scores every pair at zero margin (loss ln 2)."""
    import json

    jobs = layout_grid / "lora" / "jobs"
    records = [json.loads(line) for line in (jobs / job / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, JOB_STEPS + 1))
    losses = [record["sft/loss" if job == "sft" else "preference/loss"] for record in records]
    assert losses[-1] < min(losses[:2]), losses  # the same batch at every step
    if job == "dpo":
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
        assert records[0]["preference/rewards/accuracy"] == 0.0
    for rank in range(2):
        record = torch.load(jobs / f"{job}_rank{rank}.pt")
        assert record["base_count"] > 0 and record["base_changed"] == [], record["base_changed"][:3]
        assert record["adapters"] and record["adapters_moved"] == record["adapters"]
        assert record["trained"] == record["adapters"]
        if job == "dpo":
            assert record["reference_is_adapters_off"] and record["reference_storage_is_the_actors"]
