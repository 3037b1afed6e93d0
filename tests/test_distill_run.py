"""On-policy distillation end to end: a tiny student learns from a tiny teacher of its own weights (a world of one,
in this process): the teacher's stage runs, its metrics are logged, reverse_kl and gkd train, and a LoRA student
distils from separate teacher weights."""
import json

import pytest

from verl_mega.config import load_config
from verl_mega.demo import EXAMPLES
from verl_mega.trainer.main import run


@pytest.fixture
def models(student_and_teacher):
    """(student, teacher): conftest's tiny pair."""
    return student_and_teacher


def distill_config(tmp_path, prompt_file, models, *overrides):
    student, teacher = models
    return load_config(EXAMPLES / "grpo_demo.yaml", [
        f"model.hf_path={student}", f"data.train_files=[{prompt_file}]", f"trainer.run_dir={tmp_path / 'run'}",
        "data.batch_size=2", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
        "critic.mini_batch_size=4",
        "actor.ppo_epochs=1", "trainer.total_steps=2", "data.truncation=left", f"teacher.hf_path={teacher}",
        *overrides])


def logged(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


DISTILL_METRICS = ("distill/reverse_kl", "distill/teacher_entropy", "distill/student_entropy",
                   "distill/top1_agreement")


def test_reverse_kl_alone_trains_and_logs_the_distillation_metrics(tmp_path, prompt_file, models):
    config = distill_config(tmp_path, prompt_file, models, "algorithm.distill.loss=reverse_kl", "reward.function=")
    run(config)
    steps = logged(tmp_path / "run")
    assert [record["step"] for record in steps] == [1, 2]
    for record in steps:
        assert all(name in record for name in DISTILL_METRICS), sorted(record)
        assert 0 <= record["distill/top1_agreement"] <= 1
        assert record["distill/teacher_entropy"] > 0 and record["distill/student_entropy"] > 0
        assert record["reward/mean"] == 0  # no outcome reward: the teacher's signal alone
    # The teacher's conversion is the run's, beside the actor's, named by its checksum.
    assert len(list((tmp_path / "run").glob("initial_teacher_tp1_pp1_ep1_*"))) == 1
    provenance = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert provenance["reward"] == {"teacher": str(models[1])}


def test_each_data_source_is_scored_by_its_own_teacher(tmp_path, models):
    """Both sources' teacher is the student's own initial weights, the other rows' a different model: the first
    step's reverse KL is 0 only if every row went to its source's teacher."""
    from verl_mega.data.tables import write_rows

    student, _ = models
    prompts = write_rows([{"prompt": f"copy: {i}", "data_source": "ab"[i % 2]} for i in range(8)],
                         tmp_path / "sources.jsonl")
    config = distill_config(tmp_path, prompts, models, "algorithm.distill.loss=reverse_kl", "reward.function=",
                            f"teacher.by_data_source.a={student}", f"teacher.by_data_source.b={student}")
    run(config)
    first = logged(tmp_path / "run")[0]
    assert abs(first["distill/reverse_kl"]) < 1e-5
    config = distill_config(tmp_path / "one", prompts, models, "algorithm.distill.loss=reverse_kl", "reward.function=",
                            f"teacher.by_data_source.a={student}")
    run(config)
    assert abs(logged(tmp_path / "one" / "run")[0]["distill/reverse_kl"]) > 1e-3  # the b rows: the other teacher


def test_gkd_beside_an_outcome_reward_logs_its_loss(tmp_path, prompt_file, models):
    config = distill_config(tmp_path, prompt_file, models, "algorithm.distill.loss=gkd", "algorithm.distill.top_k=5",
                            "algorithm.distill.beta=0.5", "algorithm.distill.coef=0.5")
    run(config)
    steps = logged(tmp_path / "run")
    assert all(record["actor/gkd_loss"] > 0 for record in steps)


def test_a_lora_student_distils_from_separate_teacher_weights(tmp_path, prompt_file, models):
    config = distill_config(tmp_path, prompt_file, models, "algorithm.distill.loss=reverse_kl",
                            "actor.lora.rank=4", "actor.lora.alpha=8")
    run(config)
    steps = logged(tmp_path / "run")
    # A teacher that were the student's own base (adapters off) would agree with it: KL 0 at the first step.
    assert abs(steps[0]["distill/reverse_kl"]) > 1e-3


@pytest.mark.slow
def test_a_distillation_run_resumes_bitwise_after_sigkill(tmp_path, models):
    """reverse_kl alone, at TP 2 (2 processes): killed at a random step after the first checkpoint and resumed,
    its metrics and final weights are the straight run's bit for bit (the teacher holds no state; its
    conversion in the run folder is reused)."""
    from trainer_runs import make_inputs, train_command

    from .test_resume import assert_resume_after_sigkill_is_bitwise

    setup = make_inputs(tmp_path / "inputs")
    teacher = models[1]
    distill = ("parallel.tp=2", "parallel.pp=1", "trainer.total_steps=5", "algorithm.distill.loss=reverse_kl",
               "reward.function=", f"teacher.hf_path={teacher}")
    assert_resume_after_sigkill_is_bitwise(
        lambda run_dir: train_command(setup, run_dir, 2, *distill, example="grpo_demo.yaml"), tmp_path,
        total_steps=5, save_every=2)


def test_the_teacher_is_the_whole_reward_only_without_any_scorer(tmp_path, prompt_file, models):
    from verl_mega.trainer.rl.distill import teacher_alone

    config = distill_config(tmp_path, prompt_file, models, "algorithm.distill.loss=reverse_kl", "reward.function=")
    assert teacher_alone(config)
    assert not teacher_alone(config, reward_fn=lambda *args: 1.0)  # the Python API's callable is an outcome
    config.reward.reward_model = "some/reward/model"
    assert not teacher_alone(config)
