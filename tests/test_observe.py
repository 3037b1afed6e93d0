"""Seeing a run: PPO validation (greedy, per data_source, from step 0), sample generations, profiled steps,
`trainer.log_format: json`, and `verl-mega plot`."""
import json
import os
from pathlib import Path

import pytest

from verl_mega.demo import EXAMPLES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def text_checksum_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward that tells apart any two different texts a random model may produce (a rule like copy's scores
    them all 0), so a baseline that matches it has decoded exactly the same tokens."""
    return sum(map(ord, solution_str)) % 101 / 100


def checksum_with_fields(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """text_checksum_score as a dict reward (run in the scoring worker: it is given by name), with a numeric
    field (logged as reward/length) and a string one (kept in the samples)."""
    return {"score": text_checksum_score(data_source, solution_str, ground_truth), "length": len(solution_str),
            "first": solution_str[:1]}


def greedy_scores(hf_dir, rows, max_new_tokens) -> list[float]:
    """transformers' greedy replies to `rows`, one at a time, scored by text_checksum_score."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_mega.data.prompts import as_messages, encode_chat

    tokenizer, model = AutoTokenizer.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    scores = []
    for row in rows:
        prompt = encode_chat(tokenizer, as_messages(row["prompt"]), add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        reply = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
        scores.append(text_checksum_score(row["data_source"], reply, row["reward_model"]["ground_truth"]))
    return scores


def write_metrics(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_plot_writes_a_png_and_says_which_panels_a_run_does_not_log(tmp_path):
    from verl_mega.trainer.plot import plot_run

    # An SFT run: no reward, KL or response length; a last line cut short by a kill is left out.
    write_metrics(tmp_path / "metrics.jsonl", [{"step": step, "sft/loss": 3.0 / step, "timing/update_actor": 0.1}
                                               for step in range(1, 6)])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "sft/lo')
    out = plot_run(tmp_path, tmp_path / "plots" / "run.png")
    assert out == tmp_path / "plots" / "run.png"
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert [p.name for p in out.parent.iterdir()] == ["run.png"]  # no temp file left behind


def test_the_kl_panel_draws_the_kl_loss_of_verl_s_grpo_default():
    """GRPO with use_kl_loss logs its KL to the reference as actor/kl_loss, and an on-policy update's ppo_kl is 0:
    the panel drew only that zero line for a real model's run."""
    from verl_mega.trainer.plot import panel_metrics

    records = [{"step": step, "actor/kl_loss": 0.01 * step, "actor/ppo_kl": 0.0, "reward/mean": 0.5,
                "timing/rollout": 1.0} for step in range(1, 4)]
    panels = {title: drawn for title, drawn, _ in panel_metrics(records)}
    assert panels == {"reward": ["reward/mean"], "KL": ["actor/kl_loss", "actor/ppo_kl"],
                      "response length (tokens)": [], "time per stage (s)": ["timing/rollout"]}


@pytest.mark.parametrize("value", ["1" + "0" * 400, "-1" + "0" * 400, "1e999", "NaN", "true", '"high"'])
def test_plot_leaves_out_values_no_float_holds(tmp_path, capsys, value):
    """An integer too large for a float, an overflowing or NaN number, a bool or a string: not a point of the curve,
    and the rest of the run is still plotted."""
    from verl_mega.cli import main as cli

    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1, "reward/mean": {value}}}\n{{"step": 2, "reward/mean": 0.5}}\n')
    assert cli(["plot", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("content,message", [
    (None, "metrics.jsonl does not exist"),
    ('{"step": 1, "reward/mean": 0.5}\nnot json\n', "metrics.jsonl line 2 is not a step record"),
    ('{"step": "one"}\n', "metrics.jsonl line 1 is not a step record"),
    ("", "holds no step record yet"),
    ('{"step": 1' + "0" * 400 + '}\n', "metrics.jsonl line 1 is not a step record"),
    ('{"step": -1}\n', "metrics.jsonl line 1 is not a step record"),
])
def test_plot_of_a_missing_or_corrupt_metrics_file_is_one_line_exit_2(tmp_path, capsys, content, message):
    from verl_mega.cli import main as cli

    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert cli(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-mega plot: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "metrics.png").exists()


def test_observability_keys_are_checked_naming_the_key(tiny_models, tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.trainer.preflight import preflight_check

    train = write_rows(make_task_rows("copy", 8), tmp_path / "train.jsonl")
    val = write_rows([{"question": "no prompt column"}], tmp_path / "val.jsonl")
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{train}]",
                                f"data.val_files=[{val}]", "trainer.log_format=yaml", "trainer.total_steps=4",
                                "trainer.profile_steps=[0,2,5]", "trainer.profile_ranks=[0,2]",
                                "trainer.log_samples_every=-1", "trainer.log_samples=0", "trainer.val_every=-2"])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=2)
    for expected in ("trainer.log_format 'yaml' is unknown; known: text, json",
                     "trainer.profile_steps [0, 5]: steps count from 1 to trainer.total_steps=4",
                     "trainer.profile_ranks [2]: ranks are 0..1 in a world of 2",
                     "trainer.log_samples_every must be >= 0", "trainer.log_samples must be >= 1",
                     "trainer.val_every must be >= 0",
                     f"data.val_files: prompt column 'prompt' not found in {val}"):
        assert expected in str(err.value), str(err.value)
    config.job = "sft"
    config.trainer.log_samples_every = 2
    with pytest.raises(ConfigError, match="trainer.log_samples_every=2: job sft generates no samples to log"):
        preflight_check(config, world_size=2, check_files=False)


