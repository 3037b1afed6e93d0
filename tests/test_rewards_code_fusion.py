"""Code-execution rewards through a SandboxFusion service (`reward.code.sandbox_url`), against a real server
process (tests/workers/sandbox_fusion_server.py, running the project's sandbox): the same outcomes and scores as
the local sandbox for answers that pass, fail, loop, crash or flood the output; a 5xx retried; a service that
is down stopping the run in one line that names the URL; the preflight refusing an address that is not
http(s) and a reward.timeout_s shorter than the retries."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from verl_mega.config.schema import RewardCodeConfig
from verl_mega.rewards import code_tests
from verl_mega.rewards.code_tests import code_tests_score
from verl_mega.rewards.remote import RemoteRewardError, RequestFailed
from verl_mega.rewards.results import Refused, Scored
from verl_mega.rewards.sandbox_fusion import SandboxFusion, config_problems
from verl_mega.rewards.worker import ScoringWorker

from .test_tools_sandbox import namespaces_refused

pytestmark = pytest.mark.skipif(namespaces_refused(), reason="the kernel refuses the sandbox's namespaces")

REPO = Path(__file__).resolve().parent.parent
SUM = {"inputs": ["1 2\n", "3 4\n", "10 20\n"], "outputs": ["3\n", "7\n", "30\n"]}
LOCAL = RewardCodeConfig(test_timeout_s=3.0, memory_mb=512, workers=3, max_output_chars=10_000,
                         sandbox_retries=2, sandbox_backoff_s=0.05)
ANSWERS = {
    "passes": "a, b = map(int, input().split())\nprint(a + b)",
    "wrong on one case": "a, b = map(int, input().split())\nprint(0 if a == 10 else a + b)",
    "loops on one case": "a, b = map(int, input().split())\nwhile a == 3: pass\nprint(a + b)",
    "crashes": "a, b = map(int, input().split())\nprint(a + b)\nraise ValueError('no')",
    "prints too much": "a, b = map(int, input().split())\nprint('x' * (0 if a == 1 else 100_000))\nprint(a + b)",
}


@pytest.fixture(scope="module")
def service():
    """The test service's base URL (its output cap above reward.code.max_output_chars, as a real service's)."""
    process = subprocess.Popen([sys.executable, "-m", "tests.workers.sandbox_fusion_server", "1000000"],
                               stdout=subprocess.PIPE, cwd=REPO, text=True)
    port = int(process.stdout.readline())
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)


def fail_next(url: str, times: int) -> None:
    request = urllib.request.Request(f"{url}/control", json.dumps({"fail_times": times}).encode(), method="POST")
    urllib.request.urlopen(request, timeout=10).read()


def requests_seen(url: str) -> int:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())["requests"]


def score(answer: str, config: RewardCodeConfig) -> dict:
    code_tests.configure(config)
    try:
        return code_tests_score("codecontests", f"```python\n{answer}\n```", json.dumps(SUM))
    finally:
        code_tests.configure(RewardCodeConfig())


@pytest.mark.slow
def test_the_service_scores_as_the_local_sandbox(service):
    remote = replace(LOCAL, sandbox_url=service)
    for name, answer in ANSWERS.items():
        here, there = score(answer, LOCAL), score(answer, remote)
        assert there == here, name
    assert score(ANSWERS["loops on one case"], remote)["test_outcomes"] == ["pass", "timeout", "pass"]
    assert score(ANSWERS["crashes"], remote)["test_outcomes"] == ["error"] * 3
    assert score(ANSWERS["prints too much"], remote)["test_outcomes"] == ["pass", "output_limit", "output_limit"]
    assert score(ANSWERS["wrong on one case"], remote)["score"] == pytest.approx(2 / 3)


def test_a_5xx_is_retried(service):
    fail_next(service, 2)
    result = score(ANSWERS["passes"], replace(LOCAL, sandbox_url=service + "/", workers=1))
    assert result["score"] == 1.0
    assert requests_seen(service) == 3 + 2


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # nothing listens there once the probe closes


def test_a_service_that_stays_down_stops_the_run_in_one_line_naming_the_url():
    url = closed_port_url()
    with pytest.raises(RemoteRewardError) as stopped:
        score(ANSWERS["passes"], replace(LOCAL, sandbox_url=url))
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith(f"reward.code.sandbox_url {url}: a test case's run failed 3 times "
                           "(reward.code.sandbox_retries=2)"), line
    assert "refused" in line


@pytest.mark.slow
def test_the_scoring_worker_carries_the_address_and_refuses_the_answer_of_a_service_down(service):
    """As a run scores: the worker process reads reward.code from its setup; a service that is down refuses the
    answer with the line (the reward role stops the run on a refusal, naming the row)."""
    down = closed_port_url()
    worker = ScoringWorker("code_tests", timeout_s=60, memory_limit_mb=4096, code=replace(LOCAL, sandbox_url=service))
    stopping = ScoringWorker("code_tests", timeout_s=60, memory_limit_mb=4096, code=replace(LOCAL, sandbox_url=down))
    row = ("apps", ANSWERS["passes"], json.dumps(SUM), None)
    try:
        fail_next(service, 0)
        [verdict], [refused] = worker.score([row]), stopping.score([row])
    finally:
        worker.close()
        stopping.close()
    assert isinstance(verdict, Scored) and verdict.score == 1.0 and requests_seen(service) == 3
    assert isinstance(refused, Refused) and refused.problem.startswith(f"reward.code.sandbox_url {down}: ")


def test_a_5xx_that_never_ends_stops_the_run(service):
    fail_next(service, 100)
    try:
        with pytest.raises(RemoteRewardError, match=r"failed 3 times .*HTTP 503"):
            score(ANSWERS["passes"], replace(LOCAL, sandbox_url=service, workers=1))
    finally:
        fail_next(service, 0)


@pytest.mark.parametrize("reply", [
    {"status": "SandboxError", "message": "no worker"},
    {"status": "SandboxError", "run_result": {"status": "Error", "stdout": "", "return_code": None}},
    {"status": "Failed", "run_result": {"status": "Error", "stdout": "", "return_code": None}},
    {"status": "Failed", "message": ""}, {"status": "Success", "run_result": {"status": "Finished", "stdout": 7}},
    {"detail": "Not Found"}, ["Success"]])
def test_a_reply_that_is_the_services_failure_or_not_its_format_fails_the_request(reply):
    with pytest.raises(RequestFailed):
        SandboxFusion(replace(LOCAL, sandbox_url="http://127.0.0.1:1")).read_reply(reply)


@pytest.mark.parametrize("url", ["ftp://sandbox.example", "sandbox.example:8080", "http://"])
def test_an_address_that_is_not_http_is_refused_in_one_line(url):
    assert config_problems(replace(LOCAL, sandbox_url=url), 30.0) == [
        f"reward.code.sandbox_url {url!r} is not an http:// or https:// address of a SandboxFusion service"]


def test_a_reward_timeout_shorter_than_the_retries_is_refused():
    config = replace(LOCAL, sandbox_url="http://127.0.0.1:1", sandbox_retries=3, sandbox_backoff_s=1.0)
    assert config_problems(config, 30.0) == [] and config_problems(config, 0.0) == []
    (problem,) = config_problems(config, 5.0)
    assert problem.startswith("reward.timeout_s=5 is not above the 7 s of retries")


def test_the_preflight_check_refuses_a_bad_address(tiny_models, tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "p", "data_source": "codecontests", "reward_model": {"ground_truth": "{}"}}\n')
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompts}]",
                                "reward.function=code_tests", "reward.code.sandbox_url=ftp://sandbox.example",
                                "trainer.run_dir=run"])
    with pytest.raises(ConfigError, match=r"reward.code.sandbox_url 'ftp://sandbox.example' is not an http://"):
        preflight_check(config, world_size=1)
