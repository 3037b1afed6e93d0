"""Routing replay (R3): the embedded engine records each token's experts, the batch carries them in its token
columns, every slicing of the tokens (micro-batches, trimming, rotation, packing) slices them alike, and the
actor's forwards route as the rollout did.

The end-to-end case builds a tiny Mixtral whose routers have near-ties on purpose (expert 2's router row is
expert 1's plus a 1e-7 perturbation): transformers' forward and megatron's differ by fp32 rounding, enough to
pick the other one of the pair for some tokens. Without replay the trainer's log-probs then differ from the
rollout's where it does; with replay they agree within rounding. The layouts (EP, TP, PP) are checked in
test_offline_layout_invariance's launches.
"""
import json

import pytest
import torch

from verl_mega.config import ConfigError, load_config
from verl_mega.roles.batching import micro_batches
from verl_mega.roles.megatron_step import model_rows
from verl_mega.roles.routing_replay import NOT_RECORDED, RolloutRoutes, moe_layer_numbers
from verl_mega.rollout.engine import SamplingParams
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.rollout_batch import build_rollout_batch

LAYERS, TOP_K = 3, 2


def token_routes(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Routing that names its token: [B, L, LAYERS, TOP_K] holding the token id (and layer, slot) at every
    valid column, NOT_RECORDED at padding."""
    code = input_ids[..., None, None] * 100 + torch.arange(LAYERS)[:, None] * 10 + torch.arange(TOP_K)
    return code.masked_fill(~attention_mask.bool()[..., None, None], NOT_RECORDED).to(torch.int32)


def routed_batch() -> dict:
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[11, 12], [13, 14, 15, 16], [17]]
    batch = build_rollout_batch(prompts, responses, 5, 0)
    batch["routed_experts"] = token_routes(batch["input_ids"], batch["attention_mask"])
    return batch


def test_rollout_routing_is_placed_in_the_token_columns():
    prompts, responses = [[5, 6, 7], [8]], [[11, 12], [13, 14, 15, 16, 17, 18]]
    routes = [torch.arange(len(p) + len(r) - 1, dtype=torch.int16)[:, None, None].expand(-1, LAYERS, TOP_K)
              for p, r in zip(prompts, responses)]
    batch = build_rollout_batch(prompts, responses, 4, 0, routed_experts=routes)
    columns = batch["routed_experts"][..., 0, 0].tolist()
    # Prompt tokens end at column 3; the last response token (never run) and padding hold no record; the second
    # response is cut at 4 tokens with its routing.
    assert columns == [[0, 1, 2, 3, -1, -1, -1], [-1, -1, 0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="came with routing"):
        build_rollout_batch(prompts, responses, 4, 0, routed_experts=[routes[0][:-1], routes[1]])


def test_micro_batches_slice_the_routing_with_their_tokens():
    batch = routed_batch()
    for pieces in (micro_batches(batch, 1), micro_batches(batch, 1, trim=False), micro_batches(batch, 1, max_tokens=10)):
        assert sum(len(piece["input_ids"]) for piece in pieces) == 3
        for piece in pieces:
            assert torch.equal(piece["routed_experts"], token_routes(piece["input_ids"], piece["attention_mask"]))


@pytest.fixture(scope="module")
def one_rank():
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


@pytest.mark.parametrize("transformer_engine, packed", [(False, False), (True, False), (False, True)],
                         ids=["padded", "right_aligned", "packed"])
def test_model_rows_order_the_routing_as_the_router_sees_tokens(one_rank, transformer_engine, packed):
    batch = routed_batch()
    rows = model_rows(batch, transformer_engine, packed)
    # The router flattens megatron's sequence-first [s, b'] tokens; token id 0 is padding.
    tokens = rows.input_ids.t().reshape(-1)
    valid = tokens != 0
    assert valid.sum() == batch["attention_mask"].sum()
    assert torch.equal(rows.routed_experts[valid, 1, 1], tokens[valid] * 100 + 11)
    assert (rows.routed_experts[~valid] == NOT_RECORDED).all()


def top_k(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k, dim=-1)


def test_replay_takes_the_recorded_tokens_and_counts_changed_sets():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    target = torch.tensor([[1, 0], [3, 2], [NOT_RECORDED, NOT_RECORDED]])  # same set, another set, no record
    router = RolloutRoutes(0, replay=True)
    router.target = target
    probs, chosen = router.get_replay_topk(scores, 2, default_compute_topk=top_k)
    assert chosen.tolist() == [[1, 0], [3, 2], [0, 1]]
    assert torch.equal(probs, scores.gather(1, chosen))
    assert (int(router.mismatched), int(router.recorded)) == (1, 2)
    observed = RolloutRoutes(0, replay=False)
    observed.target = target
    assert observed.get_replay_topk(scores, 2, default_compute_topk=top_k)[1].tolist() == [[0, 1]] * 3
    assert (int(observed.mismatched), int(observed.recorded)) == (1, 2)


def test_moe_layers_are_numbered_over_all_stages():
    class Config:
        num_layers, moe_layer_freq = 4, 1

    assert moe_layer_numbers(Config) == [1, 2, 3, 4]
    Config.moe_layer_freq = [1, 0, 1, 1]
    assert moe_layer_numbers(Config) == [1, 3, 4]


def test_embedded_engine_records_the_routing_of_a_full_forward(tiny_models):
    from transformers import AutoModelForCausalLM

    from verl_mega.rollout.embedded import EmbeddedEngine
    from verl_mega.rollout.routing import RouterRecorder

    hf_dir = tiny_models["qwen2_moe"]  # layer 1 dense: three MoE layers
    engine = EmbeddedEngine(json.loads((hf_dir / "config.json").read_text()), device="cpu")
    engine.model.load_state_dict(AutoModelForCausalLM.from_pretrained(hf_dir).state_dict())
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=6, n=2, seed=0, routed_experts=True, stop_token_ids=tuple(range(40, 90)))
    responses = engine.generate(prompts, params)
    assert len({len(r.token_ids) for r in responses}) > 1, "want rows that stop at different steps"
    for response in responses:
        ran = prompts[response.prompt_index] + response.token_ids[:-1]
        with torch.no_grad(), RouterRecorder(engine.model) as recorder:
            engine.model(input_ids=torch.tensor([ran]))
            full = recorder.take(1, len(ran))[0]
        assert response.routed_experts.shape == (len(ran), 3, 2)
        assert torch.equal(response.routed_experts.sort(-1).values, full.sort(-1).values)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=300, max_position_embeddings=256)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])),
    ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16)),
])
def test_routers_of_other_moe_families_are_found_without_family_code(model_type, extra):
    """transformers names each family's router class; the recorder needs no verl_mega family spec."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_mega.rollout.routing import RouterRecorder

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **extra})).eval()
    with torch.no_grad(), RouterRecorder(model) as recorder:
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]))
        routes = recorder.take(2, 3)
    assert routes.shape == (2, 3, 2, 2)  # one of the three layers dense
    assert len({tuple(expert) for expert in routes.reshape(-1, 2).sort(-1).values.tolist()}) > 1


