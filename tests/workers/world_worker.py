"""One task of an `srun`-style job without torchrun (SLURM_* set, no RANK / WORLD_SIZE), for tests/test_world.py:
joins the process group through `init_parallel` and writes to OUT/rank{RANK}.json what it became and what it
exported, during the group's life and after `destroy_parallel`.

    python -m tests.workers.world_worker OUT
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import destroy_parallel, init_parallel

EXPORTED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main(out: str) -> None:
    layout = init_parallel(1, 1)
    ranks = [None] * layout.world_size
    dist.all_gather_object(ranks, layout.rank)
    record = {"rank": layout.rank, "world_size": layout.world_size, "gathered_ranks": ranks,
              "environment": {name: os.environ.get(name) for name in EXPORTED}}
    destroy_parallel()
    record["environment_after"] = {name: os.environ.get(name) for name in EXPORTED}
    Path(out, f"rank{layout.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
