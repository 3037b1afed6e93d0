"""What the launch fault tests run on every rank (`--module tests.faults.rank_payloads -- ACTION ARGS`).

    fail CODE   exit with CODE and a one-line message, as the trainer does for a user error
    wait DIR    join the process group, record this rank's pid in DIR, then wait to be killed
"""
import json
import os
import sys
import time
from pathlib import Path


def main(action: str, arg: str) -> int:
    if action == "fail":
        from verl_mega.config.errors import report_to_launcher

        message = f"payload: error: told to fail with {arg}"
        print(message, file=sys.stderr)
        report_to_launcher(message)
        return int(arg)
    from verl_mega.parallel.state import init_parallel

    layout = init_parallel(1, 1)
    (Path(arg) / f"rank{layout.rank}.pid").write_text(json.dumps({"pid": os.getpid()}))
    time.sleep(300)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
