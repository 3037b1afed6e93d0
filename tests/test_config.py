"""Training config: YAML + dotted overrides onto typed defaults; every error names the key to fix."""
import json
import re

import pytest

from verl_mega.config import ConfigError, load_config, to_yaml
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.main import main as train_main


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"copy: {i}", "reward_model": {"ground_truth": str(i)}})
                              for i in range(8)))
    return path


def good_overrides(tiny_models, prompt_file):
    return [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]", "parallel.tp=2",
            "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4"]


def test_yaml_and_overrides_merge_onto_defaults(tmp_path, tiny_models, prompt_file):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("actor:\n  optim: {lr: 0.5}\n  ppo_epochs: 3\nparallel: {tp: 2}\n")
    config = load_config(yaml, good_overrides(tiny_models, prompt_file) + ["actor.optim.lr=0.25"])
    assert config.actor.optim.lr == 0.25 and config.actor.ppo_epochs == 3 and config.critic.optim.lr == 1e-5
    preflight_check(config, world_size=4)
    (tmp_path / "resolved.yaml").write_text(to_yaml(config))
    assert load_config(tmp_path / "resolved.yaml") == config


@pytest.mark.parametrize("override, message", [
    ("model.nope=1", "config key 'model.nope'"),
    ("parallel.tp=two", "config key 'parallel.tp'"),
    ("parallel.tp", "must look like key.sub=value"),
    ("actor=3", "config key 'actor' is a section (keys: ppo_epochs"),
    ("actor.optim=fast", "config key 'actor.optim' is a section (keys: lr, min_lr"),
])
def test_unknown_keys_and_bad_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["model.hf_path=x", override])


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match="config key 'model.hf_path' is required"):
        load_config(None, [])


@pytest.mark.parametrize("override, world, message", [
    ("actor.mini_batch_size=3", 4, "actor.mini_batch_size=3 must be divisible by data-parallel size 2"),
    ("data.batch_size=6", 4, "data.batch_size=6 must be divisible by the number of rollout replicas 4"),
    ("parallel.tp=4", 4, "parallel.tp=4 must divide the number of query groups (num_key_value_heads=2)"),
    ("parallel.pp=3", 6, "parallel.pp=3 must divide num_hidden_layers=4"),
    ("parallel.rollout_tp=4", 4, "parallel.rollout_tp=4 must divide the training TP size parallel.tp=2"),
    ("algorithm.adv_estimator=ppo2", 4, "algorithm.adv_estimator 'ppo2' is unknown; known: dr_grpo, gae"),
    ("actor.loss.kl_loss_type=k9", 4, "actor.loss.kl_loss_type 'k9' is unknown"),
    ("parallel.tp=3", 4, "parallel.tp * parallel.pp = 3 must divide the number of processes (4)"),
    ("trainer.checkpoint_mirror=bucket/prefix", 4, "trainer.checkpoint_mirror: 'bucket/prefix' must start with s3://"),
    ("trainer.checkpoint_mirror=s3://Bad_Bucket/x", 4, "trainer.checkpoint_mirror: 's3://Bad_Bucket/x': 'Bad_Bucket' "
     "is not an S3 bucket name"),
    ("trainer.checkpoint_mirror_wait_s=-1", 4, "trainer.checkpoint_mirror_wait_s must be in [0, 1000000000], got -1.0"),
    # Values the sweep of every number found accepted, each of which crashed or misled a run:
    ("actor.optim.adam_beta1=nan", 4, "actor.optim.adam_beta1 must be in [0, 1), got nan"),  # torch's traceback
    ("actor.optim.clip_grad=nan", 4, "actor.optim.clip_grad must be a finite number (<= 0: no clipping), got nan"),
    ("actor.optim.lr=inf", 4, "actor.optim.lr must be finite and >= 0, got inf"),
    ("rollout.temperature=inf", 4, "rollout.temperature must be finite and >= 0, got inf"),  # uniform sampling
    ("parallel.bridge_timeout_s=inf", 4, "parallel.bridge_timeout_s must be in (0, 1000000000] (seconds), got inf"),
    ("data.seed=-1", 4, "data.seed must be in [0, 4294967295], got -1"),
    ("actor.optim.min_lr=1", 4, "actor.optim.min_lr=1.0 must not exceed actor.optim.lr=1e-06"),  # megatron asserts
    ("model.sha256=abc123", 4, "model.sha256='abc123' is not a sha256 (64 hexadecimal digits"),
    # The KV cache's room for the whole response was allocated at once: 51 TB here.
    ("data.max_response_length=99999999999", 4, "data.max_prompt_length + data.max_response_length = 100000000063 "
     "tokens exceed model.hf_path's context of 256"),
])
def test_preflight_check_names_the_key(tiny_models, prompt_file, override, world, message):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + [override])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=world)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.filter_groups.enable=true", "rollout.n=1"],
     "algorithm.filter_groups.enable with rollout.n=1: a group of one response is never dropped"),
    (["algorithm.filter_groups.enable=true", "rollout.n=2", "algorithm.filter_groups.max_num_gen_batches=-1"],
     "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: no bound), got -1"),
    (["algorithm.filter_groups.enable=true", "rollout.n=2", "algorithm.filter_groups.on_exhausted=skip"],
     "algorithm.filter_groups.on_exhausted 'skip' is unknown; known: stop, train"),
    (["algorithm.filter_groups.enable=true", "rollout.n=1", "algorithm.filter_groups.on_exhausted=train"],
     "algorithm.filter_groups.on_exhausted=train: a partial batch is cut to whole mini-batches, and "
     "actor.mini_batch_size=4 is the whole batch (4 rows)"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=33"],
     "reward.overlong_buffer.len=33 must be in [1, data.max_response_length=32]"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=0"],
     "reward.overlong_buffer.len=0 must be in [1, data.max_response_length=32]"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4", "reward.overlong_buffer.penalty_factor=-1"],
     "reward.overlong_buffer.penalty_factor must be >= 0, got -1.0"),
])
def test_dapo_settings_that_cannot_work_are_refused_naming_the_key(tiny_models, prompt_file, overrides, message):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + overrides)
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=4)
    # One line per problem, starting with the key.
    assert any(line.startswith(f"  - {message}") for line in str(err.value).splitlines()), str(err.value)


