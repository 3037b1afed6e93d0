"""How much two processes slow each other on this machine: the overlap's ceiling for 1 training + 1 rollout
process.

    python -m bench.core_contention [--seconds 4]

Each workload runs for about `--seconds` alone, then beside the other one (each in its own process, one thread
each, as bench.async_step's processes run): a cache-resident fp32 matmul (compute-bound, like a training step's
GEMMs) and a fp32 matrix-vector product over 440 MB (memory-bound, like decoding a ~110M fp32 model one token at a
time). Printed per workload: its rate alone and beside the other, and its wall and CPU seconds per unit of work
(CPU time that grows with the wall time: stalled on memory or a shared core; wall time that grows alone: waiting
for a core). With two idle cores of their own, both rates stay near 1.0x.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time

WORKLOADS = ("matmul", "matvec")


def work(kind: str, seconds: float, start, results) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "matmul":
        a, b = torch.randn(384, 384), torch.randn(384, 384)
        unit = lambda: a @ b  # noqa: E731
    else:
        matrix, vector = torch.randn(110_000_000 // 1024, 1024), torch.randn(1024)
        unit = lambda: matrix @ vector  # noqa: E731
    unit()
    start.wait()
    wall, cpu, units = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - wall < seconds:
        unit()
        units += 1
    results[kind] = (units, time.perf_counter() - wall, time.process_time() - cpu)


def measure(kinds: tuple[str, ...], seconds: float) -> dict:
    """Run `kinds` at once, one process each: kind -> (units, wall s, CPU s)."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results, start = manager.dict(), context.Barrier(len(kinds))
        processes = [context.Process(target=work, args=(kind, seconds, start, results)) for kind in kinds]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        return dict(results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core_contention")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    load = os.getloadavg()
    alone = {kind: measure((kind,), args.seconds)[kind] for kind in WORKLOADS}
    together = measure(WORKLOADS, args.seconds)
    print(f"load average before {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}, after "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'workload':8s} {'rate beside / alone':>20s} {'wall/unit alone':>16s} {'CPU/unit alone':>15s} "
          f"{'wall/unit beside':>17s} {'CPU/unit beside':>16s}")
    for kind in WORKLOADS:
        (units_a, wall_a, cpu_a), (units_t, wall_t, cpu_t) = alone[kind], together[kind]
        print(f"{kind:8s} {units_t / wall_t / (units_a / wall_a):20.2f}x {1e3 * wall_a / units_a:14.2f}ms "
              f"{1e3 * cpu_a / units_a:13.2f}ms {1e3 * wall_t / units_t:15.2f}ms {1e3 * cpu_t / units_t:14.2f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
