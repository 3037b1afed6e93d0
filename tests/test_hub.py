"""Hub ids resolved through huggingface_hub's cache, against a real Hub-compatible server process on localhost
(tests/workers/hub_server.py) holding tiny models and datasets these tests publish: public, private with and
without a token, gated, revisions, offline with a warm and a cold cache, an unreachable endpoint, pickle-only
weights, two processes at once, an interrupted download resumed, datasets in the Hub's parquet layout."""
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import verl_mega as vm
from hub_fixtures import ROOT, clean_env, hub_env, set_hub_env, start_hub_server, write_split_dataset
from test_train_sh import TINY_GRPO
from verl_mega.config import load_config
from verl_mega.launch import local
from verl_mega.launch.payload import check_trainer_config
from verl_mega.rollout import planner
from verl_mega.trainer import plan
from verl_mega.trainer.rl.needs import model_keys
from verl_mega.hub import (HubError, dataset_ref, hub_origin, is_repo_id, model_ref, resolve_dataset, resolve_inputs,
                           resolve_model)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_models):
    """The server, holding org/tiny (main; branch v2 with a changed config), org/private, org/gated, org/pickled
    (a .bin only) and the dataset org/rows (two splits in the Hub's parquet layout)."""
    server = start_hub_server(tmp_path_factory.mktemp("hub_root"))
    work = tmp_path_factory.mktemp("hub_src")
    try:
        model = tiny_models["qwen2"]
        server.commits = {"main": server.publish("org/tiny", model)}
        changed = work / "v2"
        shutil.copytree(model, changed)
        config = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
        server.commits["v2"] = server.publish("org/tiny", changed, branch="v2")
        server.publish("org/private", model, private=True)
        server.publish("org/gated", model, gated=True)
        pickled = work / "pickled"
        pickled.mkdir()
        shutil.copy(model / "config.json", pickled)
        torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
        server.publish("org/pickled", pickled)
        rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "copy",
                 "reward_model": {"ground_truth": f"a{i}"}} for i in range(6)]
        server.publish("org/rows", write_split_dataset(work / "rows", rows), repo_type="dataset")
        yield server
    finally:
        server.stop()


@pytest.fixture
def home(tmp_path, hub, monkeypatch):
    """A cold HF_HOME for each test, the server as HF_ENDPOINT, the token set."""
    set_hub_env(monkeypatch, hub_env(hub, tmp_path / "hf_home"))
    return tmp_path / "hf_home"


def test_ids_and_local_paths_are_told_apart(tmp_path, monkeypatch):
    assert model_ref("Qwen/Qwen2-7B-Instruct").repo_id == "Qwen/Qwen2-7B-Instruct"
    ref = model_ref("org/tiny@v2")
    assert (ref.repo_id, ref.revision) == ("org/tiny", "v2")
    assert model_ref("/models/org/tiny") is None and model_ref("./org/tiny") is None
    assert model_ref("a/b/c") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert model_ref("org/tiny") is None  # an existing local folder wins
    data = dataset_ref("hf://datasets/org/rows@v1/data/train")
    assert (data.repo_id, data.revision, data.path, data.repo_type) == ("org/rows", "v1", "data/train", "dataset")
    assert is_repo_id("org/name") and not is_repo_id("org/name@v1") and not is_repo_id("org/name/x")
    assert dataset_ref("rows.parquet") is None
    with pytest.raises(ValueError, match="hf://datasets/ORG/NAME"):
        dataset_ref("hf://datasets/justaname")


def test_public_model_downloads_once_and_records_its_commit(hub, home):
    resolved = resolve_model(model_ref("org/tiny"))
    assert resolved.commit == hub.commits["main"]
    assert (resolved.path / "config.json").is_file() and (resolved.path / "model.safetensors").is_file()
    assert str(resolved.path).startswith(str(home))
    fetched = len(hub.downloads())
    again = resolve_model(model_ref("org/tiny"))
    assert again.path == resolved.path and len(hub.downloads()) == fetched  # the second run downloads nothing
    origin = hub_origin(resolved.path)
    assert origin == {"id": "org/tiny", "type": "model", "commit": hub.commits["main"], "refs": ["main"]}


def test_revision_pins_a_branch_and_a_commit(hub, home):
    branch = resolve_model(model_ref("org/tiny@v2"))
    assert branch.commit == hub.commits["v2"]
    assert json.loads((branch.path / "config.json").read_text())["rms_norm_eps"] == 1e-5
    pinned = resolve_model(model_ref(f"org/tiny@{hub.commits['main']}"))
    assert pinned.commit == hub.commits["main"] and pinned.path != branch.path
    with pytest.raises(HubError, match=r"^Hub model org/tiny@nope: no revision 'nope'"):
        resolve_model(model_ref("org/tiny@nope"))


