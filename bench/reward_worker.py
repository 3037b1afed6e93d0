"""What the scoring worker costs on normal answers: the math reward (math-verify) on a batch of ordinary answers,
in the trainer's process vs through the worker (pipe round trips, JSON verdicts), per answer; and the same for
exact_match, a string comparison, which shows the worker's own cost alone.

    python bench/reward_worker.py [--answers 512] [--repeats 10]

Times are the best of `repeats` batches for both sides (on a shared machine the others measure the
neighbours); the worker is started and warm before the first timed batch. The worker's start (a child
importing sympy and math-verify) is shown apart: it is paid once per run, and again after each stopped answer.
"""
import argparse
import time

from verl_mega.rewards.registry import get_reward_fn
from verl_mega.rewards.results import call_reward
from verl_mega.rewards.worker import ScoringWorker

ANSWERS = ["So the answer is \\boxed{\\frac{1}{2}}.", "48 + 24 = 72\n#### 72", "The answer is $\\sqrt{8}$",
           "I get 0.5", "\\boxed{(1, 2)}", "Therefore x = \\boxed{3}"]
TRUTHS = ["\\frac{1}{2}", "72", "2\\sqrt{2}", "\\frac{1}{2}", "(1,2)", "4"]


def batch(size: int, first: int) -> list[tuple]:
    # Distinct texts (a counter in front) in every batch, so math-verify's parse caches do not serve repeats.
    return [("lighteval/MATH", f"Step {i}: {ANSWERS[i % len(ANSWERS)]}", TRUTHS[i % len(TRUTHS)], None)
            for i in range(first, first + size)]


def seconds(score, rows) -> float:
    start = time.perf_counter()
    score(rows)
    return time.perf_counter() - start


def best_of(repeats: int, size: int, scorers: list) -> list[float]:
    """Each scorer's fastest of `repeats` batches of `size` fresh answers, the scorers taking turns on the same
    batch (each process has its own parse caches) so that both sides see the same neighbours."""
    times = [[] for _ in scorers]
    for repeat in range(repeats):
        rows = batch(size, first=repeat * size)
        for scorer, measured in zip(scorers, times):
            measured.append(seconds(scorer, rows))
    return [min(measured) for measured in times]


def compare(name: str, answers: int, repeats: int) -> None:
    fn = get_reward_fn(name)
    worker = ScoringWorker(name, timeout_s=5.0, memory_limit_mb=4096)
    try:
        started = seconds(worker.score, batch(1, first=-1))
        call_reward(fn, batch(1, first=-1)[0])  # the same warm-up in this process
        in_process, through_worker = best_of(repeats, answers, [
            lambda rows: [call_reward(fn, row) for row in rows], worker.score])
    finally:
        worker.close()
    per_answer = 1e3 / answers
    print(f"{name}: {answers} answers, best of {repeats}")
    print(f"  in process      {in_process * per_answer:8.3f} ms/answer")
    print(f"  scoring worker  {through_worker * per_answer:8.3f} ms/answer")
    print(f"  overhead        {(through_worker - in_process) * per_answer:8.3f} ms/answer")
    print(f"  worker start    {started:8.3f} s (once per run, and after each stopped answer)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for name in ("math", "exact_match"):
        compare(name, args.answers, args.repeats)


if __name__ == "__main__":
    main()
