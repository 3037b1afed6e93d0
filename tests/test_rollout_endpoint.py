"""The rollout endpoint (rollout.endpoint) over real HTTP with the real `openai` client: agents written against
it get the same trajectories, token for token, as the in-process agent loop on the embedded engine (greedy, and
sampled under the same seed); a planted re-tokenisation is kept as sampled; and hostile agents and requests are
refused with a clear error, counted, and never stop the batch."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from tests.agent_chat import memorized_tool_model, qwen_tokenizer, two_grpo_steps
from tests.test_agent_loop import ANSWER, CALL, QUESTION, ReplayEngine, exactness_problems, turn
from verl_mega.config import ToolsConfig
from verl_mega.demo_agent_http import AGENT, calculator_agent
from verl_mega.rollout.agent_loop import AgentLoop
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.endpoint import EndpointRollout, load_agent
from verl_mega.rollout.endpoint.rollout import shared_contexts
from verl_mega.rollout.engine import SamplingParams
from verl_mega.tools import ToolCall, ToolSet

ROWS = [[{"role": "user", "content": "tom has 23 boxes of 7 pens. how many pens?"}],
        [{"role": "user", "content": "ann has 9 coins and 4 more. how many coins?"}]]
EXPECTED = {"prompt": ROWS[0], "reward_model": {"ground_truth": "161"}, "extra_info": {"expression": "23*7"}}
TOOLS = ToolSet(["calculator"], ToolsConfig())  # the agents' own calculator, as the in-process loop's


async def async_calculator_agent(messages, base_url, session_id):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS.schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            result = TOOLS.call(ToolCall(call.function.name, call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    hf, _ = memorized_tool_model(tmp_path_factory.mktemp("endpoint_model") / "hf", EXPECTED)
    engine = EmbeddedEngine(AutoConfig.from_pretrained(hf).to_dict(), device="cpu")
    engine.load_weights(load_file(str(hf / "model.safetensors")).items())
    return AutoTokenizer.from_pretrained(hf), engine


def endpoint(tokenizer, agent, **limits) -> EndpointRollout:
    """The endpoint of the tests: rounds wait up to 30 s for every session (lockstep, however loaded the machine),
    unless a test shortens it for an agent that never asks again."""
    options = {"max_turns": 3, "budget": 64, "stop_token_ids": [], "max_model_len": 256, "tool_call_format":
               "hermes", "timeout_s": 60.0, "batch_wait_s": 30.0, **limits}
    return EndpointRollout(tokenizer, agent, **options)


def in_process(tokenizer, engine, params, conversations=ROWS, **limits):
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        loop = AgentLoop(tokenizer, tools, max_turns=limits.get("max_turns", 3), budget=limits.get("budget", 64),
                         stop_token_ids=[], tool_call_format="hermes")
        return loop.run(engine, conversations, params)


def rewards(result) -> list:
    return [None if response is None else response.episode.agent_reward for response in result.responses]


def same_trajectories(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.prompt_index == b.prompt_index
        assert a.episode.prompt_ids == b.episode.prompt_ids
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.episode.messages == b.episode.messages and a.episode.turn_ends == b.episode.turn_ends
        assert a.episode.tool_calls == b.episode.tool_calls and a.episode.truncated == b.episode.truncated
        assert [r["text"] for r in a.episode.tool_results] == [r["text"] for r in b.episode.tool_results]


@pytest.mark.parametrize("agent", [calculator_agent, async_calculator_agent])
def test_greedy_episodes_through_the_endpoint_are_the_in_process_loops_token_for_token(memorized, agent):
    tokenizer, engine = memorized
    params = SamplingParams(temperature=0.0, max_new_tokens=64, logprobs=True)
    result = endpoint(tokenizer, agent).run(engine, ROWS, params)
    assert result.problems == [] and None not in result.responses
    expected = in_process(tokenizer, engine, params)
    same_trajectories(result.responses, expected)
    first = result.responses[0].episode
    assert first.tool_calls == [{"turn": 0, "name": "calculator", "arguments": {"expression": "23*7"}}]
    assert [m["content"] for m in first.messages[2:]] == ["161", "161"]
    assert rewards(result) == ([None, None] if agent is calculator_agent else [1.0, 1.0])
    assert result.metrics["endpoint/engine_calls"] == 2 and result.metrics["endpoint/dropped"] == 0


def test_sampled_episodes_under_the_same_seed_are_the_in_process_loops(memorized):
    """Temperature 1, two samples per prompt: the endpoint's rounds are the loop's turns, seed for seed."""
    tokenizer, engine = memorized
    params = SamplingParams(temperature=1.0, max_new_tokens=64, n=2, seed=11, logprobs=True)
    result = endpoint(tokenizer, calculator_agent).run(engine, ROWS, params)
    assert result.problems == []
    same_trajectories(result.responses, in_process(tokenizer, engine, params))
    again = endpoint(tokenizer, calculator_agent).run(engine, ROWS, params)
    assert [r.token_ids for r in again.responses] == [r.token_ids for r in result.responses]


def test_a_planted_retokenisation_stays_as_sampled_and_the_episode_is_the_templates():
    """The model spells " answer" letter by letter; the agent sends the decoded text back, which the tokenizer
    would merge: the session keeps the sampled letters, the rest is the template's rendering token by token."""
    qwen = qwen_tokenizer()
    ids = lambda text: qwen(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    spelled = [qwen.convert_tokens_to_ids(piece) for piece in ["Ġ", "a", "n", "s", "w", "e", "r"]]
    planted = ids("The") + spelled + ids(" is 408.") + [qwen.convert_tokens_to_ids("<|im_end|>")]
    sampled = [turn(qwen, CALL), planted]
    engine = ReplayEngine([[sampled[0]], [planted]])
    rollout = EndpointRollout(qwen, calculator_agent, max_turns=4, budget=256, stop_token_ids=[],
                              max_model_len=1024)
    result = rollout.run(engine, [QUESTION], SamplingParams(max_new_tokens=256, seed=7, logprobs=True))
    (response,) = result.responses
    # The sampled positions hold the model's ids; the template's rendering re-tokenises the text and differs.
    (problem,) = exactness_problems(qwen, TOOLS, response, sampled)
    assert "template's rendering" in problem
    assert [t for t, m in zip(response.token_ids, response.loss_mask) if m] == sampled[0] + planted
    # The template's ids in between are what the in-process loop puts there.
    expected = AgentLoop(qwen, TOOLS, max_turns=4, budget=256, stop_token_ids=[]).run(
        ReplayEngine([[sampled[0]], [planted]]), [QUESTION], SamplingParams(max_new_tokens=256, seed=7, logprobs=True))
    same_trajectories([response], expected)
    assert response.episode.messages[-1]["content"] == ANSWER


def test_a_template_exact_episode_with_the_openai_format(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, calculator_agent).run(engine, ROWS[:1], SamplingParams(temperature=0.0))
    (response,) = result.responses
    messages = response.episode.messages
    rendered = tokenizer(tokenizer.apply_chat_template(messages, tools=TOOLS.schemas, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert response.episode.prompt_ids + response.token_ids == rendered[:len(response.episode.prompt_ids)
                                                                        + len(response.token_ids)]


# --- hostile agents ----------------------------------------------------------------------------------------------

def raising_agent(messages, base_url, session_id):
    if messages[0]["content"].startswith("ann"):
        raise RuntimeError("the agent's own bug")
    return calculator_agent(messages, base_url, session_id)


def test_an_agent_that_raises_loses_its_sample_only_and_is_named(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, raising_agent).run(engine, ROWS, SamplingParams(temperature=0.0, n=2))
    assert result.responses[0] is not None and result.responses[1] is not None
    assert result.responses[2] is None and result.responses[3] is None
    assert result.metrics["endpoint/dropped_raised"] == 2 and result.metrics["endpoint/dropped"] == 2
    assert len(result.problems) == 2 and "the agent raised RuntimeError: the agent's own bug" in result.problems[0]


def hanging_agent(messages, base_url, session_id):
    if messages[0]["content"].startswith("ann"):
        time.sleep(3600)
    return calculator_agent(messages, base_url, session_id)


async def async_hanging_agent(messages, base_url, session_id):
    if messages[0]["content"].startswith("ann"):
        await asyncio.sleep(3600)
    return await async_calculator_agent(messages, base_url, session_id)


@pytest.mark.parametrize("agent", [hanging_agent, async_hanging_agent])
def test_an_agent_that_hangs_is_dropped_at_its_wall_clock_and_the_others_are_kept(memorized, agent):
    tokenizer, engine = memorized
    start = time.monotonic()
    result = endpoint(tokenizer, agent, timeout_s=4.0, batch_wait_s=0.2).run(engine, ROWS,
                                                                           SamplingParams(temperature=0.0))
    assert time.monotonic() - start < 20
    assert result.responses[0] is not None and result.responses[1] is None
    assert result.metrics["endpoint/dropped_timeout"] == 1
    assert "did not return within its wall clock" in result.problems[0]


def unknown_session_agent(messages, base_url, session_id):
    client = openai.OpenAI(base_url=base_url.replace(session_id, "nobody"), api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(model="policy", messages=messages)
    except openai.NotFoundError as err:
        assert err.code == "unknown_session" and "unknown session 'nobody'" in err.message
        return None
    raise AssertionError("an unknown session was answered")


def test_an_unknown_session_gets_404_and_a_sample_with_no_turn_is_dropped(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, unknown_session_agent).run(engine, ROWS[:1], SamplingParams(temperature=0.0))
    assert result.responses == [None] and result.metrics["endpoint/dropped_no_turn"] == 1
    assert result.metrics["endpoint/rejected/unknown_session"] == 1
    assert "asked for no turn" in result.problems[0]


def endless_agent(messages, base_url, session_id):
    """Never stops on its own: it answers every turn with another question."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS.schemas)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        for call in reply.choices[0].message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "161"})
        if not reply.choices[0].message.tool_calls:
            messages.append({"role": "user", "content": "again"})


def test_a_session_that_never_ends_is_ended_by_max_turns_and_kept(memorized):
    """The agent raises on the refusal (410): the trajectory a limit ended is kept all the same."""
    tokenizer, engine = memorized
    result = endpoint(tokenizer, endless_agent, max_turns=3, budget=200).run(engine, ROWS[:1],
                                                                          SamplingParams(temperature=0.0))
    (response,) = result.responses
    assert response is not None and len(response.episode.turn_ends) == 3 and result.problems == []
    assert result.metrics["endpoint/limit_ended"] == 1 and result.metrics["endpoint/rejected/session_ended"] == 1
    assert [m["role"] for m in response.episode.messages].count("user") == 2  # the prompt's, and one "again"


def test_a_session_is_ended_by_its_token_budget(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, endless_agent, max_turns=50, budget=40).run(engine, ROWS[:1],
                                                                          SamplingParams(temperature=0.0))
    (response,) = result.responses
    assert len(response.token_ids) <= 40 and response.episode.truncated
    assert result.metrics["endpoint/limit_ended"] == 1


def flooding_agent(messages, base_url, session_id):
    """Twenty requests at once on its own session; the status of each in `flooding_agent.codes`."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    codes = []

    def ask():
        try:
            client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            codes.append(200)
        except openai.APIStatusError as err:
            codes.append(err.status_code)

    threads = [threading.Thread(target=ask) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flooding_agent.codes = codes


def test_a_flooding_agent_gets_one_turn_at_a_time_and_the_rest_refused(memorized):
    """One request is answered; the others find the session busy (409) or, once its turn (cut at max_tokens)
    ended the session, ended (410)."""
    tokenizer, engine = memorized
    result = endpoint(tokenizer, flooding_agent, batch_wait_s=0.2).run(engine, ROWS[:1],
                                                                      SamplingParams(temperature=0.0))
    codes = flooding_agent.codes
    assert len(codes) == 20 and codes.count(200) == 1 and set(codes) <= {200, 409, 410}
    # How many find it busy rather than ended is the threads' timing (none, when the turn ends first).
    assert result.metrics.get("endpoint/rejected/session_busy", 0) == codes.count(409)
    assert result.metrics["endpoint/rejected_requests"] == 19
    assert len(result.responses[0].episode.turn_ends) == 1 and result.problems == []


def context_agent(messages, base_url, session_id):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 400}])
    except openai.BadRequestError as err:
        assert err.code == "context_length_exceeded" and "context length is 256" in err.message
    return calculator_agent(messages, base_url, session_id)  # the session is still new: it may start again


def test_a_prompt_past_the_context_length_is_a_clear_400(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, context_agent).run(engine, ROWS[:1], SamplingParams(temperature=0.0))
    assert result.responses[0] is not None and result.metrics["endpoint/rejected/context_length_exceeded"] == 1


def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


MALFORMED = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request"),
    (json.dumps({"messages": []}).encode(), 400, "invalid_request"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": {"x": 1}}]}).encode(), 400, "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode(), 400, "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 3}).encode(), 400, "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(), 400,
     "invalid_request"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": "calculator"}).encode(), 400,
     "invalid_request"),
]


def malformed_agent(messages, base_url, session_id):
    """Sends each malformed body over raw HTTP, then runs a normal episode."""
    seen = []
    for body, _, _ in MALFORMED:
        status, answer = post(f"{base_url}/chat/completions", body)
        seen.append((status, answer["error"]["code"], answer["error"]["message"]))
    status, answer = post(f"{base_url}/chat/completions", b"x" * (17 * 2**20))
    seen.append((status, answer["error"]["code"], answer["error"]["message"]))
    status, answer = post(f"{base_url}/completions", json.dumps({"prompt": [10**9]}).encode())
    seen.append((status, answer["error"]["code"], answer["error"]["message"]))
    status, answer = post(base_url.rsplit("/v1", 1)[0] + "/elsewhere", b"{}")
    seen.append((status, answer["error"]["code"], answer["error"]["message"]))
    malformed_agent.seen = seen
    return calculator_agent(messages, base_url, session_id)


def test_malformed_requests_get_4xx_json_errors_and_the_session_goes_on(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, malformed_agent).run(engine, ROWS[:1], SamplingParams(temperature=0.0))
    assert result.problems == []
    expected = [(status, code) for _, status, code in MALFORMED] + [(413, "request_too_large"),
                                                                   (400, "invalid_request"), (404, "not_found")]
    assert [(status, code) for status, code, _ in malformed_agent.seen] == expected
    assert all(message for _, _, message in malformed_agent.seen)
    assert result.responses[0] is not None and result.problems == []
    assert result.metrics["endpoint/rejected_requests"] == len(expected)


def completion_agent(messages, base_url, session_id):
    """/v1/completions: a raw prompt, one continuation, then the same text extended by the agent."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt = "tom has 23 boxes"
    first = client.completions.create(model="policy", prompt=prompt, max_tokens=5)
    second = client.completions.create(model="policy", prompt=prompt + first.choices[0].text + " and",
                                       max_tokens=5)
    return float(len(first.choices[0].text) + len(second.choices[0].text) > 0)


def test_completions_record_the_sampled_ids_and_mask_the_agents_text(memorized):
    tokenizer, engine = memorized
    result = endpoint(tokenizer, completion_agent).run(engine, ROWS[:1], SamplingParams(temperature=0.0))
    (response,) = result.responses
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert response.episode.prompt_ids == encode("tom has 23 boxes")
    first_end = response.episode.turn_ends[0] + 1
    assert response.loss_mask[:first_end] == [1] * first_end
    added = encode(" and")
    assert response.token_ids[first_end:first_end + len(added)] == added
    assert response.loss_mask[first_end:first_end + len(added)] == [0] * len(added)
    assert len(response.episode.turn_ends) == 2 and rewards(result) == [1.0]


def test_an_agent_is_named_module_function():
    assert load_agent(AGENT) is calculator_agent
    for spec, problem in [("nocolon", "must look like"), ("tests.nowhere_at_all:f", "cannot import module"),
                          ("tests.test_rollout_endpoint:missing", "has no function")]:
        with pytest.raises(ValueError, match=problem):
            load_agent(spec)


@pytest.mark.slow
def test_a_grpo_run_trains_on_the_agents_episodes_through_the_endpoint(tmp_path):
    """Two GRPO steps of `make demo-agent-http`'s recipe (its openai agent) on the memorized prompt, one process,
    the embedded engine: every sample is a session, the episodes call the calculator, the rollout's log-probs
    line up with the trainer's on the sampled tokens, and greedy validation replays the memorized episode."""
    hf, _ = memorized_tool_model(tmp_path / "hf", EXPECTED)
    records = two_grpo_steps(hf, EXPECTED, tmp_path, [f"rollout.multi_turn.agent={AGENT}",
                                                      "rollout.multi_turn.tools=[]"])
    trained = [r for r in records if "reward/mean" in r]
    assert len(trained) == 2 and all(r["endpoint/sessions"] == 4 and r["endpoint/dropped"] == 0 for r in trained), \
        [{k: v for k, v in r.items() if k.startswith("endpoint")} for r in trained]
    assert all(r["multi_turn/tool_calls_mean"] > 0 for r in trained), trained
    assert all(r["rollout_corr/kl_k3"] < 1e-9 for r in trained), [r["rollout_corr/kl_k3"] for r in trained]
    validation = [r for r in records if "val/reward_mean" in r]
    assert validation and all(r["val/reward/acc"] == 1.0 and r["val/reward/tool_correct"] == 1.0
                              for r in validation), validation


def test_the_preflight_check_names_a_bad_agent_and_takes_one_without_tools(tiny_models):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", "rollout.multi_turn.enable=true",
                                "rollout.multi_turn.agent=tests.nowhere_at_all:run", "parallel.rollout_tp=2",
                                "rollout.multi_turn.agent_timeout_s=0"])
    with pytest.raises(ConfigError) as error:
        preflight_check(config, world_size=2, check_files=False)
    message = str(error.value)
    for problem in ("rollout.multi_turn.agent: cannot import module 'tests.nowhere_at_all'",
                    "rollout.multi_turn.agent with parallel.rollout_tp=2", "rollout.multi_turn.agent_timeout_s"):
        assert problem in message, message
    assert "rollout.multi_turn.tools is empty" not in message


