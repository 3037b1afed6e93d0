"""rollout.quantization in the config: the pre-flight's one-line refusals (fp8 without vLLM on a GPU, int8 outside
the embedded engine on CPU), and the recommended token TIS with its note."""
import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.quantized_rollout import tis_note, with_quantization_tis


@pytest.fixture
def overrides(tiny_models, prompt_file):
    return [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]", "data.batch_size=4",
            "actor.mini_batch_size=4", "critic.mini_batch_size=4"]


def _problems(config) -> list[str]:
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=1)
    return str(err.value).splitlines()[1:]


def test_int8_on_the_embedded_engine_is_taken(overrides):
    preflight_check(load_config(None, overrides + ["rollout.quantization=int8"]), world_size=1)
    preflight_check(load_config(None, overrides + ["rollout.quantization=int8", "rollout.engine=embedded"]),
                    world_size=1)


@pytest.mark.parametrize("engine", ["auto", "embedded"])
def test_fp8_without_a_gpu_is_refused_in_one_line(overrides, engine):
    problems = _problems(load_config(None, overrides + ["rollout.quantization=fp8", f"rollout.engine={engine}"]))
    assert problems == [
        "  - rollout.quantization=fp8 runs in vLLM's FP8 layers on a GPU, and this run's rollout is embedded on CPU "
        "(no GPU here): set rollout.engine=vllm on a GPU, or rollout.quantization=int8 on CPU"]


def test_int8_with_vllm_and_unknown_formats_are_refused(overrides):
    problems = _problems(load_config(None, overrides + ["rollout.quantization=int8", "rollout.engine=vllm"]))
    assert problems == ["  - rollout.quantization=int8 runs in the embedded engine on CPU (oneDNN), and this run's "
                        "rollout is vllm on CPU: set rollout.engine=embedded, or rollout.quantization=fp8 with vLLM "
                        "on a GPU"]
    problems = _problems(load_config(None, overrides + ["rollout.quantization=int4"]))
    assert problems == ["  - rollout.quantization 'int4' is unknown; known: none, int8, fp8"]


def test_quantized_rollouts_turn_token_tis_on_unless_told_otherwise(overrides):
    config = load_config(None, overrides + ["rollout.quantization=int8"])
    resolved = with_quantization_tis(config)
    assert resolved.algorithm.rollout_correction.rollout_is == "token"
    assert resolved.algorithm.rollout_correction.rollout_is_threshold == 2.0  # verl's decoupled_token_is
    assert config.algorithm.rollout_correction.rollout_is is None  # the caller's config is left as it was
    assert tis_note(config).startswith("note: rollout.quantization=int8 turns on token TIS "
                                       "(algorithm.rollout_correction.rollout_is=token, rollout_is_threshold=2.0")
    for told in (["rollout.quantization_tis=false"], ["algorithm.rollout_correction.rollout_is=sequence"], []):
        quantized = [] if not told else ["rollout.quantization=int8"]
        config = load_config(None, overrides + quantized + told)
        assert tis_note(config) is None
        assert with_quantization_tis(config).algorithm.rollout_correction == config.algorithm.rollout_correction
