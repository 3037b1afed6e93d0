// Token log-prob partials and their fused backward on the GPU: one block per row of the vocabulary slice,
// 16-byte vectorised loads, and an online max / sum-exp so that each logit is read once.
#include <cstdint>

#include "cuda_common.cuh"

namespace verl_mega::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kLoadBytes = 16;

// exp() of anything below this is < 2e-38; flooring there keeps -inf logits from producing 0 * -inf
// (fmax also maps the NaN of -inf - -inf to the floor). Same constant as the CPU kernels.
constexpr double kMinExponent = -87.0;

__device__ __forceinline__ float floor_exponent(float x) { return fmaxf(x, static_cast<float>(kMinExponent)); }
__device__ __forceinline__ double floor_exponent(double x) { return fmax(x, kMinExponent); }
__device__ __forceinline__ float exponential(float x) { return expf(x); }
__device__ __forceinline__ double exponential(double x) { return exp(x); }

// N consecutive elements read or written as one aligned load/store (N == 1: plain scalar access).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T value[N];
};

// Running softmax partials of a set of logits: its max m, sum = sum exp(x - m), shifted = sum exp(x - m)(x - m).
template <typename A>
struct SoftmaxState {
  A max;
  A sum;
  A shifted;
};

template <typename A, bool kEntropy>
__device__ __forceinline__ void raise_max(SoftmaxState<A>& s, A new_max) {
  const A d = floor_exponent(s.max - new_max);
  const A factor = exponential(d);
  if constexpr (kEntropy) s.shifted = factor * (s.shifted + d * s.sum);
  s.sum *= factor;
  s.max = new_max;
}

template <typename A, bool kEntropy>
__device__ __forceinline__ void add_logit(SoftmaxState<A>& s, A x) {
  const A d = floor_exponent(x - s.max);
  const A e = exponential(d);
  s.sum += e;
  if constexpr (kEntropy) s.shifted += e * d;
}

template <typename A, bool kEntropy>
__device__ __forceinline__ SoftmaxState<A> merge(SoftmaxState<A> a, SoftmaxState<A> b) {
  const A m = fmax(a.max, b.max);
  raise_max<A, kEntropy>(a, m);
  raise_max<A, kEntropy>(b, m);
  return {m, a.sum + b.sum, a.shifted + b.shifted};
}

template <typename A, bool kEntropy>
__device__ __forceinline__ SoftmaxState<A> warp_merge(SoftmaxState<A> s) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const SoftmaxState<A> other{__shfl_xor_sync(0xffffffffu, s.max, offset),
                                __shfl_xor_sync(0xffffffffu, s.sum, offset),
                                __shfl_xor_sync(0xffffffffu, s.shifted, offset)};
    s = merge<A, kEntropy>(s, other);
  }
  return s;
}

// The merged state of the whole block, valid in thread 0.
template <typename A, bool kEntropy>
__device__ SoftmaxState<A> block_merge(SoftmaxState<A> s) {
  __shared__ SoftmaxState<A> per_warp[kThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  s = warp_merge<A, kEntropy>(s);
  if (lane == 0) per_warp[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / kWarpSize ? per_warp[lane] : SoftmaxState<A>{-INFINITY, 0, 0};
    s = warp_merge<A, kEntropy>(s);
  }
  return s;
}

template <typename T, int N, bool kEntropy>
__global__ void __launch_bounds__(kThreads)
    partials_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels, int64_t vocab,
                    int64_t vocab_start, acc_t<T>* row_max, acc_t<T>* sum_exp, acc_t<T>* label_logit,
                    acc_t<T>* shifted_sum) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const auto* packs = reinterpret_cast<const Pack<T, N>*>(x);

  SoftmaxState<A> state{-INFINITY, 0, 0};
  for (int64_t i = threadIdx.x; i < vocab / N; i += kThreads) {
    const Pack<T, N> pack = packs[i];
    A values[N];
    A pack_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      values[k] = to_acc(pack.value[k]);
      pack_max = fmax(pack_max, values[k]);
    }
    // One rescale per pack, not per element.
    if (pack_max > state.max) raise_max<A, kEntropy>(state, pack_max);
