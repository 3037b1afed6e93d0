import pytest
import torch
from transformers import AutoTokenizer

from verl_mega.config.errors import UserError
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tiny_tokenizer import save_tiny_tokenizer
from verl_mega.rewards.registry import get_reward_fn
from verl_mega.rewards.rules import add_score, copy_score, exact_match_score
from verl_mega.roles.reward import RuleReward, scores_to_token_rewards

from .faults.rewards import graded_reward


@pytest.mark.parametrize(
    "response, expected",
    [
        ("12345", 1.0),
        (" 12345\n", 1.0),  # surrounding whitespace is not judged
        ("12045", 0.8),
        ("123", 0.6),  # missing positions count as wrong
        ("1234567", 5 / 7),  # extra characters cost credit too
        ("54321", 0.2),
        ("", 0.0),
    ],
)
def test_copy_partial_credit(response, expected):
    assert copy_score("copy", response, "12345", None) == pytest.approx(expected)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("579", 1.0),
        ("578", 0.5 * 2 / 3),
        ("79", 0.5 * 2 / 3),  # digits aligned by place value: 7 tens and 9 units are right
        ("1579", 0.5 * 3 / 4),
        ("975", 0.5 * 1 / 3),
        ("abc", 0.0),
    ],
)
def test_add_exact_and_digit_partial_credit(response, expected):
    assert add_score("add", response, "579", None) == pytest.approx(expected)


def test_exact_match():
    assert exact_match_score(None, " 42 ", "42", None) == 1.0
    assert exact_match_score(None, "42.0", "42", None) == 0.0


def test_registry_by_name():
    assert get_reward_fn("copy") is copy_score
    assert get_reward_fn("add") is add_score
    assert get_reward_fn("exact_match") is exact_match_score


def test_registry_by_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(len(solution_str))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards:length_score")
    assert fn("x", "abcd", None, None) == 4.0


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError, match=r"unknown reward function 'nosuch'; registered: add, code_tests, copy, dapo, default, "
                                         r"exact_match, gsm8k, math, number \(or give 'module:function'\)"):
        get_reward_fn("nosuch")


def test_missing_module_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_reward_module' for reward function"):
        get_reward_fn("no_such_reward_module:score")


def test_missing_function_is_a_clear_error():
    with pytest.raises(ValueError, match=r"module 'verl_mega.roles.reward' has no function 'nope'"):
        get_reward_fn("verl_mega.roles.reward:nope")


