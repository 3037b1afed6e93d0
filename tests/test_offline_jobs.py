"""`verl-mega sft` and `verl-mega preference` (and its old name `dpo`) end to end on the tiny model: refusals
before start-up, SFT loss falling, export, DPO preference accuracy and margins rising on the copy rule, every
preference loss running, bitwise resume after SIGKILL, the reference log-prob cache."""
import json
import math
import os
import subprocess
import sys

import pytest

from verl_mega.demo import EXAMPLES

from .test_resume import NOT_COMPARED, assert_resume_after_sigkill_is_bitwise


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows, preference_pairs, sft_conversations
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("offline_jobs")
    train, held_out = make_task_rows("copy", 256, seed=0, max_digits=2), make_task_rows("copy", 32, seed=1,
                                                                                         max_digits=2)
    kto = [{"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
           for pair in preference_pairs(train) for key in ("chosen", "rejected")]
    return {"root": root, "hf": make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2),
            "sft": write_rows(sft_conversations(train), root / "sft.jsonl"),
            "sft_val": write_rows(sft_conversations(held_out), root / "sft_val.jsonl"),
            "pairs": write_rows(preference_pairs(train), root / "pairs.jsonl"),
            "pairs_val": write_rows(preference_pairs(held_out, seed=1), root / "pairs_val.jsonl"),
            "kto": write_rows(kto, root / "kto.jsonl")}


def run_job(job, config, *overrides):
    command = [sys.executable, "-m", "verl_mega.cli", job, "--config", str(config), *map(str, overrides)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"role": "user", "content": "copy: 1"}]}, "no assistant turn"),
    ({"prompt": "copy: 1", "response": ""}, "response is empty"),
])
def test_bad_sft_rows_are_refused_before_start_up_naming_file_and_row(data, tmp_path, capsys, row, message):
    from verl_mega.cli import main as cli
    from verl_mega.data.tables import write_rows

    bad = write_rows([{"prompt": "copy: 2", "response": "2"}] * 3 + [row], tmp_path / "bad.jsonl")
    code = cli(["sft", "--config", str(EXAMPLES / "sft_demo.yaml"), f"model.hf_path={data['hf']}",
                f"data.train_files=[{bad}]", f"trainer.run_dir={tmp_path / 'run'}", "data.batch_size=2",
                "actor.mini_batch_size=2", "actor.micro_batch_size=1"])
    assert code == 2
    assert f"data.train_files: {bad} row 3: " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_preference_config_errors_name_their_keys(data, tmp_path, capsys):
    from verl_mega.cli import main as cli

    code = cli(["dpo", "--config", str(EXAMPLES / "dpo_demo.yaml"), f"model.hf_path={data['hf']}",
                f"data.train_files=[{data['pairs']}]", "algorithm.loss=rpo", "algorithm.beta=0",
                "actor.mini_batch_size=12"])
    err = capsys.readouterr().err
    assert code == 2
    for expected in ("algorithm.loss 'rpo' is unknown; known: dpo, ipo, kto, orpo, simpo", "algorithm.beta must be > 0",
                     "data.batch_size=16 must be divisible by actor.mini_batch_size=12"):
        assert expected in err


@pytest.mark.parametrize("loss,reason", [("simpo", "needs no reference"),
                                         ("kto", "scores each batch's mismatched pairs with the reference")])
