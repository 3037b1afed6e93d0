"""String-comparison rewards for the synthetic tasks (exact match, copy, add): linear in the answer's length,
so no answer can make them slow."""

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


def no_outcome_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """reward.function empty (on-policy distillation with the teacher's signal alone): no outcome reward."""
    return 0.0


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
