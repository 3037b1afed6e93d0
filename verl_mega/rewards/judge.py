"""An LLM judge behind an OpenAI-compatible server (`vllm serve`, docs/remote-rewards.md): each row's prompt,
response and ground truth rendered into the judge's template, one chat completion per row (temperature 0), the
score read from the answer by a regular expression.

An answer the pattern does not read fails its request like a server error (retried, counted in
reward/remote_unparsed); one still unread after the retries stops the run naming the URL and the row: a score
is never invented, and the trainer's batch has no hole for a dropped row.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

from .remote import SHOWN_CHARS, RemoteClient, RequestFailed
from .results import FLOAT32_MAX, Scored

PLACEHOLDERS = ("prompt", "response", "ground_truth")
PLACEHOLDER = re.compile(r"\{(\w+)\}")  # other braces (a JSON example in the template) are left as they are


def load_template(value: str) -> str:
    """reward.remote.prompt_template: the text of the file it names, or itself."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is no valid path
        is_file = False
    return path.read_text() if is_file else value


def check_template(template: str) -> None:
    """ValueError naming an unknown placeholder, or a missing {response}."""
    unknown = sorted({name for name in PLACEHOLDER.findall(template) if name not in PLACEHOLDERS})
    if unknown:
        raise ValueError(f"reward.remote.prompt_template has {', '.join('{' + n + '}' for n in unknown)}; its "
                         f"placeholders are {', '.join('{' + n + '}' for n in PLACEHOLDERS)}")
    if "{response}" not in template:
        raise ValueError("reward.remote.prompt_template has no {response} placeholder (a file it names is not "
                         "there either), so the judge would never see the answer")


def compile_pattern(text: str) -> re.Pattern:
    """reward.remote.score_pattern compiled; ValueError where it does not compile or has no group."""
    try:
        pattern = re.compile(text)
    except re.error as err:
        raise ValueError(f"reward.remote.score_pattern {text!r} is not a regular expression: {err}") from None
    if pattern.groups < 1:
        raise ValueError(f"reward.remote.score_pattern {text!r} has no group: its first group is the score")
    return pattern


def prompt_text(prompt: Any) -> str:
    """A row's prompt as the judge reads it: the text, or chat messages as "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(message, dict) for message in prompt):
        return "\n".join(f"{message.get('role', '')}: {message.get('content', '')}" for message in prompt)
    return str(prompt)


def render(template: str, prompt: Any, response: str, ground_truth: Any) -> str:
    values = {"prompt": prompt_text(prompt), "response": response,
              "ground_truth": "" if ground_truth is None else str(ground_truth)}
    return PLACEHOLDER.sub(lambda match: values.get(match.group(1), match.group(0)), template)


def parse_score(pattern: re.Pattern, answer: str, scale: float) -> float | None:
    """The first group of the pattern's last match in `answer`, as a number, times `scale`; None where it does not
    match, or its group is no number a float32 score holds."""
    matches = list(pattern.finditer(answer))
    if not matches or matches[-1].group(1) is None:
        return None
    try:
        score = float(matches[-1].group(1)) * scale
    except ValueError:
        return None
    return score if math.isfinite(score) and abs(score) <= FLOAT32_MAX else None


def answer_text(reply: Any) -> str:
    """choices[0].message.content of a chat completion; RequestFailed where the reply has none."""
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise RequestFailed(f"the reply is no chat completion with a text answer: {str(reply)[:SHOWN_CHARS]!r}")
    return content


class Judge:
    """Scores rows (`prompt`, `response`, `ground_truth` keys) by chat completions from `client.url`."""

    def __init__(self, client: RemoteClient, model: str, template: str, pattern: str, scale: float,
                 max_tokens: int):
        self.client, self.model, self.scale, self.max_tokens = client, model, scale, max_tokens
        self.template = load_template(template)
        check_template(self.template)
        self.pattern = compile_pattern(pattern)
        self.endpoint = client.url.rstrip("/") + "/chat/completions"

    def score(self, rows: Sequence[dict]) -> list[Scored]:
        labels = [f"row {row}" for row in range(len(rows))]
        return self.client.map(self.attempt, list(rows), labels)

    def attempt(self, row: dict) -> Scored:
        content = render(self.template, row["prompt"], row["response"], row["ground_truth"])
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0.0,
                "max_tokens": self.max_tokens}
        answer = answer_text(self.client.post(self.endpoint, body))
        score = parse_score(self.pattern, answer, self.scale)
        if score is None:
            self.client.count_unparsed()
            raise RequestFailed(f"reward.remote.score_pattern does not read the judge's answer "
                                f"{answer[-SHOWN_CHARS:]!r}")
        return Scored(score, {}, {})
