"""The multi-turn agent loop (rollout.agent_loop): token-exact episodes against the chat template's own rendering,
the planted re-tokenisation that check catches, tool-call parsing, budgets and turn limits, and the masks the
batch and the reward take from an episode.

`ReplayEngine` is a RolloutEngine whose "model" replays given token ids turn by turn: the loop's contract with
an engine is only `generate`, and a replayed policy is what lets a test know every id the model sampled (the
real engines run the same loop in test_agent_engines.py)."""
from __future__ import annotations

import gc
import json
import time
from typing import Iterable, Sequence

import pytest
import torch

from tests.agent_chat import llama_tokenizer, qwen_tokenizer
from verl_mega.config import ToolsConfig
from verl_mega.rollout.agent_loop import (
    AgentLoop, ChatRenderer, check_tool_template, episode_metrics, parse_tool_calls, resolve_tool_call_format,
)
from verl_mega.rollout.engine import Response, RolloutEngine, SamplingParams
from verl_mega.roles.reward import RuleReward, episode_fields, final_answer
from verl_mega.tools import ToolCall, ToolSet
from verl_mega.trainer.rollout_batch import build_rollout_batch, response_tokens

QUESTION = [{"role": "user", "content": "What is 12 * 34?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
ANSWER = "The answer is 408."


class ReplayEngine(RolloutEngine):
    """Call k of `generate` answers context i with `turns[k][i]` (prompt-major, `n` per prompt on call 0), with
    log-probs -0.01 * (position + 1); records each call's contexts and sampling."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.calls = turns, []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Response]:
        replies = self.turns[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], params))
        rows = [index for index in range(len(prompts)) for _ in range(params.n)]
        assert len(rows) == len(replies), (len(rows), len(replies))
        return [Response(index, list(reply)[:params.max_new_tokens],
                         [-0.01 * (j + 1) for j in range(min(len(reply), params.max_new_tokens))])
                for index, reply in zip(rows, replies)]

    def load_weights(self, weights: Iterable) -> int:
        return 0

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture
def toolset():
    tools = ToolSet(["calculator"], ToolsConfig())
    yield tools
    tools.close()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(tokenizer, text: str) -> list[int]:
    """An assistant turn sampled as the canonical tokens of `text`, ended by the end-of-turn token."""
    return ids(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def run_loop(tokenizer, toolset, turns, *, n=1, budget=256, max_turns=4, conversations=(QUESTION,), seed=7):
    loop = AgentLoop(tokenizer, toolset, max_turns=max_turns, budget=budget, stop_token_ids=[])
    engine = ReplayEngine(turns)
    params = SamplingParams(temperature=1.0, max_new_tokens=budget, n=n, seed=seed, logprobs=True)
    return loop.run(engine, list(conversations), params), engine


def template_ids(tokenizer, toolset, messages) -> list[int]:
    """The chat template's own ids for the whole conversation (no generation prompt after its last turn)."""
    return ids(tokenizer, tokenizer.apply_chat_template(messages, tools=toolset.schemas, tokenize=False))


def exactness_problems(tokenizer, toolset, response: Response, sampled_turns: list[list[int]]) -> list[str]:
    """Why an episode is not token-exact: its sampled positions must hold exactly the ids the model sampled,
    turn by turn, and prompt + episode must be the template's rendering of its conversation, token by token (up
    to what the template writes after the last sampled end-of-turn token)."""
    problems = []
    tokens, mask = response.token_ids, response.loss_mask
    sampled = [token for token, keep in zip(tokens, mask) if keep]
    if sampled != [token for ids_ in sampled_turns for token in ids_]:
        problems.append("the sampled positions do not hold the model's ids")
    episode = response.episode.prompt_ids + tokens
    rendered = template_ids(tokenizer, toolset, response.episode.messages)
    first = next((i for i, (a, b) in enumerate(zip(episode, rendered)) if a != b), None)
    if first is not None or len(rendered) < len(episode):
        problems.append(f"the episode differs from the template's rendering at token {first}")
    return problems


def test_an_episode_is_the_sampled_ids_plus_the_templates_ids_token_by_token(qwen, toolset):
    sampled = [turn(qwen, CALL), turn(qwen, ANSWER)]
    (response,), engine = run_loop(qwen, toolset, [[sampled[0]], [sampled[1]]])
    episode = response.episode
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2]["content"] == "408" and episode.tool_results[0]["ok"]
    assert episode.tool_calls == [{"turn": 0, "name": "calculator", "arguments": {"expression": "12 * 34"}}]
    assert not episode.truncated and final_answer(episode) == ANSWER
    assert exactness_problems(qwen, toolset, response, sampled) == []
    # The second turn decoded from the first turn's sampled ids and the template's ids, as they stand.
    assert engine.calls[1][0] == [episode.prompt_ids + response.token_ids[:episode.turn_ends[0] + 1]
                                  + [t for t, m in zip(response.token_ids, response.loss_mask) if not m]]
    # The prompt carries the tools' schemas; the template's ids are masked and carry no log-prob.
    assert '"name": "calculator"' in qwen.decode(episode.prompt_ids)
    template_positions = [i for i, keep in enumerate(response.loss_mask) if not keep]
    assert template_positions and all(response.logprobs[i] == 0.0 for i in template_positions)
    assert episode.turn_ends == [len(sampled[0]) - 1, len(response.token_ids) - 1]


def test_a_planted_retokenisation_is_caught(qwen, toolset):
    """The model spells "answer" letter by letter, which decodes to the same text as the merged token the
    tokenizer would give: the episode keeps the letters (no re-tokenisation), and the check fails on an
    episode built by decoding and re-encoding the model's turn."""
    merged = ids(qwen, " answer")
    assert len(merged) == 1, "the tokenizer must merge ' answer' for the plant to differ"
    spelled = [qwen.convert_tokens_to_ids(piece) for piece in ["Ġ", "a", "n", "s", "w", "e", "r"]]
    assert qwen.decode(spelled) == " answer"
    planted = ids(qwen, "The") + spelled + ids(qwen, " is 408.") + [qwen.convert_tokens_to_ids("<|im_end|>")]
    sampled = [turn(qwen, CALL), planted]
    (response,), _ = run_loop(qwen, toolset, [[sampled[0]], [planted]])
    assert [t for t, m in zip(response.token_ids, response.loss_mask) if m] == sampled[0] + planted
    # The template's rendering re-tokenises the text, so it no longer matches the model's ids...
    assert any("template's rendering" in problem for problem in exactness_problems(qwen, toolset, response, sampled))
    # ...and an episode built by re-tokenising the decoded turn matches the rendering but lost the model's ids.
    end = response.episode.turn_ends[0] + 1 + sum(1 for m in response.loss_mask if not m)
    retokenised = response.token_ids[:end] + turn(qwen, qwen.decode(planted[:-1]))
    rebuilt = Response(0, retokenised, None, [1] * len(retokenised), response.episode)
    assert exactness_problems(qwen, toolset, rebuilt, sampled) == ["the sampled positions do not hold the model's ids"]


def test_hermes_and_llama_json_calls_are_parsed_and_bad_ones_explained():
    calls = parse_tool_calls(f"thinking {CALL} and {CALL.replace('12 * 34', '1+1')}", "hermes")
    assert calls == [ToolCall("calculator", {"expression": "12 * 34"}), ToolCall("calculator", {"expression": "1+1"})]
    assert parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "7 + 5"}}',
                            "llama3_json") == [ToolCall("calculator", {"expression": "7 + 5"})]
    assert parse_tool_calls("The answer is 12.", "llama3_json") == [] == parse_tool_calls("no call", "hermes")
    (bad,) = parse_tool_calls("<tool_call>{not json</tool_call>", "hermes")
    assert isinstance(bad, str) and "not valid JSON" in bad
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": 1}"}</tool_call>',
                            "hermes") == [ToolCall("calculator", '{"expression": 1}')]


