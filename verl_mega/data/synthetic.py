"""Synthetic verifiable tasks as prompt rows in verl's row format.

Each task makes (prompt text, answer) pairs from a seeded RNG. Rows carry the answer in
reward_model.ground_truth and the task name in data_source, which is also the name of the rule
reward that scores it (verl_mega.roles.reward). Prompts use only characters of the tiny tokenizer's
alphabet (verl_mega.data.tiny_tokenizer).
"""
from __future__ import annotations

import random
from typing import Callable, NamedTuple


def _copy_example(rng: random.Random, max_digits: int) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, max_digits)))
    return f"copy: {digits}", digits


def _add_example(rng: random.Random, max_digits: int) -> tuple[str, str]:
    a, b = (rng.randrange(10 ** rng.randint(1, max_digits)) for _ in range(2))
    return f"{a}+{b}=", str(a + b)


class SyntheticTask(NamedTuple):
    make_example: Callable[[random.Random, int], tuple[str, str]]
    ability: str


TASKS = {
    "copy": SyntheticTask(_copy_example, ability="copy"),
    "add": SyntheticTask(_add_example, ability="arithmetic"),
}


def make_task_rows(task: str, num_rows: int, seed: int = 0, max_digits: int = 3, split: str = "train") -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; available: {', '.join(sorted(TASKS))}")
    task_spec = TASKS[task]
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        prompt, answer = task_spec.make_example(rng, max_digits)
        rows.append(
            {
                "data_source": task,
                "prompt": [{"role": "user", "content": prompt}],
                "ability": task_spec.ability,
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def sft_pairs(rows: list[dict]) -> list[dict]:
    """Prompt/correct-response pairs for a supervised warm-up before RL."""
    return [{"prompt": row["prompt"], "response": row["reward_model"]["ground_truth"]} for row in rows]


def sft_conversations(rows: list[dict]) -> list[dict]:
    """SFT rows in chat form: the prompt's messages followed by the correct answer as the assistant's turn."""
    return [{"messages": [*row["prompt"], {"role": "assistant", "content": row["reward_model"]["ground_truth"]}]}
            for row in rows]


def preference_pairs(rows: list[dict], seed: int = 0) -> list[dict]:
    """Preference rows: the correct answer chosen over a wrong one of the same length (each position's digit
    shifted by a random non-zero amount), so a policy learns to prefer answers that follow the task's rule."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        wrong = "".join(str((int(digit) + rng.randint(1, 9)) % 10) if digit.isdigit() else digit for digit in answer)
        pairs.append({"prompt": row["prompt"], "chosen": answer, "rejected": wrong})
    return pairs