def test_reference_cache_is_refused_where_it_cannot_serve(data, tmp_path, capsys, loss, reason):
    from verl_mega.cli import main as cli

    files = data["kto"] if loss == "kto" else data["pairs"]
    code = cli(["dpo", "--config", str(EXAMPLES / "dpo_demo.yaml"), f"model.hf_path={data['hf']}",
                f"data.train_files=[{files}]", f"trainer.run_dir={tmp_path / 'run'}", f"algorithm.loss={loss}",
                "algorithm.cache_reference_logprobs=true"])
    assert code == 2
    assert f"algorithm.cache_reference_logprobs: algorithm.loss={loss} {reason}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sft_then_dpo_loss_falls_exports_and_preference_accuracy_rises(data):
    from transformers import AutoModelForCausalLM

    from verl_mega.cli import main as cli

    root = data["root"]
    run_job("sft", EXAMPLES / "sft_demo.yaml", f"model.hf_path={data['hf']}", f"data.train_files=[{data['sft']}]",
            f"data.val_files=[{data['sft_val']}]", f"trainer.run_dir={root / 'sft'}", "trainer.total_steps=30",
            "trainer.val_every=10")
    sft = records(root / "sft")
    assert [r["step"] for r in sft] == list(range(1, 31))
    losses = [r["sft/loss"] for r in sft]
    assert mean(losses[-5:]) < mean(losses[:5]) - 0.5, losses
    val = [r["val/loss"] for r in sft if "val/loss" in r]
    assert len(val) == 3 and val[-1] < val[0], val
    assert cli(["export", "--ckpt", str(root / "sft"), "--out", str(root / "sft_hf")]) == 0
    assert AutoModelForCausalLM.from_pretrained(root / "sft_hf").config.tie_word_embeddings is True

    run_job("preference", EXAMPLES / "dpo_demo.yaml", f"model.hf_path={root / 'sft_hf'}",
            f"data.train_files=[{data['pairs']}]", f"data.val_files=[{data['pairs_val']}]",
            f"trainer.run_dir={root / 'dpo'}", "trainer.total_steps=12", "trainer.val_every=6")
    dpo = records(root / "dpo")
    pair_metrics = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy",
                    "logps/chosen", "logps/rejected")
    for key in (*(f"preference/{name}" for name in pair_metrics), *(f"val/{name}" for name in pair_metrics),
                "preference/grad_norm", "timing/ref_log_prob", "perf/tokens_per_second"):
        assert key in dpo[-1] and math.isfinite(dpo[-1][key]), key
    assert dpo[-1]["preference/rewards/margins"] == pytest.approx(
        dpo[-1]["preference/rewards/chosen"] - dpo[-1]["preference/rewards/rejected"], rel=1e-5, abs=1e-6)
    # The first step's policy is the reference: every implicit reward, hence the accuracy, is zero.
    assert dpo[0]["preference/rewards/accuracy"] == 0.0 and dpo[0]["preference/loss"] == pytest.approx(0.6931, abs=1e-4)
    train_losses = [r["preference/loss"] for r in dpo]
    assert mean(train_losses[-4:]) < mean(train_losses[1:5]), train_losses
    val = [r for r in dpo if "val/loss" in r]
    assert val[-1]["val/rewards/margins"] > val[0]["val/rewards/margins"] > 0
    assert val[-1]["val/loss"] < val[0]["val/loss"]
    assert val[-1]["val/rewards/accuracy"] >= 0.9
    assert cli(["export", "--ckpt", str(root / "dpo"), "--out", str(root / "dpo_hf")]) == 0


@pytest.mark.slow
def test_every_preference_loss_trains_in_one_process(data, tmp_path):
    """IPO, KTO, SimPO and ORPO, two steps each through `verl-mega preference` (one Python process for all four)."""
    runs = {"ipo": data["pairs"], "kto": data["kto"], "simpo": data["pairs"], "orpo": data["pairs"]}
    script = "; ".join(
        ["import sys", "from verl_mega.trainer.main import preference_main"]
        + [f"assert preference_main(['--config', {str(EXAMPLES / 'dpo_demo.yaml')!r}, 'model.hf_path={data['hf']}', "
           f"'data.train_files=[{files}]', 'trainer.run_dir={tmp_path / loss}', 'algorithm.loss={loss}', "
           f"'trainer.total_steps=2', 'trainer.tensorboard=false']) == 0" for loss, files in runs.items()])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for loss in runs:
        last = records(tmp_path / loss)[-1]
        assert last["step"] == 2 and last["preference/grad_norm"] > 0, (loss, last)
        assert ("timing/ref_log_prob" in last) == (loss in ("ipo", "kto")), loss
    kto = records(tmp_path / "kto")[-1]
    assert "preference/kl" in kto and kto["preference/kl"] >= 0 and "timing/kl_baseline" in kto


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_sigkill_then_resume_gives_the_same_metrics_and_weights(data, tmp_path, job):
    """One process (test_resume's PPO case covers the distributed optimizer's sharded state at DP=2); two
    optimizer steps per step, validation every 3 steps."""
    train, val = {"sft": (data["sft"], data["sft_val"]), "dpo": (data["pairs"], data["pairs_val"])}[job]

    def command_for(run_dir):
        return [sys.executable, "-m", "verl_mega.trainer.main", "--config", str(EXAMPLES / f"{job}_demo.yaml"),
                f"model.hf_path={data['hf']}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                f"trainer.run_dir={run_dir}", "data.batch_size=8", "actor.mini_batch_size=4",
                "actor.micro_batch_size=2", "trainer.total_steps=5", "trainer.save_every=2", "trainer.val_every=3",
                "trainer.tensorboard=false"]

    assert_resume_after_sigkill_is_bitwise(command_for, tmp_path, total_steps=5, save_every=2)


