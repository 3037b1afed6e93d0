"""Math answers checked with HF's math-verify: the final answer of a response (its last `\\boxed{}`, GSM8K's
`#### N`, else the last LaTeX or plain expression) against the ground truth, equal as numbers, fractions,
expressions, sets or intervals as math-verify decides.

math-verify evaluates what it reads, so `"so she has 26 - 10 ="` equals 16. `reward.math.final_form` (`configure`)
refuses, before math-verify compares, an answer that still holds an operation on written numbers or a response
that ends on an operator (`final_number.holds_operation`, `ends_unfinished`).

math-verify's own time limits are switched off (`parsing_timeout=None`, `timeout_seconds=None`): they use
signal.alarm, which works only in the main thread and cannot interrupt C code. The hard limit is the scoring
worker's (`worker`), which these functions run under whenever `reward.timeout_s` is set.
"""
from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from verl_mega.config.schema import RewardMathConfig

from .final_number import ends_unfinished, holds_operation

# GSM8K's answer line: "#### 1,234". The number is read loosely here and checked by Decimal, so the pattern
# has no nested repetition to backtrack over on a long hostile string.
GSM8K_MARKER = re.compile(r"####\s*(-?[0-9.,]+)")
ANSWER_TARGETS = (LatexExtractionConfig(), ExprExtractionConfig())  # LaTeX first: a \boxed{} wins

_settings = RewardMathConfig()


def configure(config: RewardMathConfig) -> None:
    """The options of this process's math scoring (the scoring worker's, or the trainer's without one)."""
    global _settings
    _settings = config


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its alarms are off; here that is by design (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


def gsm8k_answer(text: str) -> str | None:
    """The number after the last `####`, commas dropped; None without one."""
    found = GSM8K_MARKER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def parse_gold(ground_truth) -> list:
    """The ground truth as math-verify reads it: a full GSM8K solution counts by its `####` line, anything else
    is read as the content of a `\\boxed{}` (LaTeX or a plain number)."""
    truth = str(ground_truth)
    if "####" in truth:
        truth = gsm8k_answer(truth) or truth
    return parse(f"\\boxed{{{truth}}}", (LatexExtractionConfig(),), parsing_timeout=None)


def parse_answer(solution_str: str) -> list:
    """The response's final answer: its `#### N` when it has one, else math-verify's extraction (the last
    `\\boxed{}`, then other LaTeX, then a plain expression). Empty when nothing parses."""
    marked = gsm8k_answer(solution_str)
    if marked is not None:
        return parse(f"\\boxed{{{marked}}}", (LatexExtractionConfig(),), parsing_timeout=None)
    return parse(solution_str, ANSWER_TARGETS, parsing_timeout=None)


def in_final_form(solution_str: str, written: str) -> bool:
    """reward.math.final_form's test: the answer as written (a GSM8K line whole: `#### 26 - 10` is read as 26)
    holds no operation left to carry out, and the response does not end on an operator."""
    if GSM8K_MARKER.search(solution_str):
        written = solution_str[solution_str.rfind("####") + 4:].split("\n", 1)[0]
    return not holds_operation(written) and not ends_unfinished(solution_str)


def is_correct(solution_str: str, ground_truth) -> tuple[bool, str]:
    """Whether the response's final answer equals the ground truth (and, under reward.math.final_form, is
    written in final form), and that answer as written ("" if none)."""
    answer = parse_answer(solution_str)
    written = str(answer[-1]) if answer else ""
    if not answer or (_settings.final_form and not in_final_form(solution_str, written)):
        return False, written
    return verify(parse_gold(ground_truth), answer, timeout_seconds=None), written


def math_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1 when the final answer equals the ground truth (math-verify), else 0."""
    return float(is_correct(solution_str, ground_truth)[0])


def dapo_score(data_source, solution_str: str, ground_truth, extra_info=None) -> dict:
    """DAPO's reward, as verl's `math_dapo` returns it: score 1 for a correct final answer and -1 otherwise, with
    the accuracy and the extracted answer as extra fields (`reward/acc` in the metrics, `pred` in the samples)."""
    correct, written = is_correct(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": written}


def gsm8k_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """GSM8K's strict format: 1 when the response's last `#### N` equals the ground truth's number, else 0 (also
    when the response has no `####` line, as verl's gsm8k reward with its format score 0)."""
    answer, truth = gsm8k_answer(solution_str), str(ground_truth)
    truth = gsm8k_answer(truth) if "####" in truth else truth.replace(",", "").strip()
    if answer is None or truth is None:
        return 0.0
    try:
        return float(Decimal(answer) == Decimal(truth))
    except InvalidOperation:  # "1.2.3", "-" and other non-numbers
        return 0.0
