"""Prompts + generated responses -> the batch the roles train on (see `roles.batching` for its layout)."""
from __future__ import annotations

from typing import Sequence

import torch

from verl_mega.data.padding import pad_rows, position_ids


def build_rollout_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        max_response_length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Prompts left-padded to the longest, responses right-padded to `max_response_length`, so each row's
    valid tokens are contiguous and the response is the last R columns."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = pad_rows(prompts, pad_token_id, side="left")
    response_ids, response_mask = pad_rows(responses, pad_token_id, side="right", width=max_response_length)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "responses": response_ids,
        "response_mask": response_mask,
    }
