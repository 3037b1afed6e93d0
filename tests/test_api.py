"""The Python API (`verl_mega.Trainer`, `load_policy`), the run's provenance record, model checksums and HF
`datasets` folders as data files; the docs' API example runs as printed."""
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import verl_mega as vm
from verl_mega.api import algorithm_settings
from verl_mega.checkpoint.hf_assets import model_sha256
from verl_mega.config import ConfigError, load_config
from verl_mega.config.errors import UserError
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import read_rows, write_dataset_folder
from verl_mega.rewards.registry import reward_fn_provenance
from verl_mega.trainer.preflight import preflight_check

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "python_api.py"


def test_import_stays_cheap_and_exposes_the_api():
    probe = "import sys, verl_mega; print('torch' in sys.modules, 'Trainer' in dir(verl_mega))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
    assert vm.Trainer.__module__ == "verl_mega.api" and callable(vm.load_policy)
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        vm.Trainr


@pytest.mark.parametrize("algorithm, expected", [
    ("ppo", {"job": "rl", "algorithm.adv_estimator": "gae"}),
    ("grpo", {"job": "rl", "algorithm.adv_estimator": "grpo"}),
    ("rloo", {"job": "rl", "algorithm.adv_estimator": "rloo"}),
    ("sft", {"job": "sft"}),
    ("kto", {"job": "preference", "algorithm.loss": "kto"}),
])
def test_algorithm_names_pick_the_job(algorithm, expected):
    assert algorithm_settings(algorithm) == expected


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"algorithm 'trpo' is unknown; known: sft, ppo, .*grpo.*dpo"):
        algorithm_settings("trpo")


def score_by_length(data_source, response, ground_truth, extra_info=None):
    return float(len(response) == len(ground_truth))


def test_trainer_builds_the_config_the_command_line_builds(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("trainer: {total_steps: 7, seed: 3}\nrollout: {n: 2}\n")
    trainer = vm.Trainer(algorithm="ppo", actor="models/a", critic="models/c", reward_fn=score_by_length,
                         train_data=["x.jsonl", Path("y.parquet")], val_data="v.jsonl", run_dir="runs/r",
                         config=yaml_file)
    cli_config = load_config(yaml_file, [
        "job=ppo", "algorithm.adv_estimator=gae", "model.hf_path=models/a", "model.critic_hf_path=models/c",
        "data.train_files=[x.jsonl,y.parquet]", "data.val_files=[v.jsonl]", "trainer.run_dir=runs/r",
        f"reward.function={__name__}:score_by_length"])
    assert trainer.config == cli_config
    assert trainer.reward_fn is score_by_length
    # A dict of dotted keys takes the place of the YAML file; the arguments win over it.
    trainer = vm.Trainer(algorithm="grpo", actor="m", train_data="x.jsonl", reward_fn="copy",
                         config={"trainer.total_steps": 3, "model.hf_path": "ignored", "trainer.run_dir": "runs/mine"})
    assert (trainer.config.trainer.total_steps, trainer.config.model.hf_path, trainer.run_dir,
            trainer.config.reward.function, trainer.reward_fn) == (3, "m", Path("runs/mine"), "copy", None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(config={"trainer.total_step": 3}), r"config key 'trainer.total_step'"),
    (dict(config={"trainer.total_steps": "many"}), r"config key 'trainer.total_steps'"),
    (dict(config=["trainer.total_steps=3"]), r"config: list given"),
    (dict(reward_fn=42), r"reward_fn: 42 is neither a function"),
    (dict(train_data=[]), r"train_data: give a file"),
    (dict(train_data=5), r"train_data: give a file .* got 5"),
    (dict(train_data={"x.jsonl": 1}), r"train_data: give a file"),
    (dict(val_data=3.5), r"val_data: give a file"),
    (dict(actor=5), r"actor: give a folder path .* got 5"),
    (dict(actor=""), r"actor: give a folder path"),
    (dict(critic=["a", "b"]), r"critic: give a folder path"),
    (dict(run_dir=0), r"run_dir: give a folder path"),
    (dict(algorithm=5), r"algorithm 5 is unknown"),
])
def test_trainer_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(UserError, match=message):
        vm.Trainer(**{"algorithm": "grpo", "actor": "m", "train_data": "x.jsonl", **kwargs})


