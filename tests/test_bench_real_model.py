"""bench/real_model.py without its packages: one line naming the pip command, exit 0 (the run itself needs the
GGUF model and is not in CI); and its data: held-out word problems share no number with the training ones, and
no two of them are the same problem."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.real_model import INSTALL, PACKAGES, word_problem_rows

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(all(importlib.util.find_spec(module) for module in PACKAGES),
                    reason="the GGUF packages are installed: the bench would run for real")
def test_without_the_packages_the_bench_says_how_to_install_them_in_one_line():
    done = subprocess.run([sys.executable, "-m", "bench.real_model", "--steps", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and INSTALL in lines[0], lines


def test_held_out_problems_use_numbers_no_training_problem_holds():
    train, heldout = word_problem_rows(16)

    def numbers(rows):
        return {number for row in rows for number in re.findall(r"\d+", row["prompt"][0]["content"])}

    assert len(heldout) == 16 and not numbers(train) & numbers(heldout)
    for row in heldout:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        expected = a + b if row["extra_info"]["operation"] == "addition" else a - b
        assert row["reward_model"]["ground_truth"] == str(expected) and expected >= 0
    problems = [(row["extra_info"]["operation"], *sorted(re.findall(r"\d+", row["prompt"][0]["content"])))
                for row in word_problem_rows(306)[1]]
    assert len(set(problems)) == 306
    with pytest.raises(ValueError, match="at most 306"):
        word_problem_rows(307)
