"""Virtual pipeline stages (`parallel.vpp`, megatron's interleaved schedule): which layers each model chunk holds,
the schedule's micro-batch groups, the pre-flight refusals, and, on 2 ranks at PP 2, the same outputs, losses and
gradients as without them (actor, critic, a replayed MoE actor), a run resumed across a change of vpp, and the
export of weights saved with it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.sharding import rank_slots, stage_layers
from verl_mega.parallel.pipeline import interleaved_group_size


def tiny_config(layers: int = 8, tied: bool = True) -> HFModelConfig:
    return HFModelConfig.from_dict({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": tied})


def test_chunk_c_of_rank_r_runs_the_c_times_pp_plus_r_th_run_of_layers():
    config = tiny_config(8)
    assert [list(stage_layers(config, rank, 2, 2, chunk)) for chunk in (0, 1) for rank in (0, 1)] == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(stage_layers(config, 1, 2)) == [4, 5, 6, 7]  # one chunk: the contiguous stage


@pytest.mark.parametrize("tied", [True, False])
def test_the_ranks_chunks_hold_every_tensor_once_named_by_chunk(tied):
    config = tiny_config(8, tied)
    family = family_for(config)
    whole = {(slot.global_name, slot.is_tied_copy) for rank in (0, 1) for slot in rank_slots(config, family, rank, 2)}
    chunked = [slot for rank in (0, 1) for slot in rank_slots(config, family, rank, 2, vpp=2)]
    assert sorted((slot.global_name, slot.is_tied_copy) for slot in chunked) == sorted(whole)
    rank1 = {slot.local_name: slot for slot in rank_slots(config, family, 1, 2, vpp=2)}
    # Rank 1's chunk 1 holds layers 6 and 7 as its layers 0 and 1, and the head; its chunk 0 no head.
    layer6 = [slot for slot in rank1.values() if slot.layer == 6]
    assert layer6 and all(slot.local_name.startswith("chunks.1.decoder.layers.0.") for slot in layer6)
    assert "chunks.1.output_layer.weight" in rank1 and "chunks.0.output_layer.weight" not in rank1
    assert rank1["chunks.1.output_layer.weight"].is_tied_copy == tied
    rank0 = {slot.local_name for slot in rank_slots(config, family, 0, 2, vpp=2)}
    assert "chunks.0.embedding.word_embeddings.weight" in rank0
    assert not any(name.startswith("chunks.1.embedding") for name in rank0)


@pytest.mark.parametrize("micro_batches, pp, group", [(4, 2, 2), (8, 4, 4), (3, 2, 3), (5, 2, 3), (2, 2, 2)])
def test_the_group_is_pp_where_it_divides_else_the_smallest_the_schedule_takes(micro_batches, pp, group):
    assert interleaved_group_size(micro_batches, pp) == group
    remainder = micro_batches % group
    assert pp <= group <= micro_batches and (remainder == 0 or remainder >= pp)


def test_fewer_micro_batches_than_stages_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="at least pp=4 micro-batches in each pass; this one has 3.*parallel.vpp=1"):
        interleaved_group_size(3, 4)


def test_the_chunks_run_only_through_the_schedule():
    from verl_mega.models.chunks import StageChunks, model_chunks, schedule_chunks

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    for chunk in chunks:
        chunk.config, chunk.model_type = "config", "encoder_or_decoder"
    model = StageChunks(chunks)
    assert model_chunks(model) == chunks and schedule_chunks(model) == chunks
    assert [name for name, _ in model.named_parameters()][:2] == ["chunks.0.weight", "chunks.0.bias"]
    plain = torch.nn.Linear(2, 2)
    assert model_chunks(plain) == [plain] and schedule_chunks(plain) == [plain]
    with pytest.raises(TypeError, match="interleaved schedule"):
        model(torch.zeros(2))


@pytest.mark.parametrize("overrides, problem", [
    (["parallel.vpp=3"], "parallel.pp=2 x parallel.vpp=3 must divide the model's 4 layers"),
    (["parallel.vpp=2", "actor.max_tokens_per_micro_batch=4096"],
     "actor.max_tokens_per_micro_batch=4096 may pack a pass into fewer than parallel.pp=2 micro-batches"),
    (["parallel.vpp=2", "actor.recompute.granularity=full", "actor.recompute.num_layers=2"],
     "actor.recompute.num_layers=2 must divide the 1 layers of each model chunk (parallel.vpp)"),
    (["parallel.vpp=2", "actor.micro_batch_size=4"],
     "actor.mini_batch_size=4 gives each of the 1 data-parallel ranks 1 micro-batches of actor.micro_batch_size=4"),
])
def test_preflight_refuses_virtual_stages_it_cannot_run(tiny_models, prompt_file, overrides, problem):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
                                "critic.mini_batch_size=4", "critic.micro_batch_size=2", "parallel.pp=2", *overrides])
    with pytest.raises(ConfigError) as refused:
        preflight_check(config, world_size=2)
    lines = str(refused.value).splitlines()[1:]
    assert len(lines) == 1 and problem in lines[0], lines


def test_a_manifest_whose_virtual_stages_do_not_split_its_layers_is_refused(tmp_path):
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", num_hidden_layers=4)
    raw = json.loads((hf / "config.json").read_text())
    fields = dict(family="qwen2", hf_config=raw, format="megatron_legacy", tp=1, pp=2, ep=1, dtype="fp32",
                  tied_embeddings=bool(raw.get("tie_word_embeddings")), padded_vocab_size=raw["vocab_size"])
    Manifest(**fields, vpp=2).write(tmp_path)
    assert Manifest.read(tmp_path).vpp == 2
    Manifest(**fields, vpp=3).write(tmp_path)
    with pytest.raises(ValueError, match="key 'vpp' 3 needs pp > 1 and pp x vpp dividing the model's 4 layers"):
        Manifest.read(tmp_path)


# --- 2 ranks at PP 2 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def virtual_pipeline_runs(tmp_path_factory):
    """The worker's results at vpp 1 and 2: a dense actor and critic, and a replayed MoE actor, each loaded from a
    legacy checkpoint converted at PP 2 (at vpp 2 each rank's chunks come from both ranks' shards)."""
    from tests.workers.sequence_parallel_worker import run_cases_on_two_ranks

    return run_cases_on_two_ranks(tmp_path_factory.mktemp("virtual_pipeline"), "virtual_pipeline_worker",
                                  num_layers=4, tp=1, pp=2)


def joined(runs: Path, case: str, vpp: int) -> tuple[list[dict], dict]:
    """Both ranks' results, and their gradients joined by global name."""
    results = [torch.load(runs / f"{case}_vpp{vpp}_rank{rank}.pt") for rank in (0, 1)]
    return results, {name: grad for result in results for name, grad in result["grads"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2_actor", "qwen2_critic", "mixtral_replay_actor"])
def test_virtual_stages_give_the_outputs_losses_and_gradients_without_them(virtual_pipeline_runs, case):
    """fp32 tolerance: without virtual stages the micro-batches are trimmed to their longest row, with them they
    are full width (`transformer_config`), which changes the sums' order. The replayed MoE actor is full width in
    both (CPU's all-gather dispatcher), so any chunk missing its routes would show."""
    from tests.workers.roles_worker import fixed_batch

    mask = fixed_batch(300, 0)["response_mask"]
    (plain, plain_grads), (chunked, chunked_grads) = (joined(virtual_pipeline_runs, case, vpp) for vpp in (1, 2))
    assert chunked_grads.keys() == plain_grads.keys() and any(grad.abs().max() > 0 for grad in plain_grads.values())
    for rank in (0, 1):
        torch.testing.assert_close(chunked[rank]["outputs"] * mask, plain[rank]["outputs"] * mask, rtol=1e-5, atol=1e-6)
        assert chunked[rank]["loss"] == pytest.approx(plain[rank]["loss"], rel=1e-5, abs=1e-7)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if case.startswith("mixtral"):
        assert all(torch.equal(chunked_grads[name], grad) for name, grad in plain_grads.items())


@pytest.mark.slow
def test_a_run_resumed_with_virtual_stages_continues_it_and_exports_the_same_weights(tmp_path):
    """PPO (actor, critic, reference, HybridEngine) at PP 2 on 2 ranks for 4 steps, against the same run saved at
    step 2 and resumed with vpp=2: the same metrics at every step, and its final actor, saved by chunks, exports to
    the uninterrupted run's weights."""
    from safetensors.torch import load_file

    from tests.trainer_runs import NOT_COMPARED, train_command
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=4)
    setup = (tmp_path, hf, write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), tmp_path / "copy.jsonl"))
    # An entropy bonus and the KL in the reward give the actor and then the critic gradients though the tiny
    # model earns no reward at first.
    common = ["parallel.tp=1", "parallel.pp=2", "parallel.rollout_tp=1", "actor.loss.entropy_coeff=0.01",
              "algorithm.use_kl_in_reward=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(run_dir: Path, vpp: int, steps: int):
        command = train_command(setup, run_dir, 2, *common, f"parallel.vpp={vpp}", f"trainer.total_steps={steps}")
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def metrics(run_dir: Path) -> dict:
        return {record["step"]: {key: value for key, value in record.items() if not key.startswith(NOT_COMPARED)}
                for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    train(tmp_path / "plain", 1, 4)
    train(tmp_path / "switched", 1, 2)
    assert "resumed from" in train(tmp_path / "switched", 2, 4)
    plain, switched = metrics(tmp_path / "plain"), metrics(tmp_path / "switched")
    assert sorted(switched) == sorted(plain) == [1, 2, 3, 4]
    assert plain[4]["actor/grad_norm"] > 0.01 and plain[4]["critic/vf_loss"] > 0
    for step, record in plain.items():
        assert switched[step] == pytest.approx(record, rel=1e-4, abs=1e-6), step

    assert json.loads((tmp_path / "switched" / "final_actor" / "verl_mega_manifest.json").read_text())["vpp"] == 2
    exported = {}
    for run in ("plain", "switched"):
        done = subprocess.run([sys.executable, "-m", "verl_mega.cli", "export", "--ckpt", str(tmp_path / run),
                               "--out", str(tmp_path / f"hf_{run}")], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        exported[run] = {name: tensor for path in (tmp_path / f"hf_{run}").glob("*.safetensors")
                         for name, tensor in load_file(path).items()}
    assert exported["switched"].keys() == exported["plain"].keys()
    for name, tensor in exported["plain"].items():
        torch.testing.assert_close(exported["switched"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
