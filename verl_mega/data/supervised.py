"""SFT and preference rows, tokenized and checked at load time so a bad row is refused before start-up.

SFT rows hold `messages` (a multi-turn chat; the loss covers every assistant turn) or `prompt` + `response`.
Preference rows hold `prompt`, `chosen`, `rejected` (strings or assistant chat messages, as verl and TRL read
them); KTO rows hold `prompt`, `completion`, `label` (true = desirable). With a chat template each example is
rendered by it; without one, a string prompt is encoded as is and the completion gets EOS appended.

Every example is split into prompt tokens and response tokens, the layout the roles train on: the prompt is
everything before the first assistant turn, cut to `max_prompt_length` by `truncation` like a PPO prompt; the
response is the rest, cut on the right to `max_response_length` ("error" refuses both instead). Problems name
the file and the row; with `skip_invalid` the row is counted and skipped instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

from verl_mega.data.prompts import as_messages, encode_chat, truncate_prompt, unknown_role
from verl_mega.data.tables import read_rows

MESSAGES_KEY = "messages"
RESPONSE_KEY = "response"
PAIR_KEYS = ("chosen", "rejected")
KTO_KEYS = ("completion", "label")


@dataclass(frozen=True)
class Limits:
    max_prompt_length: int
    max_response_length: int
    truncation: str


@dataclass(frozen=True)
class SFTExample:
    prompt: list[int]
    response: list[int]
    loss_mask: list[int]  # per response token: 1 on the assistant's tokens


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with its completions: (chosen, rejected) for pairs, (completion,) with `desirable` for KTO."""

    prompt: list[int]
    completions: tuple[list[int], ...]
    desirable: bool = True
    # The frozen reference's summed log-prob of each completion, when read from a cache instead of computed
    # per batch (trainer/reference_cache.py).
    reference_logps: tuple[float, ...] | None = None


@dataclass
class LoadedRows:
    examples: list
    skipped: int


def load_sft_examples(paths: Sequence[str | os.PathLike], tokenizer, limits: Limits, prompt_key: str = "prompt",
                      skip_invalid: bool = False) -> LoadedRows:
    return _load(paths, lambda row: _sft_example(row, tokenizer, limits, prompt_key), skip_invalid)


def load_preference_examples(paths: Sequence[str | os.PathLike], tokenizer, limits: Limits, *, unpaired: bool,
                             prompt_key: str = "prompt", skip_invalid: bool = False) -> LoadedRows:
    """Pairs, or with `unpaired` KTO's labelled single completions."""
    make = _kto_example if unpaired else _pair_example
    return _load(paths, lambda row: make(row, tokenizer, limits, prompt_key), skip_invalid)


def _load(paths, make_example: Callable[[dict], object], skip_invalid: bool) -> LoadedRows:
    examples, skipped = [], 0
    for path in paths:
        for index, row in enumerate(read_rows(path)):
            try:
                examples.append(make_example(row))
            except ValueError as err:
                if not skip_invalid:
                    raise ValueError(f"{os.fspath(path)} row {index}: {err}") from None
                skipped += 1
    if not examples:
        raise ValueError(f"no usable rows in {', '.join(map(os.fspath, paths))} ({skipped} skipped as invalid)")
    return LoadedRows(examples, skipped)


def _column(row: dict, key: str):
    if key not in row:
        raise ValueError(f"column {key!r} is missing; columns present: {sorted(row)}")
    return row[key]


def _sft_example(row: dict, tokenizer, limits: Limits, prompt_key: str) -> SFTExample:
    if MESSAGES_KEY in row:
        ids, mask = encode_conversation(tokenizer, _column(row, MESSAGES_KEY))
        start = mask.index(1)
        prompt, response, loss_mask = ids[:start], ids[start:], mask[start:]
    else:
        if prompt_key not in row or RESPONSE_KEY not in row:
            raise ValueError(f"needs {MESSAGES_KEY!r}, or {prompt_key!r} and {RESPONSE_KEY!r}; columns present: "
                             f"{sorted(row)}")
        prompt, response = encode_prompt_completion(tokenizer, row[prompt_key], row[RESPONSE_KEY], RESPONSE_KEY)
        loss_mask = [1] * len(response)
    prompt, response = _fit(prompt, response, limits, RESPONSE_KEY)
    return SFTExample(prompt, response, loss_mask[:len(response)])


