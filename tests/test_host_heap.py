"""glibc's heap settings for a CPU rank (`parallel/host_heap`): a freed tensor's pages are reused by the next one,
and a process started with malloc settings of its own keeps them. Each case runs in a fresh interpreter, as a
rank does, because the settings last for the process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.parallel.host_heap import malloc_set_by_environment

ROOT = Path(__file__).resolve().parent.parent
PAGES = 64 * 2**20 // 4096  # a 64 MiB tensor: glibc maps a block this large by itself unless told otherwise

# A CPU rank's set-up, then a 64 MiB tensor allocated, filled and freed 16 times, as a step does its logits; prints
# how many pages the last 4 tensors faulted in. (The heap holds a few such blocks before it reuses one: torch
# aligns its blocks, and the small objects allocated between them split the first holes.)
LAST_TENSORS_FAULTS = f"""
import resource, torch
from verl_mega.parallel.state import select_local_device
select_local_device(0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(12):
    torch.ones({PAGES * 1024})
before = faults()
for _ in range(4):
    torch.ones({PAGES * 1024})
print(faults() - before)
"""


def last_tensors_faults(extra_env: dict[str, str]) -> int:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", LAST_TENSORS_FAULTS], capture_output=True, text=True, check=True,
                          cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": "", **extra_env})
    return int(done.stdout)


def test_a_cpu_rank_reuses_a_freed_tensors_pages():
    faults = last_tensors_faults({})
    assert faults < 4 * PAGES // 10, faults


def test_malloc_settings_of_the_environment_are_kept():
    # tcache_count=7 is glibc's default: the environment names a malloc setting without changing one, so the
    # tensors are mapped and faulted in again, as glibc does by default for blocks over 32 MiB.
    faults = last_tensors_faults({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"})
    assert faults > 4 * PAGES * 9 // 10, faults


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, False),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.trim_threshold=0"}, True),
    ({"MALLOC_ARENA_MAX": "2"}, True),
    ({"MALLOC_CONF": "background_thread:true"}, True),
    ({"MY_MALLOC_": "1"}, False),
])
def test_which_environments_set_malloc_up(environ, expected):
    assert malloc_set_by_environment(environ) is expected
