"""The CPU kernels' threading policy (docs/kernels.md): every call runs on the calling thread, whatever
torch.get_num_threads() says, so a kernel starts no thread of its own. Checked in a fresh process, where no
earlier test has started torch's inter-op pool already."""
import importlib.util
import os
import subprocess
import sys

import pytest

# Counts this process's threads around calls of every CPU kernel at 2 torch threads, on inputs large enough that
# the kernels used to share them with helper threads (many tasks of 2^16 elements each); prints both counts.
CALLS_AT_TWO_THREADS = """
import os, torch
import verl_mega._kernels as kernels
torch.set_num_threads(2)
logits, labels = torch.randn(2048, 4096), torch.randint(0, 4096, (2048,))
log_z = torch.randn(2048)
rewards, values, mask = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.rand(1024, 1024) > 0.2
x, weight = torch.randn(4096, 256), torch.randn(256)
before = len(os.listdir("/proc/self/task"))
for _ in range(5):
    kernels.logprob_partials(logits, labels, 0, True)
    kernels.logprob_backward(logits, labels, 0, log_z, log_z, None, None)
    kernels.gae(rewards, values, mask, 0.99, 0.95)
    y, rstd = kernels.rms_norm_forward(x, weight, 1e-6)
    kernels.rms_norm_backward(y, x, weight, rstd)
print(before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
@pytest.mark.skipif(importlib.util.find_spec("verl_mega._kernels") is None, reason="the CPU kernels are not built")
def test_cpu_kernels_start_no_thread():
    done = subprocess.run([sys.executable, "-c", CALLS_AT_TWO_THREADS], capture_output=True, text=True, timeout=120,
                          check=True)
    before, after = map(int, done.stdout.split())
    assert after == before, f"the kernels started {after - before} thread(s)"
