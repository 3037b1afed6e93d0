"""Prompt dataset in verl's row format, tokenized for generation.

A row holds a prompt (a string, or a list of {"role", "content"} chat messages) plus any other
columns such as "data_source", "reward_model" ({"ground_truth": ...}) and "extra_info"; those are
carried through untouched so the reward role can see them next to the generated responses.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from jinja2 import TemplateError
from torch.utils.data import Dataset

from verl_mega.data.tables import read_rows

TRUNCATION_SIDES = ("left", "right", "error")


class PromptDataset(Dataset):
    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
    ):
        if truncation not in TRUNCATION_SIDES:
            raise ValueError(f"truncation must be one of {TRUNCATION_SIDES}, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; prompts cannot be left-padded into a batch")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.truncation = truncation
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.rows = []
        for path in paths:
            rows = read_rows(path)
            check_prompt_column(rows, prompt_key, path)
            if truncation == "error":  # at start-up, not at the step that happens to sample the row
                self._check_lengths(rows, path)
            self.rows.extend(rows)

    def _check_lengths(self, rows: list[dict], path) -> None:
        try:
            lengths = [len(self._encode(row[self.prompt_key], index)) for index, row in enumerate(rows)]
        except ValueError as err:
            raise ValueError(f"{os.fspath(path)} {err}") from None
        too_long = [index for index, length in enumerate(lengths) if length > self.max_prompt_length]
        if too_long:
            first = too_long[0]
            raise ValueError(
                f"{os.fspath(path)}: {len(too_long)} of {len(rows)} prompts are longer than data.max_prompt_length="
                f"{self.max_prompt_length} (row {first}: {lengths[first]} tokens); raise it, or set "
                "data.truncation to left or right to cut them"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        prompt = row[self.prompt_key]
        input_ids = truncate_prompt(self._encode(prompt, index), self.max_prompt_length, self.truncation,
                                    f"row {index}")
        metadata = {key: value for key, value in row.items() if key != self.prompt_key}
        return {"input_ids": input_ids, "raw_prompt": prompt, **metadata}

    def _encode(self, prompt: str | list[dict], index: int) -> list[int]:
        if self.tokenizer.chat_template:
            try:
                return encode_chat(self.tokenizer, as_messages(prompt), add_generation_prompt=True)
            except ValueError as err:
                raise ValueError(f"row {index}: {err}") from None
        if not isinstance(prompt, str):
            raise ValueError(
                f"row {index}: prompt is a list of chat messages but the tokenizer has no chat_template "
                "to render it"
            )
        return self.tokenizer(prompt)["input_ids"]


def truncate_prompt(input_ids: list[int], max_prompt_length: int, truncation: str, where: str) -> list[int]:
    """`input_ids` cut to `max_prompt_length` on the `truncation` side; "error" refuses, naming `where`."""
    if len(input_ids) <= max_prompt_length:
        return input_ids
    if truncation == "left":
        return input_ids[-max_prompt_length:]
    if truncation == "right":
        return input_ids[:max_prompt_length]
    raise ValueError(
        f"{where}: prompt is {len(input_ids)} tokens, longer than max_prompt_length={max_prompt_length} "
        "(set truncation to 'left' or 'right' to cut it)"
    )


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """A plain string prompt becomes a single user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, **template_inputs) -> str:
    """The tokenizer's chat template over `messages`. What the template raises (a syntax error; Gemma's "System role
    not supported" for a system message) is a ValueError naming the template."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_inputs)
    except TemplateError as err:
        raise ValueError(f"the tokenizer's chat template failed on these messages: {err}") from None


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = render_chat(tokenizer, messages, add_generation_prompt)
    # The template already renders BOS and any other special tokens; letting the tokenizer add its own
    # on top would double them (the Qwen2/Llama-Instruct pitfall).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_prompt_column(rows: list[dict], prompt_key: str, path) -> None:
    """Every row has the prompt column, holding a string or a list of {"role", "content"} messages."""
    for index, row in enumerate(rows):
        if prompt_key not in row:
            raise ValueError(
                f"prompt column {prompt_key!r} not found in {os.fspath(path)} (row {index}); "
                f"columns present: {sorted(row)}"
            )
        if not _is_prompt(row[prompt_key]):
            raise ValueError(
                f"{os.fspath(path)} row {index}: column {prompt_key!r} holds {type(row[prompt_key]).__name__} "
                f"{str(row[prompt_key])[:40]!r}; a prompt is a string or a list of {{'role', 'content'}} messages"
            )
        problem = None if isinstance(row[prompt_key], str) else unknown_role(row[prompt_key])
        if problem:
            raise ValueError(f"{os.fspath(path)} row {index}: column {prompt_key!r}: {problem}")


# The roles chat templates render. Others (ShareGPT's human / gpt, a capitalised Assistant) are rendered as plain
# text or not at all by most templates, and an assistant turn under another name is never trained on, so they are
# refused rather than guessed at: rename them in the data.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def unknown_role(messages: list[dict]) -> str | None:
    """Why `messages` holds a role no chat template knows, or None."""
    for index, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            return (f"message {index} has role {message.get('role')!r}; roles are {', '.join(CHAT_ROLES)} "
                    "(ShareGPT's human / gpt are user / assistant: rename them)")
    return None


def _is_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
        for message in prompt)

