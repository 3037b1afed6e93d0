"""`make demo`'s own pieces: `--seed` reaches the warm-up and the training runs (the default keeps the configs'
seeds), and each conversion's parity is reported once, with its figures."""
import pytest
import torch
import yaml

from verl_mega.data.synthetic import make_task_rows, sft_pairs
from verl_mega.demo import EXAMPLES, convert_and_verify, sft_warmup, training_seed
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
    seed = yaml.safe_load((EXAMPLES / config).read_text())["trainer"]["seed"]
    assert training_seed(0) == f"trainer.seed={seed}"


@pytest.mark.slow
def test_conversion_reports_its_parity_once_with_figures(tmp_path, capfd):
    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=1)
    convert_and_verify(hf, tmp_path / "mcore", 1, 1)
    lines = [line for line in capfd.readouterr().out.splitlines() if "parity" in line or "logit" in line]
    assert len(lines) == 1 and "max |Δ logit|" in lines[0] and lines[0].endswith("OK"), lines
