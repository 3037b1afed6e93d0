"""The reward role: rule-based scores for verifiable tasks, or a learned reward model.

Rule reward functions share verl's `compute_score` signature,
`fn(data_source, solution_str, ground_truth, extra_info) -> float`, so verl reward files can be
used unchanged through a "module:function" path (the Python API hands over the function itself).
Sequence scores become token-level rewards at the last valid response token, where PPO/GRPO
advantage estimation expects the outcome reward.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import numbers
from typing import Any, Callable, NamedTuple, Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from verl_mega.config.errors import UserError
from verl_mega.data.prompts import as_messages, encode_chat

RewardFn = Callable[[Any, str, Any, Any], float]

# Near-misses on arithmetic earn at most this much, so an exact answer is always clearly better
# than any almost-right one.
ADD_PARTIAL_CREDIT = 0.5


def _positional_match_fraction(answer: str, target: str, align_right: bool) -> float:
    """Matching characters over the longer string's length, so extra characters cost credit too."""
    longest = max(len(answer), len(target))
    if longest == 0:
        return 1.0
    if align_right:
        answer, target = answer[::-1], target[::-1]
    return sum(a == b for a, b in zip(answer, target)) / longest


def exact_match_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    return float(solution_str.strip() == str(ground_truth).strip())


def copy_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """Fraction of positions that repeat the digit string correctly."""
    return _positional_match_fraction(solution_str.strip(), str(ground_truth).strip(), align_right=False)


def add_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1 for the exact sum; otherwise partial credit for digits right in their place value."""
    answer, target = solution_str.strip(), str(ground_truth).strip()
    if answer == target:
        return 1.0
    # Aligned from the right: units with units, tens with tens.
    return ADD_PARTIAL_CREDIT * _positional_match_fraction(answer, target, align_right=True)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match_score,
    "copy": copy_score,
    "add": add_score,
}


def get_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A registered name, "package.module:function" for a function defined elsewhere, or the function itself."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise UserError(f"reward function {spec!r} is neither a callable nor a name / 'module:function'")
    name = spec
    if ":" in name:
        module_name, _, function_name = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UserError(f"cannot import module {module_name!r} for reward function {name!r}: {error}") from error
        function = getattr(module, function_name, None)
        if not callable(function):
            raise UserError(f"module {module_name!r} has no function {function_name!r} (reward function {name!r})")
        return function
    if name not in REWARD_FUNCTIONS:
        raise UserError(
            f"unknown reward function {name!r}; registered: {', '.join(sorted(REWARD_FUNCTIONS))} "
            "(or give 'module:function')"
        )
    return REWARD_FUNCTIONS[name]


def reward_fn_name(spec: str | RewardFn) -> str:
    """How a run names its reward function: the registered name or "module:function" as given, or a callable's
    "module:qualname" (importable back when the function is defined at a module's top level)."""
    if isinstance(spec, str):
        return spec
    module, qualname = getattr(spec, "__module__", None), getattr(spec, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(spec)


def reward_fn_provenance(spec: str | RewardFn) -> dict[str, str]:
    """What scored a run: a registered function by its name (the package version pins its code); any other by
    the sha256 of its source, so an edited reward file shows up as a different one."""
    record = {"name": reward_fn_name(spec)}
    if isinstance(spec, str) and spec in REWARD_FUNCTIONS:
        return record
    function = get_reward_fn(spec)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # a builtin, a functools.partial, a function typed into a REPL
        source = None
    record["source_sha256"] = hashlib.sha256(source.encode()).hexdigest() if source is not None else "unavailable"
    return record


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] rewards, each score at its row's last valid response token, zero elsewhere."""
    valid = response_mask.bool()
    empty_rows = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(f"response rows {empty_rows} have no valid tokens to carry their reward")
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last_valid = torch.where(valid, positions, -1).max(dim=-1).values
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    token_rewards[torch.arange(len(scores), device=response_mask.device), last_valid] = scores.to(token_rewards)
    return token_rewards


class RewardOutput(NamedTuple):
    scores: torch.Tensor  # [B]
    token_level_rewards: torch.Tensor  # [B, T]
    extras: dict = {}  # a dict reward's further fields, name -> [B] values (never mutated: a shared default)


class RuleReward:
    def __init__(self, tokenizer, reward_fn: str | RewardFn = "exact_match"):
        self.tokenizer = tokenizer
        self.name = reward_fn_name(reward_fn)
        self.reward_fn = get_reward_fn(reward_fn)

    def decode(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        valid_ids = [[token for token, valid in zip(row, mask) if valid]
                     for row, mask in zip(responses.tolist(), response_mask.tolist())]
        return self.tokenizer.batch_decode(valid_ids, skip_special_tokens=True)

    def __call__(
        self,
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        ground_truths: Sequence[Any],
        data_sources: Sequence[Any] | None = None,
        extra_infos: Sequence[Any] | None = None,
    ) -> RewardOutput:
        batch_size = len(responses)
        data_sources = data_sources if data_sources is not None else [None] * batch_size
        extra_infos = extra_infos if extra_infos is not None else [None] * batch_size
        texts = self.decode(responses, response_mask)
        rows = zip(data_sources, texts, ground_truths, extra_infos, strict=True)
        scores = torch.tensor([self._score(row, *args) for row, args in enumerate(rows)], dtype=torch.float32)
        # NaN/inf pass through: the trainer stops or skips the batch (trainer.nonfinite) and names the rows.
        return RewardOutput(scores, scores_to_token_rewards(scores, response_mask.cpu()))

    def _score(self, row: int, source, text: str, truth, info) -> float:
        """One response's score; a function that raises or returns a non-number is the user's to fix."""
        where = f"response {row} (data_source {source!r})"
        try:
            value = self.reward_fn(source, text, truth, info)
        except Exception as err:
            raise UserError(f"reward.function {self.name!r} raised {type(err).__name__}: {err} on {where}") from None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real):
            return float(value)
        raise UserError(f"reward.function {self.name!r} returned {type(value).__name__} {str(value)[:40]!r} on "
                        f"{where}; it must return a number")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFRewardModel:
    """A sequence-classification reward model with a single label; its logit is the score."""

    def __init__(self, model_dir: str, device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token_id is None:
            raise UserError(f"the reward model tokenizer in {model_dir} has no pad token to batch with")
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise UserError(f"reward model in {model_dir} has {self.model.config.num_labels} labels; expected 1")
        # The model reads its score at the rightmost non-pad token, so it must know the pad id.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def _encode(self, prompt: str | list[dict], response: str) -> list[int]:
        if self.tokenizer.chat_template:
            conversation = as_messages(prompt) + [{"role": "assistant", "content": response}]
            return encode_chat(self.tokenizer, conversation, add_generation_prompt=False)
        if not isinstance(prompt, str):
            raise ValueError("prompt is a list of chat messages but the reward model tokenizer has no chat_template")
        return self.tokenizer(prompt + response)["input_ids"]

    @torch.no_grad()
    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores on the CPU, from prompt and response texts (the policy's tokens are not
        reused: the reward model may have a different vocabulary and chat template)."""
        encoded = [self._encode(prompt, response) for prompt, response in zip(prompts, responses, strict=True)]
        # Right padding keeps each sequence's positions as they are unpadded; the model's forward
        # does not derive position ids from the attention mask.
        batch = self.tokenizer.pad({"input_ids": encoded}, padding=True, padding_side="right", return_tensors="pt")
        logits = self.model(
            input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
        ).logits
        return logits[:, 0].float().cpu()