def test_the_format_and_the_end_of_turn_token_come_from_the_chat_template(qwen, toolset):
    llama = llama_tokenizer()
    assert resolve_tool_call_format("auto", qwen.chat_template) == "hermes"
    assert resolve_tool_call_format("auto", llama.chat_template) == "llama3_json"
    assert resolve_tool_call_format("llama3_json", qwen.chat_template) == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_format=auto"):
        resolve_tool_call_format("auto", "{{ messages }}")
    assert ChatRenderer(qwen, []).end_of_turn_ids() == [qwen.convert_tokens_to_ids("<|im_end|>")]
    assert ChatRenderer(llama, []).end_of_turn_ids() == [llama.convert_tokens_to_ids("<|eot_id|>")]
    loop = AgentLoop(llama, toolset, max_turns=2, budget=64, stop_token_ids=[])
    assert loop.format == "llama3_json" and llama.convert_tokens_to_ids("<|eot_id|>") in loop.stop_token_ids


def test_a_llama_episode_renders_its_tool_result_as_an_ipython_turn(toolset):
    llama = llama_tokenizer()
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    sampled = [ids(llama, '{"name": "calculator", "parameters": {"expression": "7 + 5"}}') + [eot],
               ids(llama, "12") + [eot]]
    loop = AgentLoop(llama, toolset, max_turns=3, budget=128, stop_token_ids=[])
    (response,) = loop.run(ReplayEngine([[sampled[0]], [sampled[1]]]), [QUESTION],
                           SamplingParams(max_new_tokens=128, logprobs=True))
    template = llama.decode([t for t, m in zip(response.token_ids, response.loss_mask) if not m])
    assert template == "<|start_header_id|>ipython<|end_header_id|>\n\n12<|eot_id|><|start_header_id|>assistant" \
                       "<|end_header_id|>\n\n"
    assert exactness_problems(llama, toolset, response, sampled) == []