def test_a_reward_function_is_refused_for_jobs_without_rewards():
    trainer = vm.Trainer(algorithm="sft", actor="m", train_data="x.jsonl")
    with pytest.raises(ConfigError, match="reward_fn: the sft job learns from its data"):
        preflight_check(trainer.config, world_size=1, check_files=False, reward_fn=score_by_length)


def test_reward_provenance_names_registered_functions_and_hashes_the_source_of_others():
    assert reward_fn_provenance("copy") == {"name": "copy"}
    source = ast.get_source_segment(Path(__file__).read_text(), _function_node("score_by_length")) + "\n"
    source_hash = hashlib.sha256(source.encode()).hexdigest()
    expected = {"name": f"{__name__}:score_by_length", "source_sha256": source_hash}
    assert reward_fn_provenance(score_by_length) == expected
    assert reward_fn_provenance(f"{__name__}:score_by_length") == expected
    assert reward_fn_provenance(len)["source_sha256"] == "unavailable"


def _function_node(name: str) -> ast.FunctionDef:
    return next(node for node in ast.parse(Path(__file__).read_text()).body
                if isinstance(node, ast.FunctionDef) and node.name == name)


def test_model_checksum_covers_config_and_weights_not_the_tokenizer(tmp_path):
    from verl_mega.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "model", "qwen2", vocab_size=64)
    before = model_sha256(model)
    assert before == model_sha256(make_tiny_hf_model(tmp_path / "again", "qwen2", vocab_size=64))
    assert re.fullmatch(r"[0-9a-f]{64}", before)
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + " ")
    assert model_sha256(model) == before
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_sha256(model) != before
    (model / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        model_sha256(model)


def test_datasets_folders_read_like_parquet_files(tmp_path):
    rows = make_task_rows("copy", 6, seed=2)
    folder = write_dataset_folder(rows, tmp_path / "copy")
    assert read_rows(folder) == rows
    # A DatasetDict's root is refused with the splits to choose from.
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"holds a DatasetDict: point at one split's folder \(train, test\)"):
        read_rows(tmp_path / "dict")


@pytest.mark.parametrize("state, message", [
    ({"_data_files": [{"filename": "../outside.arrow"}]}, r"'../outside.arrow' is not an .arrow file inside"),
    ({"_data_files": [{"filename": "/etc/passwd"}]}, r"'/etc/passwd' is not an .arrow file inside"),
    ({"_data_files": [{"filename": "state.json"}]}, r"'state.json' is not an .arrow file inside"),
    ({"_data_files": [{"filename": "gone.arrow"}]}, r"data file gone.arrow is missing"),
    ({"_data_files": "data.arrow"}, r"not a datasets state file"),
    ({}, r"not a datasets state file"),
])
def test_datasets_folder_state_is_checked(tmp_path, state, message):
    folder = write_dataset_folder(make_task_rows("copy", 2), tmp_path / "copy")
    (tmp_path / "outside.arrow").write_bytes((Path(folder) / "data-00000-of-00001.arrow").read_bytes())
    (Path(folder) / "state.json").write_text(json.dumps(state))
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_rows(folder)


def test_a_link_out_of_the_datasets_folder_is_refused(tmp_path):
    folder = Path(write_dataset_folder(make_task_rows("copy", 2), tmp_path / "copy"))
    target = tmp_path / "elsewhere.arrow"
    (folder / "data-00000-of-00001.arrow").rename(target)
    (folder / "data-00000-of-00001.arrow").symlink_to(target)
    with pytest.raises(ValueError, match="is not an .arrow file inside"):
        read_rows(folder)


def test_docs_show_the_api_example_verbatim():
    assert f"```python\n{EXAMPLE.read_text()}```" in (ROOT / "docs" / "python-api.md").read_text()


