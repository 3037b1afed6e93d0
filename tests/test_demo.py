"""`make demo`'s own pieces: `--seed` reaches the warm-up and the training runs (the default keeps the configs'
seeds), the warm-up's stop is passed only by a model that copies, and each conversion's parity is reported once,
with its figures."""
import dataclasses
import itertools
import typing

import pytest
import torch

from verl_mega.config.schema import TrainConfig, load_config
from verl_mega.data.synthetic import make_task_rows, sft_pairs
from verl_mega.demo import (EXAMPLES, SEEDED_KEYS, WARMUP_TARGET, convert_and_verify, disjoint_copy_rows, mean_score,
                            parse_args, probe_answers, sft_warmup, training_seeds)
from verl_mega.models.tiny import make_tiny_hf_model


def _warm_weights(hf, pairs, out, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sft_warmup(hf, pairs, out, steps=1, seed=seed)[0]).state_dict()


def test_warmup_seed_draws_the_start_and_repeats(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "random", "qwen2", vocab_size=64, num_hidden_layers=1)
    pairs = sft_pairs(make_task_rows("copy", 64, seed=0, max_digits=2))
    first, again, other = (_warm_weights(hf, pairs, tmp_path / name, seed) for name, seed in
                           (("a", 3), ("b", 3), ("c", 4)))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.parametrize("config", ["grpo_demo.yaml", "ppo_gae_demo.yaml", "dapo.yaml", "sft_demo.yaml",
                                    "dpo_demo.yaml"])
def test_default_seed_trains_at_the_configs_seed(config):
    """The figures the docs print were measured at the configs' seeds: `--seed 0` must not move them."""
    loaded = load_config(EXAMPLES / config, ["model.hf_path=unused", "data.train_files=[unused]"])
    at_default = [f"{key}={getattr(getattr(loaded, key.split('.')[0]), key.split('.')[1])}" for key in SEEDED_KEYS]
    assert training_seeds(0) == at_default


def test_a_seed_reaches_every_seed_of_the_config():
    """`--seed 1` must draw other batches and other samples, not only reseed the ranks' RNGs: the demo sets every
    `seed` field of the config's sections."""
    sections = typing.get_type_hints(TrainConfig)
    seeds = {f"{name}.seed" for name, section in sections.items() if dataclasses.is_dataclass(section)
             and "seed" in {field.name for field in dataclasses.fields(section)}}
    assert set(SEEDED_KEYS) == seeds
    assert training_seeds(1) == [f"{key}=2" for key in SEEDED_KEYS]


def test_set_overrides_reach_the_learning_runs_config():
    """`--set` (repeatable) is how the int8 demo runs: its overrides load into examples/grpo_demo.yaml's config."""
    overrides = parse_args(["--set", "rollout.quantization=int8", "--set", "rollout.quantization_tis=false"]).overrides
    loaded = load_config(EXAMPLES / "grpo_demo.yaml", ["model.hf_path=unused", "data.train_files=[unused]", *overrides])
    assert (loaded.rollout.quantization, loaded.rollout.quantization_tis) == ("int8", False)
    assert parse_args([]).overrides == []
    with pytest.raises(SystemExit):
        parse_args(["--set", "rollout.quantization"])


def _answers(rows: list[dict]) -> set[str]:
    return {row["reward_model"]["ground_truth"] for row in rows}


@pytest.fixture(scope="module")
def copy_rows():
    return disjoint_copy_rows()


def test_warmup_probe_is_never_trained_on_nor_held_out(copy_rows):
    train, probe, heldout = copy_rows
    assert len(probe) == 10 and len(heldout) == 24 and len(train) == 512
    assert _answers(train).isdisjoint(_answers(probe) | _answers(heldout))
    assert _answers(probe).isdisjoint(_answers(heldout))


def test_warmup_stop_is_out_of_reach_of_replies_from_a_few_digits(copy_rows):
    """Seed 1's former warm model answered every prompt with one of a few strings of the digits 0, 1 and 4 and
    passed the former stop (0.3 on training prompts). On the probe, replies from any k digits (the best such
    reply for each prompt) score at most k/10, and a fixed reply at most 0.1."""
    _, probe, _ = copy_rows
    for digits in itertools.combinations("0123456789", 4):
        best = [_best_reply_from(row["reward_model"]["ground_truth"], digits) for row in probe]
        assert mean_score(best, probe) <= 0.4 < WARMUP_TARGET
    assert max(mean_score([f"{a}{b}"] * len(probe), probe) for a in "0123456789" for b in "0123456789") == 0.1


def _best_reply_from(answer: str, digits: tuple[str, ...]) -> str:
    return "".join(char if char in digits else digits[0] for char in answer)


def test_probe_answers_put_each_digit_once_in_each_place():
    answers = probe_answers({"07", "18"})
    assert sorted(a[0] for a in answers) == sorted(a[1] for a in answers) == list("0123456789")
    assert {"07", "18"}.isdisjoint(answers) and all(a[0] != a[1] for a in answers)
    with pytest.raises(ValueError, match="hold out fewer"):
        probe_answers({f"{d}{(d + s) % 10}" for s in range(1, 10) for d in range(1)})


@pytest.mark.slow
def test_conversion_reports_its_parity_once_with_figures(tmp_path, capfd):
    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=1)
    convert_and_verify(hf, tmp_path / "mcore", 1, 1)
    lines = [line for line in capfd.readouterr().out.splitlines() if "parity" in line or "logit" in line]
    assert len(lines) == 1 and "max |Δ logit|" in lines[0] and lines[0].endswith("OK"), lines
