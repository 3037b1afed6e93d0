"""`verl-mega generate --engine vllm` for real (vLLM's CPU build on a CPU), run as the command runs: a plain process
of its own, which gets a world of one for vLLM's external launcher. Its greedy answers are the embedded engine's,
the same seed writes the same file, and it leaves no shared memory behind.

Skipped where vLLM is not installed; with VERL_MEGA_REQUIRE_VLLM=1 (CI) a missing vLLM fails instead (the fixture
imported from tests/test_vllm_rollout.py). The refusals without vLLM are in tests/test_generate.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_vllm_rollout import REPO, VLLM_SIZES, vllm_installed  # noqa: F401 (vllm_installed: autouse)
from verl_mega.data.prompts import PromptDataset
from verl_mega.data.tables import read_rows, write_rows
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.parallel.world import TORCHRUN_VARIABLES
from verl_mega.rollout.vllm_cpu_shm import SHM_DIR, mapping_processes
from verl_mega.trainer.generate import generate_file

PROMPTS = 16
MAX_NEW_TOKENS = 16
# Where two fp32 engines may part on a greedy token: transformers' two best logits closer than their kernels'
# rounding apart (the vLLM rollout tests measure log-probs within 1e-3 of each other).
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny Qwen2 of vLLM's CPU head size and its prompts (seed 4: 13 of the 16 get a greedy answer, of 2 to 11
    characters, where the random models of other seeds mostly stop at once)."""
    root = tmp_path_factory.mktemp("generate_vllm")
    model = make_tiny_hf_model(root / "hf", "qwen2", seed=4, **VLLM_SIZES)
    rows = [{"prompt": [{"role": "user", "content": f"copy: {i * 7919 % 100000}"}], "data_source": "copy",
             "extra_info": {"index": i}} for i in range(PROMPTS)]
    return model, write_rows(rows, root / "prompts.jsonl")


def generate_vllm(model: Path, data: str, out: Path, *extra: str) -> None:
    """The command in a process of its own, without torchrun's variables, as a user runs it."""
    plain = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    subprocess.run([sys.executable, "-m", "verl_mega.cli", "generate", "--model", str(model), "--data", data, "--out",
                    str(out), "--engine", "vllm", "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "8", *extra],
                   check=True, cwd=REPO, env={**plain, "OMP_NUM_THREADS": "1"})


def left_segments(before: set[Path]) -> list[Path]:
    """Shared-memory segments that appeared since `before` and that no process maps (what a run left behind;
    another job's live engine maps its own)."""
    return [path for path in set(SHM_DIR.iterdir()) - before if not mapping_processes(path)]


def logit_gap(model: Path, prompt_ids: list[int], prefix: list[int]) -> float:
    """transformers' fp32 gap between its two best next-token logits after `prompt_ids + prefix`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + prefix])).logits[0, -1]
    best = logits.topk(2).values
    return float(best[0] - best[1])


@pytest.mark.slow
def test_greedy_answers_are_the_embedded_engines(inputs, tmp_path):
    """fp32, temperature 0: every row's answer equals the embedded engine's, or the two part where transformers'
    two best tokens are a near-tie (measured on this machine: all 16 rows equal, none parted)."""
    model, data = inputs
    shared_memory = set(SHM_DIR.iterdir())
    generate_vllm(model, data, tmp_path / "vllm.jsonl", "--temperature", "0")
    assert left_segments(shared_memory) == []
    generate_file(model, [data], tmp_path / "embedded.jsonl", temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    on_vllm, embedded = read_rows(tmp_path / "vllm.jsonl"), read_rows(tmp_path / "embedded.jsonl")
    assert [row["extra_info"] for row in on_vllm] == [{"index": i, "sample": 0} for i in range(PROMPTS)]
    assert sum(bool(row["response"]) for row in embedded) >= PROMPTS * 3 // 4, "too few answers to compare"
    tokenizer = load_tokenizer(model)
    prompts = PromptDataset([data], tokenizer, 1024, "prompt", "error")
    parted = [index for index, (a, b) in enumerate(zip(on_vllm, embedded, strict=True)) if a != b]
    print(f"greedy, fp32: {PROMPTS - len(parted)} of {PROMPTS} rows equal on vLLM and the embedded engine")
    for index in parted:
        ids = [tokenizer.encode(row["response"], add_special_tokens=False) for row in (on_vllm[index], embedded[index])]
        common = next((k for k, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
        gap = logit_gap(model, prompts[index]["input_ids"], ids[1][:common])
        assert gap < NEAR_TIE, (index, on_vllm[index]["response"], embedded[index]["response"], gap)
    assert len(parted) <= PROMPTS // 8


@pytest.mark.slow
def test_the_same_seed_writes_the_same_sampled_file(inputs, tmp_path):
    """n=2 at temperature 1, written twice with one seed: the same bytes, each prompt's two samples numbered 0 and
    1, and samples that are samples (not all of a prompt's alike)."""
    model, data = inputs
    shared_memory = set(SHM_DIR.iterdir())
    for name in ("a", "b"):
        generate_vllm(model, data, tmp_path / f"{name}.jsonl", "--n", "2", "--temperature", "1", "--seed", "3")
    assert left_segments(shared_memory) == []
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    rows = read_rows(tmp_path / "a.jsonl")
    assert [(row["extra_info"]["index"], row["extra_info"]["sample"]) for row in rows] == [
        (i, s) for i in range(PROMPTS) for s in range(2)]
    assert any(rows[2 * i]["response"] != rows[2 * i + 1]["response"] for i in range(PROMPTS))


def test_a_head_size_vllms_cpu_build_lacks_is_one_line(tmp_path, inputs, capsys):
    """The shared tiny models' head_dim 16: refused before vLLM starts, its world of one taken down again."""
    import torch.distributed as dist

    from verl_mega.cli import main as cli

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU build's head sizes")
    _, data = inputs
    model = make_tiny_hf_model(tmp_path / "hf", "qwen2", num_hidden_layers=1)
    world_before = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    assert cli(["generate", "--model", str(model), "--data", data, "--out", str(tmp_path / "out.jsonl"),
                "--engine", "vllm", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM's CPU attention supports head_dim in" in err and "head_dim=16" in err
    assert not (tmp_path / "out.jsonl").exists() and not dist.is_initialized()
    assert {name: os.environ.get(name) for name in TORCHRUN_VARIABLES} == world_before
