"""The Hub both ways through the command line, against the local Hub server (tests/workers/hub_server.py):
`convert hf-to-mcore --hf org/name`, `export --push-to-hub` read back by transformers, and `train.sh` with
`MODEL_ID=org/name@rev` and `DATASET_PATH=hf://datasets/...`, whose pushed export's model card names the base
model's commit, the data, the algorithm and the final metrics."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hub_fixtures import ROOT, TOKEN, clean_env, hub_env, start_hub_server, write_split_dataset
from test_train_sh import TINY_GRPO, run_train_sh

READ_BACK = """
import json, sys
import torch
from huggingface_hub import hf_hub_download
from transformers import AutoModelForCausalLM
repo, revision, local = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(repo, revision=revision)
expected = AutoModelForCausalLM.from_pretrained(local)
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
card = open(hf_hub_download(repo, "README.md", revision=revision)).read()
print(json.dumps({"same": same, "card": card}))
"""


@pytest.fixture
def hub(tmp_path, tiny_models):
    server = start_hub_server(tmp_path / "hub_root")
    try:
        server.commits = {"main": server.publish("org/tiny", tiny_models["qwen2"])}
        yield server
    finally:
        server.stop()


def _cli(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_mega.cli", *args], cwd=ROOT, env={**clean_env(), **env},
                          capture_output=True, text=True, timeout=timeout)


def _read_back(env: dict, repo: str, revision: str, local: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", READ_BACK, repo, revision, str(local)], cwd=ROOT,
                          env={**clean_env(), **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_convert_a_hub_id_and_push_the_export_back(hub, tmp_path, tiny_models):
    env = hub_env(hub, tmp_path / "hf_home")
    converted = _cli(env, "convert", "hf-to-mcore", "--hf", "org/tiny", "--out", str(tmp_path / "ckpt"))
    assert converted.returncode == 0, converted.stderr
    out = tmp_path / "export"
    pushed = _cli(env, "export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--push-to-hub",
                  "org/pushed", "--private", "--revision", "v1")
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed" in pushed.stdout and "org/pushed@v1" in pushed.stdout
    assert load_file(out / "model.safetensors").keys() == load_file(tiny_models["qwen2"] / "model.safetensors").keys()
    read = _read_back(env, "org/pushed", "v1", out)
    assert read.returncode == 0, read.stderr[-2000:]
    record = json.loads(read.stdout.splitlines()[-1])
    assert record["same"] and "belongs to no run folder" in record["card"]
    # Private: without the token the repo is not there, and the error says what to set.
    hidden = _read_back({**env, "HF_TOKEN": ""}, "org/pushed", "v1", out)
    assert hidden.returncode != 0
    refused = _cli({**env, "HF_TOKEN": ""}, "export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "e2"),
                   "--push-to-hub", "org/other")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("verl-mega export: error: --push-to-hub org/other: ")
    assert "set HF_TOKEN to a token with write access" in refused.stderr


def test_a_missing_hub_model_is_one_line(hub, tmp_path):
    done = _cli(hub_env(hub, tmp_path / "hf_home"), "convert", "hf-to-mcore", "--hf", "org/absent@v3", "--out",
                str(tmp_path / "ckpt"))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"verl-mega convert: error: Hub model org/absent@v3 is not on {hub.url}, or "
                                   "HF_TOKEN's account cannot read it (and no local folder org/absent exists)")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_train_sh_trains_a_hub_model_at_a_revision_and_the_card_records_it(hub, tmp_path):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    small = make_tiny_hf_model(tmp_path / "small", "qwen2", vocab_size=64)
    pinned = hub.publish("org/small", small, branch="v1")
    hub.publish("org/copy", write_split_dataset(tmp_path / "copy", make_task_rows("copy", 32, max_digits=2)),
                repo_type="dataset")
    (tmp_path / "grpo.yaml").write_text(TINY_GRPO)
    env = hub_env(hub, tmp_path / "hf_home")
    run_dir = tmp_path / "run"
    done = run_train_sh({**env, "MODEL_ID": "org/small@v1", "DATASET_PATH": "hf://datasets/org/copy/train",
                         "RL_CONFIG": str(tmp_path / "grpo.yaml"), "RUN_DIR": str(run_dir),
                         "CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    provenance = json.loads((run_dir / "provenance.json").read_text())
    assert provenance["model"]["hub"] == {"id": "org/small", "type": "model", "commit": pinned, "refs": ["v1"]}
    assert provenance["data"][0]["id"] == "org/copy"
    assert provenance["data"][0]["files"] == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]

    out = tmp_path / "export"
    pushed = _cli(env, "export", "--ckpt", str(run_dir), "--out", str(out), "--push-to-hub", "org/trained")
    assert pushed.returncode == 0, pushed.stderr
    read = _read_back(env, "org/trained", "main", out)
    assert read.returncode == 0, read.stderr[-2000:]
    record = json.loads(read.stdout.splitlines()[-1])
    card = record["card"]
    assert record["same"]
    assert "base_model: org/small" in card and f"at revision `{pinned}` (v1)" in card
    assert "org/copy at revision" in card and "algorithm: grpo" in card
    assert "## Final metrics (step 1)" in card and "| actor/" in card
