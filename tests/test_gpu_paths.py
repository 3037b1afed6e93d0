"""Seams of the GPU training paths that run on one CPU rank: the log-prob path's memory at a real vocabulary
and the attention inputs of the transformer-engine layers."""
import dataclasses
import os

import pytest
import torch

from bench.logprob_memory import logprob_pass
from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.data.packing import pack, pack_layout
from verl_mega.data.padding import pad_rows, position_ids
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.roles.batching import response_window
from verl_mega.roles.logprobs import vocab_parallel_logprobs
from verl_mega.roles.megatron_step import forward_rows, model_rows, stage_forward

QWEN_VOCAB = 152_064


@pytest.fixture(scope="module")
def one_rank():
    init_parallel(1, 1)
    yield
    destroy_parallel()


def test_bf16_logprobs_keep_no_fp32_copy_of_the_logits(one_rank):
    """Forward and backward from bf16 logits at Qwen's vocabulary hold the logits and their gradient, both
    bf16 (4 bytes per logit): an fp32 copy kept for backward, or an fp32 gradient, would need at least 8."""
    tokens = 16
    measured = logprob_pass(tokens, hidden=32, vocab=QWEN_VOCAB)
    logits, labels, logprob, entropy = (measured[key] for key in ("logits", "labels", "logprob", "entropy"))
    logit_bytes = tokens * QWEN_VOCAB * torch.bfloat16.itemsize
    assert measured["peak"] <= 2 * logit_bytes + 2**16, (measured["peak"], logit_bytes)

    reference = torch.log_softmax(logits.double(), -1)
    want = reference.gather(-1, labels[..., None])[..., 0]
    want_entropy = -(reference.exp() * reference).sum(-1)
    assert logprob.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprob.double(), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vocabulary_padding_is_masked_in_the_model_dtype(one_rank, dtype):
    """Padded vocabulary rows take no probability, also in fp16, where -1e30 does not exist."""
    vocab, padded = 100, 128
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, padded, generator=generator).to(dtype)
    labels = torch.randint(0, vocab, (3,), generator=generator)
    logprob = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, return_entropy=False)
    want = torch.log_softmax(logits[:, :vocab].double(), -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(logprob.double(), want, rtol=0, atol=1e-5)


def left_right_batch(prompts, responses):
    """input_ids = left-padded prompts + right-padded responses (pad id 0)."""
    prompt_ids, prompt_mask = pad_rows(prompts, 0, side="left")
    response_ids, response_mask = pad_rows(responses, 0, side="right")
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {"input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask), "responses": response_ids, "response_mask": response_mask}


BATCH = left_right_batch([[11, 12, 13, 14, 15], [21, 22], [31]], [[41, 42], [51, 52, 53, 54], [61]])


def test_transformer_engine_gets_no_left_padding_and_no_mask():
    """Under the causal mask type TE's flash and cuDNN attention ignore any mask, so no real token may follow
    padding in a row it is handed."""
    rows = model_rows(BATCH, transformer_engine=True, packed=False)
    assert rows.attention_mask is None and rows.packed_seq_params is None
    valid = rows.input_ids != 0
    assert (valid.cummin(dim=1).values == valid).all(), rows.input_ids  # real tokens first, padding last
    assert valid.sum(1).tolist() == BATCH["attention_mask"].sum(1).tolist()


def test_right_aligned_rows_give_the_left_padded_rows_outputs(one_rank, tiny_models, tmp_path):
    """The TE path's rows under a causal mask alone (what TE's causal mask type computes) give the same
    response logits as the local path's left padding with its padding mask."""
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "ckpt", tp=1, pp=1)
    model, *_ = build_model_from_checkpoint(tmp_path / "ckpt", implementation="local")
    model.eval()
    with torch.no_grad():
        left_padded = stage_forward(model, BATCH)
        rows = model_rows(BATCH, transformer_engine=True, packed=False)
        width = rows.input_ids.shape[1]
        causal_only = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
        right_aligned = forward_rows(model, dataclasses.replace(rows, attention_mask=causal_only))
    valid = BATCH["response_mask"].bool()
    assert left_padded.shape == right_aligned.shape == (3, 4, left_padded.shape[-1])
    torch.testing.assert_close(right_aligned[valid], left_padded[valid], rtol=1e-5, atol=1e-5)


def test_packed_response_positions_read_the_response_window():
    """The packed path's last stage reads the response-predicting tokens straight from the packed row."""
    rows = model_rows(BATCH, transformer_engine=True, packed=True)
    layout = pack_layout(BATCH["attention_mask"])
    token_values = torch.arange(BATCH["input_ids"].numel()).view_as(BATCH["input_ids"]) + 1
    packed_values = pack(token_values, layout)  # [1, T], sequence-first flattened alike
    window = response_window(token_values, BATCH["responses"].shape[1])
    valid = BATCH["response_mask"].bool()
    got = packed_values.t().flatten()[rows.response_positions]
    assert torch.equal(got[valid], window[valid])


class OnDevice(torch.Tensor):
    """A stand-in for a tensor on the accelerator, where the roles' forward-only passes leave their outputs
    (`compute_per_token` puts them on `parallel.state.device()`): `.cpu()` gives the host copy, any other op
    stays on the device."""

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_the_on_policy_batch_mean_pass_joins_the_batch_on_the_host(one_rank, tiny_models, tmp_path, monkeypatch):
    """With rollout_is_batch_normalize and no old-log-prob pass, the actor's own log-prob pass joins the host
    batch (as old_log_probs beside the rollout's) and is left for the mismatch metrics: on a GPU it came back
    on the device, and the correction mixed CUDA and CPU tensors."""
    from verl_mega.config import OptimConfig, PolicyLossConfig, RolloutCorrectionConfig
    from verl_mega.roles.actor import Actor

    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "ckpt", tp=1, pp=1)
    correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True)
    actor = Actor(tmp_path / "ckpt", OptimConfig(lr=1e-3), PolicyLossConfig(), schedule_steps=1,
                  correction=correction)
    forward_only = actor.compute_log_prob
    monkeypatch.setattr(actor, "compute_log_prob", lambda *args, **kwargs: {
        name: value.as_subclass(OnDevice) for name, value in forward_only(*args, **kwargs).items()})
    batch_mean_weight, seen = actor._batch_mean_weight, []
    monkeypatch.setattr(actor, "_batch_mean_weight",
                        lambda batch: seen.append(type(batch["old_log_probs"])) or batch_mean_weight(batch))
    mask = BATCH["response_mask"].float()
    batch = {**BATCH, "response_mask": mask, "advantages": torch.ones_like(mask),
             "rollout_log_probs": torch.full(mask.shape, -2.0)}
    actor.update_policy(batch, ppo_epochs=1, mini_batch_size=3, micro_batch_size=3)
    assert seen == [torch.Tensor]
    assert type(actor.first_forward_log_probs) is torch.Tensor


