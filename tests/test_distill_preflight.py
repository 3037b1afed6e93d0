"""The pre-flight check of on-policy distillation: each refusal is one line naming the key, before anything starts
or is written."""
import json
import shutil

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.demo import EXAMPLES
from verl_mega.trainer.main import run
from verl_mega.trainer.preflight import preflight_check


@pytest.fixture
def models(student_and_teacher):
    """(student, teacher): conftest's tiny pair."""
    return student_and_teacher


def config_of(tmp_path, prompt_file, student, *overrides):
    return load_config(EXAMPLES / "grpo_demo.yaml", [
        f"model.hf_path={student}", f"data.train_files=[{prompt_file}]", f"trainer.run_dir={tmp_path / 'run'}",
        "data.truncation=left", "reward.function=", "algorithm.distill.loss=reverse_kl", *overrides])


def problems(config, world_size: int = 2) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        preflight_check(config, world_size)
    return [line.removeprefix("  - ") for line in str(refused.value).splitlines()[1:]]


def only_problem(config, world_size: int = 2) -> str:
    found = problems(config, world_size)
    assert len(found) == 1, found
    return found[0]


def test_a_teacher_of_the_student_s_tokenizer_passes(tmp_path, prompt_file, models):
    student, teacher = models
    preflight_check(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}"), 2)
    preflight_check(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}",
                              "algorithm.distill.loss=gkd", "algorithm.distill.top_k=8"), 2)


def test_a_tokenizer_mismatch_is_one_line_saying_how_the_vocabularies_differ(tmp_path, prompt_file, models):
    student, teacher = models
    other = shutil.copytree(teacher, tmp_path / "other_tokenizer")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={other}"))
    first = min(vocab["a"], vocab["b"])
    assert line.startswith("teacher.hf_path: the teacher's tokenizer is not model.hf_path's")
    assert f"first differing id {first}" in line and "'a' vs 'b'" in line or "'b' vs 'a'" in line


def test_a_smaller_vocabulary_is_named_by_its_size(tmp_path, prompt_file, models):
    student, teacher = models
    other = shutil.copytree(teacher, tmp_path / "fewer_tokens")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    del vocab[last]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={other}"))
    size = len(vocab) + 1
    assert f"({size}" in line and f"vs {size - 1} tokens" in line and repr(last) in line, line


def test_a_missing_teacher_is_one_line(tmp_path, prompt_file, models):
    student, _ = models
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={tmp_path / 'nowhere'}"))
    assert line == f"teacher.hf_path: {tmp_path / 'nowhere'}/config.json does not exist; point it at the teacher's " \
                   "HF model folder"
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.ckpt={tmp_path / 'nowhere'}"))
    assert line.startswith("teacher.ckpt: ") and "is not a verl_mega checkpoint" in line


def test_no_teacher_at_all_is_one_line(tmp_path, prompt_file, models):
    student, _ = models
    assert only_problem(config_of(tmp_path, prompt_file, student)) == (
        "algorithm.distill.loss=reverse_kl needs a teacher (of the rows of every data source teacher.by_data_source "
        "does not name): set teacher.hf_path (its HF folder) or teacher.ckpt (a converted checkpoint)")


def test_each_data_source_s_teacher_is_checked_and_the_others_need_one(tmp_path, prompt_file, models):
    student, teacher = models
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}",
                                  f"teacher.by_data_source.math={tmp_path / 'nowhere'}"))
    assert line.startswith(f"teacher.by_data_source.math: {tmp_path / 'nowhere'}/config.json does not exist")
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.by_data_source.math={teacher}"))
    assert line.startswith("algorithm.distill.loss=reverse_kl needs a teacher (of the rows of every data source")


@pytest.mark.parametrize("damage", ["truncated weights", "garbled config"])
def test_a_corrupt_teacher_is_one_line(tmp_path, prompt_file, models, damage):
    student, teacher = models
    broken = shutil.copytree(teacher, tmp_path / "broken")
    if damage == "truncated weights":
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        (broken / "config.json").write_text("{not json")
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={broken}"))
    assert line.startswith("teacher.hf_path: ") and ("truncated" in line if damage == "truncated weights"
                                                     else "config.json" in line), line


