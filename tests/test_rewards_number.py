"""Rewards that cannot be paid for not computing: the `number` scorer and `reward.math.final_form`, on the hostile
answers of a real run (math-verify paid "26 - 10 =" for 16) and on the right answers people write."""
import pytest

from verl_mega.config import load_config
from verl_mega.config.schema import RewardMathConfig
from verl_mega.rewards import math_answers
from verl_mega.rewards.final_number import final_number, holds_operation, number_score
from verl_mega.rewards.math_answers import dapo_score, math_score
from verl_mega.rewards.registry import needs_time_limit
from verl_mega.rewards.results import Scored
from verl_mega.rewards.worker import ScoringWorker

# Answers a policy found to stop before the result: each evaluates to the truth.
HOSTILE = [
    ("... so she has 26 - 10 =", "16"),
    ("so 3 + 4 =", "7"),
    ("The answer is 26-10", "16"),
    ("The answer is \\boxed{26-10}", "16"),
    ("#### 26 - 10", "16"),
    ("She has 16/2 apples", "8"),
    ("so she has 2^{4}", "16"),
    ("The total is 2 \\times 8", "16"),
    ("So she has 9 + 7 = ", "16"),
]


@pytest.mark.parametrize("answer, truth", HOSTILE)
def test_number_pays_no_expression(answer, truth):
    assert number_score("arith", answer, truth) == 0.0


@pytest.mark.parametrize("answer, truth", HOSTILE)
def test_math_pays_them_unless_final_form_is_asked(answer, truth):
    math_answers.configure(RewardMathConfig(final_form=True))
    try:
        assert math_score("arith", answer, truth) == 0.0
        assert dapo_score("arith", answer, truth)["score"] == -1.0
    finally:
        math_answers.configure(RewardMathConfig())


def test_math_without_the_option_pays_the_issue_s_expressions():
    # The behaviour the option exists for (math-verify evaluates what it reads): if this changes, the docs do too.
    assert math_score("arith", "... so she has 26 - 10 =", "16") == 1.0
    assert math_score("arith", "so 3 + 4 =", "7") == 1.0
    assert math_score("arith", "The answer is 26-10", "16") == 1.0


@pytest.mark.parametrize("answer, truth", [
    ("26 - 10 = 16", "16"),
    ("So she has 26 - 10 = 16 apples.", "16"),
    ("The answer is 16.", "16"),
    ("16.0", "16"),
    ("She pays $16", "16"),
    ("She pays \\$16.", "16"),
    ("1,600 people", "1600"),
    ("It was 1,600", "1,600"),
    ("The change is -3", "-3"),
    ("It fell by \u22123", "-3"),
    ("The answer is \\boxed{16}. Check: 26 - 10 = 16", "16"),
    ("48 + 24 = 72\n#### 72", "72"),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72"),  # a full GSM8K solution as the truth
    ("x = 16", 16),
    ("It is 0.5", 0.5),
])
def test_number_pays_the_number_stated(answer, truth):
    assert number_score("arith", answer, truth) == 1.0


@pytest.mark.parametrize("answer, truth", [
    ("26 - 10 = 15", "16"),
    ("16 apples, then 2 more", "16"),  # the final number is the last one stated
    ("sixteen", "16"),  # words are not numbers
    ("\\frac{32}{2}", "16"),
    ("\\sqrt{256}", "16"),
    ("", "16"),
    ("16 -", "16"),
])
def test_number_refuses_what_is_not_the_final_number(answer, truth):
    assert number_score("arith", answer, truth) == 0.0


@pytest.mark.parametrize("answer, truth", [
    ("26 - 10 = 16", "16"),
    ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{x^2+7x+10}", "x^2+7x+10"),
    ("\\boxed{2+\\sqrt{3}}", "2+\\sqrt{3}"),
    ("\\boxed{-3}", "-3"),
    ("48 + 24 = 72\n#### 72", "72"),
])
def test_final_form_still_pays_final_answers(answer, truth):
    math_answers.configure(RewardMathConfig(final_form=True))
    try:
        assert math_score("any", answer, truth) == 1.0
    finally:
        math_answers.configure(RewardMathConfig())


def test_what_holds_an_operation():
    assert holds_operation("26 - 10") and holds_operation("\\frac{16}{2}") and holds_operation("16/2")
    assert not holds_operation("1/2") and not holds_operation("3-4i") and not holds_operation("1,600")


def test_a_ground_truth_that_is_no_number_names_itself():
    with pytest.raises(ValueError, match=r"needs a number as the ground truth, got '\\\\frac\{1\}\{2\}'"):
        number_score("arith", "0.5", "\\frac{1}{2}")


def test_number_is_linear_and_runs_without_the_worker():
    assert not needs_time_limit("number")
    hostile = "1," * 200_000 + "9" * 200_000 + " - " * 100_000 + "\\boxed{" + "{" * 100_000
    # Linear work on 1.6 MB takes a fraction of a second; a quadratic scan would not finish.
    assert final_number(hostile) is None


def test_the_config_key_reaches_the_scoring_worker():
    config = load_config(None, ["model.hf_path=unused", "reward.math.final_form=true"])
    worker = ScoringWorker("math", timeout_s=60, memory_limit_mb=4096, math=config.reward.math)
    try:
        hostile, right = worker.score([("arith", "so 3 + 4 =", "7", None), ("arith", "3 + 4 = 7", "7", None)])
    finally:
        worker.close()
    assert isinstance(hostile, Scored) and hostile.score == 0.0
    assert isinstance(right, Scored) and right.score == 1.0
