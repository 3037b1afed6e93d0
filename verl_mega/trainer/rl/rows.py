"""Per-row values of the RL step: the prompts' fields, one row per response, rows taken and joined, and the
batch of tensors built from rows and their responses. Pure functions of their arguments."""
from __future__ import annotations

import torch

from verl_mega.data.prompts import PromptDataset
from verl_mega.rollout.engine import EpisodeInfo, Response

from ..rollout_batch import build_rollout_batch

PROMPT_FIELDS = ("raw_prompt", "reward_model", "data_source", "extra_info")  # what the reward and samples read


def prompt_rows(dataset: PromptDataset, indices: list[int]) -> dict:
    """The prompts `indices` of the dataset: their token ids, indices and the fields the reward reads."""
    items = [dataset[i] for i in indices]
    return {"input_ids": [item["input_ids"] for item in items], "index": list(indices),
            **{key: [item.get(key) for item in items] for key in PROMPT_FIELDS}}


def one_row_per_response(prompts: dict[str, list], n: int) -> dict[str, list]:
    """Each prompt's fields repeated for its `n` samples, in the order the engine returns the responses."""
    return {key: [value for value in values for _ in range(n)] for key, values in prompts.items()}


def with_episodes(rows: dict, responses: list[Response]) -> dict:
    """Multi-turn rows: each row's episode, and its prompt as the episode rendered it (with the tools' schemas);
    single-turn rows as they are."""
    if not responses or responses[0].episode is None:
        return rows
    episodes: list[EpisodeInfo] = [response.episode for response in responses]
    return {**rows, "input_ids": [episode.prompt_ids for episode in episodes], "episode": episodes}


def rollout_routing(responses: list[Response]) -> list[torch.Tensor] | None:
    """The responses' routed experts, where the engine recorded them (see `Response.routed_experts`)."""
    routes = [response.routed_experts for response in responses]
    return None if any(route is None for route in routes) else routes


def responses_batch(rows: dict, responses: list[Response], max_response_length: int, pad_token_id: int,
                    log_probs: bool = True) -> dict:
    """The batch of `rows`' prompts and their responses (with the engine's log-probs, multi-turn episodes' loss
    masks, and the routing where the engine recorded it)."""
    return build_rollout_batch(rows["input_ids"], [r.token_ids for r in responses], max_response_length,
                               pad_token_id, [r.logprobs for r in responses] if log_probs else None,
                               [r.loss_mask for r in responses], rollout_routing(responses),
                               [r.token_versions for r in responses])


def take_rows(rows, index):
    """The rows `index` of per-row values: a tensor's, a list's, or each of a dict's values."""
    if isinstance(rows, torch.Tensor):
        return rows[torch.as_tensor(list(index), dtype=torch.long)]
    if isinstance(rows, dict):
        return {key: take_rows(values, index) for key, values in rows.items()}
    if isinstance(rows, list):
        return [rows[i] for i in index]
    raise TypeError(f"{type(rows).__name__} is not a per-row value")


def concat_rows(parts: list):
    """Per-row values of several parts (tensors, lists, or dicts of them) one after the other."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {key: concat_rows([part[key] for part in parts]) for key in first}
    if isinstance(first, list):
        return [row for part in parts for row in part]
    raise TypeError(f"{type(first).__name__} is not a per-row value")