def test_dapo_settings_that_fit_are_taken(tiny_models, prompt_file):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + [
        "algorithm.filter_groups.enable=true", "rollout.n=2", "algorithm.filter_groups.on_exhausted=train",
        "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32", "algorithm.overlong_filtering=true"])
    preflight_check(config, world_size=4)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_0_1_is_refused_in_one_line(tiny_models, prompt_file, value):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + [f"rollout.gpu_memory_utilization={value}"])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=4)
    assert str(err.value).splitlines() == [
        "invalid config:", f"  - rollout.gpu_memory_utilization must be in (0, 1], got {float(value)}"]


def test_gpu_memory_utilization_of_1_is_taken(tiny_models, prompt_file):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + ["rollout.gpu_memory_utilization=1"])
    preflight_check(config, world_size=4)
    assert config.rollout.gpu_memory_utilization == 1.0


def test_bad_dataset_is_refused_before_training(tiny_models, tmp_path, prompt_file):
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text(json.dumps({"question": "1+1="}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path, message in ((no_prompt, "prompt column 'prompt' not found"), (empty, "data file has no rows"),
                          (tmp_path / "absent.jsonl", "data file not found")):
        overrides = good_overrides(tiny_models, prompt_file) + [f"data.train_files=[{path}]"]
        with pytest.raises(ConfigError, match=f"data.train_files: {message}"):
            preflight_check(load_config(None, overrides), world_size=4)


# A world of 4 as torchrun describes it, and as Slurm does for tasks that `srun` starts without torchrun: the
# pre-flight check sizes the config by the world that `init_parallel` would build.
@pytest.mark.parametrize("world", [
    {"WORLD_SIZE": "4"},
    {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_NODELIST": "gpu[01-02]",
     "SLURM_JOB_ID": "7"},
], ids=["torchrun", "srun"])
def test_train_command_exits_2_with_the_problem_before_any_process_group(tiny_models, prompt_file, capsys,
                                                                           monkeypatch, world):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in world.items():
        monkeypatch.setenv(name, value)
    code = train_main(good_overrides(tiny_models, prompt_file) + ["actor.micro_batch_size=3"])
    assert code == 2
    assert "actor.mini_batch_size=4 must be divisible by data-parallel size 2 x actor.micro_batch_size=3" in \
        capsys.readouterr().err
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.parametrize("function, message", [
    ("nosuch", "reward.function: unknown reward function 'nosuch'"),
    ("os:nosuch", "reward.function: module 'os' has no function 'nosuch'"),
])
def test_reward_function_is_checked(tiny_models, prompt_file, function, message):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + [f"reward.function={function}"])
    with pytest.raises(ConfigError, match=message):
        preflight_check(config, world_size=4)


def test_invalid_yaml_is_refused_with_the_file_named_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: {lr: 1}\nactor: {lr: 2}\n")
    with pytest.raises(ConfigError, match=f"config file {bad} is not valid YAML") as error:
        load_config(bad)
    assert "\n" not in str(error.value)


def test_a_file_that_is_not_utf8_is_refused_with_the_file_named(tmp_path):
    garbled = tmp_path / "config.yaml"
    garbled.write_bytes(b"trainer:\n  total_steps: \xff\xfe\n")
    with pytest.raises(ConfigError, match=f"^config file {garbled} is not UTF-8 text \\(byte 0xff at offset 24\\)"):
        load_config(garbled)


@pytest.mark.parametrize("text", ["- trainer\n- actor\n", "3\n"])  # a list: omegaconf's ConfigTypeError traceback
def test_a_file_that_is_not_a_mapping_is_refused_with_the_file_named(tmp_path, text):
    listed = tmp_path / "a config #1.yaml"
    listed.write_text(text)
    with pytest.raises(ConfigError, match=f"^config file {listed} must hold a mapping of sections"):
        load_config(listed)


def test_a_folder_given_as_the_config_file_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=f"^config file {tmp_path} is a folder$"):
        load_config(tmp_path)