def test_token_rewards_sit_on_the_last_valid_token_of_a_ragged_mask():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    rewards = scores_to_token_rewards(torch.tensor([0.5, 1.0, -2.0]), mask)
    assert rewards.tolist() == [
        [0.0, 0.0, 0.5, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
        [-2.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert rewards.dtype == torch.float32


def test_token_rewards_reject_rows_without_valid_tokens():
    mask = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match=r"response rows \[1\] have no valid tokens"):
        scores_to_token_rewards(torch.tensor([1.0, 1.0]), mask)


def encode_responses(tokenizer, texts, length):
    """Right-padded response ids ending in EOS, as a rollout would return them."""
    responses = torch.full((len(texts), length), tokenizer.pad_token_id)
    mask = torch.zeros((len(texts), length), dtype=torch.long)
    for row, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        responses[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    return responses, mask


def test_rule_reward_decodes_only_valid_tokens_and_scores(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["12345", "12", "9"], length=8)
    # A stray digit past the mask must not be read as part of the answer.
    responses[1, 6] = tokenizer.convert_tokens_to_ids("3")
    reward = RuleReward(tokenizer, "copy")
    assert reward.decode(responses, mask) == ["12345", "12", "9"]
    output = reward(responses, mask, ground_truths=["12345", "123", "1"], data_sources=["copy"] * 3)
    assert output.scores.tolist() == pytest.approx([1.0, 2 / 3, 0.0])
    assert output.token_level_rewards.sum(dim=-1).tolist() == pytest.approx([1.0, 2 / 3, 0.0])
    # Each score sits on the EOS, the last valid token.
    assert output.token_level_rewards[0, 5].item() == 1.0
    assert output.token_level_rewards[1, 2].item() == pytest.approx(2 / 3)


def test_rule_reward_passes_data_source_and_extra_info_to_custom_functions(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "2"], length=3)
    seen = []

    def recording_score(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.25

    output = RuleReward(tokenizer, recording_score)(responses, mask, ["a", "b"], ["s1", "s2"], [{"i": 0}, {"i": 1}])
    assert seen == [("s1", "1", "a", {"i": 0}), ("s2", "2", "b", {"i": 1})]
    assert output.scores.tolist() == [0.25, 0.25]


@pytest.mark.parametrize("task", ["copy", "add"])
def test_synthetic_ground_truth_earns_full_reward_from_the_reward_named_by_its_data_source(task):
    for row in make_task_rows(task, 20, seed=0):
        fn = get_reward_fn(row["data_source"])
        assert fn(row["data_source"], row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"], None) == 1.0


# In the worker by name from a module that imports little (the worker imports it anew).
@pytest.mark.parametrize("spec", [pytest.param(graded_reward, id="in_process"),
                                  pytest.param("tests.faults.rewards:graded_reward", id="in_the_worker",
                                               marks=pytest.mark.slow)])
def test_dict_rewards_give_the_score_numeric_extras_and_sample_fields(tmp_path, spec):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["12", "7", "123"], length=5)
    reward = RuleReward(tokenizer, spec)
    try:
        output = reward(responses, mask, ["12", "8", "123"], ["s"] * 3)
    finally:
        reward.close()
    assert (reward.worker is not None) == isinstance(spec, str)
    assert output.scores.tolist() == [1.0, -1.0, 1.0]
    assert output.token_level_rewards.sum(dim=-1).tolist() == [1.0, -1.0, 1.0]
    assert sorted(output.extras) == ["acc", "length"]
    assert output.extras["acc"].tolist() == [1.0, 0.0, 1.0] and output.extras["length"].tolist() == [2.0, 1.0, 3.0]
    assert output.sample_fields == ({"pred": "12"}, {"pred": "7"}, {"pred": "123"})
    assert output.timeouts == {}


def test_float_rewards_have_no_extras(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1"], length=3)
    output = RuleReward(tokenizer, "copy")(responses, mask, ["1"])
    assert output.extras == {} and output.sample_fields == ({},)


def test_rows_without_a_field_are_nan_in_its_tensor(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "2"], length=3)

    def sometimes_a_dict(data_source, solution_str, ground_truth, extra_info):
        return {"score": 1.0, "acc": 1} if solution_str == "1" else 0.0

    output = RuleReward(tokenizer, sometimes_a_dict)(responses, mask, ["1", "1"])
    assert output.scores.tolist() == [1.0, 0.0]
    assert output.extras["acc"][0].item() == 1.0 and output.extras["acc"][1].isnan()


@pytest.mark.parametrize("value, words", [
    ({"acc": 1.0}, "returned dict with fields ['acc'] but no 'score'"),
    ({"score": "1"}, "returned dict whose 'score' is str '1'; it must be a number"),
    ({"score": None, "acc": 1}, "returned dict whose 'score' is NoneType 'None'"),
])
def test_a_dict_without_a_numeric_score_is_one_line_naming_function_and_row(tmp_path, value, words):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "2"], length=3)

    def bad_on_second_row(data_source, solution_str, ground_truth, extra_info):
        return value if solution_str == "2" else 1.0

    with pytest.raises(ValueError) as error:
        RuleReward(tokenizer, bad_on_second_row)(responses, mask, ["1", "2"], ["a", "b"])
    message = str(error.value)
    assert message.startswith("reward.function 'tests.test_reward_rules:test_a_dict_without_a_numeric_score_is_")
    assert "on response 1 (data_source 'b'): " + words in message and "\n" not in message


@pytest.mark.parametrize("value, words", [
    (10**400, "returned int '1" + "0" * 39 + "', outside a float32 score's range (magnitude at most 3.4e+38)"),
    (10**5000, "returned int '(too many digits to print)', outside a float32 score's range"),
    (1e300, "returned float '1e+300', outside a float32 score's range"),
    ({"score": -10**400}, "returned dict whose 'score' is int '-1000"),
    ({"score": 1.0, "acc": 10**400}, "returned dict whose 'acc' is int '1000"),
], ids=["10**400", "10**5000", "1e300", "dict score", "dict field"])
def test_a_number_out_of_a_float32_scores_range_is_one_line_naming_function_and_row(tmp_path, value, words):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "2"], length=3)

    def huge_on_second_row(data_source, solution_str, ground_truth, extra_info):
        return value if solution_str == "2" else 1.0

    with pytest.raises(UserError) as error:
        RuleReward(tokenizer, huge_on_second_row)(responses, mask, ["1", "2"], ["a", "b"])
    message = str(error.value)
    assert "on response 1 (data_source 'b'): " + words in message and "\n" not in message


def test_a_function_that_calls_sys_exit_is_one_line_naming_it(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1"], length=3)
    with pytest.raises(UserError, match=r"^reward.function 'tests.faults.rewards:exiting_reward' on response 0 "
                                        r"\(data_source None\): called sys.exit\(3\)$"):
        RuleReward(tokenizer, "tests.faults.rewards:exiting_reward", timeout_s=0)(responses, mask, ["1"])


def test_a_dict_score_that_is_nan_reaches_the_trainer_as_such(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1"], length=3)
    output = RuleReward(tokenizer, lambda *row: {"score": float("nan")})(responses, mask, ["1"])
    assert output.scores.isnan().all()  # trainer.nonfinite stops or skips, naming the function and the rows
