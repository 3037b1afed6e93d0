"""Multi-turn rollouts with tools (`rollout.multi_turn`): the agent loop, over any `RolloutEngine`.

Every live episode of the batch decodes one assistant turn per engine call, up to its end-of-turn token; the
turn's tool calls are parsed (Hermes / Qwen2.5 / Qwen3 `<tool_call>{json}</tool_call>`, or Llama-3.1's bare
JSON object), all episodes' calls run together through `ToolSet.call_many` (concurrently), each result is
rendered by the tokenizer's own chat template as a `tool` message, and decoding goes on, until the model ends a
turn without a call, `max_turns` turns, or the episode's token budget.

Token-exact: an episode is the ids the model sampled plus, after each tool-calling turn, the ids the chat
template adds there: the text the template renders after the turn's end-of-turn token, up to and including the
next assistant header, tokenised alone. That text is the difference between two renderings of the same
conversation (without and with the tool messages), so the model's own tokens are never decoded and
re-tokenised into the episode; they are decoded only for parsing and for the messages the template and the
reward read. The loss mask is 1 on sampled ids, 0 on template ids; rollout log-probs are 0 at the latter.

Seeds: the first turn samples `params.n` episodes per prompt with `params.seed`, as a single-turn rollout does;
turn t (0-based) of the live episodes with `params.seed + t * TURN_SEED_STRIDE`. A batch is reproducible as
the single-turn one is: the same prompts, weights and seed give the same episodes.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Sequence

from verl_mega.data.prompts import render_chat
from verl_mega.tools import ToolCall, ToolResult, ToolSet
from verl_mega.tools.arguments import too_deep

from .engine import EpisodeInfo, Response, RolloutEngine, SamplingParams

TOOL_CALL_FORMATS = ("auto", "hermes", "llama3_json")
# Above any step's seed offsets and the generation rounds' 2**31 stride (trainer.rl.generation.rollout_seed).
TURN_SEED_STRIDE = 2**36
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
PROBE = "verl_mega probe 7391"  # a message's content while the chat template is probed


def resolve_tool_call_format(name: str, chat_template: str | None) -> str:
    """`auto`: the format the chat template renders tools in; the others are taken as named."""
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"rollout.multi_turn.tool_call_format '{name}' is unknown; known: "
                         f"{', '.join(TOOL_CALL_FORMATS)}")
    if name != "auto":
        return name
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if LLAMA_PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    raise ValueError("rollout.multi_turn.tool_call_format=auto: the tokenizer's chat template shows neither "
                     "Hermes' <tool_call> tags nor Llama-3.1's ipython role; name the format the model was "
                     f"trained on ({', '.join(TOOL_CALL_FORMATS[1:])})")


def check_tool_template(tokenizer, tool_call_format: str) -> str:
    """The tool-call format multi-turn episodes of `tokenizer` use; ValueError where its chat template cannot
    hold one (no template, or one that renders no `tool` message after an assistant turn)."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template to render tool results with")
    resolved = resolve_tool_call_format(tool_call_format, tokenizer.chat_template)
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "tool", "name": "calculator", "content": PROBE}]
    try:
        text = ChatRenderer(tokenizer, []).text(conversation, add_generation_prompt=True)
    except Exception as err:  # jinja2's errors, and the templates' own raise_exception
        raise ValueError(f"the chat template fails on a tool message ({type(err).__name__}: {err})") from None
    if PROBE not in text:
        raise ValueError("the chat template renders no tool messages: multi-turn episodes need one that does "
                         "(Qwen2.5/Qwen3, Hermes, Llama-3.1 instruct)")
    return resolved


def parse_tool_calls(text: str, tool_call_format: str) -> list[ToolCall | str]:
    """The tool calls in an assistant turn's text, in order; a call that cannot be read is the reason why."""
    if tool_call_format == "hermes":
        return [_read_call(block.strip()) for block in _hermes_blocks(text)]
    body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
    return [_read_call(body, arguments_key="parameters")] if body.startswith("{") else []


