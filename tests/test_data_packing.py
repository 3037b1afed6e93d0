"""Padding-free THD packing (verl_mega/data/packing.py): layout, round trips, and per-token results equal to
the padded path's. Runs on CPU; the GPU path feeds the same packed rows to transformer-engine's attention."""
import pytest
import torch

from verl_mega.config import ConfigError
from verl_mega.data.packing import pack, pack_layout, unpack
from verl_mega.data.padding import pad_rows, position_ids
from verl_mega.roles.batching import causal_padding_mask
from verl_mega.roles.megatron_step import resolve_sequence_packing

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
RESPONSES = [[1, 2], [3, 4, 5, 6], [7], [8, 9, 10]]


def rollout_rows():
    """A rollout micro-batch's layout: left-padded prompts followed by right-padded responses."""
    prompt_ids, prompt_mask = pad_rows(PROMPTS, 0, side="left")
    response_ids, response_mask = pad_rows(RESPONSES, 0, side="right")
    return (torch.cat([prompt_ids, response_ids], dim=1), torch.cat([prompt_mask, response_mask], dim=1),
            torch.cat([torch.zeros_like(prompt_mask), response_mask], dim=1))


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_layout_cu_seqlens_and_positions(multiple_of):
    input_ids, attention_mask, _ = rollout_rows()
    layout = pack_layout(attention_mask, multiple_of)
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    padded = [-(-n // multiple_of) * multiple_of for n in lengths]
    assert layout.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert layout.cu_seqlens_padded.tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert layout.cu_seqlens.dtype == layout.cu_seqlens_padded.dtype == torch.int32
    assert layout.total == sum(padded) and layout.max_seqlen == max(padded)
    packed_ids = pack(input_ids, layout)
    positions = layout.position_ids()
    assert packed_ids.shape == positions.shape == (1, sum(padded))
    for row, start in enumerate(layout.cu_seqlens_padded[:-1].tolist()):
        run = PROMPTS[row] + RESPONSES[row]
        assert packed_ids[0, start:start + len(run)].tolist() == run
        assert packed_ids[0, start + len(run):start + padded[row]].tolist() == [0] * (padded[row] - len(run))
        assert positions[0, start:start + padded[row]].tolist() == list(range(padded[row]))
    # The padded layout numbers a row's valid tokens the same way.
    valid = pack(attention_mask, layout).bool()
    assert torch.equal(pack(position_ids(attention_mask), layout)[valid], positions[valid])


@pytest.mark.parametrize("multiple_of", [1, 3])
def test_round_trip_keeps_valid_tokens_and_zeroes_padding(multiple_of):
    input_ids, attention_mask, response_mask = rollout_rows()
    layout = pack_layout(attention_mask, multiple_of)
    values = torch.randn(*input_ids.shape, 5)
    back = unpack(pack(values, layout), layout)
    assert back.shape == values.shape
    assert torch.equal(back, values * attention_mask[..., None])
    # Loss masks survive packing: the same tokens count, in the same order.
    packed_mask = pack(response_mask, layout)
    assert packed_mask.sum() == response_mask.sum()
    assert torch.equal(pack(input_ids, layout)[packed_mask.bool()], input_ids[response_mask.bool()])
    assert torch.equal(unpack(packed_mask, layout), response_mask)
    assert torch.equal(unpack(pack(input_ids, layout), layout, fill=-1)[attention_mask == 0],
                       torch.full((int((attention_mask == 0).sum()),), -1))


def test_rows_with_gaps_and_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"rows \[1\] have gaps"):
        pack_layout(torch.tensor([[0, 1, 1], [1, 0, 1]]))
    layout = pack_layout(torch.tensor([[0, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="do not match"):
        pack(torch.zeros(2, 4), layout)
    with pytest.raises(ValueError, match="do not match"):
        unpack(torch.zeros(1, layout.total + 1), layout)


def causal_attention(hidden, positions, blocked):
    """A one-head attention whose queries and keys depend on the token positions: [1|B, T, d] -> same.
    `blocked` [B, 1, T, T] is True where a query may not see a key."""
    torch.manual_seed(0)
    q_proj, k_proj, v_proj = (torch.randn(hidden.shape[-1], hidden.shape[-1]) for _ in range(3))
    position_table = torch.randn(64, hidden.shape[-1])
    with_positions = hidden + position_table[positions]
    scores = (with_positions @ q_proj) @ (with_positions @ k_proj).transpose(-1, -2)
    scores = scores.masked_fill(blocked[:, 0], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num()  # fully blocked (padding) queries see nothing
    return weights @ (hidden @ v_proj)


def varlen_causal_mask(cu_seqlens_padded):
    """What THD attention computes: causal within each run, nothing across runs. [1, 1, T, T]."""
    lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    run = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    total = len(run)
    future = torch.ones(total, total, dtype=torch.bool).triu(1)
    return (future | (run[:, None] != run[None, :]))[None, None]


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_packed_per_token_results_equal_the_padded_path(multiple_of):
    input_ids, attention_mask, response_mask = rollout_rows()
    embedding = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    hidden = embedding[input_ids].requires_grad_()
    padded_out = causal_attention(hidden, position_ids(attention_mask), causal_padding_mask(attention_mask))

    layout = pack_layout(attention_mask, multiple_of)
    packed_hidden = pack(hidden, layout)
    packed_out = causal_attention(packed_hidden, layout.position_ids(), varlen_causal_mask(layout.cu_seqlens_padded))
    back = unpack(packed_out, layout)
    valid = attention_mask.bool()
    torch.testing.assert_close(back[valid], padded_out[valid])
    assert torch.count_nonzero(back[~valid]) == 0
    # The per-token losses (a response-masked sum here) and their gradients agree too.
    (padded_grad,) = torch.autograd.grad((padded_out.sum(-1) * response_mask).sum(), hidden)
    (packed_grad,) = torch.autograd.grad((back.sum(-1) * response_mask).sum(), hidden)
    # Sums of ~10 summed in another order: fp32 agrees to a few ulps of the sum, not of each term (rtol 1e-5; a
    # wrong mask moves a gradient by O(1)).
    torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-5, atol=1e-5)


def test_packing_setting_without_transformer_engine_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))  # no transformer-engine module: megatron's local spec
    assert resolve_sequence_packing("auto", model, "actor.use_packed_sequences") is False
    assert resolve_sequence_packing("False", model, "actor.use_packed_sequences") is False
    with pytest.raises(ConfigError, match=r"actor.use_packed_sequences=true needs transformer-engine"):
        resolve_sequence_packing("True", model, "actor.use_packed_sequences")
    with pytest.raises(ConfigError, match=r"critic.use_packed_sequences='yes' must be one of auto, true, false"):
        resolve_sequence_packing("yes", model, "critic.use_packed_sequences")
