"""Every number of the config has a declared range, and the one walk over them refuses what is outside it."""
from __future__ import annotations

import dataclasses
import math

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.config.ranges import Range, above, at_least, declared_ranges, numeric_fields, out_of_range, within
from verl_mega.config.schema import TrainConfig
from verl_mega.trainer.preflight import preflight_check


def test_every_number_of_the_schema_has_a_range_and_every_range_a_number():
    fields = numeric_fields(TrainConfig)
    assert len(fields) > 100
    assert [key for key, owner, name in fields if name not in declared_ranges(owner)] == []
    owners = {owner for _, owner, _ in fields}
    for owner in owners:
        names = {field.name for field in dataclasses.fields(owner)}
        assert declared_ranges(owner).keys() <= names, owner


def test_a_number_without_a_range_is_found():
    """The coverage check above can fail: a new int field with no RANGES entry is listed."""
    @dataclasses.dataclass
    class Probe:
        RANGES = {"bounded": at_least(0)}
        bounded: int = 0
        forgotten: float | None = None
        names: list[int] = dataclasses.field(default_factory=list)

    missing = [key for key, owner, name in numeric_fields(Probe) if name not in declared_ranges(owner)]
    assert missing == ["forgotten"]


def test_every_default_is_in_its_range():
    assert out_of_range(TrainConfig()) == {}


@pytest.mark.parametrize("bound, admitted, refused", [
    (at_least(0), [0, 1.5, 1e300], [-1e-9, math.nan, math.inf, -math.inf]),
    (above(0, infinite=True), [1e-9, math.inf], [0, -math.inf, math.nan]),
    (within(0, 1, high_open=True), [0, 0.999], [1, -0.1, math.nan]),
    (at_least(1, off=-1), [-1, 1, 7], [0, -2]),
    (Range(), [-5.0, 0, 3], [math.nan, math.inf]),
])
def test_a_range_admits_its_values_and_no_others(bound, admitted, refused):
    assert all(bound.admits(value) for value in admitted)
    assert not any(bound.admits(value) for value in refused)


def test_each_key_out_of_range_gets_one_line_naming_it():
    config = load_config(None, ["model.hf_path=x", "rollout.top_k=0", "critic.optim.adam_eps=-1",
                                "algorithm.rollout_correction.rollout_is_threshold=-inf", "actor.lora.alpha=nan"])
    assert out_of_range(config) == {
        "rollout.top_k": "rollout.top_k must be -1 (off) or >= 1, got 0",
        "critic.optim.adam_eps": "critic.optim.adam_eps must be >= 0, got -1.0",
        "algorithm.rollout_correction.rollout_is_threshold":
            "algorithm.rollout_correction.rollout_is_threshold must be > 0 (inf: no limit; 2 is usual), got -inf",
        "actor.lora.alpha": "actor.lora.alpha must be > 0 (null: 2 x rank), got nan",
    }


@pytest.mark.parametrize("layer", ["override", "yaml", "api"])
def test_a_boolean_key_takes_true_or_false_not_any_integer(tmp_path, layer):
    """OmegaConf reads `critic.enable: 2` as true; a number other than 0 or 1 is a typo of something else."""
    path, overrides, values = None, ["model.hf_path=x"], None
    if layer == "override":
        overrides.append("critic.enable=2")
    elif layer == "yaml":
        path = tmp_path / "config.yaml"
        path.write_text("critic:\n  enable: 2\n")
    else:
        values = {"critic.enable": 2}
    with pytest.raises(ConfigError, match=r"^critic\.enable='?2'?: a boolean key takes true or false$"):
        load_config(path, overrides, values)
    assert load_config(None, ["model.hf_path=x", "critic.enable=off", "trainer.tensorboard=1"]).critic.enable is False


def test_the_schedule_megatron_asserts_on_is_refused_naming_both_keys():
    """megatron's OptimizerParamScheduler asserts warmup < decay steps and min_lr <= lr: an AssertionError on
    every rank, where the pre-flight check now names the keys."""
    config = load_config(None, ["model.hf_path=x", "critic.optim.lr_warmup_steps=5", "critic.optim.lr_decay_steps=5",
                                "critic.optim.min_lr=1e-3"])
    with pytest.raises(ConfigError) as caught:
        preflight_check(config, world_size=1, check_files=False)
    assert "critic.optim.lr_warmup_steps=5 must be below critic.optim.lr_decay_steps=5" in str(caught.value)
    assert "critic.optim.min_lr=0.001 must not exceed critic.optim.lr=1e-05" in str(caught.value)


@pytest.mark.parametrize("override, key", [
    ("trainer.run_dir=   ", "trainer.run_dir"), ("model.conversion_cache= ", "model.conversion_cache"),
    ("data.train_files=[a.jsonl, '  ']", "data.train_files"),
])
def test_a_string_of_blanks_is_refused_where_an_empty_one_means_off(override, key):
    """A folder named '   ' was made and written into; '' keeps its meaning (off, or refused where required)."""
    problems = out_of_range(load_config(None, ["model.hf_path=x", override]))
    assert list(problems) == [key] and problems[key].endswith("is blank: leave it empty or give a value")
    assert out_of_range(load_config(None, ["model.hf_path=x", "model.conversion_cache="])) == {}


def test_an_empty_run_folder_is_refused_before_the_run_writes_into_the_current_folder():
    config = load_config(None, ["model.hf_path=x", "trainer.run_dir="])
    with pytest.raises(ConfigError, match="trainer.run_dir is empty, which would write the run into the current"):
        preflight_check(config, world_size=1, check_files=False)
