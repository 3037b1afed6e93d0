"""Documented features compose: every job reads every documented data form (a jsonl file, a parquet file, an HF
`datasets` save_to_disk folder, a list of them) for training and validation, with the preference job's reference
log-prob cache on and off. One process runs every job for two steps, as `verl-mega train` would each."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verl_mega.demo import EXAMPLES

SMALL = ("actor.mini_batch_size=8", "actor.micro_batch_size=8")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows, preference_pairs, sft_conversations
    from verl_mega.data.tables import write_dataset_folder, write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("compose")
    rows = {"rl": make_task_rows("copy", 48, seed=0, max_digits=2)}
    rows["sft"] = sft_conversations(rows["rl"])
    rows["pairs"] = preference_pairs(rows["rl"])

    def forms(kind: str) -> dict[str, str]:
        third = len(rows[kind]) // 3
        parts = [rows[kind][i * third:(i + 1) * third] for i in range(3)]
        return {"jsonl": write_rows(parts[0], root / f"{kind}.jsonl"),
                "parquet": write_rows(parts[1], root / f"{kind}.parquet"),
                "folder": write_dataset_folder(parts[2], root / f"{kind}_folder")}

    return {"root": root, "hf": make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2),
            **{kind: forms(kind) for kind in rows}}


def _run(job: str, config: str, data: dict, kind: str, run_dir, *extra: str) -> str:
    files = data[kind]
    return (f"assert {job}(['--config', {str(EXAMPLES / config)!r}, 'model.hf_path={data['hf']}', "
            f"'data.train_files=[{files['jsonl']}, {files['parquet']}, {files['folder']}]', "
            f"'data.val_files={files['folder']}', 'trainer.run_dir={run_dir}', 'trainer.total_steps=2', "
            f"'trainer.val_every=1', 'data.batch_size=8', 'trainer.tensorboard=false', "
            + "".join(f"{item!r}, " for item in extra) + "]) == 0")


@pytest.mark.slow
def test_every_job_reads_every_data_form(data, tmp_path):
    runs = {
        "rl": _run("main", "grpo_demo.yaml", data, "rl", tmp_path / "rl", "rollout.n=2", "actor.mini_batch_size=16",
                   "actor.micro_batch_size=8", "parallel.rollout_tp=1"),
        "sft": _run("sft_main", "sft_demo.yaml", data, "sft", tmp_path / "sft", *SMALL),
        "preference": _run("preference_main", "dpo_demo.yaml", data, "pairs", tmp_path / "preference", *SMALL),
        "preference-cached": _run("preference_main", "dpo_demo.yaml", data, "pairs", tmp_path / "preference-cached",
                                  *SMALL, "algorithm.cache_reference_logprobs=true"),
    }
    script = "\n".join(["from verl_mega.trainer.main import main, preference_main, sft_main", *runs.values()])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for name in runs:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [record["step"] for record in records if "step" in record][-1] == 2, name
        assert any(key.startswith("val/") for key in records[-1]), (name, sorted(records[-1]))
    assert (tmp_path / "preference-cached" / "reference_logprobs.safetensors").is_file()
