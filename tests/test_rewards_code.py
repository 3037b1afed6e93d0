"""Code-execution rewards (`code_tests`, and `default` on verl's code data sources), in process: answers that
pass, fail a case, loop, crash, flood the output or try to get out of the sandbox; stdin, call-based and
assert tests; verl's output tolerances (floats by np.allclose's rule); and the scoring worker carrying
reward.code's limits and leaving no process behind when it is killed mid-test."""
import json
import os
import socket
import time

import psutil
import pytest

from verl_mega.config.schema import RewardCodeConfig
from verl_mega.rewards import code_tests
from verl_mega.rewards.code_tests import code_tests_score, extract_code, read_tests, stdout_matches
from verl_mega.rewards.registry import get_reward_fn
from verl_mega.rewards.results import Scored
from verl_mega.rewards.worker import ScoringWorker

from .test_tools_sandbox import namespaces_refused

pytestmark = pytest.mark.skipif(namespaces_refused(), reason="the kernel refuses the sandbox's namespaces")

SUM = {"inputs": ["1 2\n", "3 4\n", "10 20\n"], "outputs": ["3\n", "7\n", "30\n"]}
QUICK = RewardCodeConfig(test_timeout_s=4.0, memory_mb=512, workers=2, max_output_chars=10_000)
SECRET = "verl-mega-code-secret-4711"


@pytest.fixture(autouse=True)
def quick_limits():
    code_tests.configure(QUICK)
    yield
    code_tests.configure(RewardCodeConfig())


@pytest.fixture(scope="module", autouse=True)
def earlier_children():
    """The processes this worker already had when the module started (another file's, e.g. multiprocessing's
    resource tracker, which lives as long as the process): not the scoring's, so not counted against it."""
    EARLIER.update(child.pid for child in psutil.Process().children(recursive=True))
    yield


EARLIER: set[int] = set()


def no_descendants() -> bool:
    """Every process the scoring started has ended (the sandbox's namespaces take their processes with them)."""
    def started() -> list:
        return [child for child in psutil.Process().children(recursive=True) if child.pid not in EARLIER]

    deadline = time.monotonic() + 3.0
    while started() and time.monotonic() < deadline:
        time.sleep(0.05)
    return started() == []


def score(answer: str, tests=SUM) -> dict:
    result = code_tests_score("codecontests", f"Here it is:\n```python\n{answer}\n```\nDone.", json.dumps(tests))
    assert no_descendants()
    return result


def test_a_correct_answer_passes_every_case():
    result = score("a, b = map(int, input().split())\nprint(a + b)")
    assert result == {"score": 1.0, "tests_passed": 3, "tests_run": 3, "test_outcomes": ["pass"] * 3}


def test_an_answer_wrong_on_one_case_scores_the_fraction_it_passes():
    result = score("a, b = map(int, input().split())\nprint(0 if a == 10 else a + b)")
    assert result["score"] == pytest.approx(2 / 3) and result["test_outcomes"] == ["pass", "pass", "wrong"]


def test_only_the_first_max_tests_cases_count_as_verl_s_continuous_score():
    tests = {"inputs": [f"{i} 0" for i in range(12)], "outputs": [str(i) for i in range(12)]}
    code_tests.configure(RewardCodeConfig(**{**vars(QUICK), "max_tests": 10}))
    wrong_late = "a, b = map(int, input().split())\nprint(-1 if a >= 10 else a)"
    assert score(wrong_late, tests)["score"] == 1.0  # cases 11 and 12 fail, as in verl: still 1
    assert score("a, b = map(int, input().split())\nprint(-1 if a == 0 else a)", tests)["score"] == 0.9


def test_an_infinite_loop_fails_its_case_at_the_time_limit():
    start = time.monotonic()
    result = score("a, b = map(int, input().split())\nwhile a == 10:\n    pass\nprint(a + b)")
    assert result["test_outcomes"] == ["pass", "pass", "timeout"]
    assert time.monotonic() - start < 2 * QUICK.test_timeout_s + 3


@pytest.mark.parametrize("ending, outcome", [
    ("raise ValueError('boom')", "error"),
    ("import sys; sys.exit(3)", "pass"),  # verl judges a sys.exit()'ed program by its output
    ("import os; os._exit(0)", "pass"),  # the output was written unbuffered before it
    ("import os; os._exit(7)", "error"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "error"),
])
def test_a_crash_after_the_right_output_is_judged_as_verl_does(ending, outcome):
    result = score(f"a, b = map(int, input().split())\nprint(a + b)\n{ending}")
    assert result["test_outcomes"] == [outcome] * 3


def test_a_syntax_error_fails_every_case():
    assert score("print(1 +")["test_outcomes"] == ["error"] * 3


def test_printing_100_mb_fails_at_the_output_limit_at_once():
    start = time.monotonic()
    result = score("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)")
    assert result["test_outcomes"] == ["output_limit"] * 3
    assert time.monotonic() - start < 5


def test_a_memory_bomb_fails_its_case():
    assert score("x = bytearray(10 ** 11)\nprint(3)")["test_outcomes"] == ["error"] * 3


def test_a_fork_bomb_is_contained_and_leaves_no_process():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert score(bomb)["score"] == 0.0


def test_children_left_running_in_their_own_session_die_with_the_case():
    code = ("import os, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
            "a, b = map(int, input().split())\nprint(a + b)")
    assert score(code)["score"] == 1.0  # and score() found no process left


