"""`default`: the scorer for each row chosen by its data_source, as verl's `default_compute_score` chooses
(a verl data file, with its data_source column, scores here without naming a function). One choice differs:
GSM8K is scored by `number`, which pays the final number stated (its `####` line when there is one) where verl
pays only a `####` line.

verl's code sources run their test cases (`code_tests`, as verl's prime_code scorer). Its retrieval-QA and
geometry sources have no scorer here: a data_source outside the table stops the run naming it and the known
ones."""
from __future__ import annotations

from verl_mega.config.errors import UserError

from .code_tests import code_tests_score
from .final_number import number_score
from .math_answers import dapo_score, math_score
from .rules import add_score, copy_score

SCORER_BY_SOURCE = {
    # Arithmetic with a whole-number answer: the final number stated, its `####` line when it has one (verl's
    # gsm8k scorer pays only that line; a math-verify one pays "26 - 10 =" for 16).
    "openai/gsm8k": number_score,
    # MATH and its re-publications: verl's math_reward (or its math-verify variant); 1 / 0.
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    # NuminaMath's parts, which verl scores with PRIME's math grader: boxed answers as well.
    **{f"numina_{part}": math_score for part in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc",
                                                  "cn_k12", "olympiads")},
    # DAPO's data (and verl's "math" source, which verl scores the same way): 1 / -1 with acc and pred.
    "math_dapo": dapo_score,
    "math": dapo_score,
    "math_dapo_reasoning": dapo_score,
    # Code with test cases: verl scores these with prime_code's continuous score (without a sandbox-fusion URL).
    **{source: code_tests_score for source in ("codecontests", "apps", "codeforces", "taco")},
    # This project's synthetic tasks (verl_mega.data.synthetic).
    "copy": copy_score,
    "add": add_score,
}
SCORER_BY_PREFIX = {"aime": dapo_score}  # aime24, aime2025, ...: DAPO's evaluation sets
SHOWN_CHARS = 80


def known_sources() -> str:
    return ", ".join([*SCORER_BY_SOURCE, *(f"{prefix}*" for prefix in SCORER_BY_PREFIX)])


def scorer_for(data_source):
    """The scorer of `data_source`; UserError naming it and the known ones when there is none."""
    source = str(data_source)
    scorer = SCORER_BY_SOURCE.get(source)
    if scorer is None:
        scorer = next((fn for prefix, fn in SCORER_BY_PREFIX.items() if source.startswith(prefix)), None)
    if scorer is None:  # a data file's value, of any length: the message shows its start
        shown = repr(source[:SHOWN_CHARS]) + ("..." if len(source) > SHOWN_CHARS else "")
        raise UserError(f"no scorer for data_source {shown}; known: {known_sources()} "
                        "(or set reward.function to one scorer for every row)")
    return scorer


def default_score(data_source, solution_str: str, ground_truth, extra_info=None):
    """The score of the scorer that `data_source` names (a number or a dict, as that scorer returns)."""
    return scorer_for(data_source)(data_source, solution_str, ground_truth, extra_info)
