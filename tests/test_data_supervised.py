"""SFT and preference rows: assistant-token masks, truncation, refusals naming file and row, length grouping."""
import pytest

from verl_mega.data.sampler import ResumableBatchSampler
from verl_mega.data.supervised import Limits, encode_conversation, load_preference_examples, load_sft_examples
from verl_mega.data.tables import write_rows
from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer

LIMITS = Limits(max_prompt_length=32, max_response_length=16, truncation="error")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_every_assistant_turn_and_its_end_of_turn_is_a_loss_token(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "12"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "3"}]
    ids, mask = encode_conversation(tokenizer, messages)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "".join(tokens) == "<bos><|user|>a<eos><|assistant|>12<eos><|user|>b<eos><|assistant|>3<eos>"
    assert [token for token, on in zip(tokens, mask) if on] == ["1", "2", "<eos>", "3", "<eos>"]


def test_messages_and_prompt_response_rows_give_the_same_example(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": "copy: 12"}, {"role": "assistant", "content": "12"}]},
            {"prompt": [{"role": "user", "content": "copy: 12"}], "response": "12"},
            {"prompt": "copy: 12", "response": "12"}]
    examples = load_sft_examples([write_rows(rows, tmp_path / "sft.jsonl")], tokenizer, LIMITS).examples
    assert examples[0] == examples[1] == examples[2]
    assert tokenizer.decode(examples[0].response) == "12<eos>" and examples[0].loss_mask == [1, 1, 1]
    assert tokenizer.decode(examples[0].prompt) == "<bos><|user|>copy: 12<eos><|assistant|>"


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     "assistant turn 1 is empty"),
    ({"prompt": "hi", "response": ""}, "response is empty"),
    ({"prompt": "hi"}, "needs 'messages', or 'prompt' and 'response'"),
    ({"prompt": "x" * 40, "response": "1"}, "longer than max_prompt_length=32"),
    ({"prompt": "hi", "response": "1" * 20}, "longer than max_response_length=16"),
    ({"messages": "hi"}, "list of {'role', 'content'} messages"),
])
def test_bad_sft_rows_are_refused_naming_file_and_row(tmp_path, tokenizer, row, message):
    path = write_rows([{"prompt": "ok", "response": "1"}, row], tmp_path / "sft.jsonl")
    with pytest.raises(ValueError, match=rf"sft.jsonl row 1: .*{message}"):
        load_sft_examples([path], tokenizer, LIMITS)


def test_truncation_cuts_the_prompt_on_its_side_and_the_response_on_the_right(tmp_path, tokenizer):
    path = write_rows([{"prompt": "x" * 40, "response": "1" * 20}], tmp_path / "sft.jsonl")
    (example,) = load_sft_examples([path], tokenizer, Limits(8, 4, "left")).examples
    assert len(example.prompt) == 8 and tokenizer.decode(example.prompt).endswith("<eos><|assistant|>")
    assert tokenizer.decode(example.response) == "1111" and example.loss_mask == [1] * 4


def test_invalid_rows_are_counted_and_skipped_when_configured(tmp_path, tokenizer):
    path = write_rows([{"prompt": "ok", "response": "1"}, {"prompt": "hi", "response": ""}], tmp_path / "sft.jsonl")
    loaded = load_sft_examples([path], tokenizer, LIMITS, skip_invalid=True)
    assert len(loaded.examples) == 1 and loaded.skipped == 1


def test_preference_pairs_in_string_and_chat_form(tmp_path, tokenizer):
    rows = [{"prompt": "copy: 12", "chosen": "12", "rejected": "34"},
            {"prompt": [{"role": "user", "content": "copy: 12"}], "chosen": [{"role": "assistant", "content": "12"}],
             "rejected": [{"role": "assistant", "content": "34"}]}]
    examples = load_preference_examples([write_rows(rows, tmp_path / "p.jsonl")], tokenizer, LIMITS,
                                        unpaired=False).examples
    assert examples[0] == examples[1]
    assert [tokenizer.decode(c) for c in examples[0].completions] == ["12<eos>", "34<eos>"]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "hi", "chosen": "1"}, "column 'rejected' is missing"),
    ({"prompt": "hi", "chosen": "1", "rejected": "1"}, "chosen is identical to rejected"),
    ({"prompt": "hi", "chosen": "", "rejected": "1"}, "chosen is empty"),
])
def test_bad_preference_rows_are_refused_naming_file_and_row(tmp_path, tokenizer, row, message):
    path = write_rows([{"prompt": "hi", "chosen": "1", "rejected": "2"}, row], tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=rf"p.jsonl row 1: {message}"):
        load_preference_examples([path], tokenizer, LIMITS, unpaired=False)


def test_kto_rows_need_a_boolean_label(tmp_path, tokenizer):
    good = {"prompt": "hi", "completion": "1", "label": False}
    examples = load_preference_examples([write_rows([good], tmp_path / "k.jsonl")], tokenizer, LIMITS,
                                        unpaired=True).examples
    assert examples[0].desirable is False and len(examples[0].completions) == 1
    path = write_rows([good, {**good, "label": "yes"}], tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"bad.jsonl row 1: label must be true .* got 'yes'"):
        load_preference_examples([path], tokenizer, LIMITS, unpaired=True)


def test_length_grouped_batches_hold_similar_lengths_and_cover_the_epoch_once():
    lengths = [(index * 37) % 100 for index in range(64)]
    sampler = ResumableBatchSampler(64, 8, seed=3, lengths=lengths, group_batches=8)
    batches = list(sampler)
    assert sorted(index for batch in batches for index in batch) == list(range(64))
    # One group spans the epoch: every batch is a run of the sorted lengths.
    spreads = [max(lengths[i] for i in batch) - min(lengths[i] for i in batch) for batch in batches]
    assert max(spreads) <= 16
    assert [len(batch) for batch in batches] == [8] * 8
    assert list(ResumableBatchSampler(64, 8, seed=3, lengths=lengths, group_batches=8)) == batches
