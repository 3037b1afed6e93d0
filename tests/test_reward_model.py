import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config

from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer
from verl_mega.roles.reward import HFRewardModel


def save_tiny_reward_model(directory, num_labels=1, with_chat_template=True):
    """A randomly initialised two-layer Qwen2 scorer with the tiny tokenizer beside it."""
    tokenizer = build_tiny_tokenizer(with_chat_template)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


PROMPTS = ["1+1=", [{"role": "user", "content": "copy: 12345"}], "copy: 7"]
RESPONSES = ["2", "12345", "77"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return HFRewardModel(save_tiny_reward_model(tmp_path_factory.mktemp("rm")), device="cpu")


def test_scores_are_a_float_tensor_per_sequence(reward_model):
    scores = reward_model.score(PROMPTS, RESPONSES)
    assert scores.shape == (3,)
    assert scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    # A random model still tells different sequences apart.
    assert len(set(scores.tolist())) == 3


def test_scores_are_deterministic(reward_model):
    assert torch.equal(reward_model.score(PROMPTS, RESPONSES), reward_model.score(PROMPTS, RESPONSES))


def test_padding_does_not_change_a_score(reward_model):
    batched = reward_model.score(PROMPTS, RESPONSES)
    alone = torch.cat([reward_model.score([prompt], [response]) for prompt, response in zip(PROMPTS, RESPONSES)])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)


def test_score_is_the_single_logit_of_the_templated_conversation(reward_model):
    tokenizer = reward_model.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0].tolist().count(tokenizer.bos_token_id) == 1
    expected = reward_model.model(input_ids=ids).logits[0, 0]
    torch.testing.assert_close(reward_model.score(["1+1="], ["2"])[0], expected)


def test_without_a_template_prompt_and_response_are_scored_as_plain_text(tmp_path):
    model = HFRewardModel(save_tiny_reward_model(tmp_path, with_chat_template=False), device="cpu")
    ids = model.tokenizer("1+1=2", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(model.score(["1+1="], ["2"])[0], model.model(input_ids=ids).logits[0, 0])
    with pytest.raises(ValueError, match="no chat_template"):
        model.score([[{"role": "user", "content": "1+1="}]], ["2"])


def test_more_than_one_label_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="has 2 labels; expected 1"):
        HFRewardModel(save_tiny_reward_model(tmp_path, num_labels=2), device="cpu")
