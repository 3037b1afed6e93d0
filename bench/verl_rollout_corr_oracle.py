"""verl's own rollout-correction code as the oracle for verl_mega's, on random batches.

    python -m bench.verl_rollout_corr_oracle --verl /path/to/verl-checkout

Imports `verl/trainer/ppo/rollout_corr_helper.py` from the checkout (read there, never copied into this
repository) under a temporary `verl` package whose other modules are four stand-ins for the names it imports
(the DataProto wrapper, two config types it only annotates with, and verl's masked_sum / masked_mean, which
are restated below). Then compares, on batches of growing rollout/training mismatch:
- the rejection mask and metrics of every `rollout_rs` option at several thresholds, and chains of options;
- the IS weights and metrics at token and sequence level, three caps, with and without batch normalisation;
- the off-policy metrics (perplexities, their differences, chi-squared);
- the worked example of issue 45 (rho = [0.65, 1, 1.5], bounds 0.6_1.4: verl keeps [0, 1, 1]).
Prints the number of comparisons and of differences (goal: 0), and the first differences.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from verl_mega.algorithms import RS_OPTIONS, mismatch_metrics, rollout_correction

HELPER = Path("verl/trainer/ppo/rollout_corr_helper.py")
STAND_INS = {
    "verl/protocol.py": "class DataProto:\n    def __init__(self, batch):\n        self.batch = batch\n\n"
                        "    @classmethod\n    def from_dict(cls, tensors):\n        return cls(tensors)\n",
    "verl/trainer/config/algorithm.py": "RolloutCorrectionConfig = dict\n",
    "verl/workers/config/actor.py": "PolicyLossConfig = dict\n",
    # verl's masked_sum and masked_mean (its eps included): the helper's averages go through them.
    "verl/utils/torch_functional.py": (
        "import torch\n\n\ndef masked_sum(values, mask, axis=None):\n"
        "    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)\n\n\n"
        "def masked_mean(values, mask, axis=None):\n"
        "    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)\n"),
}
THRESHOLDS = {"k1": ["0.6_1.4", "0.9_1.3", "1.5", "0.5_2.0"], "k2": ["0.05", "0.2"], "k3": ["0.05", "0.3"]}
CHAINS = [("token_k1,seq_max_k3", "0.6_1.4,0.3"), ("seq_mean_k1,token_k2", "0.9_1.1"),
          ("seq_sum_k3,seq_mean_k2,token_k1", "0.5,0.1,0.7_1.5")]
OURS = {"kl": "kl_k1", "k3_kl": "kl_k3", "rollout_rs_masked_fraction": "rejected_frac"}  # verl's name -> ours


def import_helper(verl_checkout: Path, scratch: Path):
    source = verl_checkout / HELPER
    if not source.is_file():
        raise SystemExit(f"--verl {verl_checkout}: no {HELPER} there (a checkout of volcengine/verl is needed)")
    for relative, text in {**STAND_INS, HELPER.as_posix(): None}.items():
        path = scratch / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for package in path.relative_to(scratch).parents:
            if package != Path("."):
                (scratch / package / "__init__.py").touch()
        if text is None:
            path.symlink_to(source.resolve())
        else:
            path.write_text(text)
    sys.path.insert(0, str(scratch))
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


def random_batch(scale: float, rows: int = 6, length: int = 7):
    mask = torch.zeros(rows, length, dtype=torch.float64)
    for row in range(rows):
        mask[row, :random.randint(1, length)] = 1
    old = -torch.rand(rows, length, dtype=torch.float64) * 2 * mask
    rollout = (old + torch.randn(rows, length, dtype=torch.float64) * scale) * mask
    return old, rollout, mask


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


class Tally:
    def __init__(self):
        self.count, self.differences = 0, []

    def check(self, same: bool, *what) -> None:
        self.count += 1
        if not same:
            self.differences.append(what)

    def metrics(self, theirs: dict, ours: dict, tol: float, *what) -> None:
        for key, value in theirs.items():
            mine = ours.get(OURS.get(key, key))
            self.check(mine is not None and close(value, mine, tol), key, *what, value, mine)


def compare(helper, tally: Tally, old, rollout, mask) -> None:
    log_ratio = old - rollout
    cases = [(option, threshold) for option in RS_OPTIONS for threshold in THRESHOLDS[option[-2:]]] + CHAINS
    for option, threshold in cases:
        try:
            their_mask, their_metrics = helper.compute_rollout_rejection_mask(log_ratio, mask, option, threshold)
        except ValueError:  # a threshold verl refuses for the option
            continue
        correction = rollout_correction(old, rollout, mask, rollout_rs=option, rollout_rs_threshold=threshold)
        tally.check(torch.equal(their_mask, correction.loss_weights.to(their_mask.dtype) * mask), "mask", option,
                    threshold)
        # 1e-5: verl's masked_mean divides by the count + 1e-8, so the spread of a statistic clipped to one value
        # everywhere comes out near 1e-6 there, 0 here.
        tally.metrics(their_metrics, mismatch_metrics(old, rollout, mask, correction), 1e-5, option, threshold)
    for level, cap, normalize in itertools.product(["token", "sequence"], [1.2, 2.0, 5.0], [False, True]):
        weights, their_metrics = helper.compute_rollout_correction_weights(log_ratio, mask, level, cap, normalize)
        correction = rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_threshold=cap,
                                        rollout_is_batch_normalize=normalize)
        tally.check(torch.allclose(weights, correction.loss_weights.to(weights.dtype), rtol=1e-6, atol=1e-9),
                    "weights", level, cap, normalize)
        tally.metrics(their_metrics, mismatch_metrics(old, rollout, mask, correction), 1e-5, level, cap, normalize)
    tally.metrics(helper.compute_offpolicy_metrics(old, rollout, mask),
                  mismatch_metrics(old, rollout, mask, rollout_correction(old, rollout, mask)), 1e-5, "off-policy")


def worked_example(helper, tally: Tally) -> None:
    rho, ones = torch.tensor([[0.65, 1.0, 1.5]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    theirs, _ = helper.compute_rollout_rejection_mask(rho.log(), ones, "token_k1", "0.6_1.4")
    ours = rollout_correction(rho.log(), torch.zeros_like(rho), ones, rollout_rs="token_k1",
                              rollout_rs_threshold="0.6_1.4").loss_weights
    tally.check(torch.equal(theirs, ours) and theirs.tolist() == [[0.0, 1.0, 1.0]], "worked example", theirs, ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", type=Path, required=True, help="a checkout of volcengine/verl")
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    tally = Tally()
    with tempfile.TemporaryDirectory() as scratch:
        helper = import_helper(args.verl, Path(scratch))
        for scale in (0.1, 0.3, 0.6, 1.0):
            compare(helper, tally, *random_batch(scale))
        worked_example(helper, tally)
    print(f"comparisons {tally.count} differences {len(tally.differences)}")
    print(dict(Counter(str(difference[0]) for difference in tally.differences)))
    for difference in tally.differences[:15]:
        print(difference)


if __name__ == "__main__":
    main()
