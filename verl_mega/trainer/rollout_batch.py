"""Prompts + generated responses -> the batch the roles train on (see `roles.batching` for its layout)."""
from __future__ import annotations

from typing import Sequence

import torch

from verl_mega.data.padding import pad_rows, position_ids
from verl_mega.roles.routing_replay import NOT_RECORDED, ROUTED_EXPERTS

ROLLOUT_VERSIONS = "rollout_versions"  # the batch key of each response token's weight version


def build_rollout_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        max_response_length: int, pad_token_id: int,
                        rollout_log_probs: Sequence[Sequence[float]] | None = None,
                        loss_masks: Sequence[Sequence[int] | None] | None = None,
                        routed_experts: Sequence[torch.Tensor] | None = None,
                        token_versions: Sequence[Sequence[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Prompts left-padded to the longest, responses right-padded to `max_response_length`, so each row's
    valid tokens are contiguous and the response is the last R columns. `rollout_log_probs`: the engine's
    log-prob of each response token (`SamplingParams.logprobs`), kept as `rollout_log_probs` [B, R] float32
    (0 at padding). `loss_masks`: per multi-turn response, 1 on the tokens the model sampled (None: all of
    them); the attention covers every response token, `response_mask` (what the log-probs, KL, advantages and
    losses count) only the sampled ones. `response_tokens(batch)` is every response token. `routed_experts`:
    the engine's routing of each row (`Response.routed_experts`), kept as `routed_experts` [B, L, moe_layers,
    top_k] (see `roles.routing_replay`). `token_versions`: the weight version that sampled each response token
    (`Response.token_versions`), kept as `rollout_versions` [B, R] int64 (-1 at padding) when the rows carry
    them."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = pad_rows(prompts, pad_token_id, side="left")
    response_ids, valid = pad_rows(responses, pad_token_id, side="right", width=max_response_length)
    attention_mask = torch.cat([prompt_mask, valid], dim=1)
    batch = {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "responses": response_ids,
        "response_mask": (valid if loss_masks is None or all(mask is None for mask in loss_masks)
                          else sampled_mask(loss_masks, responses, valid)),
    }
    if rollout_log_probs is not None:
        batch["rollout_log_probs"] = right_padded_values(rollout_log_probs, responses, max_response_length)
    if token_versions is not None and any(versions is not None for versions in token_versions):
        batch[ROLLOUT_VERSIONS] = version_columns(token_versions, responses, max_response_length)
    if routed_experts is not None:
        batch[ROUTED_EXPERTS] = routing_columns(routed_experts, prompts, responses, prompt_ids.shape[1],
                                                max_response_length)
    return batch


def routing_columns(routes: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]],
                    responses: Sequence[Sequence[int]], prompt_width: int, response_width: int) -> torch.Tensor:
    """Each row's routing [prompt + response - 1 tokens, moe_layers, top_k] placed in the batch's columns, the
    prompt's ending at `prompt_width` and the response's cut at `response_width`; NOT_RECORDED elsewhere (padding
    and each response's last token, which the engine never ran)."""
    if len(routes) != len(prompts):
        raise ValueError(f"{len(prompts)} responses but {len(routes)} routings")
    per_token = tuple(routes[0].shape[1:]) if routes else (0, 0)
    out = torch.full((len(prompts), prompt_width + response_width, *per_token), NOT_RECORDED, dtype=torch.int16)
    for row, (route, prompt, response) in enumerate(zip(routes, prompts, responses)):
        ran = len(prompt) + len(response) - 1
        if tuple(route.shape) != (ran, *per_token):
            raise ValueError(f"a response of {len(response)} tokens to a prompt of {len(prompt)} came with routing "
                             f"{tuple(route.shape)}; expected {(ran, *per_token)} (every token the engine ran)")
        prompt_part, response_part = route[:len(prompt)], route[len(prompt):][:response_width]
        out[row, prompt_width - len(prompt):prompt_width] = prompt_part
        out[row, prompt_width:prompt_width + len(response_part)] = response_part
    return out


def right_padded_values(values: Sequence[Sequence[float]], responses: Sequence[Sequence[int]], width: int
                        ) -> torch.Tensor:
    """One float per response token, [rows, width] float32, cut and padded (with 0) as the responses are."""
    for row, tokens in zip(values, responses):
        if len(row) != len(tokens):
            raise ValueError(f"a response of {len(tokens)} tokens came with {len(row)} log-probs")
    return pad_rows(values, 0.0, side="right", width=width, dtype=torch.float32)[0]


def version_columns(token_versions: Sequence[Sequence[int] | None], responses: Sequence[Sequence[int]],
                    width: int) -> torch.Tensor:
    """One weight version per response token, [rows, width] int64, cut as the responses are and -1 at padding;
    every row must carry them (a batch mixing tracked and untracked rows has no staleness to measure)."""
    if len(token_versions) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(token_versions)} rows of token versions")
    for versions, tokens in zip(token_versions, responses):
        if versions is None:
            raise ValueError("some responses carry token versions and others do not; a batch takes all or none")
        if len(versions) != len(tokens):
            raise ValueError(f"a response of {len(tokens)} tokens came with {len(versions)} token versions")
    return pad_rows(token_versions, -1, side="right", width=width)[0]


def sampled_mask(loss_masks: Sequence[Sequence[int] | None], responses: Sequence[Sequence[int]],
                 valid: torch.Tensor) -> torch.Tensor:
    """[B, R] 1 on the response tokens the model sampled: a row's loss mask, or every valid token without one."""
    rows = [list(mask) if mask is not None else [1] * len(tokens) for mask, tokens in zip(loss_masks, responses)]
    for row, tokens in zip(rows, responses):
        if len(row) != len(tokens):
            raise ValueError(f"a response of {len(tokens)} tokens came with a loss mask of {len(row)}")
    return pad_rows(rows, 0, side="right", width=valid.shape[1], dtype=valid.dtype)[0] * valid


def response_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, R] 1 on every response token, sampled or a multi-turn episode's tool-result tokens (the attention's
    response columns; `response_mask` is the sampled ones only)."""
    return batch["attention_mask"][:, -batch["responses"].shape[1]:]