def _hermes_blocks(text: str) -> list[str]:
    """What each `<tool_call>` holds up to the next `</tool_call>` (an unclosed one holds nothing), in one pass
    over the text: a regex's lazy match rescans the rest of the text from every unclosed tag, quadratic in a turn
    of repeated tags."""
    blocks, start = [], text.find(HERMES_OPEN)
    while start != -1:
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end == -1:  # no close after this tag, so none after any later one
            break
        blocks.append(text[start + len(HERMES_OPEN):end])
        start = text.find(HERMES_OPEN, end + len(HERMES_CLOSE))
    return blocks


def _read_call(body: str, arguments_key: str = "arguments") -> ToolCall | str:
    """A JSON object {"name": ..., arguments_key: object or JSON text} as a ToolCall (the ToolSet checks the
    name and the arguments), else the problem. Nesting is bounded before parsing: deep enough, json.loads raises
    RecursionError, and any later json.dumps of a call parsed just below that limit would."""
    problem = too_deep(body)
    if problem:
        return f"the tool call is not accepted: {problem}"
    try:
        value = json.loads(body)
    except ValueError as err:
        return f"the tool call is not valid JSON ({err})"
    if not isinstance(value, dict):
        return f'the tool call must be a JSON object {{"name": ..., "{arguments_key}": {{...}}}}'
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return ToolCall(name=value.get("name"), arguments=arguments if isinstance(arguments, (str, dict)) else
                    json.dumps(arguments))


class ChatRenderer:
    """The tokenizer's chat template over a conversation, with the tools' schemas as `tools=`."""

    def __init__(self, tokenizer, schemas: Sequence[dict]):
        self.tokenizer = tokenizer
        self.schemas = list(schemas)

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools=self.schemas or None)

    def ids(self, text: str) -> list[int]:
        # The template renders its special tokens itself: none are added on top.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.ids(self.text(messages, add_generation_prompt=True))

    def end_of_turn_ids(self) -> list[int]:
        """The special token the template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`), which a
        turn stops at; none where the template closes it with text."""
        head = self.text([{"role": "user", "content": "q"}], add_generation_prompt=False)
        turn = self.text([{"role": "user", "content": "q"}, {"role": "assistant", "content": PROBE}],
                         add_generation_prompt=False)[len(head):]
        ids = self.ids(turn[turn.rfind(PROBE) + len(PROBE):])
        return ids[:1] if ids and ids[0] in self.tokenizer.all_special_ids else []

    def tool_turn_ids(self, messages: list[dict], tool_messages: list[dict], stop_text: str) -> list[int]:
        """The template's ids after an assistant turn (`messages[-1]`) that the model ended with `stop_text`:
        what it renders after that text, the tool messages, and the next assistant header."""
        head = self.text(messages[:-1], add_generation_prompt=False)
        before = self.text(messages, add_generation_prompt=False)
        after = self.text(messages + tool_messages, add_generation_prompt=True)
        if not (before.startswith(head) and after.startswith(before)):
            raise ValueError("the chat template renders earlier turns differently once later ones follow, so an "
                             "episode cannot extend its tokens turn by turn; use a template that appends turns")
        turn = before[len(head):]
        end = turn.rfind(stop_text) if stop_text else -1
        tail = turn[end + len(stop_text):] if end >= 0 else ""
        return self.ids(tail + after[len(before):])


