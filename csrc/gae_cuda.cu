// Masked GAE on the GPU: one thread scans one sequence backwards (the recursion is sequential in time).
#include <cstdint>

#include "cuda_common.cuh"

namespace verl_mega::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gae_kernel(const T* __restrict__ rewards, const T* __restrict__ values, const bool* __restrict__ mask,
               int64_t batch, int64_t steps, acc_t<T> discount, acc_t<T> trace_decay, acc_t<T>* advantages,
               acc_t<T>* returns) {
  using A = acc_t<T>;
  const int64_t sequence = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (sequence >= batch) return;
  A next_value = 0, last_gae = 0;
  for (int64_t i = sequence * steps + steps - 1; i >= sequence * steps; --i) {
    const A value = to_acc(values[i]);
    A advantage = 0;
    // Masked-out tokens (padding, tool output) carry the recursion through untouched.
    if (mask[i]) {
      const A delta = to_acc(rewards[i]) + discount * next_value - value;
      last_gae = delta + trace_decay * last_gae;
      next_value = value;
      advantage = last_gae;
    }
    advantages[i] = advantage;
    returns[i] = advantage + value;
  }
}

}  // namespace

cudaError_t launch_gae(DType dtype, const void* rewards, const void* values, const bool* mask, int64_t batch,
                       int64_t steps, double gamma, double lam, void* advantages, void* returns, cudaStream_t stream) {
  if (batch == 0 || steps == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const auto blocks = static_cast<unsigned>((batch + kThreads - 1) / kThreads);
    gae_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(rewards), static_cast<const T*>(values),
                                                   mask, batch, steps, static_cast<A>(gamma),
                                                   static_cast<A>(gamma * lam), static_cast<A*>(advantages),
                                                   static_cast<A*>(returns));
    return cudaGetLastError();
  });
}

}  // namespace verl_mega::cuda
