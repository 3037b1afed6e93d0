"""The math rewards (math-verify) on a table of answers, and the router that picks a scorer by data_source."""
import pytest

from verl_mega.config.errors import UserError
from verl_mega.rewards.final_number import number_score
from verl_mega.rewards.math_answers import dapo_score, gsm8k_score, math_score
from verl_mega.rewards.registry import REWARD_FUNCTIONS, get_reward_fn
from verl_mega.rewards.router import default_score, scorer_for
from verl_mega.rewards.rules import copy_score

GSM8K_SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"


@pytest.mark.parametrize("answer, truth, expected", [
    ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),  # equal as numbers, not as strings
    ("The answer is $\\frac{3}{6}$", "\\frac{1}{2}", 1.0),  # LaTeX without a box
    ("0.5", "\\frac{1}{2}", 1.0),  # a plain number
    ("x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # expressions, simplified
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("First 3, then \\boxed{7}", "7", 1.0),  # the boxed answer, not the first number
    ("48 + 24 = 72\n#### 72", "72", 1.0),  # GSM8K's answer line
    ("#### 1,000", "1000", 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0),  # a full GSM8K solution as the ground truth counts by its #### line
    ("The answer is 42.", "42", 1.0),
    ("\\boxed{41}", "42", 0.0),  # wrong
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("#### 71", "72", 0.0),
    ("garbage \\boxed{", "42", 0.0),  # unparsable
    ("", "42", 0.0),
    ("no digits at all", "42", 0.0),
])
def test_math_score_table(answer, truth, expected):
    assert math_score("lighteval/MATH", answer, truth) == expected


@pytest.mark.parametrize("answer, truth, expected", [
    ("48 + 24 = 72\n#### 72", "72", 1.0),
    ("#### 72.0", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0),
    ("#### 70\nno, #### 72", "72", 1.0),  # the last answer line counts
    ("#### 71", "72", 0.0),
    ("The answer is 72", "72", 0.0),  # strict: no #### line, no reward (verl's format score 0)
    ("\\boxed{72}", "72", 0.0),
    ("#### 1.2.3", "123", 0.0),  # not a number
    ("", "72", 0.0),
])
def test_gsm8k_score_is_strict_about_the_answer_line(answer, truth, expected):
    assert gsm8k_score("openai/gsm8k", answer, truth) == expected


def test_dapo_score_is_plus_or_minus_one_with_acc_and_pred():
    assert dapo_score("math_dapo", "so \\boxed{34}", "34") == {"score": 1.0, "acc": True, "pred": "34"}
    assert dapo_score("math_dapo", "so \\boxed{35}", "34") == {"score": -1.0, "acc": False, "pred": "35"}
    assert dapo_score("math_dapo", "no answer", "34") == {"score": -1.0, "acc": False, "pred": ""}


def test_registered_names():
    assert {"math", "gsm8k", "dapo", "default"} <= set(REWARD_FUNCTIONS)
    assert get_reward_fn("math") is math_score and get_reward_fn("default") is default_score


@pytest.mark.parametrize("source, scorer", [
    ("openai/gsm8k", number_score),  # not verl's: its gsm8k scorer pays only a #### line
    ("lighteval/MATH", math_score),
    ("DigitalLearningGmbH/MATH-lighteval", math_score),
    ("HuggingFaceH4/MATH-500", math_score),
    ("numina_olympiads", math_score),
    ("math_dapo", dapo_score),
    ("math", dapo_score),  # as verl routes it
    ("aime24", dapo_score),
    ("aime_2025", dapo_score),
    ("copy", copy_score),
])
def test_router_picks_the_scorer_verl_picks(source, scorer):
    assert scorer_for(source) is scorer


def test_router_scores_each_row_by_its_own_source():
    # GSM8K's final number (its #### line first), MATH's boxed answer, DAPO's plus or minus one.
    assert default_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_score("openai/gsm8k", "#### 72\nsince 8 * 9 = 72", "72") == 1.0
    assert default_score("openai/gsm8k", "she has 26 - 10 =", "16") == 0.0
    assert default_score("openai/gsm8k", "\\boxed{72}", "72") == 1.0
    assert default_score("HuggingFaceH4/MATH-500", "\\frac{144}{2}", "72") == 1.0
    assert default_score("HuggingFaceH4/MATH-500", "\\boxed{72}", "72") == 1.0
    assert default_score("aime24", "\\boxed{72}", "71")["score"] == -1.0


def test_an_unknown_data_source_is_one_line_naming_it_and_the_known_ones():
    with pytest.raises(UserError) as error:
        default_score("hiyouga/geometry3k", "\\boxed{1}", "1")
    message = str(error.value)
    assert "no scorer for data_source 'hiyouga/geometry3k'" in message and "\n" not in message
    assert "known: openai/gsm8k, lighteval/MATH" in message and "aime*" in message


def test_a_huge_unknown_data_source_is_shown_by_its_start():
    with pytest.raises(UserError) as error:
        default_score("x" * 1_000_000 + "\n", "\\boxed{1}", "1")
    message = str(error.value)
    assert f"no scorer for data_source '{'x' * 80}'..." in message and len(message) < 1000 and "\n" not in message