@dataclass
class EpisodeState:
    """One trajectory while it runs (the agent loop's, or an endpoint session's)."""

    prompt_index: int
    messages: list[dict]
    budget: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    tool_results: list[dict] = field(default_factory=list)
    truncated: bool = False
    done: bool = False

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    def append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([int(sampled)] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def stop(self, truncated: bool) -> None:
        self.done, self.truncated = True, truncated

    def response(self, prompt_ids: list[int], logprobs: bool) -> Response:
        """The finished trajectory as a Response with its loss mask and `EpisodeInfo`."""
        info = EpisodeInfo(prompt_ids=prompt_ids, messages=self.messages, tool_calls=self.tool_calls,
                           tool_results=self.tool_results, turn_ends=self.turn_ends, truncated=self.truncated)
        return Response(self.prompt_index, self.token_ids, self.logprobs if logprobs else None,
                        loss_mask=self.loss_mask, episode=info)


class TurnRules:
    """How a sampled turn extends a trajectory, the same for the agent loop and the rollout endpoint: the turn's
    ids cut to the budget, its message, whether it ended (at one of `stop_token_ids`) with or without tool calls
    (`tool_call_format`), `max_turns`; and the template's ids for the messages that follow a turn."""

    def __init__(self, tokenizer, renderer: ChatRenderer, tool_call_format: str, max_turns: int,
                 stop_token_ids: Sequence[int]):
        self.tokenizer, self.renderer, self.format, self.max_turns = tokenizer, renderer, tool_call_format, max_turns
        self.stop_token_ids = tuple(sorted(set(stop_token_ids) | set(renderer.end_of_turn_ids())))

    def take_turn(self, episode: EpisodeState, response: Response) -> list[ToolCall | str]:
        """The sampled ids of a turn (cut to the episode's budget), its message, and whether it goes on; returns
        the turn's tool calls where it goes on (to run them), else []."""
        ids = response.token_ids[:episode.remaining]
        logprobs = None if response.logprobs is None else response.logprobs[:len(ids)]
        episode.append(ids, sampled=True, logprobs=logprobs)
        episode.turn_ends.append(len(episode.token_ids) - 1)
        ended = bool(ids) and ids[-1] in self.stop_token_ids and len(ids) == len(response.token_ids)
        content = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        episode.messages.append({"role": "assistant", "content": content})
        calls = parse_tool_calls(content, self.format) if ended else []
        if not ended:
            episode.stop(truncated=True)
        elif not calls:
            episode.stop(truncated=False)
        elif len(episode.turn_ends) == self.max_turns:  # it asked for a tool it may not call any more
            episode.stop(truncated=True)
        return [] if episode.done else calls

    def append_messages(self, episode: EpisodeState, messages: list[dict]) -> None:
        """`messages` (tool results, a user's reply) after the episode's last assistant turn: the template's ids
        for them and the next assistant header, masked; the episode stops (truncated) where they and a token of
        the next turn do not fit its budget."""
        stop_text = self.tokenizer.decode(episode.token_ids[-1:], skip_special_tokens=False)
        ids = self.renderer.tool_turn_ids(episode.messages, messages, stop_text)
        episode.messages.extend(messages)
        if len(ids) >= episode.remaining:  # no room for the results and a token of the next turn
            episode.stop(truncated=True)
            return
        episode.append(ids, sampled=False)


class AgentLoop:
    """Runs episodes of `max_turns` assistant turns at most and `budget` response tokens (model and template
    ids together), with the tools of `toolset`. `stop_token_ids`: the tokens a turn ends at (EOS and the
    template's end-of-turn token)."""

    def __init__(self, tokenizer, toolset: ToolSet, *, max_turns: int, budget: int, stop_token_ids: Sequence[int],
                 tool_call_format: str = "auto"):
        if max_turns < 1 or budget < 1:
            raise ValueError(f"max_turns ({max_turns}) and the token budget ({budget}) must be >= 1")
        self.tokenizer = tokenizer
        self.toolset = toolset
        self.renderer = ChatRenderer(tokenizer, toolset.schemas)
        self.format = resolve_tool_call_format(tool_call_format, tokenizer.chat_template)
        self.max_turns, self.budget = max_turns, budget
        self.rules = TurnRules(tokenizer, self.renderer, self.format, max_turns, stop_token_ids)
        self.stop_token_ids = self.rules.stop_token_ids

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A prompt as the episodes start from it: its messages rendered with the tools' schemas."""
        return self.renderer.prompt_ids(messages)

    def run(self, engine: RolloutEngine, conversations: Sequence[list[dict]], params: SamplingParams
            ) -> list[Response]:
        """`params.n` episodes per conversation, prompt-major as `RolloutEngine.generate` returns responses;
        each Response carries its loss mask and its `EpisodeInfo`."""
        prompts = [self.prompt_ids(list(messages)) for messages in conversations]
        episodes = [EpisodeState(index, list(messages), self.budget) for index, messages in enumerate(conversations)
                    for _ in range(params.n)]
        turn_params = dataclasses.replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids)
                                                                           | set(self.stop_token_ids))))
        for turn in range(self.max_turns):
            live = [episode for episode in episodes if not episode.done]
            if not live:
                break
            calls = self._decode_turn(engine, prompts, live, turn_params, turn)
            self._run_tools([episode for episode in live if not episode.done], calls, turn)
        return [episode.response(prompts[episode.prompt_index], params.logprobs) for episode in episodes]

    def _decode_turn(self, engine: RolloutEngine, prompts: list[list[int]], live: list[EpisodeState],
                     params: SamplingParams, turn: int) -> list[list[ToolCall | str]]:
        """One assistant turn of every live episode, appended to it; the calls of those that go on."""
        longest = max(episode.remaining for episode in live)
        if turn == 0:  # every episode is live: the engine samples the n of each prompt as a single turn does
            responses = engine.generate(prompts, dataclasses.replace(params, max_new_tokens=longest))
        else:
            seed = None if params.seed is None else params.seed + turn * TURN_SEED_STRIDE
            contexts = [prompts[episode.prompt_index] + episode.token_ids for episode in live]
            responses = engine.generate(contexts, dataclasses.replace(params, n=1, max_new_tokens=longest,
                                                                      seed=seed))
        return [calls for episode, response in zip(live, responses, strict=True)
                if (calls := self.rules.take_turn(episode, response))]

    def _run_tools(self, calling: list[EpisodeState], parsed: list[list[ToolCall | str]], turn: int) -> None:
        """Every calling episode's calls, all at once; then each episode's tool messages and template ids."""
        runnable = [call for calls in parsed for call in calls if isinstance(call, ToolCall)]
        results = iter(self.toolset.call_many(runnable) if runnable else [])
        for episode, calls in zip(calling, parsed, strict=True):
            outcomes = [(call, next(results)) if isinstance(call, ToolCall) else (None, _unreadable(call))
                        for call in calls]
            self._append_tool_turn(episode, outcomes, turn)

    def _append_tool_turn(self, episode: EpisodeState, outcomes: list[tuple[ToolCall | None, ToolResult]],
                          turn: int) -> None:
        tool_messages = []
        for call, result in outcomes:
            name = call.name if call is not None and isinstance(call.name, str) else ""
            episode.tool_calls.append({"turn": turn, "name": name,
                                       "arguments": call.arguments if call is not None else None})
            episode.tool_results.append({"turn": turn, "text": result.text, "ok": result.ok, "error": result.error,
                                         "seconds": result.seconds})
            tool_messages.append({"role": "tool", "name": name, "content": result.text})
        self.rules.append_messages(episode, tool_messages)


def _unreadable(problem: str) -> ToolResult:
    """The result a call that could not be parsed gets: the problem, as the model's next observation."""
    return ToolResult(text=f"error: {problem}", ok=False, error="bad_json", seconds=0.0)


def episode_metrics(episodes: Sequence[EpisodeInfo], prefix: str = "multi_turn/") -> dict[str, float]:
    """Turns and tool calls per episode, the share of calls that succeeded, the tools' seconds (summed over
    the calls) and the share of truncated episodes."""
    if not episodes:
        return {}
    results = [result for episode in episodes for result in episode.tool_results]
    metrics = {"turns_mean": sum(len(e.turn_ends) for e in episodes) / len(episodes),
               "tool_calls_mean": len(results) / len(episodes),
               "tool_seconds": sum(result["seconds"] for result in results),
               "truncated": sum(e.truncated for e in episodes) / len(episodes)}
    if results:
        metrics["tool_success_rate"] = sum(result["ok"] for result in results) / len(results)
    return {prefix + name: value for name, value in metrics.items()}
