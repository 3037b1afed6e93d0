"""The scoring worker: a hostile answer (a LaTeX power tower that sympy computes for hours) scores 0 within
reward.timeout_s plus a margin, is counted, the worker is replaced and the next answers score normally; an
answer that allocates past reward.memory_limit_mb likewise; no worker process outlives close(). The tests that
start a worker are slow (a child process importing sympy: about half a second each on an idle machine)."""
import re
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from verl_mega.config.errors import UserError
from verl_mega.data.tiny_tokenizer import save_tiny_tokenizer
from verl_mega.rewards.results import Scored, Stopped
from verl_mega.rewards.worker import ScoringWorker
from verl_mega.roles.reward import RewardOutput, RuleReward

from .faults.processes import survivors_after
from .test_reward_rules import encode_responses

HOSTILE = "\\boxed{9^{9^{9}}}"
LIMIT_S = 1.0
MARGIN_S = 1.5  # killing the child and the pipe's round trip, on a loaded 2-core machine
RIGHT, WRONG = ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5", None), ("lighteval/MATH", "\\boxed{3}", "2", None)


@pytest.mark.slow
def test_the_hostile_answer_runs_far_past_the_limit_without_it():
    """The premise: in-process, with math-verify's own alarms off (as the math rewards run), the answer does
    not finish in 4x the limit the tests below hold it to."""
    script = "import sys; from verl_mega.rewards.math_answers import math_score; math_score(None, sys.argv[1], '1')"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", script, HOSTILE], timeout=4 * LIMIT_S + 1.0)  # +1: the imports


@pytest.mark.slow
def test_a_hostile_answer_scores_0_in_time_and_its_worker_is_replaced():
    worker = ScoringWorker("math", timeout_s=LIMIT_S, memory_limit_mb=1024)
    try:
        assert worker.score([RIGHT]) == [Scored(1.0, {}, {})]  # started and warm
        first = worker.process.pid
        start = time.monotonic()
        [verdict] = worker.score([("lighteval/MATH", HOSTILE, "1", None)])
        elapsed = time.monotonic() - start
        assert verdict == Stopped(f"took longer than reward.timeout_s={LIMIT_S:g} s")
        assert LIMIT_S <= elapsed < LIMIT_S + MARGIN_S
        assert survivors_after([first], 5.0) == []
        verdicts = worker.score([RIGHT, ("lighteval/MATH", HOSTILE, "1", None), WRONG, RIGHT])
        assert [type(v).__name__ for v in verdicts] == ["Scored", "Stopped", "Scored", "Scored"]
        assert [v.score for v in verdicts if isinstance(v, Scored)] == [1.0, 0.0, 1.0]
        assert worker.process.pid != first
    finally:
        last = worker.process.pid
        worker.close()
    assert worker.process is None and survivors_after([last], 5.0) == []


@pytest.mark.slow
def test_an_answer_that_allocates_past_the_memory_limit_scores_0_and_the_next_ones_score():
    worker = ScoringWorker("tests.faults.rewards:allocating_reward", timeout_s=30.0, memory_limit_mb=256)
    try:
        [verdict] = worker.score([(None, "1", "1", None)])
        assert verdict == Stopped("exceeded reward.memory_limit_mb=256")
    finally:
        worker.close()
    sane = ScoringWorker("math", timeout_s=30.0, memory_limit_mb=256)  # the cap leaves room for the imports
    try:
        assert sane.score([RIGHT, WRONG]) == [Scored(1.0, {}, {}), Scored(0.0, {}, {})]
    finally:
        sane.close()


@pytest.mark.slow
def test_rule_reward_counts_the_stopped_answers_and_close_ends_its_worker(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "9", "1", "2"], length=3)
    reward = RuleReward(tokenizer, "tests.faults.rewards:hostile_on_nine", timeout_s=LIMIT_S)
    try:
        output = reward(responses, mask, ["1", "9", "2", "2"], ["m"] * 4)
        assert output.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert output.timeouts == {1: f"took longer than reward.timeout_s={LIMIT_S:g} s"}
        assert output.token_level_rewards.sum(dim=-1).tolist() == [1.0, 0.0, 0.0, 1.0]
        assert output.extras == {}
        pid = reward.worker.process.pid
    finally:
        reward.close()
    assert survivors_after([pid], 5.0) == []


@pytest.mark.slow
def test_a_worker_that_dies_is_counted_apart_and_the_next_answers_score(tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1", "9", "1"], length=3)
    reward = RuleReward(tokenizer, "tests.faults.rewards:dies_on_nine", timeout_s=30.0)
    try:
        output = reward(responses, mask, ["1", "9", "1"], ["m"] * 3)
    finally:
        reward.close()
    assert output.scores.tolist() == [1.0, 0.0, 1.0]
    assert output.worker_deaths == {1: "the scoring worker died on it (exit code 9)"} and output.timeouts == {}
    assert output.take([1, 2]).worker_deaths == {0: "the scoring worker died on it (exit code 9)"}
    assert RewardOutput.concat([output, output]).worker_deaths.keys() == {1, 4}
    assert "reward.function 'tests.faults.rewards:dies_on_nine': the scoring worker died on it (exit code 9) " \
           "(response 1, data_source 'm')" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("function, words", [("huge_int_reward", "returned int '1000"),
                                             ("exiting_reward", "called sys.exit(3)")])
def test_a_bad_return_or_exit_in_the_worker_is_one_line_naming_the_function(tmp_path, function, words):
    """Not a death nor a timeout: the worker reads the value (or catches the exit) as the trainer would."""
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    responses, mask = encode_responses(tokenizer, ["1"], length=3)
    reward = RuleReward(tokenizer, f"tests.faults.rewards:{function}", timeout_s=30.0)
    try:
        with pytest.raises(UserError, match=f"^reward.function 'tests.faults.rewards:{function}' on response 0 "
                                            f"\\(data_source 'm'\\): {re.escape(words)}"):
            reward(responses, mask, ["1"], ["m"])
    finally:
        reward.close()


def test_linear_time_rules_and_callables_run_without_a_worker(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    assert RuleReward(tokenizer, "copy").worker is None
    assert RuleReward(tokenizer, lambda *row: 1.0).worker is None
    assert RuleReward(tokenizer, "math", timeout_s=0).worker is None  # reward.timeout_s=0: no limit
    assert RuleReward(tokenizer, "math").worker is not None


@pytest.mark.slow
def test_a_worker_that_cannot_import_its_function_is_a_clear_error():
    worker = ScoringWorker("no_such_module_here:score", timeout_s=1.0, memory_limit_mb=0)
    with pytest.raises(RuntimeError, match="the scoring worker for reward.function 'no_such_module_here:score' "
                                           "did not start"):
        worker.score([RIGHT])
    assert worker.process is None
