"""Test payload: a gloo all_reduce over every rank; each rank writes what it saw to OUT/rank<R>.json."""
from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "sum": value.item(),
        "env_marker": os.environ.get("LAUNCH_TEST_MARKER"),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
