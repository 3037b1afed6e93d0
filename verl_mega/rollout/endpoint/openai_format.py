"""OpenAI's wire format for the rollout endpoint: requests checked into what a session needs, answers and errors
written as the `openai` client reads them.

Every problem is an `EndpointError`: an HTTP status, a code and one line naming the field to fix, sent as
OpenAI's error body `{"error": {"message", "type", "code", "param"}}` with `x-should-retry: false` (the `openai`
client would otherwise retry a 408 / 409: the answer would be the same).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from verl_mega.rollout.agent_loop import HERMES_CLOSE, HERMES_OPEN
from verl_mega.tools import ToolCall

ROLES = ("system", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the endpoint refuses, or a session it cannot go on with."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict:
        kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None) -> EndpointError:
    return EndpointError(400, "invalid_request", message, param)


@dataclass(frozen=True)
class ChatRequest:
    """A `/v1/chat/completions` request: its messages (content as text), its tools' schemas (OpenAI's function
    format, as chat templates take them) and the most tokens the turn may take (None: what the session has left)."""

    messages: list[dict]
    tools: list[dict]
    max_tokens: int | None


@dataclass(frozen=True)
class CompletionRequest:
    """A `/v1/completions` request: the prompt as text, or as token ids."""

    prompt: str | list[int]
    max_tokens: int | None


def _common(body) -> int | None:
    """What both endpoints check alike: a JSON object, one choice, no streaming; the max_tokens asked for."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("stream"):
        raise bad_request("stream=true is not supported: the endpoint answers each turn whole", "stream")
    if body.get("n", 1) != 1:
        raise bad_request(f"n={body.get('n')!r}: one choice per request (the rollout samples its n per prompt as "
                          "separate sessions)", "n")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(key)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise bad_request(f"{key} must be an integer >= 1, got {limit!r}", key)
    return limit


def content_text(content, where: str) -> str:
    """A message's content as text: a string, None, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise bad_request(f"{where}.content must be a string or a list of text parts", where)


def parse_chat(body) -> ChatRequest:
    limit = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"{where} must be an object whose role is one of {', '.join(ROLES)}", where)
        content_text(message.get("content"), where)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) and tool.get("type") == "function"
                                              and isinstance(tool.get("function"), dict)
                                              and isinstance(tool["function"].get("name"), str) for tool in tools):
        raise bad_request('tools must be a list of {"type": "function", "function": {"name": ...}} objects', "tools")
    return ChatRequest(messages, tools, limit)


def parse_completion(body) -> CompletionRequest:
    limit = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise bad_request("prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                          "request)", "prompt")
    return CompletionRequest(prompt, limit)


def visible_content(text: str, calls: list[ToolCall | str], tool_call_format: str) -> str | None:
    """An assistant turn's content as an OpenAI message shows it: without the tool calls it made (they go in
    `tool_calls`), None where nothing else is left."""
    if not any(isinstance(call, ToolCall) for call in calls):
        return text
    if tool_call_format == "hermes":
        kept, position = [], 0
        while (start := text.find(HERMES_OPEN, position)) != -1:
            end = text.find(HERMES_CLOSE, start)
            if end == -1:
                break
            kept.append(text[position:start])
            position = end + len(HERMES_CLOSE)
        text = "".join(kept) + text[position:]
    else:  # llama3_json: the whole turn is the call
        text = ""
    return text.strip() or None


def openai_tool_calls(calls: list[ToolCall | str], ids: list[str]) -> list[dict]:
    """The readable calls of a turn in OpenAI's format, under `ids` (one per readable call)."""
    readable = [call for call in calls if isinstance(call, ToolCall)]
    return [{"id": call_id, "type": "function",
             "function": {"name": call.name if isinstance(call.name, str) else "",
                          "arguments": call.arguments if isinstance(call.arguments, str) else
                          json.dumps(call.arguments)}}
            for call_id, call in zip(ids, readable, strict=True)]


def chat_answer(answer_id: str, model: str, content: str | None, tool_calls: list[dict], finish_reason: str,
                prompt_tokens: int, completion_tokens: int) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": answer_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_answer(answer_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                      completion_tokens: int) -> dict:
    return {"id": answer_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