def test_tool_failures_are_results_and_the_episode_goes_on(qwen, toolset):
    bad_json = turn(qwen, "<tool_call>{not json</tool_call>")
    unknown = turn(qwen, '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    (response,), _ = run_loop(qwen, toolset, [[bad_json], [unknown], [turn(qwen, ANSWER)]])
    results = response.episode.tool_results
    assert [r["ok"] for r in results] == [False, False] and results[0]["error"] == "bad_json"
    assert results[1]["error"] == "unknown_tool" and not response.episode.truncated
    assert final_answer(response.episode) == ANSWER


def deep_call(depth: int, closed: bool) -> str:
    """A Hermes call whose arguments nest `depth` lists deep (closed again or not)."""
    return '<tool_call>{"name": "calculator", "arguments": ' + "[" * depth + ("]" * depth + "}" if closed else "") \
        + "</tool_call>"


@pytest.mark.parametrize("depth", [1_000, 100_000])
@pytest.mark.parametrize("closed", [True, False])
def test_a_call_nested_deep_is_a_bad_json_result_in_every_format(depth, closed):
    (hermes,) = parse_tool_calls(deep_call(depth, closed), "hermes")
    (llama,) = parse_tool_calls(deep_call(depth, closed).removeprefix("<tool_call>").removesuffix("</tool_call>"),
                                "llama3_json")
    assert hermes == llama == f"the tool call is not accepted: the JSON nests {depth + 1} levels deep, more than " \
                              "the 64 allowed"


@pytest.mark.parametrize("depth", [900, 1_000])  # parsed without, and RecursionError, on Python's default limit
def test_arguments_nested_deep_as_json_text_are_a_bad_json_result(toolset, depth):
    result = toolset.call(ToolCall("calculator", '{"a": ' * depth + "1" + "}" * depth))
    assert (result.ok, result.error) == (False, "bad_json")
    assert f"nests {depth} levels deep" in result.text


def test_a_deeply_nested_call_is_an_error_result_and_the_episode_goes_on(qwen, toolset):
    (response,), _ = run_loop(qwen, toolset, [[turn(qwen, deep_call(1_000, True))], [turn(qwen, ANSWER)]],
                              budget=4096)
    [result] = response.episode.tool_results
    assert result["error"] == "bad_json" and "nests 1001 levels deep" in result["text"]
    assert final_answer(response.episode) == ANSWER


def best_parse_seconds(text: str, tool_call_format: str) -> float:
    """The fastest of seven parses of `text`: the least disturbed by the other processes on the machine (and
    none of them by a collection of the earlier tests' garbage)."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(7):
            start = time.perf_counter()
            parse_tool_calls(text, tool_call_format)
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return min(times)


@pytest.mark.parametrize("text, tool_call_format", [("<tool_call>{", "hermes"), ("[", "llama3_json")])
def test_a_turn_of_repeated_unclosed_tags_parses_in_time_linear_in_its_length(text, tool_call_format):
    """16k and 256k repeats (`<tool_call>` is one token of Qwen's): 16x the length may take 16x the time and
    noise up to 4x more (a busy machine), not the 256x a parse that rescans the rest of the turn from each tag
    takes."""
    head = "{" if tool_call_format == "llama3_json" else ""
    short, long = (best_parse_seconds(head + text * repeats, tool_call_format) for repeats in (16_000, 256_000))
    assert long / short < 64, (short, long)


def test_max_turns_and_the_token_budget_truncate(qwen, toolset):
    call = turn(qwen, CALL)
    (looping,), engine = run_loop(qwen, toolset, [[call], [call], [call]], max_turns=3)
    assert len(looping.episode.turn_ends) == 3 and len(looping.episode.tool_calls) == 2 and looping.episode.truncated
    assert len(engine.calls) == 3
    # A budget that holds the call but not its result: the episode stops before the template's ids.
    (short,), _ = run_loop(qwen, toolset, [[call]], budget=len(call) + 3)
    assert short.token_ids == call and short.loss_mask == [1] * len(call) and short.episode.truncated
    # A turn longer than what is left of the budget is cut there.
    (cut,), _ = run_loop(qwen, toolset, [[call + call]], budget=len(call) + 2)
    assert cut.token_ids == (call + call)[:len(call) + 2] and cut.episode.truncated


def test_episodes_of_a_prompt_group_and_later_turns_seeded_apart(qwen, toolset):
    """Call 0 samples n episodes per prompt with the rollout's seed (as a single turn does); later turns go to
    the live episodes only, one sample each, under their own seed."""
    call, done = turn(qwen, CALL), turn(qwen, ANSWER)
    second = [{"role": "user", "content": "And 7 + 5?"}]
    responses, engine = run_loop(qwen, toolset, [[call, done, done, call], [done, done]], n=2,
                                 conversations=(QUESTION, second))
    assert [r.prompt_index for r in responses] == [0, 0, 1, 1]
    assert [len(r.episode.turn_ends) for r in responses] == [2, 1, 1, 2]
    (first_contexts, first), (later_contexts, later) = engine.calls
    assert len(first_contexts) == 2 and first.n == 2 and first.seed == 7
    assert len(later_contexts) == 2 and later.n == 1 and later.seed not in (None, 7)
    metrics = episode_metrics([r.episode for r in responses])
    assert metrics == {"multi_turn/turns_mean": 1.5, "multi_turn/tool_calls_mean": 0.5, "multi_turn/truncated": 0.0,
                       "multi_turn/tool_success_rate": 1.0,
                       "multi_turn/tool_seconds": sum(r["seconds"] for x in responses for r in x.episode.tool_results)}


def test_the_batch_attends_to_every_token_and_trains_on_the_sampled_ones(qwen, toolset):
    (response,), _ = run_loop(qwen, toolset, [[turn(qwen, CALL)], [turn(qwen, ANSWER)]])
    single = Response(0, [5, 6, 7], [-1.0, -1.0, -1.0])
    batch = build_rollout_batch([response.episode.prompt_ids, [9, 9]], [response.token_ids, single.token_ids], 128,
                                qwen.pad_token_id, [response.logprobs, single.logprobs],
                                [response.loss_mask, single.loss_mask])
    length = len(response.token_ids)
    assert response_tokens(batch)[0].sum() == length and response_tokens(batch)[1].sum() == 3
    assert batch["response_mask"][0, :length].tolist() == response.loss_mask
    assert batch["response_mask"][1].tolist() == [1, 1, 1] + [0] * 125
    masked = batch["response_mask"][0, :length] == 0
    assert masked.any() and (batch["rollout_log_probs"][0, :length][masked] == 0).all()


def test_the_reward_scores_the_final_answer_with_the_episode_and_per_turn_scores(qwen, toolset):
    (response,), _ = run_loop(qwen, toolset, [[turn(qwen, CALL)], [turn(qwen, ANSWER)]])
    episode = response.episode
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info):
        seen.append((solution_str, extra_info))
        return {"score": float("408" in solution_str), "turn_scores": [0.25, 0.5]}

    batch = build_rollout_batch([episode.prompt_ids], [response.token_ids], 128, qwen.pad_token_id,
                                loss_masks=[response.loss_mask])
    extra = episode_fields(episode, {"split": "train"})
    out = RuleReward(qwen, reward)(batch["responses"], batch["response_mask"], ["408"], ["arith"], [extra],
                                   episodes=[episode])
    solution, info = seen[0]
    assert solution == ANSWER and info["split"] == "train" and info["turns"] == 2
    assert info["tool_results"][0]["text"] == "408" and info["messages"] == json.loads(json.dumps(episode.messages))
    first, last = episode.turn_ends
    expected = torch.zeros(128)
    expected[first], expected[last] = 0.25, 1.0 + 0.5
    assert out.scores.tolist() == [1.0] and torch.equal(out.token_level_rewards[0], expected)


def test_a_template_that_renders_no_tool_message_is_refused(qwen):
    from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer

    assert check_tool_template(qwen, "auto") == "hermes"
    tiny = build_tiny_tokenizer()
    tiny.chat_template = "{% for m in messages if m.role != 'tool' %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="renders no tool messages"):
        check_tool_template(tiny, "hermes")
    tiny.chat_template = "{{ raise_exception('no tools') }}"
    with pytest.raises(ValueError, match="fails on a tool message"):
        check_tool_template(tiny, "hermes")
    with pytest.raises(ValueError, match="no chat template"):
        check_tool_template(build_tiny_tokenizer(with_chat_template=False), "hermes")


def test_the_preflight_check_names_each_bad_multi_turn_key(tiny_models):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", "rollout.multi_turn.enable=true",
                                "data.max_response_length=32", "rollout.multi_turn.max_tokens=64",
                                "rollout.multi_turn.max_turns=0", "rollout.multi_turn.tools=[calculator,nowhere]"])
    with pytest.raises(ConfigError) as error:
        preflight_check(config, world_size=1)
    message = str(error.value)
    for problem in ("rollout.multi_turn.max_tokens=64 must be in [0, data.max_response_length=32]",
                    "rollout.multi_turn.max_turns must be >= 1", "rollout.multi_turn.tools: ",
                    "rollout.multi_turn with model.hf_path's tokenizer: rollout.multi_turn.tool_call_format=auto"):
        assert problem in message, message
    config.rollout.multi_turn.tools, config.rollout.multi_turn.tool_call_format = [], "json"
    with pytest.raises(ConfigError) as error:
        preflight_check(config, world_size=1, check_files=False)
    assert "rollout.multi_turn.tools is empty" in str(error.value)
    assert "rollout.multi_turn.tool_call_format 'json' is unknown; known: auto, hermes, llama3_json" in str(error.value)


def test_a_bad_tool_limit_is_named_once_with_multi_turn_on(tiny_models):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", "rollout.multi_turn.enable=true",
                                "rollout.multi_turn.tools=[calculator]", "tools.timeout_s=-1"])
    with pytest.raises(ConfigError) as error:
        preflight_check(config, world_size=1, check_files=False)
    assert str(error.value).count("tools.timeout_s") == 1, str(error.value)
