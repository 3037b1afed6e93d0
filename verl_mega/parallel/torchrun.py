"""torchrun as the launchers run it, with the two things plain torchrun gets wrong for a user:

- A rank that fails with its own exit code and one-line message (2: a user error) comes out as that code and
  that message, not as torchrun's ChildFailedError traceback and exit 1.
- Ranks outlive a killed launcher: torchrun starts each rank in its own session, so killing the launcher's
  process group leaves them training. Every rank asks the kernel for SIGKILL when its parent (the torchrun
  agent) dies (`exit_with_agent`, called from `init_parallel`), and so does every process a rank forks; the
  agent likewise asks for SIGTERM when the launcher above it dies.
- torchrun answers SIGTERM or Ctrl-C by stopping its ranks and killing them 30 s later, whether or not they have
  saved, and then fails with a traceback. Here the agent passes SIGINT, SIGTERM and SIGUSR1 to its ranks once
  each (`stop_signals`) and keeps watching them: a rank finishes its step, saves, says where, and exits 0, and
  so does the agent. An explicit `--signals-to-handle` keeps torchrun's own handling of the signals it names.

`python -m verl_mega.parallel.torchrun ARGS` takes torchrun's own arguments.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

from .process_exit import exit_process
from .stop_signals import child_pids, forwarding

# The agent's pid, exported to its ranks: a rank whose parent is no longer this pid has lost its agent.
AGENT_PID_ENV = "VERL_MEGA_TORCHRUN_AGENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_NO_MESSAGE = "To enable traceback"  # torchrun's placeholder when a rank left no error record
# What torchrun still handles itself (it stops the ranks and exits): the signals not forwarded.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def signal_on_parent_death(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent dies; False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def exit_with_agent() -> None:
    """In a rank under torchrun: die with the agent (SIGKILL: the run folder's lock and checkpoints are safe
    against that, and a rank asked politely would first finish its step). Processes the rank forks (megatron's
    checkpoint writers) die with the rank likewise, instead of lingering on a queue nobody reads."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    signal_on_parent_death(signal.SIGKILL)
    os.register_at_fork(after_in_child=lambda: signal_on_parent_death(signal.SIGKILL))
    agent = os.environ.get(AGENT_PID_ENV)
    if agent and os.getppid() != int(agent):  # the agent died before the request above was in place
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    signal_on_parent_death(signal.SIGTERM)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.startswith(("--signals-to-handle", "--signals_to_handle")) for arg in argv):
        argv.insert(0, f"--signals-to-handle={TORCHRUN_SIGNALS}")
    try:
        with forwarding(child_pids):
            run(parse_args(argv))
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else ""
        if not message or message.startswith(_NO_MESSAGE):
            message = "see its output above"
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"rank {rank} failed (exit {code}): {message}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    exit_process(main())