@pytest.mark.slow
def test_short_ppo_run_validates_logs_samples_profiles_and_prints_json(tmp_path):
    """Two processes (DP 2), three steps: validation at steps 0, 2 and 3 over five held-out prompts of two
    sources (an uneven share per rank), samples at step 2, a trace of step 2 on rank 0 only, JSON on stdout."""
    from verl_mega.cli import main as cli
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.spawn import run_torchrun
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import plot_run

    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    held_out = make_task_rows("copy", 3, seed=1, max_digits=2) + make_task_rows("add", 2, seed=1, max_digits=1)
    train_file = write_rows(make_task_rows("copy", 32, seed=0, max_digits=2), tmp_path / "train.jsonl")
    val_file = write_rows(held_out, tmp_path / "val.jsonl")
    run_dir = tmp_path / "run"
    result = run_torchrun(2, "verl_mega.trainer.main", [
        "--config", str(EXAMPLES / "ppo_gae_demo.yaml"), f"model.hf_path={hf}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{train_file}]", f"data.val_files=[{val_file}]", "parallel.tp=1", "parallel.pp=1",
        "data.batch_size=4", "rollout.n=2", "actor.optim.lr=0.01", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
        *(f"{role}.{key}={value}" for role in ("actor", "critic")
          for key, value in (("mini_batch_size", 8), ("micro_batch_size", 4))),
        "trainer.total_steps=3", "trainer.val_every=2", "trainer.log_samples_every=2", "trainer.log_samples=3",
        "trainer.profile_steps=[2]", "trainer.profile_ranks=[0]", "trainer.log_format=json",
        "trainer.progress_bar=true", "reward.function=test_observe:checksum_with_fields"], capture_output=True,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})

    # stdout: one JSON object per logged step, nothing else; the same records as metrics.jsonl.
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert printed == records
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    validated = {r["step"]: r for r in records if "val/reward_mean" in r}
    assert sorted(validated) == [0, 2, 3]
    assert "reward/mean" not in records[0]  # step 0 is the baseline, before any rollout
    for record in records[1:]:  # the dict reward's numeric field, a mean of characters decoded
        assert 0 <= record["reward/length"] <= record["response/length_max"]
        assert record["reward/timeouts"] == record["reward/worker_deaths"] == 0
    for record in validated.values():
        assert {"val/reward_mean/copy", "val/reward_mean/add", "val/response_length_mean", "val/reward/length"} <= \
            set(record)
        assert record["val/reward/timeouts"] == record["val/reward/worker_deaths"] == 0
        assert record["val/reward_mean"] == pytest.approx(
            (3 * record["val/reward_mean/copy"] + 2 * record["val/reward_mean/add"]) / 5)

    # Greedy decoding as transformers does it, scored by the same function: of the untrained model at step 0
    # (the baseline), of the trained actor at the end (the weights were synced before validating).
    for step, hf_dir in ((0, hf), (3, tmp_path / "final_hf")):
        if step == 3:
            assert cli(["export", "--ckpt", str(run_dir), "--out", str(hf_dir)]) == 0
        scores = greedy_scores(hf_dir, held_out, max_new_tokens=4)
        assert len(set(scores)) > 1
        assert validated[step]["val/reward_mean"] == pytest.approx(sum(scores) / 5, abs=1e-6)
        assert validated[step]["val/reward_mean/add"] == pytest.approx(sum(scores[3:]) / 2, abs=1e-6)

    samples = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 2]
    for sample in samples:
        assert sample["prompt"].startswith("user: copy: ") and isinstance(sample["response"], str)
        assert sample["data_source"] == "copy" and 0.0 <= sample["score"] <= 1.0
        assert sample["length"] == len(sample["response"]) and sample["first"] == sample["response"][:1]

    trace = RunFolder(run_dir).profile_trace(2, 0)
    assert "traceEvents" in json.loads(trace.read_text())
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]  # not step 1 or 3, not rank 1

    assert plot_run(run_dir).read_bytes().startswith(PNG_SIGNATURE)


