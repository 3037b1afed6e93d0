"""The RL job: batch assembly, rollout placement, the order of a job's construction, and a short end-to-end run
whose reward rises."""
import json

import pytest
import torch

from verl_mega.parallel.layout import rollout_coordinates
from verl_mega.trainer.rollout_batch import build_rollout_batch


def test_rollout_batch_keeps_each_row_contiguous_with_the_response_last():
    batch = build_rollout_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 9]], max_response_length=3, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert torch.equal(batch["responses"], batch["input_ids"][:, -3:])
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("tp,pp,dp,rollout_tp", [(2, 2, 2, 1), (4, 1, 2, 2), (4, 1, 1, 4), (2, 1, 2, 2)])
def test_rollout_replicas_cover_every_rank_once_per_replica(tp, pp, dp, rollout_tp):
    world = tp * pp * dp
    seen = {}
    for rank in range(world):
        coordinates = rollout_coordinates(rank, world, tp, rollout_tp)
        replicas, replica, leader = coordinates.replicas, coordinates.replica, coordinates.leads_replica
        assert replicas == world // rollout_tp
        seen.setdefault(replica, []).append(leader)
    assert sorted(seen) == list(range(world // rollout_tp))
    assert all(len(members) == rollout_tp and members.count(True) == 1 for members in seen.values())


@pytest.mark.slow
def test_short_ppo_run_reward_rises_and_exports(tmp_path):
    """The demo's recipe at a small scale, one process: warm-up, then PPO at the learning run's lr and samples per
    prompt; fixed seeds, deterministic on CPU."""
    from verl_mega.cli import main as cli
    from verl_mega.data.synthetic import make_task_rows, sft_pairs
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, sft_warmup, train
    from verl_mega.models.tiny import make_tiny_hf_model

    rows = make_task_rows("copy", 512, seed=0, max_digits=2)
    train_file = write_rows(rows, tmp_path / "copy.jsonl")
    sft, _ = sft_warmup(make_tiny_hf_model(tmp_path / "random", "qwen2", vocab_size=64), sft_pairs(rows), tmp_path / "sft")
    run_dir = tmp_path / "run"
    train(EXAMPLES / "ppo_gae_demo.yaml", 1, [
        f"model.hf_path={sft}", f"data.train_files=[{train_file}]", f"trainer.run_dir={run_dir}",
        "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=16", "actor.micro_batch_size=16",
        "critic.micro_batch_size=16", "actor.optim.lr=1e-3", "rollout.n=8",
    ])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 17))
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/entropy", "actor/lr",
                "timing/rollout", "timing/update_actor", "perf/tokens_per_second", "perf/peak_rss_gib"):
        assert key in records[-1], key
    # The embedded engine samples in fp32 from the weights the trainer scores with: no mismatch but rounding.
    assert all(record["rollout_corr/kl_k3"] < 1e-9 and record["rollout_corr/kl_k3/copy"] < 1e-9
               and 1 - 1e-4 < record["rollout_corr/ratio_min"] <= record["rollout_corr/ratio_max"] < 1 + 1e-4
               for record in records), [(r["rollout_corr/kl_k3"], r["rollout_corr/ratio_max"]) for r in records]
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.03, rewards
    assert (run_dir / "config.yaml").is_file() and list((run_dir / "tensorboard").iterdir())
    exported = tmp_path / "hf"
    assert cli(["export", "--ckpt", str(run_dir), "--out", str(exported)]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).config.tie_word_embeddings is True
    # The trained actor regrouped by the HybridEngine into the embedded rollout engine streams exactly the
    # exported tensors, and generates greedily what transformers generates from the exported folder.
    from verl_mega.parallel.spawn import run_torchrun

    run_torchrun(1, "tests.workers.hybrid_worker", ["--tp", "1", "--pp", "1", "--case",
                                            f"qwen2,{exported},{run_dir / 'final_actor'},1", "--greedy",
                                            f"qwen2={exported}"])
    assert cli(["export", "--ckpt", str(run_dir), "--role", "critic", "--out", str(tmp_path / "critic")]) == 0


def test_lr_schedule_spans_every_optimizer_step_of_the_run():
    from verl_mega.config import load_config
    from verl_mega.trainer.rl.needs import optimizer_steps

    config = load_config(None, ["model.hf_path=x", "trainer.total_steps=10", "data.batch_size=8", "rollout.n=4",
                                "actor.mini_batch_size=16", "actor.ppo_epochs=2"])
    assert optimizer_steps(config, config.actor) == 10 * 2 * (32 // 16)


def test_a_job_is_built_then_started_by_the_base_class(tiny_models, tmp_path):
    """The subclass builds its parts from its inputs before the base class resumes into them and opens the metrics
    log; it never calls start() itself."""
    from verl_mega.config import load_config
    from verl_mega.parallel.layout import ParallelLayout
    from verl_mega.trainer.job import TrainingJob

    class RecordingJob(TrainingJob):
        def build(self, marker: str) -> None:
            self.built = (marker, self.logger)

        def trainables(self) -> dict:
            return {}

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"trainer.run_dir={tmp_path}",
                                "trainer.tensorboard=false"])
    layout = ParallelLayout(tp=1, pp=1, dp=1, ep=1, rank=0, world_size=1, tp_rank=0, pp_rank=0, dp_rank=0, ep_rank=0)
    job = RecordingJob(config, layout, marker="built first")
    assert job.built == ("built first", None)
    assert job.logger is not None and job.step == 0