@pytest.mark.slow
def test_cached_reference_logprobs_give_the_same_update_and_altered_caches_are_refused(data, tmp_path):
    """With one pair per micro-batch the reference scores the same micro-batches whether it runs per batch or
    once for the data set, so the cached run must reproduce every metric bit for bit; it builds no reference
    for its steps, and its resume reuses the cache. One Python process for the three runs."""
    from verl_mega.run.folder import RunFolder

    common = [f"model.hf_path={data['hf']}", f"data.train_files=[{data['pairs']}]", "data.batch_size=8",
              f"data.val_files=[{data['pairs_val']}]", "actor.mini_batch_size=4", "actor.micro_batch_size=1",
              "trainer.tensorboard=false", "trainer.val_every=2"]
    argv = lambda run_dir, *extra: ["--config", str(EXAMPLES / "dpo_demo.yaml"), *common,  # noqa: E731
                                    f"trainer.run_dir={run_dir}", *extra]
    cached_args = lambda steps: argv(tmp_path / "cached", f"trainer.total_steps={steps}",  # noqa: E731
                                     "algorithm.cache_reference_logprobs=true")
    cache = RunFolder(tmp_path / "cached").reference_logprobs
    script = "\n".join([
        "import os", "from verl_mega.trainer.main import preference_main",
        f"assert preference_main({argv(tmp_path / 'per_batch', 'trainer.total_steps=3')!r}) == 0",
        f"assert preference_main({cached_args(2)!r}) == 0",
        f"stamp = os.stat({str(cache)!r}).st_mtime_ns",
        f"assert preference_main({cached_args(3)!r}) == 0",
        f"assert os.stat({str(cache)!r}).st_mtime_ns == stamp, 'the cache was rewritten'"])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "recomputing" not in result.stdout
    strip = lambda record: {k: v for k, v in record.items() if not k.startswith(NOT_COMPARED)}  # noqa: E731
    per_batch, cached = records(tmp_path / "per_batch"), records(tmp_path / "cached")
    assert [strip(r) for r in cached] == [strip(r) for r in per_batch]
    assert "val/rewards/margins" in cached[-1] and cached[-1]["preference/rewards/margins"] != 0
    assert "timing/ref_log_prob" in per_batch[-1] and "timing/ref_log_prob" not in cached[-1]

    raw = bytearray(cache.read_bytes())
    raw[-1] ^= 0x01
    cache.write_bytes(bytes(raw))
    folder = RunFolder(tmp_path / "cached")
    kept = {path: path.read_bytes() for path in (folder.config, folder.provenance, folder.metrics)}
    result = subprocess.run([sys.executable, "-m", "verl_mega.cli", "dpo", *cached_args(4)], capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{cache}: not a valid reference log-prob cache (its values do not match their checksum)" in result.stderr
    # The refused start changed nothing in the run folder (its config still says 3 steps).
    assert {path: path.read_bytes() for path in kept} == kept
