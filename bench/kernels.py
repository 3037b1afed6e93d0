"""Benchmark of verl_mega.ops against what verl does without them.

    python bench/kernels.py [--device cpu|cuda]

GAE: the kernel vs verl's reverse Python loop over time steps (B=256, T=1024), and vs our PyTorch
reference (the same loop, leaner). Goal: >= 100x faster than verl's.
Log-prob: the kernel vs log_softmax(logits).gather(labels), 4096 tokens x 32k vocabulary, float32.
Goals: >= 1.5x faster, peak extra memory <= 10 % of the reference's. Forward and backward is shown as well.
RMSNorm (CPU): forward and backward of the kernel vs torch's rms_norm at a 100M model's update shape (41 x 32
tokens, hidden 768) and a tiny model's (hidden 64).

Times are the best of several runs, for both sides: on a shared machine the other runs measure the
neighbours. On the CPU everything runs on one thread and then on torch's default thread count.

Threads (CPU only), `--threads-only` for just this table: each kernel alone (GAE at B=256, T=1024; the log-prob
partials and backward at a micro-batch's 256x32000 and an update's 2048x32000, float32), median calls on 1 and 2
threads alternating call by call, idle, beside a steady busy neighbour (a 2-thread torch process doing matmuls,
as another rank on the node would) and beside a bursty one (a short-lived `python -c pass` every ~0.1 s), over
--rounds rounds. Per cell: the medians, the ratio 2 threads / 1 thread (median over rounds and its spread) and
the goal, <= 1.05x, printed PASS or FAIL.
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from verl_mega.ops import _backend, gae, fallback, rms_norm, token_logprobs

GAE_SHAPE = (256, 1024)
RMS_NORM_SHAPES = [(41 * 32, 768), (41 * 32, 64)]
LOGPROB_SHAPE = (4096, 32000)
# The threads table's log-prob shapes: a micro-batch's worth of tokens, and a large update's.
THREADS_LOGPROB_SHAPES = [(256, 32000), (2048, 32000)]
THREADS_GOAL = 1.05
# Neighbours stop by themselves after this long, should this process die without killing them.
NEIGHBOUR_SECONDS = 300
# Steady: a 2-thread torch process doing matmuls, as another rank on the node would.
BUSY_NEIGHBOUR = f"""
import time, torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
deadline = time.monotonic() + {NEIGHBOUR_SECONDS}
while time.monotonic() < deadline:
    a @ a