def test_the_answer_reads_no_file_of_the_trainer(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    code = f"print(open({str(secret)!r}).read())"
    assert score(code, {"inputs": [""], "outputs": [SECRET]})["test_outcomes"] == ["error"]


def test_the_answer_reaches_no_socket_of_the_host():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('in')"
        assert score(code, {"inputs": [""], "outputs": ["in"]})["test_outcomes"] == ["error"]


def test_the_answer_cannot_signal_the_scorer():
    code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\nprint(1)"
    assert score(code, {"inputs": [""], "outputs": ["1"]})["test_outcomes"] == ["error"]  # and we are alive


@pytest.mark.parametrize("answer, tests, outcomes", [
    ("def add(a, b):\n    print('noise')\n    return a + b",
     {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[[1, 2]]"]}, ["pass", "pass"]),
    ("class Solution:\n    def pair(self, n):\n        return (n, n + 1)",  # a tuple is a list
     {"fn_name": "pair", "inputs": ["1"], "outputs": ["[1, 2]"]}, ["pass"]),
    ("def pairs(n):\n    return [(i, i) for i in range(n)]",  # a list of tuples against the first element
     {"fn_name": "pairs", "inputs": ["2"], "outputs": ["[[[0, 0], [1, 1]]]"]}, ["pass"]),
    ("def keys(d):\n    return {k + 1: v for k, v in d.items()}",  # JSON's string keys read back as ints
     {"fn_name": "keys", "inputs": ['{"1": "a"}'], "outputs": ['{"2": "a"}']}, ["pass"]),
    ("def add(a, b):\n    return a - b", {"fn_name": "add", "inputs": ["1\n2"], "outputs": ["3"]}, ["wrong"]),
    ("def other(a, b):\n    return a + b", {"fn_name": "plus", "inputs": ["1\n2"], "outputs": ["3"]}, ["error"]),
    # verl's star imports name operator.add: an answer without `add` still has one, there as here
    ("def other(a, b):\n    return a + b", {"fn_name": "add", "inputs": ["1\n2"], "outputs": ["3"]}, ["pass"]),
    ("def f(x):\n    return x * 2", {"assert_case": ["assert f(2) == 4", "assert f(3) == 5"]}, ["pass", "error"]),
])
def test_call_based_and_assert_tests(answer, tests, outcomes):
    assert score(answer, tests)["test_outcomes"] == outcomes


@pytest.mark.parametrize("written, expected, matches", [
    ("3\n", "3", True),
    ("  1 2  \n 3\n", "1 2\n3", True),  # each line stripped
    ("1\n\n2\n", "1\n2\n", True),  # empty lines dropped
    ("0.3333333\n", "0.33333333", True),  # np.allclose: rtol 1e-5, atol 1e-8
    ("1e9\n", "1000000001", True),  # relative to the expected number
    ("1e-9\n", "0", True),  # within atol
    ("0.334\n", "0.333", False),
    ("007\n", "7", False),  # two digit strings compare as text
    ("-7.0\n", "-7", True),
    ("1.0 2.0\n", "1 2", False),  # the numbers rule reads one number a line
    ("inf\n", "inf", True),
    ("nan\n", "nan ", True),  # as text
    ("nan\n", "1.5", False),
    ("1 2\n", "2 1", False),
])
def test_stdout_tolerances_follow_verl(written, expected, matches):
    assert stdout_matches(written, expected) is matches


def test_the_code_is_the_last_python_block_or_the_whole_response():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```\nc") == "\ny = 2\n"
    assert extract_code("print(1)") == "print(1)"


@pytest.mark.parametrize("ground_truth, message", [
    ("{not json", "not JSON"),
    ({"inputs": ["1"]}, "needs lists 'inputs' and 'outputs'"),
    ({"inputs": [], "outputs": []}, "no test cases"),
    (7, "got int"),
])
def test_a_ground_truth_without_tests_is_refused_naming_why(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        read_tests(ground_truth)


def test_default_routes_a_codecontests_row_to_the_code_scorer():
    result = get_reward_fn("default")("codecontests", "```python\nprint(sum(map(int, input().split())))\n```",
                                      json.dumps(SUM), None)
    assert result["score"] == 1.0 and result["tests_run"] == 3


def test_the_scoring_worker_runs_code_under_reward_code_s_limits():
    limits = RewardCodeConfig(**{**vars(QUICK), "max_tests": 2})
    worker = ScoringWorker("default", timeout_s=60, memory_limit_mb=4096, code=limits)
    try:
        [verdict] = worker.score([("apps", "print(sum(map(int, input().split())))", json.dumps(SUM), None)])
    finally:
        worker.close()
    assert isinstance(verdict, Scored) and verdict.score == 1.0 and verdict.metrics["tests_run"] == 2


def test_a_scoring_worker_killed_mid_test_leaves_no_sandbox_running():
    worker = ScoringWorker("code_tests", timeout_s=1.0, memory_limit_mb=4096,
                           code=RewardCodeConfig(test_timeout_s=60, workers=2))
    try:
        verdicts = worker.score([("apps", "import time\ntime.sleep(60)", json.dumps(SUM), None)])
    finally:
        worker.close()
    assert type(verdicts[0]).__name__ == "Stopped"
    assert no_descendants()