def _pair_example(row: dict, tokenizer, limits: Limits, prompt_key: str) -> PreferenceExample:
    prompt_text = _column(row, prompt_key)
    chosen_text, rejected_text = (_column(row, key) for key in PAIR_KEYS)
    if chosen_text == rejected_text:
        raise ValueError("chosen is identical to rejected: the pair prefers nothing")
    prompt, chosen = encode_prompt_completion(tokenizer, prompt_text, chosen_text, "chosen")
    _, rejected = encode_prompt_completion(tokenizer, prompt_text, rejected_text, "rejected")
    prompt, chosen = _fit(prompt, chosen, limits, "chosen")
    _, rejected = _fit(prompt, rejected, limits, "rejected")
    return PreferenceExample(prompt, (chosen, rejected))


def _kto_example(row: dict, tokenizer, limits: Limits, prompt_key: str) -> PreferenceExample:
    completion_text, label = (_column(row, key) for key in KTO_KEYS)
    if not isinstance(label, bool):
        raise ValueError(f"label must be true (desirable) or false (undesirable), got {label!r}")
    prompt, completion = encode_prompt_completion(tokenizer, _column(row, prompt_key), completion_text, "completion")
    prompt, completion = _fit(prompt, completion, limits, "completion")
    return PreferenceExample(prompt, (completion,), desirable=label)


def _fit(prompt: list[int], response: list[int], limits: Limits, what: str) -> tuple[list[int], list[int]]:
    prompt = truncate_prompt(prompt, limits.max_prompt_length, limits.truncation, "this row")
    if len(response) > limits.max_response_length:
        if limits.truncation == "error":
            raise ValueError(f"{what} is {len(response)} tokens, longer than max_response_length="
                             f"{limits.max_response_length} (set truncation to 'left' or 'right' to cut it)")
        response = response[:limits.max_response_length]
    return prompt, response


def encode_prompt_completion(tokenizer, prompt, completion, what: str) -> tuple[list[int], list[int]]:
    """(prompt tokens, completion tokens) of a prompt (string or chat messages) and a completion (string or
    assistant messages)."""
    if isinstance(completion, str):
        if not completion:
            raise ValueError(f"{what} is empty")
        completion_messages = [{"role": "assistant", "content": completion}]
    else:
        completion_messages = _messages(completion, what)
        if not any(message["role"] == "assistant" and message["content"] for message in completion_messages):
            raise ValueError(f"{what} has no non-empty assistant message")
    if not tokenizer.chat_template:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("chat messages need a tokenizer with a chat_template to render them")
        return (tokenizer(prompt)["input_ids"],
                tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    prompt_messages = _messages(as_messages(prompt), "prompt")
    prompt_ids = encode_chat(tokenizer, prompt_messages, add_generation_prompt=True)
    full = encode_chat(tokenizer, prompt_messages + completion_messages, add_generation_prompt=False)
    _check_prefix(full, prompt_ids)
    return prompt_ids, full[len(prompt_ids):]


def encode_conversation(tokenizer, messages) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a chat: the mask is 1 on every assistant turn's tokens as the template renders
    them after the generation prompt (content and end-of-turn), 0 elsewhere."""
    if not tokenizer.chat_template:
        raise ValueError(f"{MESSAGES_KEY!r} needs a tokenizer with a chat_template to render it")
    messages = _messages(messages, MESSAGES_KEY)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant turn to learn from")
    ids = encode_chat(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for index in turns:
        if not messages[index]["content"]:
            raise ValueError(f"assistant turn {index} is empty")
        start = encode_chat(tokenizer, messages[:index], add_generation_prompt=True)
        through = encode_chat(tokenizer, messages[:index + 1], add_generation_prompt=False)
        _check_prefix(ids, start)
        _check_prefix(ids, through)
        mask[len(start):len(through)] = [1] * (len(through) - len(start))
    return ids, mask


def _messages(messages, what: str) -> list[dict]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{what} must be a string or a list of {{'role', 'content'}} messages")
    problem = unknown_role(messages)
    if problem:
        raise ValueError(f"{what}: {problem}")
    return messages


def _check_prefix(full: list[int], prefix: list[int]) -> None:
    # Templates that rewrite earlier turns (e.g. strip reasoning from past assistant turns) cannot be masked
    # by rendering prefixes; say so rather than mask the wrong tokens.
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template does not render a conversation's turns as a prefix of the whole "
                         "conversation, so assistant tokens cannot be located")
