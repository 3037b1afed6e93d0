import json

import pytest
import torch
from transformers import AutoTokenizer

from verl_mega.data.padding import pad_rows, position_ids
from verl_mega.data.prompts import PromptDataset
from verl_mega.data.tables import write_rows
from verl_mega.data.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture
def chat_tokenizer(tmp_path):
    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "chat_tokenizer"))


@pytest.fixture
def plain_tokenizer(tmp_path):
    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "plain_tokenizer", with_chat_template=False))


ROWS = [
    {
        "data_source": "add",
        "prompt": [{"role": "user", "content": "12+34="}],
        "reward_model": {"style": "rule", "ground_truth": "46"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "copy",
        "prompt": [{"role": "user", "content": "copy: 7"}],
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(ids)


def test_chat_template_is_applied_with_a_single_bos(tmp_path, chat_tokenizer):
    path = write_rows(ROWS, tmp_path / "rows.jsonl")
    item = PromptDataset(path, chat_tokenizer, max_prompt_length=64)[0]
    assert tokens(chat_tokenizer, item["input_ids"]) == [
        "<bos>", "<|user|>", "1", "2", "+", "3", "4", "=", "<eos>", "<|assistant|>",
    ]


def test_string_prompt_is_wrapped_as_a_user_message_when_a_template_exists(tmp_path, chat_tokenizer):
    path = write_rows([{"prompt": "12+34="}], tmp_path / "rows.jsonl")
    string_ids = PromptDataset(path, chat_tokenizer, max_prompt_length=64)[0]["input_ids"]
    message_ids = PromptDataset(write_rows(ROWS[:1], tmp_path / "m.jsonl"), chat_tokenizer, 64)[0]["input_ids"]
    assert string_ids == message_ids


def test_string_prompt_without_template_is_tokenized_as_plain_text(tmp_path, plain_tokenizer):
    path = write_rows([{"prompt": "12+34="}], tmp_path / "rows.jsonl")
    item = PromptDataset(path, plain_tokenizer, max_prompt_length=64)[0]
    assert tokens(plain_tokenizer, item["input_ids"]) == ["<bos>", "1", "2", "+", "3", "4", "="]


def test_chat_messages_without_template_are_rejected(tmp_path, plain_tokenizer):
    path = write_rows(ROWS, tmp_path / "rows.jsonl")
    # Found when the dataset is read (every prompt is checked up front), not at the step that samples it.
    with pytest.raises(ValueError, match="rows.jsonl row 0: prompt is a list of chat messages but the tokenizer has no "
                                         "chat_template"):
        PromptDataset(path, plain_tokenizer, max_prompt_length=64)


def test_items_left_pad_and_carry_metadata(tmp_path, chat_tokenizer):
    dataset = PromptDataset(write_rows(ROWS, tmp_path / "rows.jsonl"), chat_tokenizer, max_prompt_length=64)
    items = [dataset[0], dataset[1]]
    input_ids, attention_mask = pad_rows([item["input_ids"] for item in items], chat_tokenizer.pad_token_id,
                                         side="left")
    pad = chat_tokenizer.pad_token_id
    # Row 0 is 10 tokens ("12+34=" templated), row 1 is 11 ("copy: 7" templated).
    assert input_ids.shape == (2, 11)
    assert input_ids[0, 0].item() == pad
    assert input_ids[0, 1:].tolist() == dataset[0]["input_ids"]
    assert input_ids[1].tolist() == dataset[1]["input_ids"]
    assert attention_mask.tolist() == [[0] + [1] * 10, [1] * 11]
    assert position_ids(attention_mask).tolist() == [[0] + list(range(10)), list(range(11))]
    assert [item["data_source"] for item in items] == ["add", "copy"]
    assert [item["reward_model"]["ground_truth"] for item in items] == ["46", "7"]
    assert [item["extra_info"] for item in items] == [{"split": "train", "index": 0}, {"split": "train", "index": 1}]
    assert [item["raw_prompt"] for item in items] == [ROWS[0]["prompt"], ROWS[1]["prompt"]]


@pytest.mark.parametrize(
    "side, expected",
    [
        ("left", ["4", "=", "<eos>", "<|assistant|>"]),
        ("right", ["<bos>", "<|user|>", "1", "2"]),
    ],
)
def test_truncation_sides(tmp_path, chat_tokenizer, side, expected):
    path = write_rows(ROWS, tmp_path / "rows.jsonl")
    item = PromptDataset(path, chat_tokenizer, max_prompt_length=4, truncation=side)[0]
    assert tokens(chat_tokenizer, item["input_ids"]) == expected


def test_truncation_error_names_the_row(tmp_path, chat_tokenizer):
    rows = [{"prompt": "1"}, {"prompt": "1234567"}]
    # The whole file is checked when it is read, not when a step samples the long row.
    with pytest.raises(ValueError, match=r"rows.jsonl: 1 of 2 prompts are longer than data.max_prompt_length=6 "
                                         r"\(row 1: 11 tokens\)"):
        PromptDataset(write_rows(rows, tmp_path / "rows.jsonl"), chat_tokenizer, max_prompt_length=6)


def test_invalid_truncation_side_is_rejected(tmp_path, chat_tokenizer):
    with pytest.raises(ValueError, match="truncation must be one of"):
        PromptDataset(write_rows(ROWS, tmp_path / "rows.jsonl"), chat_tokenizer, 8, truncation="middle")


def test_parquet_and_jsonl_give_the_same_items(tmp_path, chat_tokenizer):
    from_jsonl = PromptDataset(write_rows(ROWS, tmp_path / "rows.jsonl"), chat_tokenizer, 64)
    from_parquet = PromptDataset(write_rows(ROWS, tmp_path / "rows.parquet"), chat_tokenizer, 64)
    assert len(from_parquet) == 2
    for index in range(2):
        assert from_parquet[index] == from_jsonl[index]
    assert from_parquet[0]["reward_model"]["ground_truth"] == "46"


def test_several_files_are_concatenated(tmp_path, chat_tokenizer):
    paths = [write_rows(ROWS[:1], tmp_path / "a.jsonl"), write_rows(ROWS[1:], tmp_path / "b.parquet")]
    dataset = PromptDataset(paths, chat_tokenizer, 64)
    assert [dataset[i]["data_source"] for i in range(len(dataset))] == ["add", "copy"]


def test_custom_prompt_key(tmp_path, chat_tokenizer):
    path = write_rows([{"question": "1+1=", "data_source": "add"}], tmp_path / "rows.jsonl")
    item = PromptDataset(path, chat_tokenizer, 64, prompt_key="question")[0]
    assert item["raw_prompt"] == "1+1="
    assert "question" not in item
    assert item["data_source"] == "add"


def test_missing_prompt_column_names_it_and_lists_the_columns(tmp_path, chat_tokenizer):
    path = write_rows([{"question": "1+1=", "data_source": "add"}], tmp_path / "rows.parquet")
    with pytest.raises(ValueError) as error:
        PromptDataset(path, chat_tokenizer, 64)
    message = str(error.value)
    assert "prompt column 'prompt' not found" in message
    assert "columns present: ['data_source', 'question']" in message


def test_empty_file_is_rejected(tmp_path, chat_tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"data file has no rows: .*empty\.jsonl"):
        PromptDataset(path, chat_tokenizer, 64)


def test_empty_parquet_file_is_rejected(tmp_path, chat_tokenizer):
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"prompt": pyarrow.array([], pyarrow.string())}), path)
    with pytest.raises(ValueError, match="data file has no rows"):
        PromptDataset(path, chat_tokenizer, 64)