def test_recording_a_dense_model_is_refused(tiny_models):
    from verl_mega.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(json.loads((tiny_models["qwen2"] / "config.json").read_text()), device="cpu")
    with pytest.raises(ValueError, match="no MoE router to record"):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, routed_experts=True))


@pytest.mark.parametrize("model, overrides, problem", [
    ("qwen2", [], "actor.router_replay=rollout replays the routing of MoE layers and model.hf_path"),
    ("mixtral", ["rollout.engine=vllm"], "actor.router_replay=rollout: rollout.engine=vllm runs vLLM here"),
    ("mixtral", ["actor.router_replay=R3"], "actor.router_replay 'R3' is unknown; known: off, rollout"),
])
def test_preflight_refuses_replay_it_cannot_run(tiny_models, prompt_file, model, overrides, problem):
    config = load_config(None, [f"model.hf_path={tiny_models[model]}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                "actor.router_replay=rollout", *overrides])
    with pytest.raises(ConfigError) as refused:
        preflight_check(config, world_size=1)
    lines = str(refused.value).splitlines()[1:]
    assert len(lines) == 1 and problem in lines[0], lines


@pytest.fixture(scope="module")
def near_tie_rollout(tmp_path_factory, one_rank):
    """A tiny Mixtral with router near-ties, converted; the embedded engine's responses with their routing."""
    from transformers import AutoModelForCausalLM

    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.rollout.embedded import EmbeddedEngine

    root = tmp_path_factory.mktemp("near_ties")
    hf_dir = make_tiny_hf_model(root / "hf", "mixtral", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            rows = layer.mlp.gate.weight
            rows[2] = rows[1] + 1e-7 * torch.randn(rows.shape[1], generator=generator)
    model.save_pretrained(hf_dir)
    convert_hf_to_mcore(hf_dir, root / "ckpt", tp=1, pp=1, ep=1)
    engine = EmbeddedEngine(json.loads((hf_dir / "config.json").read_text()), device="cpu")
    engine.model.load_state_dict(model.state_dict())
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21]]
    responses = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=2, seed=0, logprobs=True,
                                                        routed_experts=True))
    batch = build_rollout_batch([prompts[r.prompt_index] for r in responses], [r.token_ids for r in responses], 12,
                                0, [r.logprobs for r in responses], routed_experts=[r.routed_experts for r in responses])
    return root / "ckpt", batch


def test_replayed_log_probs_equal_the_rollout_s_and_differ_without(near_tie_rollout):
    from verl_mega.config import OptimConfig
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.reference import Reference

    ckpt, batch = near_tie_rollout
    mask = batch["response_mask"].bool()
    gaps, mismatch = {}, {}
    for setting in ("off", "rollout"):
        actor = Actor(ckpt, OptimConfig(), schedule_steps=1, router_replay=setting)
        log_probs = actor.compute_log_prob(batch, 4)["log_probs"].cpu()
        gaps[setting] = (log_probs - batch["rollout_log_probs"])[mask].abs().max().item()
        # The update's metric: the old-log-prob pass's, measured with or without replay.
        mismatch[setting] = actor._pass_router_mismatch
    print(f"max |trainer - rollout| log-prob: {gaps}; router mismatch: {mismatch}")
    assert gaps["rollout"] < 1e-5
    assert gaps["off"] > 1e-2
    # The reference (the same weights here) replays too.
    reference = Reference(ckpt, router_replay="rollout").compute_ref_log_prob(batch, 4).cpu()
    assert (reference - batch["rollout_log_probs"])[mask].abs().max() < 1e-5
    assert 0 < mismatch["off"] < 0.5 and 0 < mismatch["rollout"] < 0.5
