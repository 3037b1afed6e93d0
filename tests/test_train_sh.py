"""docker/: the image cannot be built here (no registry), so `train.sh`, its entry point, runs directly on CPU
and the Dockerfile and the script go through hadolint and shellcheck (pinned in requirements.txt)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SH = ROOT / "docker" / "train.sh"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TINY_GRPO = """\
parallel: {tp: 1, pp: 1}
data: {max_prompt_length: 16, max_response_length: 4, batch_size: 8, truncation: error}
rollout: {n: 2}
actor: {mini_batch_size: 16, micro_batch_size: 16}
critic: {enable: false}
algorithm: {adv_estimator: grpo}
reward: {function: copy}
trainer: {total_steps: 1, progress_bar: false}
"""


def linter(name: str) -> str:
    """The linter installed beside this interpreter (the venv's bin, as requirements.txt installs it)."""
    found = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -r requirements.txt ships its binary)")
    return found


def test_hadolint_passes_the_dockerfile():
    done = subprocess.run([linter("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_train_sh_passes_bash_n_and_shellcheck():
    subprocess.run(["bash", "-n", str(TRAIN_SH)], check=True)
    done = subprocess.run([linter("shellcheck"), str(TRAIN_SH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_bakes_the_commit_in_and_enters_through_train_sh():
    text = DOCKERFILE.read_text()
    assert "ARG VERL_MEGA_COMMIT" in text and "ENV VERL_MEGA_COMMIT=${VERL_MEGA_COMMIT}" in text
    assert 'org.opencontainers.image.revision="${VERL_MEGA_COMMIT}"' in text
    assert 'ENTRYPOINT ["/usr/local/bin/train.sh"]' in text
    base = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG BASE_IMAGE="))
    assert ":" in base and not base.endswith(":latest"), base


def run_train_sh(env: dict, *overrides: str, timeout: int = 600,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1",
                "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(TRAIN_SH), *overrides], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_dataset_folder
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("train_sh")
    (root / "grpo.yaml").write_text(TINY_GRPO)
    return {"MODEL_ID": str(make_tiny_hf_model(root / "model", "qwen2", vocab_size=64)),
            "DATASET_PATH": write_dataset_folder(make_task_rows("copy", 32, max_digits=2), root / "copy"),
            "RL_CONFIG": str(root / "grpo.yaml"), "RUN_DIR": str(root / "run"), "CACHE_DIR": str(root / "cache")}


@pytest.mark.parametrize("change, message", [
    ({"MODEL_ID": None}, "MODEL_ID is not set"),
    ({"MODEL_ID": "/nonexistent/model"}, "MODEL_ID=/nonexistent/model has no config.json"),
    ({"DATASET_PATH": None}, "DATASET_PATH is not set"),
    ({"DATASET_PATH": "/nonexistent/data.parquet"}, "DATASET_PATH=/nonexistent/data.parquet does not exist"),
    ({"RL_CONFIG": ""}, "RL_CONFIG is not set"),
    ({"RL_CONFIG": "/nonexistent.yaml"}, "RL_CONFIG=/nonexistent.yaml is not a file"),
    ({"NPROC": "two"}, "NPROC=two must be a number of processes"),
    ({"NPROC": "0"}, "NPROC=0 must be a number of processes"),
    ({"MODEL_SHA256": "abc"}, "MODEL_SHA256=abc is not a sha256"),
    ({"CACHE_DIR": "/proc/no/cache"}, "CACHE_DIR=/proc/no/cache cannot be created"),
])
def test_missing_or_bad_variables_fail_naming_them(inputs, change, message):
    env = {key: value for key, value in {**inputs, **change}.items() if value is not None}
    done = run_train_sh(env)
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)
    assert not Path(inputs["RUN_DIR"], "config.yaml").exists()


# Stands in for the interpreter: the trainer's command line is answered with the config it loads (every other
# use of PYTHON runs the real one), so the test sees exactly what train.sh hands the trainer.
CONFIG_PRINTER = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$3" = "train" ]; then
    shift 4
    exec "{python}" -c 'import json, sys
from verl_mega.config import load_config
config = load_config(sys.argv[1], sys.argv[2:])
print(json.dumps({{"hf_path": config.model.hf_path, "train_files": config.data.train_files,
                  "run_dir": config.trainer.run_dir, "cache": config.model.conversion_cache,
                  "sha256": config.model.sha256, "function": config.reward.function}}))' "$@"
fi
exec "{python}" "$@"
"""


def _printed_config(tmp_path, env: dict, *overrides: str, cwd: Path | None = None) -> dict:
    printer = tmp_path / "python"
    printer.write_text(CONFIG_PRINTER.format(python=sys.executable))
    printer.chmod(0o755)
    done = run_train_sh({**env, "PYTHON": str(printer)}, *overrides, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_values_reach_the_config_exactly_as_given(inputs, tmp_path):
    """Spaces, '#', commas, quotes, '${' and a trailing blank are part of a value, never YAML syntax; a sha256 of
    digits stays a string."""
    model = tmp_path / "models" / "my model #v2, 'final'"
    model.mkdir(parents=True)
    shutil.copy(Path(inputs["MODEL_ID"]) / "config.json", model)
    data = tmp_path / "data #1 ${USER}.jsonl"
    data.write_text("{}\n")
    env = {**inputs, "MODEL_ID": str(model), "DATASET_PATH": str(data), "RUN_DIR": str(tmp_path / "run #3 "),
           "CACHE_DIR": str(tmp_path / "cache, shared"), "MODEL_SHA256": "0" * 63 + "7"}
    printed = _printed_config(tmp_path, env, "reward.function=my_rewards:score # not a comment")
    assert printed == {"hf_path": str(model), "train_files": [str(data)], "run_dir": str(tmp_path / "run #3 "),
                       "cache": str(tmp_path / "cache, shared"), "sha256": "0" * 63 + "7",
                       "function": "my_rewards:score # not a comment"}


def test_the_configs_own_run_dir_is_kept_when_run_dir_is_not_set(inputs, tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(TINY_GRPO.replace("trainer: {", f"trainer: {{run_dir: '{tmp_path / 'mine'}', "))
    env = {key: value for key, value in inputs.items() if key != "RUN_DIR"}
    assert _printed_config(tmp_path, {**env, "RL_CONFIG": str(config)})["run_dir"] == str(tmp_path / "mine")


def test_no_python_process_of_train_sh_imports_from_the_working_folder(inputs, tmp_path):
    """A yaml.py and json.py where the container starts (the run folder's reader and the trainer import them)
    never run: each would leave a proof file."""
    folder = tmp_path / "start"
    folder.mkdir()
    for module in ("yaml", "json"):
        (folder / f"{module}.py").write_text(f"open({str(folder / module)!r} + '.ran', 'w')\n")
    env = {key: value for key, value in inputs.items() if key != "RUN_DIR"}
    assert _printed_config(tmp_path, env, cwd=folder)["hf_path"] == inputs["MODEL_ID"]
    assert sorted(path.name for path in folder.iterdir()) == ["json.py", "yaml.py"]


@pytest.mark.slow
def test_train_sh_trains_converts_once_and_records_provenance(inputs, tmp_path):
    """Two runs of the same model: the first (GRPO) converts into the cache and trains, the second (PPO in another
    run folder, the model's sha256 given as MODEL_SHA256) trains actor and critic from that conversion, untouched."""
    from verl_mega.checkpoint.hf_assets import model_sha256

    checksum = model_sha256(inputs["MODEL_ID"])
    first = run_train_sh({**inputs, "VERL_MEGA_COMMIT": "0123abc"})
    assert first.returncode == 0, first.stderr[-3000:]
    (conversion,) = Path(inputs["CACHE_DIR"], checksum).iterdir()
    assert conversion.name == "tp1_pp1_ep1_fp32"
    assert f"converting the actor's {inputs['MODEL_ID']} into {conversion}" in first.stdout
    provenance = json.loads(Path(inputs["RUN_DIR"], "provenance.json").read_text())
    assert provenance["model"] == {"path": inputs["MODEL_ID"], "sha256": checksum}
    assert provenance["verl_mega"]["commit"] == "0123abc" and provenance["reward"] == {"name": "copy"}
    assert len(Path(inputs["RUN_DIR"], "metrics.jsonl").read_text().splitlines()) == 1

    before = conversion.stat()
    # The second run also gives PPO's critic the same HF folder (arguments are config overrides): its conversion
    # is the very same cache entry.
    second_run = tmp_path / "run2"
    second = run_train_sh({**inputs, "RUN_DIR": str(second_run), "MODEL_SHA256": checksum.upper()},
                          "algorithm.adv_estimator=gae", "critic.enable=true",
                          f"model.critic_hf_path={inputs['MODEL_ID']}")
    assert second.returncode == 0, second.stderr[-3000:]
    for role in ("actor", "critic"):
        assert f"using the converted {role} checkpoint {conversion}" in second.stdout
    assert "converting" not in second.stdout
    after = conversion.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    provenance = json.loads((second_run / "provenance.json").read_text())
    assert provenance["model"]["sha256"] == provenance["critic"]["sha256"] == checksum
    assert not list(second_run.glob("initial_*"))
    assert (second_run / "final_critic").is_dir()
    # `verl-mega export --step` finds the conversion a step started from through the run's config.
    assert f"critic_ckpt: {conversion}" in (second_run / "config.yaml").read_text()
