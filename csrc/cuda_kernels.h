// Launchers of the CUDA kernels, free of torch: raw device pointers and a stream, so that the .cu files
// compile with nvcc alone in seconds (a .cu including torch headers takes minutes). cuda_bindings.cpp wraps
// them as verl_mega._kernels_cuda; the semantics are those of the CPU kernels in cpu_kernels.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace verl_mega::cuda {

// Element type of logits, rewards and values. Everything computed (and every buffer typed `acc` below) is
// float, or double for kFloat64.
enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// Per-row outputs, `acc` typed; shifted_sum == nullptr skips the entropy partial.
struct LogprobPartials {
  void* row_max;
  void* sum_exp;
  void* label_logit;
  void* shifted_sum;
};

// Per-row inputs of the backward, `acc` typed; nullptr for an absent gradient (mean_logit goes with grad_entropy).
struct LogprobBackwardInputs {
  const void* log_normalizer;
  const void* grad_logprob;
  const void* mean_logit;
  const void* grad_entropy;
};

cudaError_t launch_logprob_partials(DType dtype, const void* logits, const int64_t* labels, int64_t rows,
                                    int64_t vocab, int64_t vocab_start, LogprobPartials out, cudaStream_t stream);

// grad_logits has the dtype and shape of logits.
cudaError_t launch_logprob_backward(DType dtype, const void* logits, const int64_t* labels, int64_t rows,
                                    int64_t vocab, int64_t vocab_start, LogprobBackwardInputs in, void* grad_logits,
                                    cudaStream_t stream);

// rewards, values and mask are [batch, steps]; advantages and returns are `acc` typed.
cudaError_t launch_gae(DType dtype, const void* rewards, const void* values, const bool* mask, int64_t batch,
                       int64_t steps, double gamma, double lam, void* advantages, void* returns, cudaStream_t stream);

}  // namespace verl_mega::cuda