def test_a_teacher_inside_the_run_folder_is_refused(tmp_path, prompt_file, models):
    student, teacher = models
    inside = shutil.copytree(teacher, tmp_path / "run" / "final_actor_hf")
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={inside}"))
    assert line.startswith(f"teacher.hf_path={inside} is inside trainer.run_dir=")
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.ckpt={tmp_path / 'run'}"))
    assert line.startswith(f"teacher.ckpt={tmp_path / 'run'} is inside trainer.run_dir=")


def test_a_teacher_at_its_own_layout_passes_and_impossible_ones_are_one_line(tmp_path, prompt_file, models):
    student, teacher = models
    preflight_check(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}", "teacher.tp=2"), 2)
    preflight_check(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}", "parallel.tp=2",
                              "parallel.rollout_tp=2", "teacher.tp=1"), 2)
    assert only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}", "teacher.tp=4")) == (
        "teacher.tp * parallel.pp = 4 must divide the number of processes (2)")
    assert only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}", "teacher.pp=4"),
                        world_size=4) == "teacher.hf_path: teacher.pp=4 must divide num_hidden_layers=2"
    # At teacher DP 2, a step of 2 rows cannot give each teacher rank a micro-batch of 2.
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}", "parallel.tp=2",
                                  "parallel.rollout_tp=2", "teacher.tp=1", "data.batch_size=1", "rollout.n=2",
                                  "actor.mini_batch_size=2", "critic.mini_batch_size=2", "actor.micro_batch_size=2"))
    assert line == ("data.batch_size x rollout.n = 2 must be divisible by the teacher's data-parallel size 2 "
                    "(training processes / (teacher.tp * teacher.pp)) x actor.micro_batch_size=2")


def test_a_teacher_without_a_loss_and_an_empty_reward_without_a_teacher_are_refused(tmp_path, prompt_file, models):
    student, teacher = models
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}",
                                  "algorithm.distill.loss=off", "reward.function=copy"))
    assert line.startswith("teacher.hf_path set and algorithm.distill.loss=off")
    line = only_problem(config_of(tmp_path, prompt_file, student, "algorithm.distill.loss=off"))
    assert line.startswith("reward.function: unknown reward function ''")


def test_a_converted_teacher_passes_and_its_layout_is_checked(tmp_path, prompt_file, models):
    student, teacher = models
    ckpt = tmp_path / "teacher_ckpt"
    convert_hf_to_mcore(teacher, ckpt, tp=1, pp=1, fmt="megatron_legacy")
    preflight_check(config_of(tmp_path, prompt_file, student, f"teacher.ckpt={ckpt}"), 2)
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.ckpt={ckpt}", "parallel.tp=2",
                                  "parallel.rollout_tp=2"))
    assert line.startswith(f"teacher.ckpt: {ckpt} was written for tp=1, pp=1, ep=1"), line
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.ckpt={ckpt}", "teacher.tp=2"))
    assert line.startswith(f"teacher.ckpt: {ckpt} was written for tp=1, pp=1, ep=1 and the teacher runs at tp=2, "
                           "pp=1, ep=1 (teacher.tp, teacher.pp, parallel.ep)"), line


def test_a_refused_run_writes_nothing(tmp_path, prompt_file, models):
    student, _ = models
    config = config_of(tmp_path, prompt_file, student, f"teacher.hf_path={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError):
        run(config)
    assert not (tmp_path / "run").exists()


def test_what_learns_from_an_outcome_is_refused_where_the_teacher_is_the_whole_reward(tmp_path, prompt_file,
                                                                                       models):
    student, teacher = models
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}",
                                  "algorithm.filter_groups.enable=true"))
    assert line.startswith("algorithm.filter_groups.enable with reward.function empty")
    line = only_problem(config_of(tmp_path, prompt_file, student, f"teacher.hf_path={teacher}",
                                  "algorithm.adv_estimator=gae", "critic.enable=true"))
    assert line.startswith("algorithm.adv_estimator=gae with reward.function empty")
