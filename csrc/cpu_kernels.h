// CPU kernels behind verl_mega._kernels. verl_mega.ops validates user input and hands over contiguous
// tensors; the TORCH_CHECKs in the kernels only guard that contract.
//
// Vocabulary-parallel log-probs work on partials: for each row of a vocabulary slice
//   row_max      m = max_j x_j
//   sum_exp      s = sum_j exp(x_j - m)
//   label_logit  x_label when the label falls in the slice [vocab_start, vocab_start + vocab), else 0
//   shifted_sum  t = sum_j exp(x_j - m) (x_j - m)          (entropy only)
// which combine over slices into log Z = M + log S and E[x] = M + T / S (see verl_mega/ops/token_logprobs.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace verl_mega {

// Outputs are float32 (float64 for float64 logits); shifted_sum is absent unless with_entropy.
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> logprob_partials(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, bool with_entropy);

// d/dx_j of  g * log p(label) + h * entropy  =  g (onehot_j - p_j) - h p_j (x_j - E[x]),  p_j = exp(x_j - log Z).
// Slice-local: log Z and E[x] are already global. Returns a tensor shaped and typed like logits.
at::Tensor logprob_backward(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start,
                            const at::Tensor& log_normalizer, const std::optional<at::Tensor>& grad_logprob,
                            const std::optional<at::Tensor>& mean_logit,
                            const std::optional<at::Tensor>& grad_entropy);

// Masked GAE over [batch, time]; returns (advantages, returns) in float32 (float64 for float64 input).
std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& mask, double gamma, double lam);

// RMSNorm over the rows of [rows, hidden] (x and weight of one dtype): (y, rstd), rstd = 1 / sqrt(mean(x^2) + eps)
// in float32 (float64 for float64), computed in that precision and y rounded once.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);

// (grad_x, grad_weight) from the forward's x, weight and rstd; grad_weight is summed in the accumulation type.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd);

}  // namespace verl_mega