def test_every_key_of_a_verl_config_the_schema_lacks_is_named_at_once(tmp_path):
    verl = tmp_path / "verl.yaml"
    verl.write_text("data: {train_batch_size: 8, max_prompt_length: 64}\nactor_rollout_ref: {model: {path: m}}\n"
                    "algorithm: {adv_estimator: grpo}\ncustom_reward_function: {path: r.py}\n"
                    "trainer: {n_gpus_per_node: 8}\n")
    with pytest.raises(ConfigError) as error:
        load_config(verl)
    assert str(error.value) == (f"config file {verl}: data.train_batch_size (batch_size?), actor_rollout_ref, "
                                "custom_reward_function, trainer.n_gpus_per_node are not keys of verl_mega's config "
                                "(docs/reference/config.md lists them, with verl's names where they differ)")


# --- overrides are typed by the key they set, never re-read as YAML -------------------------------------------


@pytest.mark.parametrize("override, key, expected", [
    ("model.hf_path=/m/model #v2", "model.hf_path", "/m/model #v2"),
    ("trainer.run_dir=/runs/a ", "trainer.run_dir", "/runs/a "),
    ("model.sha256=" + "1" * 64, "model.sha256", "1" * 64),
    ("reward.function='quoted': ${USER}", "reward.function", "'quoted': ${USER}"),
    ("model.hf_path=a=b", "model.hf_path", "a=b"),
    ("data.train_files=/d/my data #1.jsonl", "data.train_files", ["/d/my data #1.jsonl"]),
    ("data.train_files=[a.jsonl, b.parquet]", "data.train_files", ["a.jsonl", "b.parquet"]),
    ("actor.optim.lr=1e-6", "actor.optim.lr", 1e-6),
    ("trainer.total_steps=7", "trainer.total_steps", 7),
    ("actor.loss.clip_ratio_low=null", "actor.loss.clip_ratio_low", None),
    ("trainer.profile_ranks=1", "trainer.profile_ranks", [1]),
    ("actor.loss.extra.beta=0.5", "actor.loss.extra", {"beta": 0.5}),
])
def test_an_override_is_typed_by_its_key(override, key, expected):
    config = load_config(None, ["model.hf_path=/m", override])
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


