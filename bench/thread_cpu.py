"""Which threads of which processes took the CPU while a command ran: a sampling profile without py-spy.

    python -m bench.thread_cpu [--match MODULE ...] [--every 0.5] -- COMMAND ...

Runs COMMAND and, every `--every` seconds, reads the CPU time of each thread (/proc/PID/task/TID/stat) of every
process COMMAND started that runs `python -m MODULE` for a MODULE of `--match` (default: the trainer's ranks and
torchrun's agent); a thread's time is its last reading. Printed at the end: per process (its RANK and module),
the CPU seconds of its busiest threads by name, over the wall time the process was seen. A training rank whose
waiting thread spins shows up as a second busy thread; processes that want more than the machine's cores show
up as CPU seconds well below their wall time.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import defaultdict

import psutil

TICKS = os.sysconf("SC_CLK_TCK")


def matching(root: int, pattern: str) -> dict[int, str]:
    """pid -> a label (its RANK and its module) of every process under `root` that runs `python -m pattern`
    (another session's processes on a shared machine are not counted)."""
    found = {}
    try:
        descendants = [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for pid in descendants:
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        words = [word.decode(errors="replace") for word in cmdline]
        if pattern in words[1:] and words[words.index(pattern) - 1] == "-m":  # `python -m PATTERN`
            rank = next((entry[5:].decode() for entry in environ if entry.startswith(b"RANK=")), "?")
            found[int(pid)] = f"rank {rank} ({pattern})"
    return found


def thread_seconds(pid: int) -> dict[str, float]:
    """thread id and name -> CPU seconds (user + system) so far."""
    seconds = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            seconds[f"{tid} {name}"] = (int(fields[11]) + int(fields[12])) / TICKS
    except OSError:  # the process or a thread ended between two reads
        pass
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.thread_cpu")
    parser.add_argument("--match", nargs="+", default=["verl_mega.trainer.main", "torch.distributed.run"])
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    process = subprocess.Popen(command)
    readings: dict[int, dict[str, float]] = defaultdict(dict)
    seen: dict[int, list[float]] = {}
    labels: dict[int, str] = {}
    while process.poll() is None:
        now = time.perf_counter()
        for pid, label in {pid: label for module in args.match
                           for pid, label in matching(process.pid, module).items()}.items():
            labels[pid] = label
            seen.setdefault(pid, [now, now])[1] = now
            readings[pid].update(thread_seconds(pid))
        time.sleep(args.every)
    for pid in sorted(readings):
        first, last = seen[pid]
        total = sum(readings[pid].values())
        print(f"pid {pid} {labels[pid]}: {total:.1f} CPU s over {last - first:.1f} s seen")
        for thread, seconds in sorted(readings[pid].items(), key=lambda item: -item[1])[:6]:
            print(f"    {seconds:8.1f} s  {thread}")
    return process.returncode


if __name__ == "__main__":
    raise SystemExit(main())
