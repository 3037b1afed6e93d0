"""Context parallelism's sequence split (verl_mega.parallel.context_parallel) against megatron-core's own
`get_batch_on_this_cp_rank`, its inverse, and the gather over real gloo CP groups with the gradient megatron's
data-and-context-parallel average expects."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_mega.parallel.context_parallel import gather_sequence, restore_order, sequence_multiple, split_for_rank
from verl_mega.roles.batching import pad_columns_to_multiple
from verl_mega.roles.routing_replay import ROUTED_EXPERTS

WORLD_SIZE = 4  # one CP group of 4 ranks, and two CP groups of 2


def rows(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three rows of `length` columns, as the step's micro-batches hold them."""
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (3, length), generator=generator),
            "position_ids": torch.arange(length).repeat(3, 1),
            "attention_mask": torch.ones(3, length, dtype=torch.long)}


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 5, 7, 13, 24])
def test_split_then_restore_is_the_identity_after_the_steps_padding(cp, length):
    batch = pad_columns_to_multiple(rows(length), sequence_multiple(cp))
    padded = batch["input_ids"].shape[1]
    assert padded % sequence_multiple(cp) == 0 and padded - length < sequence_multiple(cp)
    for key, tensor in batch.items():
        pieces = [split_for_rank(tensor, cp, rank) for rank in range(cp)]
        assert {piece.shape[1] for piece in pieces} == {padded // cp}
        restored = restore_order(pieces)
        assert torch.equal(restored, tensor)
        assert torch.equal(restored[:, padded - length:], rows(length)[key])  # the padding went on the left


def test_split_needs_2cp_equal_chunks():
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        split_for_rank(torch.zeros(2, 6), 2, 0)


def test_sequence_multiple():
    assert [sequence_multiple(cp) for cp in (1, 2, 3, 8)] == [1, 4, 6, 16]


def check_rank(rank: int, store_path: str) -> None:
    from megatron.core.utils import get_batch_on_this_cp_rank

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        for group in (dist.group.WORLD, pair):
            cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
            batch = pad_columns_to_multiple(rows(13, seed=rank // 2), sequence_multiple(cp))
            # megatron's attention_mask is [b, 1, s, s]; the step's [b, s] rows of 0/1 go in as a loss mask
            batch["loss_mask"] = batch.pop("attention_mask")
            megatron = get_batch_on_this_cp_rank(dict(batch), cp_group=group)
            for key, tensor in batch.items():
                assert torch.equal(split_for_rank(tensor, cp, cp_rank), megatron[key]), (cp, key)
            # megatron splits the [b, 1, s, s] mask's query dimension
            mask = torch.arange(16 * 16).view(1, 1, 16, 16)
            assert torch.equal(split_for_rank(mask, cp, cp_rank, dim=2),
                               get_batch_on_this_cp_rank({"attention_mask": mask}, cp_group=group)["attention_mask"])
            check_gather_and_loss(group, cp, cp_rank)
    finally:
        dist.destroy_process_group()


def check_gather_and_loss(group, cp: int, cp_rank: int) -> None:
    """A token-mean loss over the whole sequence, computed on each CP rank from its gathered hidden states: its
    value, and the gradients averaged over the CP ranks as megatron's DDP averages them over DP x CP (after the
    schedule's x CP on the loss), are those of one rank holding the whole sequence (fp32)."""
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(2 * sequence_multiple(cp), 3, 8, generator=generator, dtype=torch.float32)  # [s, b, h]
    labels = torch.randint(0, 5, (hidden.shape[0], 3), generator=generator)
    mask = (torch.rand(hidden.shape[:2], generator=generator) > 0.3).float()
    head = torch.nn.Linear(8, 5)
    for parameter in head.parameters():  # the same head on every rank
        torch.nn.init.normal_(parameter, generator=generator)

    def token_mean_loss(states):
        losses = torch.nn.functional.cross_entropy(head(states).flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * mask.flatten()).sum() / mask.sum()

    whole_states = hidden.clone().requires_grad_()
    whole_loss = token_mean_loss(whole_states)
    whole_loss.backward()
    whole_head_grad = head.weight.grad.clone()
    head.zero_grad()

    local = split_for_rank(hidden, cp, cp_rank, dim=0).clone().requires_grad_()
    gathered = gather_sequence(local, group, dim=0)
    assert torch.equal(gathered, hidden)  # the original order, on every rank
    loss = token_mean_loss(gathered)
    torch.testing.assert_close(loss, whole_loss, rtol=0, atol=0)
    loss.backward()  # megatron's schedule multiplies it by CP, the step divides it by CP
    head_grad = head.weight.grad.clone()
    dist.all_reduce(head_grad, group=group)
    torch.testing.assert_close(head_grad / cp, whole_head_grad)
    pieces = [torch.empty_like(local.grad) for _ in range(cp)]
    dist.all_gather(pieces, local.grad, group=group)
    torch.testing.assert_close(restore_order(pieces, dim=0) / cp, whole_states.grad)


@pytest.mark.slow
def test_split_matches_megatron_and_gather_restores_order_over_gloo(tmp_path):
    # Any assertion failing in a rank re-raises here.
    mp.spawn(check_rank, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)


def padded_rows() -> dict[str, torch.Tensor]:
    """Two rows of the step's layout, a left-padded prompt (width 4) and a right-padded response (width 3): 7
    columns, padded by the step to 8 for CP = 2. Tokens are 1 + their column so that each can be traced; each
    token's recorded experts (routing replay: 1 MoE layer, top 2) are its own id twice."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]])
    ids = (torch.arange(1, 8).repeat(2, 1) + torch.tensor([[0], [100]])) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0) * mask,
             "responses": ids[:, 4:], ROUTED_EXPERTS: ids[:, :, None, None].expand(-1, -1, 1, 2).int()}
    return pad_columns_to_multiple(batch, sequence_multiple(2))


def check_model_inputs_on_cp_rank(rank: int, port: int) -> None:
    """What the model's forward takes on each rank of a CP group of 2 (megatron's parallel_state at cp=2, gloo),
    and what the last stage's gather brings back at the response positions."""
    import os

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
    from verl_mega.roles.megatron_step import model_rows

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    layout = init_parallel(cp=2)
    try:
        assert (layout.cp, layout.cp_rank, layout.dp, current_layout().cp) == (2, rank, 1, 2)
        batch = padded_rows()
        rows = model_rows(batch, transformer_engine=True, packed=False)
        assert rows.input_ids.shape == rows.position_ids.shape == (2, 4)  # L / cp columns on each rank

        group = ps.get_context_parallel_group()
        whole_ids, whole_positions = (gather_sequence(rows.input_ids, group, dim=1),
                                      gather_sequence(rows.position_ids, group, dim=1))
        # The whole rows start at their first token (transformer-engine's causal attention, no mask): the tokens in
        # order, positions 0, 1, ..., then the padding at the end.
        real = batch["attention_mask"].sum(1)
        for row, count in enumerate(real.tolist()):
            assert torch.equal(whole_ids[row, :count], batch["input_ids"][row][batch["attention_mask"][row].bool()])
            assert torch.equal(whole_positions[row, :count], torch.arange(count))
            assert not whole_ids[row, count:].any()
        # Each rank's part is megatron's own split of the whole rows.
        megatron = get_batch_on_this_cp_rank({"tokens": whole_ids, "position_ids": whole_positions})
        assert torch.equal(rows.input_ids, megatron["tokens"])
        assert torch.equal(rows.position_ids, megatron["position_ids"])
        # The recorded routes follow their tokens, in the routers' sequence-first order.
        real_tokens = rows.input_ids.t().flatten() != 0
        assert torch.equal(rows.routed_experts[real_tokens, 0, 1].long(), rows.input_ids.t().flatten()[real_tokens])

        # The last stage gathers its sequence-first [s/cp, b, h] outputs over CP; at `response_positions` the
        # gathered rows hold the tokens that predict each response token (the column before it).
        gathered = gather_sequence(rows.input_ids.t().contiguous(), group, dim=0)
        width, response_length = batch["input_ids"].shape[1], batch["responses"].shape[1]
        predicting = batch["input_ids"][:, width - response_length - 1: width - 1]
        assert torch.equal(gathered.flatten(0, 1)[rows.response_positions], predicting)
    finally:
        destroy_parallel()


@pytest.mark.slow
def test_model_inputs_on_each_cp_rank_are_megatrons_split(tmp_path):
    from verl_mega.parallel.spawn import free_port

    mp.spawn(check_model_inputs_on_cp_rank, args=(free_port(),), nprocs=2, join=True)


def test_preflight_refuses_cp_without_transformer_engine_in_one_line(tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.trainer.preflight import preflight_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "copy: 1"}\n' * 8)
    config = load_config(None, [f"model.hf_path={make_tiny_hf_model(tmp_path / 'qwen2', 'qwen2')}",
                                f"data.train_files=[{prompts}]", "data.batch_size=4", "actor.mini_batch_size=4",
                                "critic.mini_batch_size=4", "parallel.cp=2"])
    with pytest.raises(ConfigError) as refused:
        preflight_check(config, world_size=2)
    assert str(refused.value).splitlines()[1:] == [
        "  - parallel.cp=2: context parallelism runs transformer-engine's attention (megatron-core's local attention "
        "takes context_parallel_size 1), and this machine has no transformer-engine with CUDA: set it to 1 "
        "(`verl-mega plan --memory` models it)"]


def test_preflight_refuses_cp_for_a_family_that_keeps_megatron_s_local_attention(tmp_path, monkeypatch):
    """Gemma-2's soft-capped attention is megatron's local one even beside transformer-engine's linears, and it
    asserts context_parallel_size 1 when built: refused before any process starts, where transformer-engine
    would otherwise allow CP (stood in for here; a qwen2 at the same settings passes)."""
    from verl_mega.config import ConfigError, load_config
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.trainer import preflight

    monkeypatch.setattr(preflight, "transformer_engine_available", lambda: True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "copy: 1"}\n' * 8)
    settings = [f"data.train_files=[{prompts}]", "data.batch_size=4", "actor.mini_batch_size=4",
                "critic.mini_batch_size=4", "parallel.cp=2"]
    qwen2 = load_config(None, [f"model.hf_path={make_tiny_hf_model(tmp_path / 'qwen2', 'qwen2')}", *settings])
    preflight.preflight_check(qwen2, world_size=2)
    gemma2 = load_config(None, [f"model.hf_path={make_tiny_hf_model(tmp_path / 'gemma2', 'gemma2')}", *settings])
    with pytest.raises(ConfigError) as refused:
        preflight.preflight_check(gemma2, world_size=2)
    assert str(refused.value).splitlines()[1:] == [
        "  - parallel.cp=2: gemma2's layers keep megatron's local attention (its soft cap), which runs no context "
        "parallelism: set parallel.cp=1"]


def test_the_local_layer_spec_refuses_context_parallelism(tmp_path):
    from verl_mega.config import ConfigError
    from verl_mega.models.builder import layer_spec, transformer_config
    from verl_mega.models.families import family_for
    from verl_mega.models.hf_config import HFModelConfig
    from verl_mega.models.tiny import make_tiny_hf_model

    hf_config = HFModelConfig.from_dict(HFModelConfig.read_raw(make_tiny_hf_model(tmp_path / "qwen2", "qwen2")))
    family = family_for(hf_config)
    config = transformer_config(hf_config, family, context_parallel_size=2)
    with pytest.raises(ConfigError, match="parallel.cp=2 needs transformer-engine's layers"):
        layer_spec(family, hf_config, config)


def check_step_at_cp(rank: int, port: int, hf_dir: str) -> None:
    """forward_backward over megatron's real schedule and DDP on 2 gloo ranks, as DP = 2 and then as CP = 2, of a
    model whose attention adds nothing (its output projection zeroed): the one part of the forward that would need
    transformer-engine's context-parallel attention is then per token, so both layouts must give the same loss,
    gradients and forward-only log-probs. The local layers stand in for transformer-engine's: they take its right-aligned rows with the mask
    its causal mask type applies, as in tests/test_gpu_paths.py; the context-parallel size is set after they are
    built (megatron's local attention asserts 1 at construction; the step reads it at each forward)."""
    import dataclasses
    import os

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from verl_mega.models.builder import build_gpt_model, padded_vocab_size, transformer_config
    from verl_mega.models.families import family_for
    from verl_mega.models.hf_config import HFModelConfig
    from verl_mega.parallel.state import destroy_parallel, init_parallel
    from verl_mega.roles import megatron_step
    from verl_mega.roles.actor import response_logprobs
    from verl_mega.roles.batching import dp_slice, micro_batches
    from tests.test_gpu_paths import left_right_batch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))

    def transformer_engine_rows(micro_batch, transformer_engine, packed):
        rows = model_rows(micro_batch, True, packed)
        width = rows.input_ids.shape[1]
        return dataclasses.replace(rows, attention_mask=torch.ones(width, width, dtype=torch.bool).triu(1)[None, None])

    model_rows = megatron_step.model_rows
    megatron_step.model_rows = transformer_engine_rows
    hf_config = HFModelConfig.from_dict(HFModelConfig.read_raw(hf_dir))
    family = family_for(hf_config)
    vocab = padded_vocab_size(hf_config.vocab_size, 1)
    generator = torch.Generator().manual_seed(3)
    lengths = [(5, 2), (2, 4), (1, 1), (4, 3)]  # (prompt, response) tokens of each row
    batch = left_right_batch([torch.randint(1, hf_config.vocab_size, (p,), generator=generator).tolist()
                              for p, _ in lengths],
                             [torch.randint(1, hf_config.vocab_size, (r,), generator=generator).tolist()
                              for _, r in lengths])
    seen = {}
    try:
        for cp in (1, 2):  # megatron's groups made again over the same gloo world
            layout = init_parallel(cp=cp)
            torch.manual_seed(0)
            config = transformer_config(hf_config, family)
            module = build_gpt_model(hf_config, family, config, padded_vocab=vocab, implementation="local")
            for layer in module.decoder.layers:
                layer.self_attention.linear_proj.weight.data.zero_()
            # Nor RoPE, which only the attention reads (megatron picks its CP chunks in pinned memory: CUDA only).
            module.position_embedding_type = "none"
            config.context_parallel_size = cp
            model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True), module=module)
            config.finalize_model_grads_func = finalize_model_grads
            inputs = []
            module.register_forward_pre_hook(lambda _, args: inputs.append(args[0].shape))

            def loss_fn(output, micro_batch, share):
                mask = micro_batch["response_mask"]
                logprobs = response_logprobs(output, micro_batch, hf_config.vocab_size, False)
                loss = -(logprobs * mask).sum() / mask.sum().clamp_min(1) * share.loss
                return loss, {"loss": loss}

            loss = megatron_step.forward_backward(model, batch, 2, "token-mean", ["loss"], loss_fn)["loss"]
            # Each forward takes this CP rank's part of its micro-batch, padded to a multiple of 2 x CP columns.
            pieces = micro_batches(dp_slice(batch, layout.dp_rank, layout.dp), 2,
                                   columns_multiple_of=sequence_multiple(cp))
            assert inputs == [(2, piece["input_ids"].shape[1] // cp) for piece in pieces]
            # The forward-only pass (the rollout's and the reference's log-probs) gives the whole batch on every rank.
            log_probs = megatron_step.compute_per_token(
                model, batch, 2, ["log_probs"],
                lambda output, micro_batch: {"log_probs": response_logprobs(output, micro_batch, hf_config.vocab_size,
                                                                            False)})["log_probs"]
            seen[cp] = loss, log_probs, {name: param.main_grad.clone() for name, param in model.named_parameters()
                                         if "linear_proj" not in name}
    finally:
        destroy_parallel()
    (loss, log_probs, grads), (cp_loss, cp_log_probs, cp_grads) = seen[1], seen[2]
    assert cp_loss == pytest.approx(loss, rel=1e-6)
    assert cp_log_probs.shape == log_probs.shape == batch["responses"].shape
    torch.testing.assert_close(cp_log_probs, log_probs, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(cp_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_the_step_at_cp_2_gives_the_losses_and_gradients_of_dp_2(tmp_path):
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.spawn import free_port

    hf_dir = make_tiny_hf_model(tmp_path / "llama", "llama")
    mp.spawn(check_step_at_cp, args=(free_port(), str(hf_dir)), nprocs=2, join=True)
