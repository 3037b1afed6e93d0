"""An endpoint session: one sample's trajectory as the server records it, turn by turn.

A session is token-exact as the in-process agent loop is (agent_loop.TurnRules, the same code): its prompt is
the first request's messages rendered by the chat template with the request's tools; each turn appends the ids
the engine sampled (loss mask 1), and the messages the agent sends after a turn (tool results, a user's reply)
append the ids the template renders for them and the next assistant header (loss mask 0). The agent's copy of
an assistant turn is never re-tokenised: the session keeps the turn as sampled, and checks only that the agent's
conversation extends the one it recorded (same roles; the tool-call ids it was given).

`/v1/completions` sessions are raw text: the prompt's ids, each turn's sampled ids, and whatever text the next
prompt adds after the text returned so far, tokenised alone (masked).

A session's limits: `max_turns` turns, `budget` response tokens (sampled and template ids together), the
engine's context length; once one ends it, each further request is refused (410) and the trajectory is kept,
truncated, as the in-process loop keeps one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from verl_mega.rollout.agent_loop import ChatRenderer, EpisodeState, TurnRules, parse_tool_calls
from verl_mega.rollout.engine import Response
from verl_mega.tools import ToolCall

from .openai_format import (
    ChatRequest, CompletionRequest, EndpointError, bad_request, chat_answer, completion_answer, content_text,
    openai_tool_calls, visible_content,
)

MODEL_NAME = "verl_mega-rollout"


def session_ended(message: str, code: str) -> EndpointError:
    return EndpointError(410, code, message)


@dataclass
class Turn:
    """A turn the session asks the engine for: the context and the most new tokens it may take."""

    context: list[int]
    max_new: int


@dataclass(frozen=True)
class SessionLimits:
    """What every session of a run shares: the tokenizer, the tool-call format and the limits."""

    tokenizer: object
    tool_call_format: str
    max_turns: int
    budget: int
    stop_token_ids: frozenset[int]  # EOS and the template's end-of-turn token
    max_model_len: int


@dataclass
class Session:
    """One agent's sample: `index` among the run's samples, from prompt `prompt_index`."""

    id: str
    index: int
    prompt_index: int
    limits: SessionLimits
    kind: str | None = None  # "chat" or "completion", from the first request
    episode: EpisodeState | None = None
    prompt_ids: list[int] = field(default_factory=list)
    rules: TurnRules | None = None
    tools: list[dict] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)  # the roles of the agent's conversation so far (chat)
    call_names: dict[str, str] = field(default_factory=dict)  # OpenAI tool-call id -> tool name
    last_call_ids: list[str] = field(default_factory=list)
    text: str = ""  # completion sessions: the prompt and the text returned so far
    ended: str | None = None  # why no further turn is taken (a limit), as a line

    @property
    def turns(self) -> int:
        return 0 if self.episode is None else len(self.episode.turn_ends)

    # --- chat -------------------------------------------------------------------------------------------------

    def chat_turn(self, request: ChatRequest) -> Turn:
        """The context of the turn `request` asks for, with the messages it adds recorded (template ids)."""
        self._check_open("chat")
        messages = [self._template_message(message) for message in request.messages]
        if self.episode is None:
            renderer = ChatRenderer(self.limits.tokenizer, request.tools)
            try:
                self.prompt_ids = renderer.prompt_ids(messages)
            except ValueError as err:
                raise bad_request(f"the chat template cannot render these messages: {err}", "messages") from None
            self.kind, self.tools = "chat", request.tools
            self.rules = TurnRules(self.limits.tokenizer, renderer, self.limits.tool_call_format,
                                   self.limits.max_turns, self.limits.stop_token_ids)
            self.episode = EpisodeState(self.prompt_index, messages, self.limits.budget)
            try:
                turn = self._turn(request.max_tokens)
            except EndpointError:  # a prompt too long leaves the session as it was: the agent may start again
                self.kind, self.episode, self.prompt_ids = None, None, []
                raise
        else:
            self._extend(request, messages)
            turn = self._turn(request.max_tokens)
        self.roles = [message["role"] for message in request.messages]
        return turn

    def _extend(self, request: ChatRequest, messages: list[dict]) -> None:
        """The messages after the session's last turn, appended with the template's ids."""
        if request.tools != self.tools:
            raise bad_request("tools differ from the session's first request, whose prompt rendered them", "tools")
        known = len(self.roles)
        echo = request.messages[known] if len(request.messages) > known else None
        if (echo is None or [m["role"] for m in request.messages[:known]] != self.roles
                or echo.get("role") != "assistant"):
            raise bad_request(f"messages must extend the session's conversation: its {known} messages, the "
                              "assistant turn it answered, then tool or user messages", "messages")
        echoed_ids = [call.get("id") for call in echo.get("tool_calls") or [] if isinstance(call, dict)]
        if echoed_ids and echoed_ids != self.last_call_ids:
            raise bad_request(f"messages[{known}] carries tool calls {echoed_ids} but the session's last turn made "
                              f"{self.last_call_ids}", f"messages[{known}]")
        added = messages[known + 1:]
        if not added or any(message["role"] == "assistant" for message in added):
            raise bad_request("after the session's last assistant turn come tool or user messages, at least one, "
                              "and no assistant message: the model's turns are the ones it sampled",
                              f"messages[{known + 1}]")
        turn = self.turns - 1
        self.episode.done = False  # a turn without calls ended it, but the agent goes on (a user's reply)
        for message in added:
            if message["role"] == "tool":
                self.episode.tool_results.append({"turn": turn, "text": message["content"], "ok": True,
                                                  "error": None, "seconds": 0.0})
        self.rules.append_messages(self.episode, added)
        if self.episode.done:
            self.ended = (f"the token budget ({self.limits.budget}) has no room for the {len(added)} messages "
                          "after the last turn")
            raise session_ended(f"session ended: {self.ended}", "max_tokens")

    def _template_message(self, message: dict) -> dict:
        """A request message as the chat template takes it: text content; a tool result named by its call."""
        text = content_text(message.get("content"), "messages")
        if message["role"] == "tool":
            name = self.call_names.get(message.get("tool_call_id"), message.get("name") or "")
            return {"role": "tool", "name": name, "content": text}
        return {"role": message["role"], "content": text}

    def chat_answer(self, response: Response, turn: Turn) -> dict:
        """The sampled turn recorded; OpenAI's answer for it (its tool calls in OpenAI's format)."""
        episode = self.episode
        calls = self.rules.take_turn(episode, _cut(response, turn.max_new))
        index = self.turns - 1
        text = episode.messages[-1]["content"]
        # At max_turns a call is not run (the session ends) but the agent is shown what the model asked for.
        at_limit = episode.truncated and self.turns >= self.limits.max_turns
        shown = calls or (parse_tool_calls(text, self.rules.format) if at_limit else [])
        readable = [call for call in shown if isinstance(call, ToolCall)]
        self.last_call_ids = [f"call_{self.index}_{index}_{k}" for k in range(len(readable))]
        for call_id, call in zip(self.last_call_ids, readable):
            self.call_names[call_id] = call.name if isinstance(call.name, str) else ""
        for call in calls:  # the calls the episode goes on with, as the in-process loop records them
            readable_call = isinstance(call, ToolCall)
            episode.tool_calls.append({"turn": index, "name": call.name if readable_call and isinstance(
                call.name, str) else "", "arguments": call.arguments if readable_call else None})
        stopped = episode.token_ids[-1] in self.rules.stop_token_ids if episode.token_ids else False
        finish = "tool_calls" if readable else ("stop" if stopped else "length")
        self._note_limit()
        return chat_answer(f"chatcmpl-{self.id}-{index}", MODEL_NAME, visible_content(text, shown, self.rules.format),
                           openai_tool_calls(shown, self.last_call_ids), finish, len(turn.context),
                           len(episode.token_ids) - len(turn.context) + len(self.prompt_ids))

    # --- completions ------------------------------------------------------------------------------------------

    def completion_turn(self, request: CompletionRequest) -> Turn:
        self._check_open("completion")
        tokenizer = self.limits.tokenizer
        prompt = request.prompt
        if self.episode is None:
            ids = _encode(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            _check_vocab(tokenizer, ids)
            self.kind = "completion"
            self.prompt_ids, self.text = ids, prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            self.episode = EpisodeState(self.prompt_index, [{"role": "user", "content": self.text}],
                                        self.limits.budget)
            return self._turn(request.max_tokens)
        if isinstance(prompt, str):
            if not prompt.startswith(self.text):
                raise bad_request("prompt must extend the session's text (its prompt and the text returned so "
                                  "far)", "prompt")
            added_text, added = prompt[len(self.text):], _encode(tokenizer, prompt[len(self.text):])
        else:
            known = self.prompt_ids + self.episode.token_ids
            if prompt[:len(known)] != known:
                raise bad_request("prompt must extend the session's token ids (its prompt and the ids sampled so "
                                  "far)", "prompt")
            added = list(prompt[len(known):])
            _check_vocab(tokenizer, added)
            added_text = tokenizer.decode(added)
        if added:
            self.episode.messages.append({"role": "user", "content": added_text})
            if len(added) >= self.episode.remaining:
                self.episode.stop(truncated=True)
                self.ended = f"the token budget ({self.limits.budget}) has no room for the prompt's new text"
                raise session_ended(f"session ended: {self.ended}", "max_tokens")
            self.episode.append(added, sampled=False)
        self.text = prompt if isinstance(prompt, str) else self.text + added_text
        return self._turn(request.max_tokens)

    def completion_answer(self, response: Response, turn: Turn) -> dict:
        episode = self.episode
        ids = _cut(response, min(turn.max_new, episode.remaining)).token_ids
        episode.append(ids, sampled=True, logprobs=None if response.logprobs is None else response.logprobs[:len(ids)])
        episode.turn_ends.append(len(episode.token_ids) - 1)
        stopped = bool(ids) and ids[-1] in self.limits.stop_token_ids
        text = self.limits.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        episode.messages.append({"role": "assistant", "content": text})
        self.text += text
        if episode.remaining <= 0 or self.turns >= self.limits.max_turns:
            episode.stop(truncated=True)
        self._note_limit()
        return completion_answer(f"cmpl-{self.id}-{self.turns - 1}", MODEL_NAME, text,
                                 "stop" if stopped else "length", len(turn.context), len(ids))

    # --- both -------------------------------------------------------------------------------------------------

    def _check_open(self, kind: str) -> None:
        if self.ended is not None:
            raise session_ended(f"session ended: {self.ended}", "session_ended")
        if self.kind is not None and self.kind != kind:
            raise bad_request(f"this session is a {self.kind} session: its trajectory cannot go on as a {kind}")

    def _turn(self, max_tokens: int | None) -> Turn:
        context = self.prompt_ids + self.episode.token_ids
        room = self.limits.max_model_len - len(context)
        if room < 1:
            raise EndpointError(400, "context_length_exceeded",
                                f"the context is {len(context)} tokens; the engine's context length is "
                                f"{self.limits.max_model_len}: shorten the messages", "messages")
        return Turn(context, min(max_tokens or self.episode.remaining, self.episode.remaining, room))

    def _note_limit(self) -> None:
        """The line a further request is refused with, where this turn ended the session: max_turns (whether or
        not the turn asked for a tool), or a turn cut by the budget."""
        if self.ended is not None:
            return
        if self.turns >= self.limits.max_turns:
            self.ended = f"max_turns ({self.limits.max_turns}) turns were taken"
        elif self.episode.done and self.episode.truncated:
            self.ended = f"the token budget ({self.limits.budget}) or the turn's max_tokens ended its last turn"


def _cut(response: Response, max_new: int) -> Response:
    """The response cut to the turn's own limit (the round decodes to the largest limit of its turns)."""
    if len(response.token_ids) <= max_new:
        return response
    return Response(response.prompt_index, response.token_ids[:max_new],
                    None if response.logprobs is None else response.logprobs[:max_new])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_vocab(tokenizer, ids: list[int]) -> None:
    if not ids:
        raise bad_request("the prompt encodes to no tokens", "prompt")
    if max(ids) >= len(tokenizer):
        raise bad_request(f"token id {max(ids)} is not in the vocabulary ({len(tokenizer)} tokens)", "prompt")
