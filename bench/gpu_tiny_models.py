"""The tiny models the transformer-engine and vLLM checks of `bench/gpu_check.sh` read, in WORK:

    python -m bench.gpu_tiny_models WORK

WORK/llama and WORK/qwen2 (conversion parity with the transformer-engine layer spec), WORK/hf (a 2-layer,
hidden-256 Qwen2) and its conversion WORK/ckpt_tp1 (gpu_packing_check.py, gpu_rollout_check.py).
"""
import sys
from pathlib import Path

from verl_mega.cli import main as verl_mega
from verl_mega.models.tiny import make_tiny_hf_model


def main(work: Path) -> int:
    for family in ("llama", "qwen2"):
        make_tiny_hf_model(work / family, family)
    hf = make_tiny_hf_model(work / "hf", "qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    return verl_mega(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(work / "ckpt_tp1"), "--tp", "1"])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