def test_json_log_format_keeps_stdout_to_one_record_per_step_and_resume_truncates_samples(tmp_path, capsys):
    from verl_mega.trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, log_format="json")
    for step in (1, 2, 3):
        logger.log_samples(step, [{"prompt": "copy: 1|2", "response": "1\n2", "score": float("nan")}])
        logger.note(step, "skipped: the reward is NaN/inf")
        logger.log(step, {"reward/mean": float("nan"), "actor/pg_loss": 0.5})
    logger.close()
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == [
        {"step": step, "actor/pg_loss": 0.5, "reward/mean": None} for step in (1, 2, 3)]
    assert captured.err.count("skipped: the reward is NaN/inf") == 3

    MetricsLogger.truncate(tmp_path, 2)  # resumed from the step-2 checkpoint
    samples = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert samples == [{"step": step, "prompt": "copy: 1|2", "response": "1\n2", "score": None} for step in (1, 2)]
    MetricsLogger.truncate(tmp_path, -1)  # a fresh start over an attempt killed before its first checkpoint
    assert (tmp_path / "metrics.jsonl").read_text() == (tmp_path / "generations.jsonl").read_text() == ""


def test_live_tensor_bytes_counts_no_tracing_tensor():
    """Tensors torch.compile or export leave alive (a FunctionalTensor, a FakeTensor; here made directly) own no
    memory and may have no data pointer to read: the CPU memory metric skips them instead of raising mid-step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from verl_mega.trainer.metrics import live_tensor_bytes

    with FakeTensorMode():
        fake = torch.empty(1 << 20)
    with FunctionalTensorMode():
        functional = torch.ones(3) * 2
    real = torch.zeros(1 << 20)
    assert fake.shape == real.shape and functional.shape == (3,)
    assert live_tensor_bytes() >= real.untyped_storage().nbytes()


def test_live_tensor_bytes_passes_over_a_dead_weak_proxy():
    """A weakref proxy whose tensor is gone (another test's leftovers, in CI a planner-grid worker's) raises on
    any question asked of it, isinstance's included: the metric must not ask."""
    import weakref

    import torch

    from verl_mega.trainer.metrics import live_tensor_bytes

    tensor = torch.zeros(1 << 16)
    holder = [weakref.proxy(tensor)]  # kept in a list so the collector tracks it after the tensor dies
    del tensor
    with pytest.raises(ReferenceError):
        isinstance(holder[0], torch.Tensor)
    assert live_tensor_bytes() >= 0
