"""Large host tensors on transparent huge pages once verl_mega is imported: what a CPU step's largest tensors
(logits, the embedding's gradient) need, each a fresh mapping the kernel faults in page by page."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The minor page faults of filling a fresh 64 MB tensor.
_FILL_FAULTS = """
import resource, sys
if sys.argv[1] == "verl_mega":
    import verl_mega
import torch
torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
_SMALL_PAGES_IN_64_MB = 64 * 2**20 // 4096


def _fill_faults(first_import: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    result = subprocess.run([sys.executable, "-c", _FILL_FAULTS, first_import], capture_output=True, text=True,
                            check=True, env=env)
    return int(result.stdout.split()[-1])


def _kernel_offers_huge_pages() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.exists() and "[never]" not in setting.read_text()


@pytest.mark.skipif(not _kernel_offers_huge_pages(), reason="the kernel offers no transparent huge pages")
def test_large_host_tensors_fault_in_huge_pages_after_import():
    assert _fill_faults("torch") > _SMALL_PAGES_IN_64_MB // 2
    assert _fill_faults("verl_mega") < _SMALL_PAGES_IN_64_MB // 10