def test_api_values_keep_their_strings():
    config = load_config(None, values={"model.hf_path": "/m/${HOME} #1", "data.train_files": ["a #b.jsonl"]})
    assert (config.model.hf_path, config.data.train_files) == ("/m/${HOME} #1", ["a #b.jsonl"])


@pytest.mark.parametrize("override, words", [
    ("trainer.total_steps=ten", ("trainer.total_steps", "'ten'")),
    ("trainer.no_such_key=1", ("trainer.no_such_key",)),
    ("trainer.total_steps=null", ("trainer.total_steps",)),
    ("data.train_files=[a.jsonl", ("override 'data.train_files=[a.jsonl'", "not valid YAML")),
    ("actor.loss.extra={beta", ("override 'actor.loss.extra={beta'", "not valid YAML")),
    ("=5", ("override '=5' must look like key.sub=value",)),
])
def test_a_bad_override_is_refused_naming_its_key(override, words):
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["model.hf_path=/m", override])
    assert all(word in str(refused.value) for word in words), str(refused.value)
@pytest.mark.parametrize("given, job", [("ppo", "rl"), ("dpo", "preference"), ("rl", "rl"), ("sft", "sft"),
                                        ("preference", "preference")])
def test_job_names_and_their_old_spellings_load_as_one_name(tmp_path, given, job):
    # An old run's saved config.yaml says `job: ppo` or `job: dpo`: it loads (and resumes) as the job's name now.
    saved = tmp_path / "config.yaml"
    saved.write_text(f"job: {given}\nmodel: {{hf_path: m}}\n")
    assert load_config(saved).job == job
    assert load_config(None, ["model.hf_path=m", f"job={given}"]).job == job
    assert load_config(None, values={"model.hf_path": "m", "job": given}).job == job
    assert f"job: {job}\n" in to_yaml(load_config(saved))


@pytest.mark.parametrize("override, message", [
    ("actor.loss.clip_cov_ratio=0", "actor.loss.clip_cov_ratio must be in (0, 1], got 0"),
    ("actor.loss.kl_cov_ratio=2", "actor.loss.kl_cov_ratio must be in (0, 1], got 2"),
    ("actor.loss.tau_neg=-1", "actor.loss.tau_neg must be > 0, got -1"),
    ("actor.loss.clip_ratio_c=1", "actor.loss.clip_ratio_c must be > 1 (dual-clip), got 1"),
    ("actor.loss.extra.tau_pos=2", "actor.loss.extra repeats ['tau_pos']: set actor.loss.tau_pos instead"),
    ("actor.loss.bypass_loss_type=ppo", "actor.loss.bypass_loss_type 'ppo' is unknown; known: ppo_clip, reinforce"),
])
def test_preflight_refuses_policy_loss_knobs_out_of_range(tiny_models, prompt_file, override, message):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + ["actor.loss.policy_loss=clip_cov", override])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=4)
    assert message in str(err.value)


def test_a_wandb_project_wandb_would_refuse_is_named_before_the_run(tiny_models, prompt_file):
    config = load_config(None, good_overrides(tiny_models, prompt_file) + ["trainer.wandb_project=my runs #1"])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=4)
    assert "trainer.wandb_project='my runs #1': wandb project names may not hold #" in str(err.value)


@pytest.mark.parametrize("off", ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo"])
def test_a_critic_that_is_off_is_not_refused_for_its_batch_sizes(tiny_models, prompt_file, off):
    """GRPO (or RLOO) with a batch smaller than the critic's default mini-batch was refused with
    'must be divisible by critic.mini_batch_size=8', a key of a role that does not run."""
    overrides = good_overrides(tiny_models, prompt_file) + ["critic.mini_batch_size=8", "critic.micro_batch_size=3",
                                                           off]
    preflight_check(load_config(None, overrides), world_size=4)
    with pytest.raises(ConfigError, match="must be divisible by critic.mini_batch_size=8"):  # still checked when on
        preflight_check(load_config(None, overrides[:-1]), world_size=4)


def test_a_section_given_a_value_in_the_file_is_named(tmp_path):
    (tmp_path / "run.yaml").write_text("model: {hf_path: x}\nparallel: 2\n")
    with pytest.raises(ConfigError, match=r"config key 'parallel' is a section \(keys: tp, pp"):
        load_config(tmp_path / "run.yaml")
