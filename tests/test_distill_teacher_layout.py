"""A teacher at its own TP/PP beside the student's (torchrun, gloo, fp32) scores as one at the student's layout, so
the distillation losses are the same: reverse_kl's advantages and gkd's divergence, from the student's log-probs at
the student's layout. At a world of 2: student TP 1 (DP 2) beside a teacher at TP 2; student TP 2 beside a teacher
at PP 2, and at TP 1 (DP 2). At a world of 4: student DP 4 beside a teacher at TP 2 x PP 2. Each teacher loads its
megatron_legacy conversion at its own layout (its shards found by its own ranks), and the student's groups are back
after it: the same teacher at the student's layout, built and run after it, is the reference. The RL job, at a
world of 2, logs the same first step with the teacher at TP 2 beside a student at TP 1 as at TP 1 (reverse_kl alone;
gkd beside a reward, with a LoRA student).

Tolerance: fp32, atol = rtol = 1e-5 on log-probs, entropy and the losses (different TP splits sum the vocabulary
in a different order: up to 1e-6 apart here); the top-k ids and the top-1 matches exactly. A planted row swap
fails it."""
import pytest
import torch

from verl_mega.algorithms import distill_advantages, topk_generalized_jsd
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.parallel.spawn import run_torchrun

from tests.workers.roles_worker import fixed_batch

pytestmark = pytest.mark.slow  # eight torchrun launches, about 2.5 minutes on 2 cores

# name -> (world size, student (tp, pp), teacher (tp, pp))
LAYOUTS = {"student_tp1_teacher_tp2": (2, (1, 1), (2, 1)), "student_tp2_teacher_pp2": (2, (2, 1), (1, 2)),
           "student_tp2_teacher_dp2": (2, (2, 1), (1, 1)),
           # both data-parallel, in slices of different sizes: student DP 4, teacher TP 2 x PP 2
           "world4_student_dp4_teacher_tp2_pp2": (4, (1, 1), (2, 2))}
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_layout")
    # A vocabulary of 200 (padded to 256): both TP halves hold real tokens, so the top-k crosses them.
    student = make_tiny_hf_model(root / "student", "qwen2", vocab_size=200, num_hidden_layers=2, seed=0)
    teacher = make_tiny_hf_model(root / "teacher", "qwen2", vocab_size=200, num_hidden_layers=2, seed=1)
    convert_hf_to_mcore(student, root / "student_ckpt", fmt="torch_dist")
    for tp, pp in {layout for _, *pair in LAYOUTS.values() for layout in pair}:
        convert_hf_to_mcore(teacher, root / "teacher_ckpts" / f"tp{tp}_pp{pp}", tp=tp, pp=pp)
    results = {}
    for name, (world, (tp, pp), (teacher_tp, teacher_pp)) in LAYOUTS.items():
        out = root / f"{name}.pt"
        run_torchrun(world, "tests.workers.teacher_layout_worker",
                     [str(root / "teacher_ckpts"), str(root / "student_ckpt"), str(out), *map(str, (tp, pp, teacher_tp,
                                                                                            teacher_pp))])
        results[name] = torch.load(out)
    return results


def losses(found: dict, teacher: str) -> dict[str, torch.Tensor]:
    """reverse_kl's advantages and gkd's divergence (beta 0.5) from `teacher`'s scores (own_ or same_)."""
    mask = fixed_batch(200, pad_id=0)["response_mask"]
    return {"reverse_kl": distill_advantages(None, found["student_log_probs"], found[f"{teacher}_log_probs"], mask,
                                             coef=1.0),
            "gkd": topk_generalized_jsd(found["student_topk_log_probs"], found[f"{teacher}_topk_log_probs"], 0.5)
            * mask}


