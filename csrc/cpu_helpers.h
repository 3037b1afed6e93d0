// Helpers shared by the CPU kernels: work splitting over threads, and explicit SIMD for float rows.
//
// GCC's auto-vectoriser gives up on the softmax loops (it turns the exponent floor into a branch), so the
// float path uses GCC/Clang vector extensions: explicit float vectors that lower to SSE, AVX or NEON,
// whatever the build targets. float64 (the gradcheck path) stays scalar and exact.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__linux__)
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>
#endif

namespace verl_mega {

// Elements per task: ~40-150 us of work at 0.6-2 ns per element, so that a helper thread the OS preempts in
// the middle of a task (a busy neighbour on its core) holds the caller up by little, and a helper that starts
// late still finds work. Claiming a task costs one atomic increment.
constexpr int64_t kElementsPerTask = 1 << 16;
// Below this many tasks the work stays on the calling thread: waking a helper costs tens of microseconds.
constexpr int64_t kMinTasksToShare = 4;

// Rows (sequences) per task, so that short rows are batched and long ones still spread over the threads.
inline int64_t rows_per_task(int64_t row_length, int64_t elements_per_task = kElementsPerTask) {
  return std::max<int64_t>(1, elements_per_task / std::max<int64_t>(row_length, 1));
}

namespace detail {

// Cores a helper thread could run on right now without taking turns with another runnable thread: the CPUs
// this process may use less the threads already runnable on the machine (Linux's instantaneous count in
// /proc/loadavg, this thread included). A helper on a taken core runs in scheduler slices, and a task it holds
// while preempted keeps the caller waiting for its next slice (measured: 2 threads took 1.3-1.9x the time of 1
// on a loaded 2-core machine), so the work then stays on the calling thread. Without /proc every thread torch
// allows counts as free.
inline int64_t idle_cores() {
  constexpr int64_t kUnknown = std::numeric_limits<int64_t>::max();
#if defined(__linux__)
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return kUnknown;
  const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return kUnknown;
  char text[128];
  const ssize_t length = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (length <= 0) return kUnknown;
  text[length] = '\0';
  // "0.50 0.40 0.30 RUNNABLE/TOTAL LAST_PID"
  long runnable = 0;
  if (std::sscanf(text, "%*s %*s %*s %ld/", &runnable) != 1) return kUnknown;
  return std::max<int64_t>(0, CPU_COUNT(&allowed) - std::max<long>(runnable, 1));
#else
  return kUnknown;
#endif
}

// What the calling thread and its helpers share. Owned jointly, since a helper may start after the call has
// returned: it then finds no task left and never touches `body`, which lives on the caller's stack.
struct SharedTasks {
  explicit SharedTasks(int64_t count) : count(count) {}
  const int64_t count;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_finished;
  std::exception_ptr error;  // the first task failure, under `mutex`

  // Claims and runs tasks until none is left. `run` is only followed once a task is claimed: while one is
  // unfinished, the caller is still waiting and `run` alive.
  // Returns how many tasks this thread ran.
  template <typename Run>
  int64_t work(const Run* run) {
    int64_t ran = 0;
    for (int64_t task = next++; task < count; task = next++, ++ran) {
      try {
        (*run)(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
      }
      if (++finished == count) {
        std::lock_guard<std::mutex> lock(mutex);
        all_finished.notify_all();
      }
    }
    return ran;
  }
};

// After a call that found no idle core, or in which the caller waited on a helper for longer than its own
// tasks take (the helper was descheduled mid-task: /proc/loadavg showed an idle core that a neighbour took
// back), calls keep their work on the calling thread without looking for a while: 1 ms, then 2, 4, ... up to
// kLongestPause while it keeps happening, back to sharing at once after a call in which the helpers kept up.
// A busy neighbour then costs one load reading or one late helper per pause, instead of a reading in every
// call and a late helper in many; once the neighbour stops, sharing resumes within one pause.
class HelperBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int64_t kFirstPause = std::chrono::nanoseconds(std::chrono::milliseconds(1)).count();
  static constexpr int64_t kLongestPause = std::chrono::nanoseconds(std::chrono::milliseconds(256)).count();

  bool stay_alone() const { return now() < alone_until_.load(std::memory_order_relaxed); }

  void after_call(bool helpers_kept_up) {
    if (helpers_kept_up) {
      next_pause_.store(kFirstPause, std::memory_order_relaxed);
      return;
    }
    const int64_t pause = next_pause_.load(std::memory_order_relaxed);
    alone_until_.store(now() + pause, std::memory_order_relaxed);
    next_pause_.store(std::min(2 * pause, kLongestPause), std::memory_order_relaxed);
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }

  std::atomic<int64_t> alone_until_{0};
  std::atomic<int64_t> next_pause_{kFirstPause};
};

inline HelperBackoff& helper_backoff() {
  static HelperBackoff backoff;
  return backoff;
}

}  // namespace detail

// Runs body(begin, end) over row ranges [0, rows) of rows_per_task rows. The calling thread works through the
// tasks itself; up to torch.get_num_threads() - 1 helpers, one per idle core, from torch's inter-op pool
// (threads that sleep when idle, where OpenMP's spin) join in when they get a core. The call returns once every
// task is done, waiting only for tasks a helper has started: a helper that never got a core delays nothing,
// where a fork/join region waits at its barrier for every thread it forked, scheduled or not; a helper
// descheduled mid-task makes the next calls run alone (HelperBackoff). Each row range
// is computed by exactly one thread with the same code, so results do not depend on the number of threads.
template <typename Body>
void parallel_rows(int64_t rows, int64_t rows_per_task, const Body& body) {
  const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
  const auto run = [&](int64_t task) { body(task * rows_per_task, std::min(rows, (task + 1) * rows_per_task)); };
  const int64_t wanted = std::min<int64_t>(at::get_num_threads() - 1, tasks - 1);
  const bool share = tasks >= kMinTasksToShare && wanted >= 1 && !at::in_parallel_region() &&
                     !detail::helper_backoff().stay_alone();
  const int64_t helpers = share ? std::min(wanted, detail::idle_cores()) : 0;
  if (share && helpers == 0) detail::helper_backoff().after_call(false);
  if (helpers == 0) {
    for (int64_t task = 0; task < tasks; ++task) run(task);
    return;
  }
  using Clock = detail::HelperBackoff::Clock;
  auto shared = std::make_shared<detail::SharedTasks>(tasks);
  for (int64_t i = 0; i < helpers; ++i) {
    at::launch([shared, run = &run] { shared->work(run); });
  }
  const auto start = Clock::now();
  const int64_t ran = shared->work(&run);
  const auto own_tasks_done = Clock::now();
  // A helper that kept up finishes its last task within about one task's time of the caller's last. Until then
  // the caller keeps its core (sleeping would hand it to a neighbour and wait a time slice to get it back).
  const auto kept_up = 2 * ((own_tasks_done - start) / std::max<int64_t>(ran, 1)) + std::chrono::microseconds(20);
  while (shared->finished.load() != tasks && Clock::now() - own_tasks_done <= kept_up) {
  }
  if (shared->finished.load() != tasks) {
    std::unique_lock<std::mutex> lock(shared->mutex);
    shared->all_finished.wait(lock, [&] { return shared->finished.load() == tasks; });
  }
  detail::helper_backoff().after_call(Clock::now() - own_tasks_done <= kept_up);
  if (shared->error) std::rethrow_exception(shared->error);
}

// One register: vectors wider than the target's registers go through memory and run slower than scalars.
#if defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
using floatv = float __attribute__((vector_size(kVectorBytes)));
using int32v = int32_t __attribute__((vector_size(kVectorBytes)));

// The register type a row of acc_t is processed in, and how many acc_t it holds.
template <typename acc_t>
using vec_t = std::conditional_t<std::is_same_v<acc_t, float>, floatv, acc_t>;
template <typename acc_t>
constexpr int64_t kLanes = sizeof(vec_t<acc_t>) / sizeof(acc_t);

template <typename V>
inline V splat(double value) {
  return V{} + static_cast<std::conditional_t<std::is_same_v<V, floatv>, float, V>>(value);
}

template <typename acc_t, typename scalar_t>
inline vec_t<acc_t> load(const scalar_t* p) {
  vec_t<acc_t> v;
  if constexpr (kLanes<acc_t> == 1) {
    v = static_cast<acc_t>(*p);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

template <typename acc_t, typename scalar_t>
inline void store(scalar_t* p, vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    *p = static_cast<scalar_t>(v);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) p[i] = static_cast<scalar_t>(v[i]);
  }
}

template <typename acc_t>
inline acc_t lane_sum(vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    return v;
  } else {
    acc_t total = 0;
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) total += v[i];
    return total;
  }
}

// A plain select rather than std::max so that it applies lane-wise to vectors too.
template <typename V>
inline V max_of(V a, V b) {
  return a > b ? a : b;
}

template <typename acc_t>
inline acc_t lane_max(vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    return v;
  } else {
    acc_t best = v[0];
    for (int64_t i = 1; i < kLanes<acc_t>; ++i) best = max_of(best, v[i]);
    return best;
  }
}

// exp() of anything below this is < 2e-38: nothing next to the largest term of a row (exp(0) = 1).
// Flooring exponent arguments here keeps -inf logits (masked vocabulary entries) from producing 0 * -inf.
constexpr double kMinExponent = -87.0;

template <typename V>
inline V floor_exponent(V x) {
  return max_of(x, splat<V>(kMinExponent));
}

// 2^n for integral n in [-126, 127], built from the exponent bits.
inline float two_to_the(float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline floatv two_to_the(floatv n) {
  const int32v bits = (__builtin_convertvector(n, int32v) + 127) << 23;
  floatv result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// exp for float arguments in [kMinExponent, ~0]: Cephes' expf, 2^n times a degree-6 polynomial on
// |r| <= ln2/2 (~1 ulp), the same code for one float and for a vector.
template <typename V>
inline V exp_floored(V x) {
  if constexpr (std::is_same_v<V, double>) {
    return std::exp(x);
  } else {
    // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer.
    const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    V p = splat<V>(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * two_to_the(n);
  }
}

}  // namespace verl_mega