def test_an_agents_reward_replaces_the_score_at_its_last_sampled_token():
    import torch

    from verl_mega.roles.reward import RewardOutput
    from verl_mega.rollout.engine import EpisodeInfo
    from verl_mega.trainer.rl.scoring import with_agent_rewards

    def episode(reward):
        return EpisodeInfo([1], [], [], [], [0], False, agent_reward=reward)

    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    scored = RewardOutput(torch.tensor([0.25, 0.5]), torch.tensor([[0, 0, 0, 0.25, 0], [0, 0, 0.5, 0, 0]]))
    out = with_agent_rewards(scored, {"episode": [episode(2.0), episode(None)]}, mask)
    assert out.scores.tolist() == [2.0, 0.5]
    assert out.token_level_rewards.tolist() == [[0, 0, 0, 2.0, 0], [0, 0, 0.5, 0, 0]]
    assert with_agent_rewards(scored, {}, mask) is scored


FAILED_ONCE: set = set()


def flaky_agent(messages, base_url, session_id):
    """Raises the first time it meets the second prompt, then behaves."""
    if messages[0]["content"].startswith("ann") and "ann" not in FAILED_ONCE:
        FAILED_ONCE.add("ann")
        raise ConnectionError("the agent's sandbox was not up yet")
    return calculator_agent(messages, base_url, session_id)