@pytest.mark.slow
def test_readme_api_example_trains_records_provenance_and_generates(tmp_path):
    """The Python API page's example as printed, 2 GRPO steps on the tiny model; then the policy loads back from the
    run folder and from its export alike."""
    from verl_mega.cli import main as cli
    from verl_mega.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "model", "qwen2", vocab_size=64)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VERL_MEGA_COMMIT", None)
    done = subprocess.run([sys.executable, str(EXAMPLE), str(model), "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = re.search(r"^copy: 42 -> (.*)$", done.stdout, re.M)
    assert printed, done.stdout[-2000:]
    run_dir = tmp_path / "runs" / "copy_grpo"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    provenance = json.loads((run_dir / "provenance.json").read_text())
    reward_source = ast.get_source_segment(EXAMPLE.read_text(), next(
        node for node in ast.parse(EXAMPLE.read_text()).body if getattr(node, "name", "") == "copy_reward")) + "\n"
    assert provenance["reward"] == {"name": "__main__:copy_reward",
                                    "source_sha256": hashlib.sha256(reward_source.encode()).hexdigest()}
    assert provenance["model"] == {"path": str(model), "sha256": model_sha256(model)}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert provenance["verl_mega"]["commit"].removesuffix("-dirty") == commit.strip()

    prompt = [{"role": "user", "content": "copy: 42"}]
    from_run = vm.load_policy(run_dir).generate(prompt, max_new_tokens=4)
    assert repr(from_run) == printed.group(1)
    assert cli(["export", "--ckpt", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert vm.load_policy(tmp_path / "hf").generate(prompt, max_new_tokens=4) == from_run


def test_conversions_go_to_the_run_folder_or_the_cache_by_checksum_layout_and_dtype(tmp_path):
    from verl_mega.trainer.main import conversion_path

    config = load_config(None, ["model.hf_path=m", "parallel.tp=2", "model.dtype=bf16"])
    assert conversion_path(config, tmp_path, "actor", "ab12") == tmp_path / "initial_actor_tp2_pp1_ep1"
    assert conversion_path(config, tmp_path, "critic", "cd34") == tmp_path / "initial_critic_tp2_pp1_ep1"
    config.model.conversion_cache = str(tmp_path / "cache")
    assert conversion_path(config, tmp_path, "critic", "cd34") == tmp_path / "cache" / "cd34" / "tp2_pp1_ep1_bf16"
    config.model.family_spec = "pkg.mod:SPEC"
    assert conversion_path(config, tmp_path, "actor", "ab12").name.startswith("tp2_pp1_ep1_bf16_")


def test_step_export_finds_the_critic_s_own_conversion(tmp_path):
    from verl_mega.checkpoint.manifest import MANIFEST_NAME
    from verl_mega.converters.export import _starting_checkpoint, _step_config

    step = tmp_path / "run" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "config.yaml").write_text("model: {actor_ckpt: '', critic_ckpt: ''}\nparallel: {tp: 1, pp: 1, ep: 1}\n")
    for name in ("initial_actor_tp1_pp1_ep1", "initial_critic_tp1_pp1_ep1"):
        (tmp_path / "run" / name).mkdir()
        (tmp_path / "run" / name / MANIFEST_NAME).write_text("{}")
    assert _starting_checkpoint(step, "critic", _step_config(step)).name == "initial_critic_tp1_pp1_ep1"
    assert _starting_checkpoint(step, "actor", _step_config(step)).name == "initial_actor_tp1_pp1_ep1"
    shutil.rmtree(tmp_path / "run" / "initial_critic_tp1_pp1_ep1")
    assert _starting_checkpoint(step, "critic", _step_config(step)).name == "initial_actor_tp1_pp1_ep1"


@pytest.mark.parametrize("content, problem", [(b"model: \xff\xfe\n", "'utf-8' codec can't decode byte 0xff"),
                                             (b"model: [1\n", "while parsing a flow sequence")])
def test_a_garbled_step_config_is_one_line_naming_it(tmp_path, content, problem):
    from verl_mega.converters.export import _step_config

    (tmp_path / "config.yaml").write_bytes(content)
    with pytest.raises(ValueError, match=f"^{tmp_path}/config.yaml is missing or unreadable \\({problem}") as error:
        _step_config(tmp_path)
    assert "\n" not in str(error.value)


def test_a_garbled_run_config_is_one_line_naming_it(tmp_path):
    from verl_mega.run.continuity import check_continuation

    (tmp_path / "config.yaml").write_bytes(b"trainer:\n  total_steps: \xff\n")
    with pytest.raises(UserError, match=f"^{tmp_path}/config.yaml cannot be read back \\(config file "
                                        f"{tmp_path}/config.yaml is not UTF-8 text"):
        check_continuation(tmp_path / "config.yaml", load_config(None, ["model.hf_path=x"]))


def test_the_commit_comes_from_the_image_else_from_git(monkeypatch):
    from verl_mega.run.provenance import package_commit

    monkeypatch.setenv("VERL_MEGA_COMMIT", "baked0123")
    assert package_commit() == "baked0123"
    monkeypatch.delenv("VERL_MEGA_COMMIT")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert package_commit().removesuffix("-dirty") == head.strip()
