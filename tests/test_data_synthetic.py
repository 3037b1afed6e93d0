import pytest
from transformers import AutoTokenizer

from verl_mega.data.prompts import PromptDataset
from verl_mega.data.synthetic import make_task_rows, sft_pairs
from verl_mega.data.tables import read_rows, write_rows
from verl_mega.data.tiny_tokenizer import save_tiny_tokenizer


def test_add_rows_hold_the_correct_sum_in_verl_format():
    rows = make_task_rows("add", num_rows=50, seed=3, max_digits=3)
    for index, row in enumerate(rows):
        assert row["data_source"] == "add"
        assert row["extra_info"] == {"split": "train", "index": index}
        [message] = row["prompt"]
        assert message["role"] == "user"
        left, right = message["content"].removesuffix("=").split("+")
        assert row["reward_model"]["ground_truth"] == str(int(left) + int(right))
        assert max(len(left), len(right)) <= 3


def test_copy_rows_repeat_the_digits():
    rows = make_task_rows("copy", num_rows=50, seed=3, max_digits=4)
    for row in rows:
        digits = row["prompt"][0]["content"].removeprefix("copy: ")
        assert digits.isdigit() and 1 <= len(digits) <= 4
        assert row["reward_model"]["ground_truth"] == digits
        assert row["data_source"] == "copy"


def test_rows_are_deterministic_per_seed():
    assert make_task_rows("add", 20, seed=1) == make_task_rows("add", 20, seed=1)
    assert make_task_rows("add", 20, seed=1) != make_task_rows("add", 20, seed=2)


def test_unknown_task_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown synthetic task 'mul'; available: add, copy"):
        make_task_rows("mul", 1)


@pytest.mark.parametrize("extension", ["jsonl", "parquet"])
def test_written_files_load_as_prompt_datasets(tmp_path, extension):
    path = write_rows(make_task_rows("add", 8, seed=0, split="test"), tmp_path / f"add.{extension}")
    assert read_rows(path) == make_task_rows("add", 8, seed=0, split="test")
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tokenizer"))
    dataset = PromptDataset(path, tokenizer, max_prompt_length=32)
    prompts = [dataset[i]["input_ids"] for i in range(len(dataset))]
    assert len(prompts) == 8
    # Every prompt character is in the tiny tokenizer's alphabet.
    assert all(tokenizer.unk_token_id not in prompt for prompt in prompts)


def test_sft_pairs_answer_each_prompt_with_its_ground_truth():
    rows = make_task_rows("copy", 5, seed=0)
    pairs = sft_pairs(rows)
    assert [pair["prompt"] for pair in pairs] == [row["prompt"] for row in rows]
    assert [pair["response"] for pair in pairs] == [row["prompt"][0]["content"].removeprefix("copy: ") for row in rows]
