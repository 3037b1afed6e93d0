"""Whether processes are gone, for the tests that kill a launcher or a run and check what is left."""
import time


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def survivors_after(pids: list[int], seconds: float) -> list[int]:
    """The processes of `pids` still alive once all are gone or `seconds` have passed."""
    deadline = time.time() + seconds
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]