"""
# Bursty: a short-lived process every ~0.1 s (a Python start-up, ~20-40 ms of CPU, then a pause), as data
# workers, evaluation scripts and other ranks' launches do.
BURSTY_NEIGHBOUR = (f"end=$((SECONDS + {NEIGHBOUR_SECONDS})); "
                    f"while [ $SECONDS -lt $end ]; do '{sys.executable}' -c pass; sleep 0.1; done")
NEIGHBOURS = {"idle": None, "busy": [sys.executable, "-c", BUSY_NEIGHBOUR], "bursty": ["bash", "-c", BURSTY_NEIGHBOUR]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_extra_bytes(fn, device):
    """Memory the call needs above what is already allocated: the CUDA allocator's peak on GPUs; on the CPU
    the peak resident set (Linux's high-water mark, reset through /proc/self/clear_refs) above the current one."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def backend_name(device):
    module = _backend.kernels_for(device)
    return "PyTorch fallback (kernels not built or disabled)" if module is fallback else module.__name__


def verl_gae_loop(token_level_rewards, values, response_mask, gamma, lam):
    """verl's compute_gae_advantage_return (multi-turn masked version) without its final whitening, as the
    baseline: what PPO runs without these kernels."""
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def bench_gae(device):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(*GAE_SHAPE, generator=generator).to(device)
    values = torch.randn(*GAE_SHAPE, generator=generator).to(device)
    lengths = torch.randint(GAE_SHAPE[1] // 4, GAE_SHAPE[1] + 1, (GAE_SHAPE[0], 1), generator=generator)
    mask = (torch.arange(GAE_SHAPE[1]) < lengths).to(device)
    float_mask = mask.float()  # verl's masks are float
    kernel = best_seconds(lambda: gae(rewards, values, mask, 1.0, 0.95), device, repeats=20)
    verl = best_seconds(lambda: verl_gae_loop(rewards, values, float_mask, 1.0, 0.95), device, repeats=3)
    ours = best_seconds(lambda: fallback.gae(rewards, values, mask, 1.0, 0.95), device, repeats=3)
    print(f"GAE B={GAE_SHAPE[0]} T={GAE_SHAPE[1]}: kernel {kernel * 1e3:.3f} ms; verl's loop {verl * 1e3:.1f} ms "
          f"-> {verl / kernel:.0f}x faster (goal >= 100x); reference loop {ours * 1e3:.1f} ms -> {ours / kernel:.0f}x")


def bench_rms_norm(device):
    for tokens, hidden in RMS_NORM_SHAPES:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=generator, device=device, requires_grad=True)
        weight = torch.randn(hidden, generator=generator, device=device, requires_grad=True)
        grad = torch.randn(tokens, hidden, generator=generator, device=device)
        ours = best_seconds(lambda: rms_norm(x, weight, 1e-6).backward(grad), device, repeats=20)
        torchs = best_seconds(lambda: F.rms_norm(x, (hidden,), weight, 1e-6).backward(grad), device, repeats=20)
        print(f"RMSNorm {tokens}x{hidden} forward+backward: {backend_name(device)} {ours * 1e3:.3f} ms; torch "
              f"{torchs * 1e3:.3f} ms -> {torchs / ours:.1f}x")


def bench_logprobs(device):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*LOGPROB_SHAPE, generator=generator).to(device)
    labels = torch.randint(0, LOGPROB_SHAPE[1], LOGPROB_SHAPE[:1], generator=generator).to(device)

    def kernel():
        with torch.no_grad():
            return token_logprobs(logits, labels)

    def log_softmax_gather():
        with torch.no_grad():
            return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0]

    upstream = torch.randn(LOGPROB_SHAPE[0], generator=generator).to(device)

    def kernel_with_backward():
        x = logits.detach().requires_grad_()
        token_logprobs(x, labels).backward(upstream)

    def log_softmax_gather_with_backward():
        x = logits.detach().requires_grad_()
        torch.log_softmax(x, dim=-1).gather(-1, labels[:, None])[:, 0].backward(upstream)

    rows = [
        ("forward", kernel, log_softmax_gather, 5),
        ("forward+backward", kernel_with_backward, log_softmax_gather_with_backward, 3),
    ]
    tokens, vocab = LOGPROB_SHAPE
    for name, ours, theirs, repeats in rows:
        ours_s, theirs_s = best_seconds(ours, device, repeats), best_seconds(theirs, device, repeats)
        ours_b, theirs_b = peak_extra_bytes(ours, device), peak_extra_bytes(theirs, device)
        goals = " (goals >= 1.5x, <= 10 %)" if name == "forward" else ""
        print(f"log-prob {tokens}x{vocab} fp32 {name}: kernel {ours_s * 1e3:.1f} ms vs log_softmax+gather "
              f"{theirs_s * 1e3:.1f} ms -> {theirs_s / ours_s:.2f}x faster; peak extra memory "
              f"{ours_b / 2**20:.2f} MiB vs {theirs_b / 2**20:.1f} MiB = {100 * ours_b / theirs_b:.1f} %{goals}")