def test_private_needs_the_token(hub, home, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match=r"^Hub model org/private is not on .* or it is private: set HF_TOKEN"):
        resolve_model(model_ref("org/private"))
    assert not list(home.rglob("*.incomplete")) and not list(home.rglob("models--org--private/snapshots/*"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert (resolve_model(model_ref("org/private")).path / "model.safetensors").is_file()


@pytest.mark.parametrize("model, message", [
    ("org/missing", r"^Hub model org/missing is not on http://127\.0\.0\.1:\d+, or HF_TOKEN's account cannot read it"
                    r" \(and no local folder org/missing exists\)$"),
    ("org/gated", r"^Hub model org/gated is gated: accept its conditions"),
    ("org/pickled", r"^Hub model org/pickled: its weights are pickles \(pytorch_model\.bin\), which are never loaded"),
])
def test_unusable_repos_are_one_line_naming_the_id(hub, home, model, message):
    with pytest.raises(HubError, match=message) as caught:
        resolve_model(model_ref(model))
    assert "\n" not in str(caught.value)
    assert not list(home.rglob("*.incomplete")) and not list(home.rglob("*.bin"))


def test_offline_uses_a_warm_cache_and_refuses_a_cold_one(hub, home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=r"^Hub model org/tiny: HF_HUB_OFFLINE is set and the cache \(.*\) holds no "
                                       r"copy of it"):
        resolve_model(model_ref("org/tiny"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    online = resolve_model(model_ref("org/tiny"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fetched = len(hub.downloads())
    offline = resolve_model(model_ref("org/tiny"))
    assert (offline.path, offline.commit) == (online.path, online.commit) and len(hub.downloads()) == fetched


def test_an_unreachable_endpoint_falls_back_on_the_cache(hub, home, monkeypatch):
    online = resolve_model(model_ref("org/tiny"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert resolve_model(model_ref("org/tiny")).path == online.path
    with pytest.raises(HubError, match=r"^Hub model org/tiny@v2: HF_ENDPOINT http://127.0.0.1:9 cannot be reached "
                                       r"and the cache .* holds no copy of it"):
        resolve_model(model_ref("org/tiny@v2"))


def test_dataset_splits_in_the_hub_parquet_layout(hub, home):
    train = resolve_dataset(dataset_ref("hf://datasets/org/rows/train"))
    assert list(train.files) == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    assert sum(pq.read_table(train.path / file).num_rows for file in train.files) == 6
    one = resolve_dataset(dataset_ref("hf://datasets/org/rows/data/test-00000-of-00001.parquet"))
    assert list(one.files) == ["data/test-00000-of-00001.parquet"]
    assert not any("README.md" in line for line in hub.downloads())  # only the data files named are fetched
    with pytest.raises(HubError, match=r"^Hub dataset hf://datasets/org/rows/validation: no file, folder or split"):
        resolve_dataset(dataset_ref("hf://datasets/org/rows/validation"))


def test_config_inputs_become_snapshots(hub, home, tiny_models):
    config = load_config(None, values={"model.hf_path": "org/tiny@v2", "reward.reward_model": "org/tiny",
                                       "algorithm.distill.loss": "reverse_kl", "teacher.hf_path": "org/tiny@v2",
                                       "teacher.by_data_source": {"gsm8k": "org/tiny"},
                                       "data.train_files": ["hf://datasets/org/rows/train"],
                                       "data.val_files": ["hf://datasets/org/rows/test", "local.parquet"]})
    resolve_inputs(config, model_keys(config))
    assert hub_origin(config.model.hf_path)["commit"] == hub.commits["v2"]
    assert hub_origin(config.reward.reward_model)["commit"] == hub.commits["main"]
    assert hub_origin(config.teacher.hf_path)["commit"] == hub.commits["v2"]
    assert hub_origin(config.teacher.by_data_source["gsm8k"])["commit"] == hub.commits["main"]
    assert [Path(file).name for file in config.data.train_files] == ["train-00000-of-00002.parquet",
                                                                     "train-00001-of-00002.parquet"]
    assert Path(config.data.val_files[0]).is_file() and config.data.val_files[1] == "local.parquet"
    bad = load_config(None, values={"model.hf_path": "org/tiny", "model.critic_hf_path": "org/missing"})
    with pytest.raises(HubError, match=r"^model\.critic_hf_path: Hub model org/missing is not on"):
        resolve_inputs(bad, model_keys(bad))


def test_keys_the_run_does_not_read_are_not_fetched(hub, home):
    """GRPO runs no critic and a run without a distillation loss no teacher: ids left there (a missing one even)
    are neither downloaded nor refused."""
    config = load_config(None, values={"model.hf_path": "org/tiny", "algorithm.adv_estimator": "grpo",
                                       "model.critic_hf_path": "org/missing", "teacher.hf_path": "org/missing",
                                       "teacher.by_data_source": {"gsm8k": "org/missing"}})
    resolve_inputs(config, model_keys(config))
    assert hub_origin(config.model.hf_path)["commit"] == hub.commits["main"]
    assert (config.model.critic_hf_path, config.teacher.hf_path) == ("org/missing", "org/missing")
    assert config.teacher.by_data_source == {"gsm8k": "org/missing"}  # resolving any of them raises HubError


def _resolver(env: dict, model: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verl_mega.hub", model], cwd=ROOT, env={**clean_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_at_once_download_once(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf_home")
    before = len(hub.downloads())
    ranks = [_resolver(env, "org/tiny@v2") for _ in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] and hub.commits["v2"] in outputs[0][0]
    fetched = [line.split()[1] for line in hub.downloads()[before:]]
    assert len(fetched) == len(set(fetched))  # each file once: one process downloaded, the other waited
    # A failure: both processes end with the same one line.
    failing = [_resolver({**env, "HF_TOKEN": ""}, "org/private") for _ in range(2)]
    errors = [rank.communicate(timeout=120)[1].strip().splitlines()[-1] for rank in failing]
    assert [rank.returncode for rank in failing] == [2, 2]
    assert errors[0] == errors[1] and "org/private" in errors[0] and "set HF_TOKEN" in errors[0]


@pytest.mark.slow
def test_an_interrupted_download_resumes(tmp_path, tiny_models):
    """Killed in the middle of the weights (the server sends them slowly), the download leaves a partial file;
    the next resolve removes it, keeps the files already complete and fetches the rest."""
    server = start_hub_server(tmp_path / "slow_root", bytes_per_s=64 * 1024)
    try:
        server.publish("org/tiny", tiny_models["llama"])
        env = hub_env(server, tmp_path / "hf_home")
        first = _resolver(env, "org/tiny")
        blobs = tmp_path / "hf_home" / "hub" / "models--org--tiny" / "blobs"
        deadline = time.time() + 60
        while not list(blobs.glob("*.incomplete")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1)  # part of the weights on their way
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert list(blobs.glob("*.incomplete")), "the weights were not being downloaded when killed"
        snapshot = next((blobs.parent / "snapshots").iterdir())
        complete = {f"models/org/tiny/{path.name}" for path in snapshot.iterdir()}
        assert complete and "models/org/tiny/model.safetensors" not in complete
        offline = _resolver({**env, "HF_HUB_OFFLINE": "1"}, "org/tiny")
        assert offline.wait(timeout=120) == 2
        assert offline.stderr.read().strip().splitlines()[-1] == (
            "error: Hub model org/tiny: HF_HUB_OFFLINE is set and the cache holds an incomplete copy (a download cut "
            "short); run again online to complete it")
        assert not list(blobs.glob("*.incomplete"))  # the killed download's partial file is gone
        second = _resolver(env, "org/tiny")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert (Path(out.strip()) / "model.safetensors").stat().st_size == (tiny_models["llama"] /
                                                                             "model.safetensors").stat().st_size
        assert not list(blobs.glob("*.incomplete"))
        fetched = [line.split()[1] for line in server.downloads()]
        assert all(fetched.count(path) == 1 for path in complete)  # the complete files are kept
        assert fetched.count("models/org/tiny/model.safetensors") == 2
    finally:
        server.stop()


def test_the_local_launcher_resolves_before_any_rank_starts(hub, home, tmp_path, capsys):
    """`launch local` resolves the config's Hub ids and runs the pre-flight check on the downloaded files before
    torchrun starts; a bad id stops it there with one line naming the key."""
    config = tmp_path / "grpo.yaml"
    config.write_text(TINY_GRPO)
    overrides = ["model.hf_path=org/tiny@v2", "data.train_files=[hf://datasets/org/rows/train]",
                 "actor.micro_batch_size=8", "data.max_prompt_length=64"]
    args = local.build_parser().parse_args(["--nproc", "2", str(config), *overrides])
    check_trainer_config(args, [], 2)
    assert (home / "hub" / "models--org--tiny" / "refs" / "v2").read_text() == hub.commits["v2"]
    with pytest.raises(SystemExit):
        local.main(["--nproc", "2", str(config), "model.hf_path=org/missing"])
    assert "model.hf_path: Hub model org/missing is not on http://127.0.0.1:" in capsys.readouterr().err


def test_load_policy_takes_a_hub_id(hub, home):
    policy = vm.load_policy("org/tiny@v2")
    assert policy.model.config.rms_norm_eps == 1e-5 and isinstance(policy.generate("copy: 12", max_new_tokens=2), str)


def test_the_planners_read_a_hub_model_config_alone(hub, home, tmp_path, capsys):
    planner.main(["--hf", "org/tiny@v2", "--train-tp", "1", "--train-pp", "1", "--dp", "1", "--rollout-tp", "1"])
    config = tmp_path / "grpo.yaml"
    config.write_text(TINY_GRPO)
    assert plan.main(["--memory", str(config), "model.hf_path=org/tiny", "--json"]) == 0
    assert capsys.readouterr().out
    for commit in hub.commits.values():
        snapshot = home / "hub" / "models--org--tiny" / "snapshots" / commit
        assert sorted(path.name for path in snapshot.iterdir()) == ["config.json"]  # no weights for a plan