def test_gemma2_with_transformer_engine_linears_packs_no_rows(one_rank, tiny_models, tmp_path, monkeypatch):
    """Gemma-2's TE spec keeps megatron's local (soft-capped) attention beside TE's linears, and that attention
    asserts it gets no packed_seq_params: a bf16 Gemma-2 on a GPU with transformer-engine must not pack its rows
    under `auto`, and `true` is refused in one line."""
    from verl_mega.config import ConfigError
    from verl_mega.models import builder
    from verl_mega.roles import megatron_step
    from verl_mega.roles.megatron_step import resolve_sequence_packing

    convert_hf_to_mcore(tiny_models["gemma2"], tmp_path / "ckpt", tp=1, pp=1)
    model, *_ = build_model_from_checkpoint(tmp_path / "ckpt", implementation="local", dtype="bf16")
    for module in (builder, megatron_step):  # its linears and norms are TE's
        monkeypatch.setattr(module, "uses_transformer_engine", lambda model: True)
    assert resolve_sequence_packing("auto", model, "actor.use_packed_sequences") is False
    with pytest.raises(ConfigError, match="actor.use_packed_sequences=true needs"):
        resolve_sequence_packing("true", model, "actor.use_packed_sequences")


@pytest.mark.parametrize("family_name", ["llama", "gemma2"])
def test_every_tensor_of_a_built_model_is_on_the_ranks_device(one_rank, tiny_models, monkeypatch, family_name):
    """On a GPU megatron builds its linears there, but the local spec's torch norms and Gemma-2's own norms
    (its post norms under transformer-engine's spec too) on the default device, the CPU: the builder puts the
    whole model on the rank's device (`parallel.state.device`; the meta device stands in for CUDA here)."""
    from verl_mega.models import builder
    from verl_mega.models.families import load_hf_model_config

    hf_config, family = load_hf_model_config(tiny_models[family_name])
    monkeypatch.setattr(builder, "device", lambda: torch.device("meta"), raising=False)
    config = builder.transformer_config(hf_config, family)
    model = builder.build_gpt_model(hf_config, family, config, implementation="local",
                                    padded_vocab=builder.padded_vocab_size(hf_config.vocab_size, 1))
    placed = {name: tensor.device.type for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    assert set(placed.values()) == {"meta"}, placed


@pytest.mark.parametrize("visible, local_rank, chosen", [(8, 5, 5), (1, 5, 0), (2, 3, 1)])
def test_a_rank_bound_to_its_own_gpus_picks_among_those_it_sees(monkeypatch, visible, local_rank, chosen):
    """srun --gpus-per-task gives each task its own GPU(s): a task of local rank 5 sees one, device 0. Setting
    device 5 there fails with 'invalid device ordinal' before any work."""
    from verl_mega.parallel import state

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    state.select_local_device(local_rank)
    assert picked == [chosen]


def test_the_connections_variable_is_set_before_the_first_cuda_call(monkeypatch):
    """megatron reads CUDA_DEVICE_MAX_CONNECTIONS when the CUDA context is created: a disaggregated rollout rank's
    bridge selects its device before init_parallel, so the variable is set where the device is selected."""
    from verl_mega.parallel import state

    seen = []
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")))
    state.select_local_device(0)
    assert seen == ["1"]


@pytest.mark.parametrize("before", [None, "5"])
def test_vllm_reads_the_selected_gpu_as_its_local_rank_and_the_rank_s_comes_back(monkeypatch, before):
    """vLLM's external launcher takes LOCAL_RANK as its device index; a task of local rank 5 bound to one GPU
    selected device 0 (`select_local_device`), so vLLM must read 0 there, and LOCAL_RANK is the rank's again after."""
    from verl_mega.rollout.vllm_engine import selected_device_as_local_rank

    if before is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", before)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with selected_device_as_local_rank():
        assert os.environ["LOCAL_RANK"] == "0"
    assert os.environ.get("LOCAL_RANK") == before
