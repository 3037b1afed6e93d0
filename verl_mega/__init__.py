"""verl_mega: Megatron-backed RL post-training (PPO, GRPO) with a 3D-HybridEngine.

The Python API (`verl_mega.Trainer`, `verl_mega.load_policy`, see `verl_mega/api.py`) is imported on first
use, so `import verl_mega` stays cheap for the command line and the launchers.

The package calls megatron-core's internals (its optimizer's per-parameter state, its dist-checkpoint
metadata, its CPU-unfriendly corners patched in `parallel/shims.py`), so a megatron-core outside the releases it is
tested against (`parallel/megatron_versions.py`: 0.16.1 up to 0.19.x) is refused here, at import, with one line,
rather than deep inside a training step. megatron-core's `torch.compile` decorations are deferred to each
function's first call (`parallel/deferred_compile.py`), so importing megatron-core does not import torch's compiler
stack.
"""
import importlib
import os
import warnings

from verl_mega.parallel import deferred_compile, megatron_versions

megatron_versions.check_installed()
deferred_compile.install()

# Output every rank would repeat without telling the user anything: megatron-core's notices that it falls back
# from apex / transformer-engine (expected on CPU and with the local layer spec) and, from 0.17 on, from absl's
# logging, a deprecation megatron triggers in its own config, torch's deprecation of a collective megatron calls,
# and transformers' progress bars for each (tiny) load. Set HF_HUB_DISABLE_PROGRESS_BARS=0 to see the bars again.
for _message in (r".*(Apex|Transformer Engine).* (is|are) not installed", r"absl\.logging is not installed",
                 r"full scope is deprecated", r"`torch\.distributed\.all_gather_into_tensor` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

API_NAMES = ("Trainer", "Policy", "load_policy")


def __getattr__(name: str):
    if name in API_NAMES:
        return getattr(importlib.import_module("verl_mega.api"), name)
    raise AttributeError(f"module 'verl_mega' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API_NAMES])