#pragma unroll
    for (int k = 0; k < N; ++k) add_logit<A, kEntropy>(state, values[k]);
  }
  state = block_merge<A, kEntropy>(state);

  if (threadIdx.x == 0) {
    row_max[row] = state.max;
    sum_exp[row] = state.sum;
    if constexpr (kEntropy) shifted_sum[row] = state.shifted;
    const int64_t column = labels[row] - vocab_start;
    label_logit[row] = (column >= 0 && column < vocab) ? to_acc(x[column]) : A(0);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels, int64_t vocab,
                    int64_t vocab_start, const acc_t<T>* log_normalizer, const acc_t<T>* grad_logprob,
                    const acc_t<T>* mean_logit, const acc_t<T>* grad_entropy, T* __restrict__ grad_logits) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  const auto* packs = reinterpret_cast<const Pack<T, N>*>(logits + row * vocab);
  auto* out = reinterpret_cast<Pack<T, N>*>(grad_logits + row * vocab);
  const A lz = log_normalizer[row];
  const A g = grad_logprob ? grad_logprob[row] : A(0);
  const A h = grad_entropy ? grad_entropy[row] : A(0);
  const A mean_x = grad_entropy ? mean_logit[row] : A(0);
  const int64_t label_column = labels[row] - vocab_start;  // outside [0, vocab) when another slice holds it

  for (int64_t i = threadIdx.x; i < vocab / N; i += kThreads) {
    const Pack<T, N> pack = packs[i];
    Pack<T, N> result;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      // g (onehot - p) - h p (x - E[x]), with x floored where p vanishes so that -inf logits give 0, not NaN.
      const A d = floor_exponent(to_acc(pack.value[k]) - lz);
      const A onehot_part = (i * N + k == label_column) ? g : A(0);
      result.value[k] = from_acc<T>(onehot_part - exponential(d) * (g + h * (d + (lz - mean_x))));
    }
    out[i] = result;
  }
}

template <typename T>
constexpr int kPackElements = kLoadBytes / sizeof(T);

// Vectorised access needs every row start aligned: an aligned base and a vocabulary divisible by the pack.
template <typename T>
bool packs_fit(const void* base, int64_t vocab) {
  return reinterpret_cast<uintptr_t>(base) % kLoadBytes == 0 && vocab % kPackElements<T> == 0;
}

}  // namespace

cudaError_t launch_logprob_partials(DType dtype, const void* logits, const int64_t* labels, int64_t rows,
                                    int64_t vocab, int64_t vocab_start, LogprobPartials out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const bool entropy = out.shifted_sum != nullptr;
    const auto launch = [&](auto kernel) {
      kernel<<<rows, kThreads, 0, stream>>>(static_cast<const T*>(logits), labels, vocab, vocab_start,
                                            static_cast<A*>(out.row_max), static_cast<A*>(out.sum_exp),
                                            static_cast<A*>(out.label_logit), static_cast<A*>(out.shifted_sum));
      return cudaGetLastError();
    };
    if (packs_fit<T>(logits, vocab)) {
      return entropy ? launch(partials_kernel<T, kPackElements<T>, true>)
                     : launch(partials_kernel<T, kPackElements<T>, false>);
    }
    return entropy ? launch(partials_kernel<T, 1, true>) : launch(partials_kernel<T, 1, false>);
  });
}

cudaError_t launch_logprob_backward(DType dtype, const void* logits, const int64_t* labels, int64_t rows,
                                    int64_t vocab, int64_t vocab_start, LogprobBackwardInputs in, void* grad_logits,
                                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const auto launch = [&](auto kernel) {
      kernel<<<rows, kThreads, 0, stream>>>(
          static_cast<const T*>(logits), labels, vocab, vocab_start, static_cast<const A*>(in.log_normalizer),
          static_cast<const A*>(in.grad_logprob), static_cast<const A*>(in.mean_logit),
          static_cast<const A*>(in.grad_entropy), static_cast<T*>(grad_logits));
      return cudaGetLastError();
    };
    // grad_logits is allocated like logits, so one alignment check covers both.
    return packs_fit<T>(logits, vocab) && packs_fit<T>(grad_logits, vocab)
               ? launch(backward_kernel<T, kPackElements<T>>)
               : launch(backward_kernel<T, 1>);
  });
}

}  // namespace verl_mega::cuda