def broken_agent(messages, base_url, session_id):
    raise ConnectionError("the agent's sandbox is down")


def test_a_step_regenerates_a_group_that_lost_a_sample_and_stops_on_one_that_always_does(memorized):
    """trainer.rl.agent_endpoint: the group whose sample was dropped is generated again, whole; its lines go to
    the log and the drops into the step's metrics; a group short in every attempt stops the run, named."""
    from verl_mega.config.errors import UserError
    from verl_mega.trainer.rl.agent_endpoint import ATTEMPTS, AgentEndpoint

    tokenizer, engine = memorized
    params = SamplingParams(temperature=0.0, n=2, logprobs=True)
    steps = AgentEndpoint(endpoint(tokenizer, flaky_agent, batch_wait_s=0.2), "tests:flaky_agent")
    responses = steps.responses(engine, ROWS, params)
    assert [r.prompt_index for r in responses] == [0, 0, 1, 1] and None not in responses
    same_trajectories(responses, in_process(tokenizer, engine, params))
    lines = []
    metrics = steps.drain(lambda step, line: lines.append((step, line)), 3)
    assert metrics["endpoint/sessions"] == 4 + 2 and metrics["endpoint/dropped_raised"] == 1
    assert lines == [(3, lines[0][1])] and "the agent raised ConnectionError: the agent's sandbox was not up" \
        in lines[0][1]
    always = AgentEndpoint(endpoint(tokenizer, broken_agent), "tests:broken_agent")
    with pytest.raises(UserError, match=f"lost a sample in each of {ATTEMPTS} attempts; the last: sample 1 .*"
                                        "the agent's sandbox is down"):
        always.responses(engine, ROWS[:1], params)


def test_a_round_of_each_prompt_s_n_sessions_is_prefilled_once_per_prompt():
    """A first round holds each prompt's n sessions in a row: the engine gets each context once, with n (the
    in-process loop's first turn); any other round (contexts differ, runs of unequal length, equal contexts of
    different prompts) goes as it is."""
    a, b, c = [1, 2], [1, 3], [4]
    assert shared_contexts([(0, a), (0, a), (0, a), (1, b), (1, b), (1, b)]) == ([a, b], 3)
    assert shared_contexts([(0, a), (0, b), (1, c)]) == ([a, b, c], 1)
    assert shared_contexts([(0, a), (0, a), (1, b)]) == ([a, a, b], 1)  # a dropped session: runs of 2 and 1
    assert shared_contexts([(0, a), (1, a)]) == ([a, a], 1)  # two prompts alike: the loop's two rows, n=1
    assert shared_contexts([(0, a), (0, a), (1, b), (1, b), (2, a), (2, a)]) == ([a, b, a], 2)
