"""Data rows a chat template would render wrong: a role no template knows (ShareGPT's human / gpt, a capitalised
Assistant) is refused naming the file, the row and the role, for every kind of rows the jobs read; an assistant
turn under another name would otherwise be rendered as plain text and trained with no loss."""
from __future__ import annotations

import pytest

from verl_mega.data.prompts import PromptDataset
from verl_mega.data.supervised import Limits, load_preference_examples, load_sft_examples
from verl_mega.data.tables import write_rows
from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer

LIMITS = Limits(max_prompt_length=32, max_response_length=16, truncation="error")
GOOD_TURNS = [{"role": "user", "content": "copy: 1"}, {"role": "assistant", "content": "1"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _turns(role: str) -> list[dict]:
    return [{"role": "human" if role == "gpt" else "user", "content": "copy: 1"}, {"role": role, "content": "1"}]


ROLES = ["Assistant", "gpt", "bot", ""]


@pytest.mark.parametrize("role", ROLES)
def test_sft_conversation(tmp_path, tokenizer, role):
    path = write_rows([{"messages": GOOD_TURNS}, {"messages": _turns(role)}], tmp_path / "sft.jsonl")
    with pytest.raises(ValueError, match=r"sft\.jsonl row 1: .*has role '(human|user|" + role + ")'"):
        load_sft_examples([path], tokenizer, LIMITS)


@pytest.mark.parametrize("role", ROLES)
def test_sft_prompt_and_response(tmp_path, tokenizer, role):
    row = {"prompt": [{"role": role, "content": "copy: 1"}], "response": "1"}
    path = write_rows([{"prompt": "ok", "response": "1"}, row], tmp_path / "sft.jsonl")
    with pytest.raises(ValueError, match=rf"sft\.jsonl row 1: prompt: message 0 has role '{role}'"):
        load_sft_examples([path], tokenizer, LIMITS)


@pytest.mark.parametrize("role", ROLES)
def test_preference_completion(tmp_path, tokenizer, role):
    row = {"prompt": "hi", "chosen": [{"role": role, "content": "1"}], "rejected": "2"}
    path = write_rows([{"prompt": "hi", "chosen": "1", "rejected": "2"}, row], tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=rf"p\.jsonl row 1: chosen: message 0 has role '{role}'"):
        load_preference_examples([path], tokenizer, LIMITS, unpaired=False)


@pytest.mark.parametrize("role", ROLES)
def test_rl_prompt(tmp_path, tokenizer, role):
    path = write_rows([{"prompt": "ok"}, {"prompt": [{"role": role, "content": "copy: 1"}]}], tmp_path / "rl.jsonl")
    with pytest.raises(ValueError, match=rf"rl\.jsonl row 1: column 'prompt': message 0 has role '{role}'"):
        PromptDataset([path], tokenizer, 32)


def test_the_known_roles_load(tmp_path, tokenizer):
    turns = [{"role": "system", "content": "s"}, *GOOD_TURNS]
    path = write_rows([{"messages": turns}], tmp_path / "sft.jsonl")
    assert len(load_sft_examples([path], tokenizer, LIMITS).examples) == 1