def thread_cells():
    """The calls of the threads table: name -> (call, calls per round), each a compiled CPU kernel alone."""
    kernels = _backend.kernels_for(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(*GAE_SHAPE, generator=generator), torch.randn(*GAE_SHAPE, generator=generator)
    mask = torch.rand(*GAE_SHAPE, generator=generator) > 0.2
    cells = {f"GAE {GAE_SHAPE[0]}x{GAE_SHAPE[1]}": (lambda: kernels.gae(rewards, values, mask, 1.0, 0.95), 200)}
    for (tokens, vocab), calls in zip(THREADS_LOGPROB_SHAPES, (60, 16)):
        logits = torch.randn(tokens, vocab, generator=generator)
        labels = torch.randint(0, vocab, (tokens,), generator=generator)
        row_max, sum_exp, _, _ = kernels.logprob_partials(logits, labels, 0, False)
        log_z, upstream = row_max + sum_exp.log(), torch.randn(tokens, generator=generator)
        cells[f"log-prob {tokens}x{vocab} forward"] = (
            lambda logits=logits, labels=labels: kernels.logprob_partials(logits, labels, 0, False), calls)
        cells[f"log-prob {tokens}x{vocab} backward"] = (
            lambda logits=logits, labels=labels, log_z=log_z, upstream=upstream: kernels.logprob_backward(
                logits, labels, 0, log_z, upstream, None, None), calls)
    return cells


def thread_medians(call, calls):
    """Median seconds of `call` on 1 and on 2 threads. The thread counts alternate call by call, so that a
    change in the machine's load (the machine is shared) weighs on both medians alike."""
    times = {1: [], 2: []}
    threads_before = torch.get_num_threads()
    try:
        for repeat in range(calls + 1):
            for threads in times:
                torch.set_num_threads(threads)
                start = time.perf_counter()
                call()
                if repeat:  # the first round warms up
                    times[threads].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads_before)
    return statistics.median(times[1]), statistics.median(times[2])


def start_neighbour(condition):
    """The neighbour process of a condition, in its own process group (the bursty one is a shell and its
    children), or None when idle."""
    if NEIGHBOURS[condition] is None:
        return None
    neighbour = subprocess.Popen(NEIGHBOURS[condition], start_new_session=True)
    time.sleep(1.0)  # past its imports, into its loop
    return neighbour


def stop_neighbour(neighbour):
    if neighbour is not None:
        os.killpg(neighbour.pid, signal.SIGKILL)
        neighbour.wait()


def bench_threads(rounds):
    """The 1- vs 2-thread table: per cell the median of the per-round medians, the ratio 2 threads / 1 thread
    (median over rounds, with its spread min-max) and the goal checked on that median ratio."""
    cells = thread_cells()
    ratios = {(condition, name): [] for condition in NEIGHBOURS for name in cells}
    medians = {key: ([], []) for key in ratios}
    for _ in range(rounds):
        for condition in NEIGHBOURS:
            neighbour = start_neighbour(condition)
            try:
                for name, (call, calls) in cells.items():
                    one, two = thread_medians(call, calls)
                    medians[condition, name][0].append(one)
                    medians[condition, name][1].append(two)
                    ratios[condition, name].append(two / one)
            finally:
                stop_neighbour(neighbour)
    print(f"threads: medians over {rounds} round(s) of per-round medians; ratio = 2 threads / 1 thread, "
          f"goal <= {THREADS_GOAL:.2f}x per cell")
    print(f"{'neighbour':<10} {'kernel':<32} {'1 thread ms':>12} {'2 threads ms':>13} {'ratio':>6} "
          f"{'spread':>12}  goal")
    failed = 0
    for (condition, name), cell_ratios in ratios.items():
        one, two = (statistics.median(times) * 1e3 for times in medians[condition, name])
        ratio = statistics.median(cell_ratios)
        verdict = "PASS" if ratio <= THREADS_GOAL else "FAIL"
        failed += verdict == "FAIL"
        print(f"{condition:<10} {name:<32} {one:>12.3f} {two:>13.3f} {ratio:>6.2f} "
              f"{min(cell_ratios):>5.2f}-{max(cell_ratios):<5.2f}  {verdict}")
    print(f"threads goal: {len(ratios) - failed} of {len(ratios)} cells PASS")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads-only", action="store_true", help="only the 1- vs 2-thread table (CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the 1- vs 2-thread table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, kernels: {backend_name(device)}")
    if device.type == "cpu":
        bench_threads(args.rounds)
        if args.threads_only:
            return
    thread_counts = sorted({1, torch.get_num_threads()}) if device.type == "cpu" else [torch.get_num_threads()]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        if device.type == "cpu":
            print(f"-- {threads} thread(s)")
        bench_gae(device)
        bench_logprobs(device)
        if device.type == "cpu":
            bench_rms_norm(device)


if __name__ == "__main__":
    sys.exit(main())
