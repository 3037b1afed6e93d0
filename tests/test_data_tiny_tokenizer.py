from transformers import AutoTokenizer

from verl_mega.data.tiny_tokenizer import save_tiny_tokenizer


def test_saved_tokenizer_loads_with_special_tokens_and_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+3="}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<bos><|user|>12+3=<eos><|assistant|>"


def test_one_token_per_character_and_lossless_decode(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    ids = tokenizer("copy: 907", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("copy: 907")
    assert tokenizer.decode(ids) == "copy: 907"
    assert tokenizer.decode([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], skip_special_tokens=True) == "copy: 907"


def test_plain_encoding_adds_bos_so_a_rendered_template_would_double_it(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    assert tokenizer("1")["input_ids"] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("1")]
    doubled = tokenizer("<bos><|user|>1")["input_ids"]
    assert doubled[:2] == [tokenizer.bos_token_id, tokenizer.bos_token_id]


def test_without_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path, with_chat_template=False))
    assert not tokenizer.chat_template
