"""Prompts + generated responses -> the batch the roles train on (see `roles.batching` for its layout)."""
from __future__ import annotations

from typing import Sequence

import torch


def build_rollout_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        max_response_length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Prompts left-padded to the longest, responses right-padded to `max_response_length`, so each row's
    valid tokens are contiguous and the response is the last R columns."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    width = max(len(p) for p in prompts)
    rows = len(prompts)
    prompt_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)
    response_ids = torch.full((rows, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_response_length), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        prompt_ids[row, width - len(prompt):] = torch.tensor(list(prompt))
        prompt_mask[row, width - len(prompt):] = 1
        response = list(response)[:max_response_length]
        if response:
            response_ids[row, :len(response)] = torch.tensor(response)
            response_mask[row, :len(response)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": response_ids,
        "response_mask": response_mask,
    }