def test_missing_file_is_reported_with_its_path(tmp_path, chat_tokenizer):
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nowhere\.parquet"):
        PromptDataset(tmp_path / "nowhere.parquet", chat_tokenizer, 64)


def test_unsupported_extension_lists_the_supported_ones(tmp_path, chat_tokenizer):
    path = tmp_path / "rows.csv"
    path.write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match=r"unsupported file extension '\.csv'.*supported: \.jsonl, \.parquet"):
        PromptDataset(path, chat_tokenizer, 64)


def test_invalid_json_line_is_reported_with_its_line_number(tmp_path, chat_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: invalid JSON"):
        PromptDataset(path, chat_tokenizer, 64)


@pytest.mark.parametrize("second_line, message", [
    (b"\xff\xfe not text\n", r"rows\.jsonl:2: not UTF-8 text \(byte 0xff\)"),  # was the codec's error, no file
    (b'{"prompt": "half a pair \\ud800"}\n', r"rows\.jsonl:2: a string holds half of a UTF-16 surrogate pair"),
])  # the lone surrogate was a TypeError traceback from the tokenizer
def test_a_line_that_is_no_text_is_reported_with_its_line_number(tmp_path, chat_tokenizer, second_line, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\r\n" + second_line)
    with pytest.raises(ValueError, match=message):
        PromptDataset(path, chat_tokenizer, 64)


def test_a_whole_surrogate_pair_and_crlf_lines_are_read(tmp_path, chat_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "smile \\ud83d\\ude00"}\r\n{"prompt": "two"}\r')
    assert [row["prompt"] for row in PromptDataset(path, chat_tokenizer, 64).rows] == ["smile \U0001f600", "two"]


def test_left_padded_prompts_end_in_the_last_column(tmp_path, chat_tokenizer):
    dataset = PromptDataset(write_rows(ROWS, tmp_path / "rows.jsonl"), chat_tokenizer, 64)
    input_ids, _ = pad_rows([dataset[i]["input_ids"] for i in range(2)], chat_tokenizer.pad_token_id, side="left")
    assert input_ids.dtype == torch.long
    # Left padding: every prompt ends with the generation prompt in the last column.
    assert (input_ids[:, -1] == chat_tokenizer.convert_tokens_to_ids("<|assistant|>")).all()
