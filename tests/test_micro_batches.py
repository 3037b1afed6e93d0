"""Micro-batches trimmed of all-padding columns, and grouped by a token budget (pure tensor logic)."""
import pytest
import torch

from verl_mega.data.padding import pad_rows, position_ids
from verl_mega.roles.batching import micro_batches, pad_response_columns, token_budget_spans, trim_padding

PAD = 0


def left_right_batch(prompts, responses):
    """input_ids = left-padded prompts + right-padded responses, plus one per-token tensor."""
    prompt_ids, prompt_mask = pad_rows(prompts, PAD, side="left")
    response_ids, response_mask = pad_rows(responses, PAD, side="right")
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask), "responses": response_ids,
        "response_mask": response_mask.float(), "advantages": torch.arange(response_ids.numel()).view_as(
            response_ids).float(),
    }


def test_trim_drops_padding_columns_on_both_sides_and_keeps_the_response_window_aligned():
    batch = left_right_batch([[1, 2, 3, 4], [5, 6], [7]], [[8], [9, 10, 11, 12, 13], [14]])
    rows = trim_padding({key: value[1:] for key, value in batch.items()})  # prompts <= 2, responses <= 5
    assert rows["input_ids"].tolist() == [[5, 6, 9, 10, 11, 12, 13], [0, 7, 14, 0, 0, 0, 0]]
    assert rows["responses"].tolist() == rows["input_ids"][:, -5:].tolist()
    short = trim_padding({key: value[::2] for key, value in batch.items()})  # responses of 1 token
    assert short["input_ids"].tolist() == [[1, 2, 3, 4, 8], [0, 0, 0, 7, 14]]
    assert short["responses"].tolist() == [[8], [14]]
    assert short["advantages"].tolist() == [batch["advantages"][0, :1].tolist(), batch["advantages"][2, :1].tolist()]
    assert short["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]


def test_trim_keeps_one_response_column_and_the_prompt_column_before_it():
    batch = left_right_batch([[1, 2], [3]], [[], [4, 5]])
    trimmed = trim_padding({key: value[:1] for key, value in batch.items()})  # an empty response
    assert trimmed["responses"].shape == (1, 1) and trimmed["input_ids"].tolist() == [[1, 2, PAD]]
    assert pad_response_columns(torch.ones(1, 1), 4).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_token_budget_groups_consecutive_rows_within_the_budget():
    # Trimmed widths: each row alone 3, 6, 2, 2; rows 2-3 together 2 columns.
    batch = left_right_batch([[1, 2], [3], [4], [5]], [[6], [7, 8, 9, 10, 11], [12], [13]])
    assert token_budget_spans(batch["attention_mask"], batch["responses"].shape[1], 7) == [(0, 1), (1, 2), (2, 4)]
    assert token_budget_spans(batch["attention_mask"], batch["responses"].shape[1], 4) == [(0, 1), (1, 2), (2, 4)]
    assert token_budget_spans(batch["attention_mask"], batch["responses"].shape[1], 100) == [(0, 4)]
    pieces = micro_batches(batch, micro_batch_size=2, max_tokens=7)
    assert [piece["input_ids"].shape for piece in pieces] == [(1, 3), (1, 6), (2, 2)]
    assert torch.equal(torch.cat([pad_response_columns(piece["responses"], 5) for piece in pieces]),
                       batch["responses"])


def test_token_budget_needs_micro_batches_that_may_vary():
    batch = left_right_batch([[1]], [[2]])
    assert len(micro_batches(batch, micro_batch_size=1, trim=False)) == 1
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        micro_batches(batch, micro_batch_size=1, max_tokens=8, trim=False)