def assert_same_scores(found: dict) -> None:
    mask = fixed_batch(200, pad_id=0)["response_mask"].bool()
    for name in ("log_probs", "entropy", "topk_log_probs"):
        torch.testing.assert_close(found[f"own_{name}"][mask], found[f"same_{name}"][mask], **TOLERANCE, msg=name)
    for name in ("topk_ids", "top1_match"):
        assert torch.equal(found[f"own_{name}"][mask], found[f"same_{name}"][mask]), name
    own, same = losses(found, "own"), losses(found, "same")
    for name in own:
        torch.testing.assert_close(own[name], same[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_teacher_at_its_own_layout_gives_the_same_scores_and_losses(runs, name):
    found = runs[name]
    world, (tp, pp), (teacher_tp, teacher_pp) = LAYOUTS[name]
    assert found["layout_inside"].tolist() == [teacher_tp, teacher_pp, world // (teacher_tp * teacher_pp)]
    assert found["layout_after"].tolist() == [tp, pp, world // (tp * pp)]
    assert_same_scores(found)
    # Not vacuous: the losses depend on the teacher (the student is another model), and both TP halves of the
    # vocabulary appear in the top-k.
    assert losses(found, "own")["reverse_kl"].abs().max() > 1e-2
    assert (found["own_topk_ids"] >= 128).any() and (found["own_topk_ids"] < 128).any()


def test_a_planted_row_order_error_fails_the_comparison(runs):
    """Two rows swapped in the own-layout teacher's scores (as a wrong gather of the DP slices would give): the
    comparison above fails."""
    found = dict(runs["student_tp1_teacher_tp2"])
    order = torch.arange(found["own_log_probs"].shape[0])
    order[[0, 7]] = order[[7, 0]]
    for name in [name for name in found if name.startswith("own_")]:
        found[name] = found[name][order]
    with pytest.raises(AssertionError):
        assert_same_scores(found)


# name -> (the run's distillation overrides, the first step's metrics that depend on the teacher)
RL_RUNS = {
    "reverse_kl_alone": (["reward.function=", "algorithm.distill.loss=reverse_kl"],
                         ["distill/reverse_kl", "distill/teacher_entropy", "distill/student_entropy",
                          "distill/top1_agreement", "actor/pg_loss"]),
    "gkd_lora_student_beside_a_reward": (["algorithm.distill.loss=gkd", "algorithm.distill.top_k=5",
                                          "algorithm.distill.beta=0.5", "algorithm.distill.coef=0.5",
                                          "actor.lora.rank=4", "actor.lora.alpha=8"],
                                         ["distill/reverse_kl", "distill/teacher_entropy", "actor/gkd_loss",
                                          "actor/pg_loss"]),
}


@pytest.mark.parametrize("name", list(RL_RUNS))
def test_the_rl_job_distils_from_a_teacher_at_its_own_layout(tmp_path, prompt_file, student_and_teacher, name):
    """Two processes, the student at TP 1 (DP 2): the teacher at TP 2, converted into the run folder at that
    layout, gives the first step the same distillation metrics and losses as the teacher at the student's
    (reverse_kl alone, whose advantages are the teacher's term; gkd beside the outcome reward, a LoRA student)."""
    import json

    from verl_mega.demo import EXAMPLES

    student, teacher = student_and_teacher
    overrides, compared = RL_RUNS[name]
    logged = {}
    for teacher_tp in ("null", "2"):
        run_dir = tmp_path / f"teacher_tp_{teacher_tp}"
        run_torchrun(2, "verl_mega.trainer.main", [
            "--config", str(EXAMPLES / "grpo_demo.yaml"), f"model.hf_path={student}", f"trainer.run_dir={run_dir}",
            f"data.train_files=[{prompt_file}]", "data.truncation=left", "data.batch_size=2", "rollout.n=2",
            "actor.mini_batch_size=4", "actor.micro_batch_size=2", "critic.mini_batch_size=4", "trainer.total_steps=1",
            f"teacher.hf_path={teacher}", f"teacher.tp={teacher_tp}", *overrides])
        logged[teacher_tp] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        layout = "tp1_pp1_ep1" if teacher_tp == "null" else "tp2_pp1_ep1"
        assert len(list(run_dir.glob(f"initial_teacher_{layout}_*"))) == 1, sorted(run_dir.iterdir())
    assert logged["2"]["step"] == 1
    assert logged["2"]["distill/reverse_kl"] > 1e-2  # the teacher is another model than the student
    for metric in compared:
        assert logged["2"][metric] == pytest.approx(logged["null"][metric], abs=1e-5), metric
